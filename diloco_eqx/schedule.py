"""When each fragment is synced and applied: the schedule arithmetic of ALGORITHM.md.

Vanilla DiLoCo is the special case of one fragment (the whole model) with no delay:
``Schedule(sync_period=H)`` syncs and applies everything at every multiple of H.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import jax.numpy as jnp
from jaxtyping import Array, Bool, Int

from diloco_eqx._checks import check_int

if TYPE_CHECKING:
    from diloco_eqx.config import DiLoCoConfig


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Δh, H_eff and the sync/apply fragment of every global step t.

    `t` counts inner steps taken; the first train step ends with t = 1. Each method has a
    Python form (int in, int or None out) and a traced form (`*_traced`) used inside the
    compiled step, so one compiled function serves every schedule position.
    """

    sync_period: int
    num_fragments: int = 1
    overlap_steps: int = 0

    def __post_init__(self):
        check_int("sync_period (H)", self.sync_period, low=1)
        check_int("num_fragments (P)", self.num_fragments, low=1)
        check_int("overlap_steps (V)", self.overlap_steps, low=0)
        if self.overlap_steps >= self.period:
            raise ValueError(
                f"overlap_steps (V) must be in [0, H_eff) = [0, {self.period}); got "
                f"{self.overlap_steps}: a fragment would be applied after its next sync "
                f"(H={self.sync_period}, P={self.num_fragments}, H_eff={self.period})"
            )

    @classmethod
    def from_config(cls, cfg: DiLoCoConfig) -> Schedule:
        """The schedule a config asks for; vanilla mode is one fragment, no delay."""
        if not cfg.streaming:
            return cls(sync_period=cfg.sync_period)
        return cls(
            sync_period=cfg.sync_period,
            num_fragments=cfg.num_fragments,
            overlap_steps=cfg.overlap_steps,
        )

    @property
    def steps_between_syncs(self) -> int:
        """Δh = max(1, round(H / P)), with Python's half-to-even `round`."""
        return max(1, round(self.sync_period / self.num_fragments))

    @property
    def period(self) -> int:
        """H_eff = P·Δh: steps for every fragment to be synced once."""
        return self.num_fragments * self.steps_between_syncs

    def fragment_at(self, t: int) -> int:
        """f(t) = (t mod H_eff) // Δh."""
        return (t % self.period) // self.steps_between_syncs

    def sync_fragment(self, t: int) -> int | None:
        """Fragment synced at step t, or None."""
        if t > 0 and t % self.steps_between_syncs == 0:
            return self.fragment_at(t)
        return None

    def apply_fragment(self, t: int) -> int | None:
        """Fragment applied at step t (synced V steps earlier), or None."""
        return self.sync_fragment(t - self.overlap_steps)

    def next_sync(self, t: int) -> int:
        """The first step > t at which a sync fires."""
        return (t // self.steps_between_syncs + 1) * self.steps_between_syncs

    def is_sync_traced(self, t: Int[Array, ""]) -> Bool[Array, ""]:
        return (t > 0) & (t % self.steps_between_syncs == 0)

    def is_apply_traced(self, t: Int[Array, ""]) -> Bool[Array, ""]:
        return self.is_sync_traced(t - self.overlap_steps)

    def fragment_at_traced(self, t: Int[Array, ""]) -> Int[Array, ""]:
        # jnp's % is floor-mod like Python's, so t - V < 0 never gives a negative fragment.
        return jnp.mod(t, self.period) // self.steps_between_syncs

    def table(self, steps: int) -> list[tuple[int, int | None, int | None]]:
        """(t, sync fragment, apply fragment) for t = 1..steps."""
        return [(t, self.sync_fragment(t), self.apply_fragment(t)) for t in range(1, steps + 1)]
