"""Fragmentation: which leaves and layers each fragment owns, read and written in place (without
a copy of the layer stack: tests/perf/test_fragments_hlo.py)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import diloco_eqx as dl
from diloco_eqx.fragments import Fragmentation, _Layers
from tests.reference import make_toy, toy_loss


def cfg(p, order="interleaved"):
    return dl.DiLoCoConfig(streaming=True, num_fragments=p, sync_period=2 * p, fragment_order=order)


def params(model):
    return eqx.filter(model, eqx.is_inexact_array)


ORDERS = ["interleaved", "sequential", lambda n, p: ((5, 0), (1, 3), (2, 4))]


@pytest.mark.parametrize("order", ORDERS, ids=["interleaved", "sequential", "irregular"])
def test_take_and_put_match_numpy_indexing(order):
    model = make_toy(6, 3)
    frags = Fragmentation.from_model(model, cfg(4, order))
    p = params(model)
    w = np.asarray(p.layers.w)
    f0 = frags.take(p, 0)
    assert f0.layers.w is None and f0.calls is None
    np.testing.assert_array_equal(f0.embed, p.embed)
    for f in (1, 2, 3):
        idx = list(frags.layer_indices(f))
        part = frags.take(p, f)
        assert part.embed is None and part.head is None
        np.testing.assert_array_equal(part.layers.w, w[idx])
        new = jax.tree.map(lambda x: x + 100.0, part)
        out = frags.put(p, f, new)
        want = w.copy()
        want[idx] += 100.0
        np.testing.assert_array_equal(out.layers.w, want)
        np.testing.assert_array_equal(out.embed, p.embed)  # untouched outside f
    assert sorted(i for f in (1, 2, 3) for i in frags.layer_indices(f)) == list(range(6))


@pytest.mark.parametrize("order", ["interleaved", "sequential", lambda n, p: ((5, 0), (1, 3), (2, 4))])
def test_orders_need_no_gather_or_scatter(order):
    """Every layer group, irregular ones included, is read and written with slices."""
    frags = Fragmentation.from_model(make_toy(6, 3), cfg(4, order))
    p = params(make_toy(6, 3))
    for f in (1, 2, 3):
        jaxpr = str(jax.make_jaxpr(lambda t: frags.put(t, f, frags.take(t, f)))(p))
        assert "gather" not in jaxpr and "scatter" not in jaxpr, jaxpr


def test_blocks_of_a_group_are_its_runs_of_consecutive_layers():
    """(first layer, position in the group, length) of each block, worked by hand."""
    assert _Layers((0, 1, 4)).runs == ((0, 0, 2), (4, 2, 1))
    assert _Layers((1, 3, 5)).runs == ((1, 0, 1), (3, 1, 1), (5, 2, 1))
    assert _Layers((2, 3, 4)).runs == ((2, 0, 3),)
    assert _Layers((5,)).runs == ((5, 0, 1),)


@pytest.mark.parametrize("order", [*ORDERS, lambda n, p: ((0, 1, 4), (2,), (3, 5))],
                         ids=["interleaved", "sequential", "irregular", "blocks"])
def test_update_and_blocks_match_numpy_indexing(order):
    """`update` is `put` of an elementwise function of `take`, and `take(blocks=True)` joined
    is `take`, against NumPy's fancy indexing; with an island axis the layers join on axis 1."""
    frags = Fragmentation.from_model(make_toy(6, 3), cfg(4, order))
    p = params(make_toy(6, 3))
    w = np.asarray(p.layers.w)
    for f in (0, 1, 2, 3):
        part = jax.tree.map(lambda x: x + 1.0, frags.take(p, f))
        out = frags.update(p, f, lambda x, y: 3.0 * x - y, part)
        want = w.copy()
        if f:
            idx = list(frags.layer_indices(f))
            want[idx] = 3.0 * w[idx] - (w[idx] + 1.0)  # = 2w - 1
            np.testing.assert_array_equal(out.embed, p.embed)
        else:
            np.testing.assert_allclose(out.embed, 2.0 * np.asarray(p.embed) - 1.0, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(out.layers.w, want, rtol=1e-6, atol=1e-6)
        blocks = frags.take(p, f, blocks=True)
        if f:
            leaf = blocks.layers.w
            assert len(getattr(leaf, "parts", (leaf,))) == len(_Layers(frags.layer_indices(f)).runs)
        for got, ref in zip(jax.tree.leaves(Fragmentation.join(blocks)), jax.tree.leaves(frags.take(p, f))):
            np.testing.assert_array_equal(got, ref)
    stacked = jax.tree.map(lambda x: jnp.stack([x, -x]), p)
    joined = Fragmentation.join(jax.vmap(lambda t: frags.take(t, 1, blocks=True))(stacked), axis=1)
    np.testing.assert_array_equal(joined.layers.w, np.stack([w, -w])[:, list(frags.layer_indices(1))])


def test_vanilla_is_one_fragment_of_everything():
    model = make_toy(4, 3)
    frags = Fragmentation.from_model(model, dl.DiLoCoConfig())
    assert frags.num_fragments == 1
    assert frags.param_counts(params(model)) == [3 + 2 * 4 * 3 + 3]


def test_param_counts_partition_the_model():
    model = make_toy(6, 3)
    frags = Fragmentation.from_model(model, cfg(4))
    assert frags.param_counts(params(model)) == [6, 12, 12, 12]


def test_streaming_needs_a_layer_stack():
    class Flat(eqx.Module):
        layers: jax.Array

    with pytest.raises(ValueError, match="every leaf of the layer stack"):
        Fragmentation.from_model(Flat(jnp.ones(())), cfg(2))
    with pytest.raises(ValueError, match="`layers` must point at the model's stacked layer module"):
        Fragmentation.from_model(make_toy(4, 3), cfg(3), layers=lambda m: m.blocks)


def test_layers_not_divisible_at_init():
    with pytest.raises(ValueError, match=r"num_fragments \(P\) - 1 must divide the number of layers: 4 layers"):
        dl.DiLoCo(cfg(4), toy_loss, optax.sgd(0.1)).init(make_toy(4, 3))


class ListOfLayers(eqx.Module):
    """Layers kept as a Python list, the way many Equinox models hold them."""

    layers: list

    def __init__(self, key, width=16, depth=3):
        self.layers = [eqx.nn.Linear(width, width, key=k) for k in jax.random.split(key, depth)]


class IntStack(eqx.Module):
    layers: jax.Array
    head: jax.Array


class Ragged(eqx.Module):
    layers: dict
    head: jax.Array


@pytest.mark.parametrize("model,message", [
    (ListOfLayers(jax.random.key(0)), "a Python list of 3 layers"),
    (eqx.nn.MLP(4, 2, 16, 2, key=jax.random.key(0)), "a Python tuple of 3 layers"),
    (IntStack(jnp.arange(6).reshape(2, 3), jnp.ones(3)), "with at least one floating-point leaf"),
    (Ragged({"a": jnp.ones((4, 2)), "b": jnp.ones((3, 2))}, jnp.ones(3)), r"leading sizes \[3, 4\]"),
])
def test_streaming_refuses_what_is_not_a_layer_stack(model, message):
    """Checked up front: an unstacked list would otherwise be read as a stack of its
    weights' rows, and the step would fail deep inside jax.vmap."""
    for build in (lambda: Fragmentation.from_model(model, cfg(3)),
                  lambda: dl.DiLoCo(cfg(3), toy_loss, optax.sgd(0.1)).init(model)):
        with pytest.raises(ValueError, match=message) as e:
            build()
        assert "eqx.filter_vmap" in str(e.value) and "jax.lax.scan" in str(e.value)
        assert "layers=lambda m: m.<field>" in str(e.value)


def test_vanilla_ignores_layers():
    """Vanilla DiLoCo has one fragment, the whole model: `layers` is never read."""
    mlp = eqx.nn.MLP(4, 2, 16, 2, key=jax.random.key(0))
    frags = Fragmentation.from_model(mlp, dl.DiLoCoConfig(), layers=lambda m: m.nothing_here)
    assert frags.num_fragments == 1
    assert frags.param_counts(params(mlp)) == [sum(x.size for x in jax.tree.leaves(params(mlp)))]
