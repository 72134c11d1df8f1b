"""When each fragment is synced and applied: pure arithmetic, importing nothing from the package.

Vanilla DiLoCo is the special case of one fragment (the whole model) with no delay:
``Schedule(sync_period=H)`` syncs and applies everything at every multiple of H.
"""

from __future__ import annotations

import dataclasses

from jaxtyping import Array, Bool, Int

Step = int | Int[Array, ""]

EVENT_SCOPE = "schedule_event"
"""The named scope of the compiled step's loop around each schedule event (a sync, a stash,
an exchange, an apply, a reset), which runs zero or one time: how the analyses tell those
loops, which run only on some steps, from the model's own loops, which run on every step."""

RECHECK_SCOPE = "sync_checked_again"
"""The named scope of a sync done again, checking every island first, because its first pass
was not trusted (a non-finite mean: some island went non-finite; or an island that did not
send): its collectives run only on such syncs."""


def _check(name: str, value, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}; got {value!r}")


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Δh, H_eff and the sync/apply fragment of every global step t.

    `t` counts inner steps taken; the first train step ends with t = 1. `is_sync`,
    `is_apply` and `fragment_at` are one formula for Python ints and for traced int32
    scalars (jnp's % is a floor modulo like Python's), so the compiled step and the host
    agree by construction; `sync_fragment`/`apply_fragment` answer with an int or None.
    """

    sync_period: int = 100
    """H: requested inner steps between syncs of the same parameters."""
    num_fragments: int = 1
    """P: fragments synced in turn (1: vanilla DiLoCo)."""
    overlap_steps: int = 0
    """V: steps between a fragment's sync and its apply."""

    def __post_init__(self):
        _check("sync_period (H)", self.sync_period, 1)
        _check("num_fragments (P)", self.num_fragments, 1)
        _check("overlap_steps (V)", self.overlap_steps, 0)
        if self.overlap_steps >= self.period:
            raise ValueError(
                f"overlap_steps (V) must be in [0, H_eff) = [0, {self.period}); got "
                f"{self.overlap_steps}: a fragment would be applied after its next sync "
                f"(H={self.sync_period}, P={self.num_fragments}, H_eff={self.period})"
            )

    @classmethod
    def from_config(cls, cfg) -> Schedule:
        """The schedule a DiLoCoConfig asks for (also `cfg.schedule`)."""
        if not cfg.streaming:
            return cls(sync_period=cfg.sync_period)
        return cls(cfg.sync_period, cfg.num_fragments, cfg.overlap_steps)

    @property
    def steps_between_syncs(self) -> int:
        """Δh = max(1, round(H / P)), with Python's half-to-even `round`."""
        return max(1, round(self.sync_period / self.num_fragments))

    @property
    def period(self) -> int:
        """H_eff = P·Δh: steps for every fragment to be synced once."""
        return self.num_fragments * self.steps_between_syncs

    def is_sync(self, t: Step) -> bool | Bool[Array, ""]:
        """A sync fires at t > 0 with t mod Δh = 0."""
        return (t > 0) & (t % self.steps_between_syncs == 0)

    def is_apply(self, t: Step) -> bool | Bool[Array, ""]:
        """An apply fires V steps after a sync."""
        return self.is_sync(t - self.overlap_steps)

    def fragment_at(self, t: Step) -> int | Int[Array, ""]:
        """f(t) = (t mod H_eff) div Δh: the fragment a sync at t would take."""
        return (t % self.period) // self.steps_between_syncs

    def sync_fragment(self, t: int) -> int | None:
        """Fragment synced at step t, or None."""
        return self.fragment_at(t) if self.is_sync(t) else None

    def apply_fragment(self, t: int) -> int | None:
        """Fragment applied at step t (synced V steps earlier), or None."""
        return self.sync_fragment(t - self.overlap_steps)

    def next_sync(self, t: int) -> int:
        """The first step > t at which a sync fires."""
        return (t // self.steps_between_syncs + 1) * self.steps_between_syncs

    def table(self, steps: int) -> list[tuple[int, int | None, int | None]]:
        """(t, sync fragment, apply fragment) for t = 1..steps."""
        return [(t, self.sync_fragment(t), self.apply_fragment(t)) for t in range(1, steps + 1)]
