"""Text from a language model: one token at a time, with temperature and top-k.

Works for any causal model called on one int32[T] sequence that returns logits [T, V] (the
built-in transformer, a `--model` factory's, an exported one): the context is the last
`context` tokens, padded at the end to a fixed length so one compiled step serves every
position (a causal model's logits at the last real token do not see the padding).
"""

from __future__ import annotations

from collections.abc import Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int, PRNGKeyArray


@eqx.filter_jit
def next_token(model: eqx.Module, window: Int[Array, " T"], last: Int[Array, ""], key: PRNGKeyArray,
               temperature: float, top_k: int, greedy: bool) -> Int[Array, ""]:
    """The token after position `last` of `window`: the most likely one (`greedy`), or a draw
    from softmax(logits / temperature) over the `top_k` most likely (0: all of them)."""
    logits = model(window)[last].astype(jnp.float32)
    if greedy:
        return jnp.argmax(logits)
    if top_k:
        values, ids = jax.lax.top_k(logits, top_k)
        return ids[jax.random.categorical(key, values / temperature)]
    return jax.random.categorical(key, logits / temperature)


def sample(model: eqx.Module, prompt: Sequence[int], tokens: int, *, context: int,
           temperature: float = 1.0, top_k: int = 0, seed: int = 0) -> list[int]:
    """`tokens` new token ids after `prompt` (temperature 0: greedy; the same seed, the same text)."""
    if not prompt:
        raise ValueError("the prompt must hold at least one token")
    if temperature < 0 or top_k < 0 or tokens < 0 or context < 1:
        raise ValueError(f"temperature, top-k and tokens must be >= 0 and context >= 1; got "
                         f"{temperature}, {top_k}, {tokens}, {context}")
    ids, key = [int(t) for t in prompt], jax.random.key(seed)
    for i in range(tokens):
        window = ids[-context:]
        padded = np.zeros(context, np.int32)
        padded[: len(window)] = window
        token = next_token(model, jnp.asarray(padded), jnp.int32(len(window) - 1), jax.random.fold_in(key, i),
                           float(temperature or 1.0), int(top_k), temperature == 0)
        ids.append(int(token))
    return ids[len(prompt):]
