"""The decoder-only transformer: shapes, causality, per-layer keys, loss at init."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diloco_eqx.models.transformer import Transformer, TransformerConfig, count_params, loss_fn

CFG = TransformerConfig(vocab_size=256, num_layers=3, width=32, num_heads=4, seq_len=16)


def test_shapes_and_stacked_layers(getkey):
    model = Transformer(CFG, getkey())
    tokens = jnp.arange(10, dtype=jnp.int32)
    assert model(tokens).shape == (10, 256)
    assert model.num_layers == 3
    for leaf in jax.tree.leaves(model.layers):
        assert leaf.shape[0] == 3
    d, f = 32, 128
    per_layer = 2 * d + d * 3 * d + d * d + d * f + f * d
    assert count_params(model) == 256 * d + 16 * d + 3 * per_layer + d + d * 256


def test_every_layer_has_its_own_init(getkey):
    model = Transformer(CFG, getkey())
    qkv = np.asarray(model.layers.qkv)
    assert not np.allclose(qkv[0], qkv[1]) and not np.allclose(qkv[1], qkv[2])


def test_causality(getkey):
    """Gradients of position i's loss with respect to the embeddings of later tokens are 0."""
    model = Transformer(CFG, getkey())
    tokens = jax.random.randint(getkey(), (12,), 0, 256)

    def logits_at(x_embed, i):
        # run the model on given input embeddings: replace the token lookup
        m = eqx.tree_at(lambda m: m.embed, model, jnp.zeros_like(model.embed))
        shifted = eqx.tree_at(lambda m: m.pos, m, m.pos.at[:12].add(x_embed))
        return shifted(tokens)[i].sum()

    x = model.embed[tokens]
    grad = jax.jit(jax.grad(logits_at))  # one compiled program for every i (eagerly: op by op)
    for i in (0, 5, 11):
        g = np.asarray(grad(x, i))
        assert np.all(g[i + 1:] == 0.0), i
        assert np.any(g[: i + 1] != 0.0)


def test_prefix_logits_do_not_see_the_future(getkey):
    model = Transformer(CFG, getkey())
    a = jax.random.randint(getkey(), (12,), 0, 256)
    b = a.at[8:].set((a[8:] + 1) % 256)
    run = eqx.filter_jit(model.__call__)
    np.testing.assert_allclose(run(a)[:8], run(b)[:8], rtol=1e-5, atol=1e-6)


def test_loss_at_init_is_near_uniform(getkey):
    model = Transformer(CFG, getkey())
    batch = jax.random.randint(getkey(), (4, 17), 0, 256)
    assert float(loss_fn(model, batch)) == pytest.approx(math.log(256), rel=0.02)


def test_config_errors():
    with pytest.raises(ValueError, match="width=30 must be divisible by num_heads=4"):
        TransformerConfig(width=30, num_heads=4)
    with pytest.raises(ValueError, match="num_layers must be an integer >= 1"):
        TransformerConfig(num_layers=0)
