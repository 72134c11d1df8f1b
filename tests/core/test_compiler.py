"""The steps' compiler options: XLA:CPU's instruction order, chosen by `cpu_scheduler`, reaches
the compiler and changes where buffers live, never a number. And the jit the steps are built
with: a call returns once its step is queued, statics pass through, the state is donated."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import diloco_eqx as dl
from diloco_eqx.analysis import profiling
from diloco_eqx.compiler import StepFunction, step_options
from tests.helpers import batches, reference_run, run_jax
from tests.reference import NpAdamW, make_toy, toy_loss, toy_to_numpy

MEMORY = {"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"}
CONCURRENCY = {"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_CONCURRENCY_OPTIMIZED"}


def test_an_unknown_order_is_refused_with_the_allowed_names():
    with pytest.raises(ValueError, match=r"cpu_scheduler: name must be one of \['concurrency', 'memory'\]; got 'fast'"):
        with dl.cpu_scheduler("fast"):
            pass
    assert step_options(None) == {}


def test_options_hold_inside_the_context_only_and_nest():
    mesh = dl.make_mesh(diloco=2, data=2)
    assert step_options(None) == {} and step_options(mesh) == {}  # XLA's own choice by default
    with dl.cpu_scheduler("memory"):
        assert step_options(None) == MEMORY and step_options(mesh) == MEMORY
        with dl.cpu_scheduler("concurrency"):
            assert step_options(None) == CONCURRENCY
        assert step_options(None) == MEMORY
    assert step_options(None) == {}


def test_the_memory_order_gives_the_reference_numbers():
    """Streaming V = 1 with AdamW built under each order: both match the NumPy reference, and
    each other bit for bit."""
    cfg = dl.DiLoCoConfig(num_replicas=2, sync_period=6, streaming=True, num_fragments=3,
                          overlap_steps=1, alpha=0.5, outer_lr=0.7, outer_momentum=0.9)
    data = batches(14)
    runs = {}
    for order in ("memory", "concurrency"):
        with dl.cpu_scheduler(order):
            runs[order] = run_jax(cfg, optax.adamw(0.01, weight_decay=1e-4), data)
    ref_losses, ref_outer, _ = reference_run(cfg, data, NpAdamW(0.01))
    np.testing.assert_allclose(runs["memory"][0], ref_losses, rtol=2e-5, atol=2e-5)
    outer = {o: toy_to_numpy(state.outer_model) for o, (_, state) in runs.items()}
    for name in ref_outer:
        np.testing.assert_allclose(outer["memory"][name], ref_outer[name], rtol=2e-5, atol=2e-5)
        np.testing.assert_array_equal(outer["memory"][name], outer["concurrency"][name])
    np.testing.assert_array_equal(runs["memory"][0], runs["concurrency"][0])


def test_the_order_reaches_the_compiler():
    """The same Streaming step compiled under the two orders places its buffers differently."""
    model = make_toy(4, 16)
    cfg = dl.DiLoCoConfig(num_replicas=2, sync_period=6, streaming=True, num_fragments=3)
    inner, batch = optax.adamw(1e-3), np.zeros((4, 16), np.float32)
    temps = {}
    for order in ("memory", "concurrency"):
        with dl.cpu_scheduler(order):
            step = dl.make_train_step(cfg, toy_loss, inner)
        temps[order] = profiling.memory(step.lower(dl.init_state(model, inner, cfg), batch).compile())["temp_bytes"]
    assert temps["memory"] != temps["concurrency"], temps


def test_a_step_call_returns_before_its_step_has_run():
    """A step of some tens of milliseconds (2000 matrix products) has not finished when the
    call returns, so the host can queue the next one: a jit that waits for each call (as
    Equinox's filter_jit does, to raise its runtime errors there) returns a ready result.
    From 0.5·I, each step keeps the matrix diagonal, d <- tanh(d²) + 0.5 on every entry,
    and counts its products."""
    def fn(n, state):
        eye = jnp.eye(128)
        x, count = jax.lax.fori_loop(0, n, lambda i, c: (jnp.tanh(c[0] @ c[0]) + 0.5 * eye, c[1] + 1),
                                     (state["x"], state["count"]))
        return {"x": x, "count": count}, jnp.trace(x)

    step = StepFunction(fn, donate=True)
    n, state = jnp.asarray(2000), {"x": jnp.eye(128) * 0.5, "count": jnp.asarray(0)}
    state, total = step(n, state)  # compiles
    state, total = step(n, state)
    assert not total.is_ready()
    d = np.float32(0.5)
    for _ in range(4000):
        d = np.tanh(d * d) + np.float32(0.5)
    assert int(state["count"]) == 4000
    np.testing.assert_allclose(float(total), 128 * d, rtol=1e-5)


def test_statics_pass_through_the_state_is_donated_and_one_structure_compiles_once():
    def fn(batch, state):
        scale, act = state["scale"], state["act"]
        return {"w": act(state["w"]) * scale + batch, "scale": scale, "act": act}, {"sum": jnp.sum(state["w"])}

    step = StepFunction(fn, donate=True)
    batch, w = jnp.full(4, 0.5), np.asarray([-1.0, 0.0, 1.0, 2.0], np.float32)
    state = {"w": jnp.asarray(w), "scale": 3, "act": jax.nn.relu}
    with profiling.count_compilations() as compiles:
        for _ in range(3):
            old, (state, metrics) = state, step(batch, state)
            assert old["w"].is_deleted() and not batch.is_deleted()
    assert compiles.count == 1
    assert state["scale"] == 3 and state["act"] is jax.nn.relu
    expected = w
    for _ in range(3):
        last, expected = expected, np.maximum(expected, 0) * 3 + 0.5
    np.testing.assert_allclose(state["w"], expected)
    assert float(metrics["sum"]) == float(last.sum())
    with profiling.count_compilations() as compiles:  # another static: another program
        step(batch, {**state, "scale": 2})
    assert compiles.count == 1


def test_each_trace_keeps_its_own_output_structure_and_equal_statics_of_other_types_differ():
    """An output that depends on the batch's shape (a Python int) is right for every shape,
    also when jax's cache of an earlier shape answers; 2, 2.0 and True are three programs."""
    step = StepFunction(lambda batch, state: ({"n": batch.shape[0], "x": state["x"] + batch.sum()}, batch.dtype.name))
    for n in (2, 5, 2):
        out, name = step(jnp.ones(n), {"x": jnp.zeros(())})
        assert (out["n"], float(out["x"]), name) == (n, float(n), "float32")
    times = StepFunction(lambda batch, k: batch * k)
    got = [np.asarray(times(jnp.full(2, 3.0), k)).tolist() for k in (2, 2.0, True)]
    assert got == [[6.0, 6.0], [6.0, 6.0], [3.0, 3.0]]
    assert len(times._built) == 3


def test_a_step_program_is_named_for_its_function():
    model, inner = make_toy(4, 8), optax.adamw(1e-3)
    cfg = dl.DiLoCoConfig(num_replicas=2, sync_period=4)
    text = dl.make_train_step(cfg, toy_loss, inner).lower(dl.init_state(model, inner, cfg), np.zeros((4, 8), np.float32)).as_text()
    assert "@jit_run_step" in text.splitlines()[0]
