"""DiLoCoConfig: the algorithm's knobs, checked when the config is made."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from typing import Any

from diloco_eqx._checks import check_int, check_number
from diloco_eqx.compression import check_format
from diloco_eqx.orders import Order, resolve_order
from diloco_eqx.schedule import Schedule

# The other framework's knob names, so a run configured there can be replayed here.
MAXTEXT_NAMES = {
    "num_diloco_replicas": "num_replicas",
    "diloco_sync_period": "sync_period",
    "num_diloco_fragments": "num_fragments",
    "enable_streaming_diloco": "streaming",
    "num_communication_overlapping_steps": "overlap_steps",
    "communication_overlapping_alpha": "alpha",
    "diloco_outer_lr": "outer_lr",
    "diloco_outer_momentum": "outer_momentum",
}


@dataclasses.dataclass(frozen=True)
class DiLoCoConfig:
    """The knobs of SPEC.md. Invalid values raise ValueError naming the knob."""

    num_replicas: int = 2
    """K: islands training independently."""
    sync_period: int = 100
    """H: requested inner steps between syncs."""
    streaming: bool = False
    """False: vanilla DiLoCo; True: Streaming DiLoCo."""
    num_fragments: int = 2
    """P: fragments (streaming only); fragment 0 holds every leaf outside the layer stack."""
    fragment_order: str | Order = "interleaved"
    """How layers are assigned to fragments 1..P-1: a registered name or a function."""
    overlap_steps: int = 0
    """V: steps between syncing a fragment and applying it (streaming only)."""
    alpha: float = 0.0
    """α: at apply, inner <- α·inner + (1-α)·outer (streaming only)."""
    outer_lr: float = 0.7
    """η_outer: outer Nesterov SGD learning rate."""
    outer_momentum: float = 0.9
    """β: outer Nesterov momentum."""
    compression: str = "none"
    """Format of the pseudo-gradients on the wire: "none" (float32), "bf16", "fp8", "fp4"."""
    error_feedback: bool = False
    """Carry each island's quantization error into its next pseudo-gradient of that fragment."""

    def __post_init__(self):
        check_int("num_replicas (K)", self.num_replicas, low=1)
        check_int("sync_period (H)", self.sync_period, low=1)
        if not isinstance(self.streaming, bool):
            raise ValueError(f"streaming must be True or False; got {self.streaming!r}")
        check_int("overlap_steps (V)", self.overlap_steps, low=0)
        check_number("alpha (α)", self.alpha, "[0, 1]", lambda a: 0.0 <= a <= 1.0)
        check_number("outer_lr (η_outer)", self.outer_lr, "(0, inf)", lambda a: a > 0.0)
        check_number("outer_momentum (β)", self.outer_momentum, "[0, 1)", lambda a: 0.0 <= a < 1.0)
        resolve_order(self.fragment_order)
        check_format(self.compression)
        if not isinstance(self.error_feedback, bool):
            raise ValueError(f"error_feedback must be True or False; got {self.error_feedback!r}")
        if self.error_feedback and self.compression == "none":
            warnings.warn(
                "error_feedback=True has no effect with compression='none' (float32 loses "
                "nothing to carry); set compression to 'bf16', 'fp8' or 'fp4' to use it",
                stacklevel=3,
            )
        if self.streaming:
            check_int("num_fragments (P) with streaming=True", self.num_fragments, low=2)
            sched = Schedule.from_config(self)  # checks V < H_eff
            if sched.period != self.sync_period:
                warnings.warn(
                    f"sync_period (H)={self.sync_period} is not a multiple of num_fragments "
                    f"(P)={self.num_fragments}: Δh=round(H/P)={sched.steps_between_syncs}, so "
                    f"the effective period is H_eff={sched.period}, not {self.sync_period}",
                    stacklevel=3,
                )
        elif self.overlap_steps != 0 or self.alpha != 0.0:
            warnings.warn(
                f"overlap_steps (V)={self.overlap_steps} and alpha (α)={self.alpha} have no "
                "effect with streaming=False (vanilla DiLoCo replaces every island's "
                "parameters at each sync); set streaming=True to use them",
                stacklevel=3,
            )

    @classmethod
    def from_maxtext(cls, cfg: Mapping[str, Any]) -> DiLoCoConfig:
        """Build from a dict using MaxText's names (or ours); other keys are ignored.

        MaxText's `use_sequential_layers` maps to fragment_order "sequential"/"interleaved".
        """
        kwargs: dict[str, Any] = {}
        ours = {f.name for f in dataclasses.fields(cls)}
        for key, value in cfg.items():
            if key in MAXTEXT_NAMES:
                kwargs[MAXTEXT_NAMES[key]] = value
            elif key == "use_sequential_layers":
                kwargs["fragment_order"] = "sequential" if value else "interleaved"
            elif key in ours:
                kwargs[key] = value
        return cls(**kwargs)

