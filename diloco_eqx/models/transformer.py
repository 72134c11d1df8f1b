"""A small decoder-only causal language model with a scanned layer stack.

Token + learned position embeddings, N pre-norm blocks (causal multi-head attention, GELU
MLP) stacked along axis 0 of field `layers` and run with `lax.scan`, a final RMS norm and
an output head. Calls work on one sequence; `loss_fn` vmaps over a batch.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """The model's shape. Field docstrings are the training CLI's help; `flag` metadata
    names a field's flag where it differs, `cli=False` keeps it off the command line (the
    vocabulary comes from the tokenizer, the sequence length from the data)."""

    vocab_size: int = dataclasses.field(default=256, metadata={"cli": False})
    """Tokens in the vocabulary (256: bytes)."""
    num_layers: int = dataclasses.field(default=4, metadata={"flag": "layers"})
    """Transformer blocks, stacked along axis 0 of `layers` and run with lax.scan."""
    width: int = 64
    """Model width d."""
    num_heads: int = dataclasses.field(default=4, metadata={"flag": "heads"})
    """Attention heads (must divide the width)."""
    seq_len: int = dataclasses.field(default=128, metadata={"cli": False})
    """Longest sequence the position embedding covers."""
    mlp_ratio: int = 4
    """MLP hidden width as a multiple of the model width."""

    def __post_init__(self):
        for name in ("vocab_size", "num_layers", "width", "num_heads", "seq_len", "mlp_ratio"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1; got {value!r}")
        if self.width % self.num_heads:
            raise ValueError(
                f"width={self.width} must be divisible by num_heads={self.num_heads}"
            )


def _rms_norm(x: Float[Array, "T d"], scale: Float[Array, " d"]) -> Float[Array, "T d"]:
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * scale[None]


class Block(eqx.Module):
    """One pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    attn_norm: Float[Array, " d"]
    qkv: Float[Array, "d three h e"]
    out: Float[Array, "h e d"]
    mlp_norm: Float[Array, " d"]
    up: Float[Array, "d f"]
    down: Float[Array, "f d"]

    def __init__(self, cfg: TransformerConfig, key: PRNGKeyArray):
        d, h = cfg.width, cfg.num_heads
        k1, k2, k3, k4 = jax.random.split(key, 4)
        std, out_std = 0.02, 0.02 / math.sqrt(2 * cfg.num_layers)
        self.attn_norm = jnp.ones((d,))
        self.qkv = std * jax.random.normal(k1, (d, 3, h, d // h))
        self.out = out_std * jax.random.normal(k2, (h, d // h, d))
        self.mlp_norm = jnp.ones((d,))
        self.up = std * jax.random.normal(k3, (d, cfg.mlp_ratio * d))
        self.down = out_std * jax.random.normal(k4, (cfg.mlp_ratio * d, d))

    def __call__(self, x: Float[Array, "T d"]) -> Float[Array, "T d"]:
        h = _rms_norm(x, self.attn_norm)
        q, k, v = jnp.einsum("td,dxhe->xthe", h, self.qkv)
        attn = jax.nn.dot_product_attention(q[None], k[None], v[None], is_causal=True)[0]
        x = x + jnp.einsum("the,hed->td", attn, self.out)
        h = _rms_norm(x, self.mlp_norm)
        return x + jax.nn.gelu(h @ self.up) @ self.down


class Transformer(eqx.Module):
    """Decoder-only LM; `layers` is a Block whose every leaf has a leading axis of N."""

    embed: Float[Array, "V d"]
    pos: Float[Array, "T d"]
    layers: Block
    final_norm: Float[Array, " d"]
    head: Float[Array, "d V"]

    def __init__(self, cfg: TransformerConfig, key: PRNGKeyArray):
        k_embed, k_pos, k_layers, k_head = jax.random.split(key, 4)
        self.embed = 0.02 * jax.random.normal(k_embed, (cfg.vocab_size, cfg.width))
        self.pos = 0.02 * jax.random.normal(k_pos, (cfg.seq_len, cfg.width))
        keys = jax.random.split(k_layers, cfg.num_layers)
        self.layers = eqx.filter_vmap(lambda k: Block(cfg, k))(keys)
        self.final_norm = jnp.ones((cfg.width,))
        self.head = 0.02 * jax.random.normal(k_head, (cfg.width, cfg.vocab_size))

    @property
    def num_layers(self) -> int:
        return self.layers.qkv.shape[0]

    def __call__(self, tokens: Int[Array, " T"]) -> Float[Array, "T V"]:
        # a one-hot product, not a gather: XLA's partitioner can fail on gathers from a table
        # split over fsdp inside a partly manual shard_map (the vocabulary is small)
        x = jax.nn.one_hot(tokens, self.embed.shape[0], dtype=self.embed.dtype) @ self.embed
        x = x + self.pos[: tokens.shape[0]]
        dynamic, static = eqx.partition(self.layers, eqx.is_array)

        def layer(x, block_arrays):
            return eqx.combine(block_arrays, static)(x), None

        x, _ = jax.lax.scan(layer, x, dynamic)
        return _rms_norm(x, self.final_norm) @ self.head


def loss_fn(model: Transformer, batch: Int[Array, "B T1"]) -> Float[Array, ""]:
    """Mean next-token cross-entropy (nats) of rows of T+1 tokens.

    The target's logit is picked with a one-hot product rather than a gather (the same loss
    up to float rounding): XLA's partitioner handles it when the output head is split over the
    vocabulary (fsdp), where a gather fails to compile inside a partly manual shard_map."""
    inputs, targets = batch[:, :-1], batch[:, 1:]
    logits = jax.vmap(model)(inputs)
    logits = logits.reshape(-1, logits.shape[-1])
    picked = jnp.sum(logits * jax.nn.one_hot(targets.reshape(-1), logits.shape[-1],
                                             dtype=logits.dtype), axis=-1)
    return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - picked)


def count_params(model: eqx.Module) -> int:
    return sum(x.size for x in jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array)))


def build(config: TransformerConfig, key: PRNGKeyArray) -> tuple[Transformer, Callable]:
    """The training CLI's default `--model diloco_eqx.models.transformer:build`: the model and its loss."""
    return Transformer(config, key), loss_fn
