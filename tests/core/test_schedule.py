"""Schedule: docs/algorithm.md's worked table, and properties over random H, P, V."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import diloco_eqx as dl

# docs/algorithm.md, P=4, H=12 (Δh=3, H_eff=12), V=1: t -> (sync fragment, apply fragment).
WORKED = {3: (1, None), 4: (None, 1), 6: (2, None), 7: (None, 2), 9: (3, None),
          10: (None, 3), 12: (0, None), 13: (None, 0)}


def test_worked_table():
    s = dl.Schedule(sync_period=12, num_fragments=4, overlap_steps=1)
    assert (s.steps_between_syncs, s.period) == (3, 12)
    for t in range(1, 14):
        assert (s.sync_fragment(t), s.apply_fragment(t)) == WORKED.get(t, (None, None)), t
    assert s.table(13) == [(t, *WORKED.get(t, (None, None))) for t in range(1, 14)]


@pytest.mark.parametrize("h,p,dh", [(10, 4, 2), (14, 4, 4), (6, 4, 2), (2, 4, 1), (1, 3, 1),
                                    (100, 37, 3), (12, 8, 2), (5, 2, 2), (7, 2, 4)])
def test_half_to_even_rounding(h, p, dh):
    # 10/4 = 2.5 -> 2 and 14/4 = 3.5 -> 4 (half to even); 5/2 = 2.5 -> 2; 7/2 = 3.5 -> 4.
    s = dl.Schedule(sync_period=h, num_fragments=p)
    assert s.steps_between_syncs == dh and s.period == p * dh


def test_vanilla_is_one_fragment_every_h():
    s = dl.Schedule.from_config(dl.DiLoCoConfig(sync_period=5))
    assert [t for t in range(1, 21) if s.sync_fragment(t) is not None] == [5, 10, 15, 20]
    assert all(s.sync_fragment(t) in (None, 0) for t in range(30))
    assert all(s.apply_fragment(t) == s.sync_fragment(t) for t in range(30))


def test_traced_forms_agree():
    """is_sync, is_apply and fragment_at on a traced step, as the compiled step calls them,
    agree with the Python forms."""
    import jax
    import jax.numpy as jnp

    s = dl.Schedule(sync_period=10, num_fragments=3, overlap_steps=2)
    traced = jax.jit(jax.vmap(lambda t: (s.is_sync(t), s.is_apply(t), s.fragment_at(t), s.fragment_at(t - 2))))
    syncs, applies, synced, applied = map(np.asarray, traced(jnp.arange(40, dtype=jnp.int32)))
    for t in range(0, 40):
        assert bool(syncs[t]) == (s.sync_fragment(t) is not None)
        assert bool(applies[t]) == (s.apply_fragment(t) is not None)
        if s.sync_fragment(t) is not None:
            assert int(synced[t]) == s.sync_fragment(t)
        if s.apply_fragment(t) is not None:
            assert int(applied[t]) == s.apply_fragment(t)


@st.composite
def schedules(draw):
    p = draw(st.integers(1, 9))
    h = draw(st.integers(1, 60))
    dh = max(1, round(h / p))
    v = draw(st.integers(0, p * dh - 1))
    return dl.Schedule(sync_period=h, num_fragments=p, overlap_steps=v)


@settings(max_examples=200, deadline=None)
@given(schedules(), st.integers(0, 5))
def test_every_fragment_synced_once_per_period(s, cycle):
    start = cycle * s.period + 1
    synced = [s.sync_fragment(t) for t in range(start, start + s.period)]
    assert sorted(f for f in synced if f is not None) == list(range(s.num_fragments))


@settings(max_examples=200, deadline=None)
@given(schedules())
def test_each_sync_followed_by_one_apply_v_steps_later(s):
    horizon = 4 * s.period
    syncs = [(t, s.sync_fragment(t)) for t in range(0, horizon + 1) if s.sync_fragment(t) is not None]
    applies = [(t, s.apply_fragment(t)) for t in range(0, horizon + s.overlap_steps + 1)
               if s.apply_fragment(t) is not None]
    assert applies == [(t + s.overlap_steps, f) for t, f in syncs]
    # between a sync of f and its apply there is no second sync of f
    for t, f in syncs:
        assert all(s.sync_fragment(u) != f for u in range(t + 1, t + s.overlap_steps + 1))


@settings(max_examples=100, deadline=None)
@given(schedules())
def test_no_sync_or_apply_at_or_before_zero(s):
    assert all(s.sync_fragment(t) is None for t in range(-s.period, 1))
    assert all(s.apply_fragment(t) is None for t in range(-s.period, s.overlap_steps + 1))


def test_overlap_must_be_below_period():
    with pytest.raises(ValueError, match=r"overlap_steps \(V\) must be in \[0, H_eff\) = \[0, 12\)"):
        dl.Schedule(sync_period=12, num_fragments=4, overlap_steps=12)
