"""The jit the steps are built with (`StepFunction`): a call returns once its step is queued,
statics pass through, the state is donated, and a program is named for its function."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

import diloco_eqx as dl
from diloco_eqx.analysis import profiling
from diloco_eqx.compiler import StepFunction
from tests.reference import make_toy, toy_loss


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
    algo = dl.DiLoCo(cfg, toy_loss, inner)
    text = algo.lower(algo.init(model), np.zeros((4, 8), np.float32)).as_text()
    assert "@jit_run_step" in text.splitlines()[0]
