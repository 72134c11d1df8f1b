"""A causal-convolution language model with settings of its own, outside the package.

    python -m experiments.train --model models.conv:build --kernel 8 --width 96 --out runs/conv

`build` takes a `ConvConfig` (its first parameter's annotation says so), so the training
command's model flags are ConvConfig's fields: `--width`, `--layers`, `--kernel`, each with
the docstring below as its help; a config file takes them under `model:`, and run.json
records them. `vocab_size` is filled in by the run from the tokenizer (a field named
`seq_len` would take --seq-len the same way); neither is a flag.
"""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import optax


@dataclasses.dataclass(frozen=True)
class ConvConfig:
    """The convolution model's shape."""

    vocab_size: int = 256
    """Tokens in the vocabulary (the run sets it to the tokenizer's)."""
    width: int = 64
    """Channels of every layer."""
    layers: int = 4
    """Convolution blocks, stacked along axis 0 of `layers` (Streaming DiLoCo's fragments)."""
    kernel: int = 4
    """Tokens each block sees: the current one and the kernel - 1 before it."""

    def __post_init__(self):
        for name in ("vocab_size", "width", "layers", "kernel"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be >= 1; got {getattr(self, name)}")


class ConvBlock(eqx.Module):
    taps: jax.Array  # [kernel, width, width]: the next token sees the last `kernel` tokens

    def __call__(self, x):  # x: [T, width]
        k, T = self.taps.shape[0], x.shape[0]
        past = jnp.pad(x, ((k - 1, 0), (0, 0)))
        return x + jax.nn.gelu(sum(past[j:j + T] @ self.taps[j] for j in range(k)))


class ConvLM(eqx.Module):
    embed: jax.Array
    layers: ConvBlock  # stacked: every leaf has the layer index as axis 0 (Streaming needs this)
    head: jax.Array

    def __call__(self, tokens):  # tokens: int32[T] -> logits [T, vocab]
        x = self.embed[tokens]
        x, _ = jax.lax.scan(lambda x, block: (block(x), None), x, self.layers)
        return x @ self.head


def loss(model, batch):  # batch: int32[B, T + 1]
    logits = jax.vmap(model)(batch[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


def build(config: ConvConfig, key: jax.Array):
    """The model and its loss, for `--model models.conv:build`."""
    k_embed, k_layers, k_head = jax.random.split(key, 3)
    d, layer_keys = config.width, jax.random.split(k_layers, config.layers)
    scale = 0.02
    layers = eqx.filter_vmap(lambda k: ConvBlock(scale * jax.random.normal(k, (config.kernel, d, d))))(layer_keys)
    return ConvLM(scale * jax.random.normal(k_embed, (config.vocab_size, d)), layers,
                  scale * jax.random.normal(k_head, (d, config.vocab_size))), loss
