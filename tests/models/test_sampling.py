"""diloco_eqx/models/sampling.py: greedy decoding equals the model's own argmax on every prefix, top-k
draws stay in the top k, and temperature-1 draws follow the softmax."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diloco_eqx.models.sampling import sample
from diloco_eqx.models.transformer import Transformer, TransformerConfig

CONFIG = TransformerConfig(vocab_size=64, num_layers=2, width=32, num_heads=2, seq_len=8)


@pytest.fixture(scope="module")
def model():
    m = Transformer(CONFIG, jax.random.key(0))
    # scale the head up so the next token is not near-uniform and greedy has clear winners
    return eqx.tree_at(lambda m: m.head, m, m.head * 40)


def test_greedy_is_the_argmax_of_every_prefix_past_the_context(model):
    prompt = [3, 1, 4, 1, 5]
    out = sample(model, prompt, 12, context=CONFIG.seq_len, temperature=0)
    seq = prompt + out
    logits = eqx.filter_jit(lambda m, x: m(x)[-1])
    for i, token in enumerate(out):  # the context slides once prompt + output pass 8 tokens
        prefix = jnp.asarray(seq[: len(prompt) + i][-CONFIG.seq_len:], jnp.int32)
        assert token == int(jnp.argmax(logits(model, prefix))), i


def test_top_1_is_greedy_and_top_k_draws_stay_in_the_top_k(model):
    prompt = [7, 2]
    greedy = sample(model, prompt, 10, context=8, temperature=0)
    assert sample(model, prompt, 10, context=8, temperature=1.5, top_k=1, seed=3) == greedy
    out = sample(model, prompt, 10, context=8, temperature=2.0, top_k=5, seed=1)
    seq, last = prompt + out, eqx.filter_jit(lambda m, x: m(x)[-1])
    for i, token in enumerate(out):
        logits = np.asarray(last(model, jnp.asarray(seq[: len(prompt) + i][-8:], jnp.int32)))
        assert token in np.argsort(logits)[-5:], i
    assert out == sample(model, prompt, 10, context=8, temperature=2.0, top_k=5, seed=1)


class Fixed(eqx.Module):
    """Next-token log-probabilities log p at every position, whatever the input."""

    logp: jax.Array

    def __call__(self, tokens):
        return jnp.broadcast_to(self.logp, (tokens.shape[0], self.logp.shape[0]))


def test_temperature_one_draws_follow_the_softmax():
    p = np.array([0.5, 0.3, 0.2])
    out = sample(Fixed(jnp.log(jnp.asarray(p, jnp.float32))), [0], 600, context=4, seed=0)
    freq = np.bincount(out, minlength=3) / len(out)
    np.testing.assert_allclose(freq, p, atol=0.06)  # 3 standard errors at n = 600
    # temperature 0.5 squares the odds: p² normalised
    cold = sample(Fixed(jnp.log(jnp.asarray(p, jnp.float32))), [0], 600, context=4, temperature=0.5, seed=1)
    np.testing.assert_allclose(np.bincount(cold, minlength=3) / 600, p**2 / (p**2).sum(), atol=0.06)


def test_bad_sampling_settings():
    with pytest.raises(ValueError, match="at least one token"):
        sample(Fixed(jnp.zeros(3)), [], 3, context=4)
    with pytest.raises(ValueError, match="must be >= 0"):
        sample(Fixed(jnp.zeros(3)), [1], 3, context=4, temperature=-1)
