"""The deferred exchange (streaming, V >= 1): same numbers as the direct form, and the
collective off the critical path of the step that runs it."""

import numpy as np
import optax
import pytest

import diloco_eqx as dl
from diloco_eqx.analysis import critical_path
from tests.reference import make_toy, toy_loss, toy_to_numpy
from tests.helpers import N_LAYERS, WIDTH, batches, make_diloco, run_jax


@pytest.mark.parametrize("order, v", [
    ("interleaved", 2),  # the default run: strided fragments, two steps of overlap
    *(pytest.param(o, v, marks=pytest.mark.slow) for o, v in
      (("interleaved", 1), ("interleaved", 5), ("sequential", 1), ("sequential", 2), ("sequential", 5))),
])
def test_deferred_equals_direct(order, v):
    # H=6, P=3: Δh=2, H_eff=6; 3·H_eff = 18 steps, ending on a sync (folded in by outer_model)
    cfg = dl.DiLoCoConfig(num_replicas=2, sync_period=6, streaming=True, num_fragments=3,
                          fragment_order=order, overlap_steps=v, alpha=0.5)
    data = batches(18)
    inner = optax.adamw(0.01)
    direct_losses, direct = run_jax(cfg, inner, data, deferred=False)
    # the exchange waiting for the inner step (the default without a mesh) and free of it (the
    # default on a mesh), each on one device and on a mesh
    for mesh, after in ((None, None), (None, False), (dl.make_mesh(2), None), (dl.make_mesh(2), True)):
        losses, deferred = run_jax(cfg, inner, data, mesh=mesh, deferred=True, exchange_after_inner=after)
        np.testing.assert_allclose(losses, direct_losses, rtol=1e-6, atol=1e-6)
        for name, want in toy_to_numpy(direct.outer).items():  # run_jax's states: every sync folded in
            np.testing.assert_allclose(toy_to_numpy(deferred.outer)[name], want, rtol=1e-6, atol=1e-7)
        for i in range(2):
            for name, want in toy_to_numpy(direct.island(i)).items():
                np.testing.assert_allclose(toy_to_numpy(deferred.island(i))[name], want, rtol=1e-6, atol=1e-7)


CROSSING = {"shard_map": {"psum_invariant", "psum", "all_gather_invariant", "all_gather"},
            "drjax": {"sum_from_diloco", "sharding_constraint"}}


def analysis(deferred, cfg=None, mesh_size=2, backend="shard_map", exchange_after_inner=None):
    cfg = cfg or dl.DiLoCoConfig(num_replicas=2, sync_period=6, streaming=True, num_fragments=3,
                                 overlap_steps=1)
    mesh = dl.make_mesh(**mesh_size) if isinstance(mesh_size, dict) else dl.make_mesh(mesh_size)
    inner = optax.adamw(0.01)
    algo = make_diloco(cfg, inner, mesh, deferred=deferred, exchange_after_inner=exchange_after_inner,
                       backend=backend)
    return critical_path.analyze(algo.jaxpr(algo.init(make_toy(N_LAYERS, WIDTH)), batches(1)[0]))


@pytest.mark.parametrize("backend", ["shard_map", "drjax"])
@pytest.mark.parametrize("compression,mesh", [("none", 2), ("fp4", 2), ("none", dict(diloco=2, data=2, fsdp=2))],
                         ids=["none", "fp4", "island-mesh"])
def test_deferred_collective_is_independent_of_the_inner_step(compression, mesh, backend):
    cfg = dl.DiLoCoConfig(num_replicas=4, sync_period=6, streaming=True, num_fragments=3,
                          overlap_steps=2, compression=compression)
    a = analysis(True, cfg, mesh, backend)  # on a mesh, free of the inner step by default
    colls = a.collectives()
    assert colls and {c.primitive for c in colls} <= CROSSING[backend]
    assert all("diloco_sync" in c.scope.split("/") for c in colls)
    assert len(a.in_scope("inner_step")) > 20
    assert set(a.collective_depends_on_inner_step().values()) == {0}
    assert a.inner_step_depends_on_collective() == set()


@pytest.mark.parametrize("backend", ["shard_map", "drjax"])
def test_direct_form_collective_waits_for_the_inner_step(backend):
    """The same analysis on the direct form finds the dependency (so the test above can fail)."""
    a = analysis(False, backend=backend)
    assert a.collectives()
    assert all(n > 0 for n in a.collective_depends_on_inner_step().values())


@pytest.mark.parametrize("mesh, backend", [(2, "shard_map"), (2, "drjax"), (dict(diloco=2, data=2, fsdp=2), "shard_map")],
                         ids=["islands-of-one-device", "drjax", "island-mesh"])
def test_exchange_after_inner_waits_for_the_inner_step(mesh, backend):
    """The deferred exchange built to wait for the inner step (as it is without a mesh, where
    nothing crosses devices) depends on what the direct form's sync does: every equation that
    computes the islands' new parameters; the inner step still never waits for it."""
    deps = analysis(True, None, mesh, backend, exchange_after_inner=True).collective_depends_on_inner_step()
    direct = analysis(False, None, mesh, backend).collective_depends_on_inner_step()
    assert deps and set(deps.values()) == set(direct.values())
    assert min(direct.values()) > 0
    assert analysis(True, None, mesh, backend, exchange_after_inner=True).inner_step_depends_on_collective() == set()


def test_without_a_mesh_the_exchange_waits_by_default():
    """With every island on one device nothing crosses devices, so DiLoCo builds the deferred
    exchange to wait for the inner step (one loop predicate for a step without an event); on
    a mesh it keeps it free, for its collective to run beside the inner step."""
    cfg = dl.DiLoCoConfig(num_replicas=2, sync_period=6, streaming=True, num_fragments=3, overlap_steps=1)
    for backend in ("shard_map", "drjax"):
        assert dl.DiLoCo(cfg, toy_loss, optax.sgd(0.1), backend=backend).plan.exchange_after_inner
        on_mesh = dl.DiLoCo(cfg, toy_loss, optax.sgd(0.1), mesh=dl.make_mesh(2), backend=backend)
        assert on_mesh.plan.deferred and not on_mesh.plan.exchange_after_inner


def test_exchange_after_inner_needs_the_deferred_form():
    cfg = dl.DiLoCoConfig(num_replicas=2, sync_period=6, streaming=True, num_fragments=3, overlap_steps=1)
    with pytest.raises(ValueError, match=r"exchange_after_inner=True needs the deferred exchange"):
        make_diloco(cfg, optax.sgd(0.1), deferred=False, exchange_after_inner=True)


def test_deferred_needs_overlap():
    cfg = dl.DiLoCoConfig(num_replicas=2, sync_period=6, streaming=True, num_fragments=3)
    with pytest.raises(ValueError, match=r"deferred=True needs streaming=True and overlap_steps \(V\) >= 1"):
        make_diloco(cfg, optax.sgd(0.1), deferred=True)


def test_tool_prints_the_evidence(capsys):
    from tools import sync_dependencies

    small = ["--layers", "2", "--width", "32", "--heads", "2", "--seq-len", "16", "--overlap-steps", "1"]
    assert sync_dependencies.main(small) == 0
    out = capsys.readouterr().out
    assert "deferred exchange" in out and "off the critical path" in out
    assert sync_dependencies.main(small + ["--direct"]) == 0
    assert "on the critical path" in capsys.readouterr().out
    assert sync_dependencies.main(small + ["--exchange-after-inner"]) == 0
    out = capsys.readouterr().out
    assert "waits for the inner step" in out and "inner-step equations that depend on a collective: 0" in out
