"""Fragmentation: which leaves and layers each fragment owns, read and written in place."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import diloco_eqx as dl
from diloco_eqx.analysis import comms
from diloco_eqx.fragments import Fragmentation, _Layers
from tests.reference import make_toy


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


def test_interleaved_fragment_is_updated_in_place():
    """Reading a strided group and writing it back compiles without a copy of the stack."""
    frags = Fragmentation.from_model(make_toy(6, 3), cfg(3, "interleaved"))
    p = params(make_toy(6, 3))
    update = jax.jit(lambda t: frags.put(t, 1, jax.tree.map(lambda x: 2.0 * x + 1.0, frags.take(t, 1))),
                     donate_argnums=0)
    hlo = update.lower(p).compile().as_text()
    assert frags.layer_indices(1) == (0, 2, 4)
    assert comms.every_step_copy_bytes(hlo) == 0


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


def test_update_of_an_interleaved_fragment_is_in_place():
    """`update` writes a strided group block by block, in place: no copy of the stack and no
    temporary, where `put` of the same function of `take` first writes the fragment out."""
    frags = Fragmentation.from_model(make_toy(6, 64), cfg(3, "interleaved"))
    p = params(make_toy(6, 64))
    u = frags.take(p, 1)

    def compiled(fn):
        return jax.jit(fn, donate_argnums=0).lower(p, u).compile()

    by_blocks = compiled(lambda t, u: frags.update(t, 1, lambda x, v: 2.0 * x + v, u))
    copied = compiled(lambda t, u: frags.put(t, 1, jax.tree.map(lambda x, v: 2.0 * x + v, frags.take(t, 1), u)))
    assert comms.every_step_copy_bytes(by_blocks.as_text()) == 0
    assert by_blocks.memory_analysis().temp_size_in_bytes == 0
    assert copied.memory_analysis().temp_size_in_bytes >= sum(x.nbytes for x in jax.tree.leaves(u))


def test_vanilla_is_one_fragment_of_everything():
    model = make_toy(4, 3)
    frags = Fragmentation.from_model(model, dl.DiLoCoConfig())
    assert frags.num_fragments == 1
    assert frags.param_counts(params(model)) == [3 + 2 * 4 * 3 + 3]


def test_param_counts_partition_the_model():
    model = make_toy(6, 3)
    frags = Fragmentation.from_model(model, cfg(4))
    assert frags.param_counts(params(model)) == [6, 12, 12, 12]


@pytest.mark.parametrize("tx", [optax.sgd(0.7, momentum=0.9, nesterov=True), optax.adamw(1e-3)],
                         ids=["nesterov", "adamw"])
def test_optimizer_state_fragments(tx):
    model = make_toy(6, 3)
    frags = Fragmentation.from_model(model, cfg(4, "interleaved"))
    state = tx.init(params(model))
    state = jax.tree.map(lambda x: x + 1.0 if jnp.issubdtype(x.dtype, jnp.floating) else x, state)
    part = frags.take_state(tx, state, 2)
    bumped = jax.tree.map(lambda x: x * 10.0 if jnp.issubdtype(x.dtype, jnp.floating) else x, part)
    new = frags.put_state(tx, state, 2, bumped)
    for old_leaf, new_leaf, path in zip(jax.tree.leaves(state), jax.tree.leaves(new),
                                        jax.tree_util.tree_flatten_with_path(state)[0]):
        keys = jax.tree_util.keystr(path[0])
        if ".layers" in keys:
            want = np.asarray(old_leaf).copy()
            want[[1, 4]] *= 10.0
            np.testing.assert_array_equal(new_leaf, want)
        elif jnp.issubdtype(old_leaf.dtype, jnp.floating):
            np.testing.assert_array_equal(new_leaf, old_leaf)


def test_streaming_needs_a_layer_stack():
    class Flat(eqx.Module):
        layers: jax.Array

    with pytest.raises(ValueError, match="every leaf of the layer stack"):
        Fragmentation.from_model(Flat(jnp.ones(())), cfg(2))
    with pytest.raises(ValueError, match="`layers` must point at the model's stacked layer module"):
        Fragmentation.from_model(make_toy(4, 3), cfg(3), layers=lambda m: m.blocks)


def test_layers_not_divisible_at_init_state():
    with pytest.raises(ValueError, match=r"num_fragments \(P\) - 1 must divide the number of layers: 4 layers"):
        dl.init_state(make_toy(4, 3), optax.sgd(0.1), cfg(4))


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
                  lambda: dl.init_state(model, optax.sgd(0.1), cfg(3))):
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
