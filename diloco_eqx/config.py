"""DiLoCoConfig: the algorithm's knobs, checked when the config is made."""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Mapping
from typing import Any

from diloco_eqx import codecs, faults
from diloco_eqx._checks import check_int, check_number
from diloco_eqx.orders import Order, resolve_order
from diloco_eqx.outer import check_outer_optimizer
from diloco_eqx.schedule import Schedule

OUTER_DTYPES = ("float32", "param")
DELAYED_OUTER = ("none", "naive", "eager")
ISLAND_WEIGHTING = ("uniform", "tokens")

# MaxText's knob names, so a run configured there can be replayed here.
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
MAXTEXT_DEFAULTS = {
    "diloco_sync_period": 36,
    "diloco_outer_lr": 0.3,
    "diloco_outer_momentum": 0.9,
    "enable_streaming_diloco": False,
    "num_diloco_fragments": None,
    "use_sequential_layers": False,
    "num_communication_overlapping_steps": 0,
    "communication_overlapping_alpha": 0.0,
    "ici_diloco_parallelism": 1,
    "dcn_diloco_parallelism": 1,
}
"""MaxText's own defaults (its base config) for the keys a DiLoCo run reads."""
MAXTEXT_READ = {*MAXTEXT_NAMES, *MAXTEXT_DEFAULTS, "enable_diloco", "num_slices"}

@dataclasses.dataclass(frozen=True)
class DiLoCoConfig:
    """The algorithm's knobs (docs/algorithm.md), each declared once here with its docstring
    (the CLI and tools derive their flags from these fields). Invalid values raise
    ValueError naming the knob."""

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
    """β: outer Nesterov momentum (outer Adam's β1)."""
    outer_optimizer: str = "nesterov"
    """How the outer model steps on the mean pseudo-gradient: "nesterov" (SGD with Nesterov
    momentum), "adam" (η = outer_lr, β1 = outer_momentum, β2 = outer_b2), "average" (the
    outer model becomes the islands' mean; η and β unused), or a registered name."""
    outer_b2: float = 0.99
    """β2 of outer Adam (outer_optimizer="adam" only)."""
    compression: str = "none"
    """Format of the pseudo-gradients on the wire: "none" (float32), "bf16", "fp8", "fp4",
    "topk" (SparseLoCo's chunked top-k, set by the topk_* knobs), or a codec registered
    with register_codec."""
    error_feedback: bool = False
    """Carry each island's quantization error into its next pseudo-gradient of that fragment."""
    error_decay: float = 1.0
    """β of the error-feedback buffer, in [0, 1]: the carried error is multiplied by it before
    it is added to the next pseudo-gradient (1: carried whole; error_feedback only)."""
    topk_density: float = 0.03
    """Fraction of each chunk's values compression="topk" sends, in (0, 1]."""
    topk_chunk: int = 4096
    """Values per chunk of compression="topk" (each chunk sends its largest), 1..65536."""
    topk_bits: int = 2
    """Bits of each value compression="topk" sends: 1, 2, 4 or 8."""
    drops: tuple[tuple[int, int], ...] = ()
    """Simulated faults: (step t, island k) pairs; island k's pseudo-gradient misses the sync at t."""
    drop_prob: float | tuple[float, ...] = 0.0
    """Chance that an island misses a sync: one value for every island, or one per island."""
    fault_seed: int = 0
    """Seed of the drop_prob coin (a function of the seed and t, so resumes repeat it)."""
    faults: tuple[str, ...] = ()
    """Further fault models, by the names they were registered under (register_fault_model)."""
    outer_dtype: str = "float32"
    """Storage of the outer model and outer optimizer state: "float32" (at least float32,
    whatever the inner dtype) or "param" (each parameter's own dtype)."""
    delayed_outer: str = "none"
    """Let each exchange run during the next round(s) of inner steps: "none" (the outer step
    waits for it), "naive" (each sync's outer step uses the mean sent `outer_delay` rounds
    earlier, the one that has arrived), "eager" (each island adds its own fresh
    pseudo-gradient's share and drops its stale one: islands then keep their own outer copies)."""
    outer_delay: int = 1
    """Rounds (syncs of a fragment) an exchange stays in flight with delayed_outer = naive or eager."""
    island_speed: float | tuple[float, ...] = 1.0
    """Fraction s_k of each period's inner steps an island takes (the first ⌊s_k·H_eff⌋ of
    every H_eff; it idles for the rest): one value for every island, or one per island, in [0, 1]."""
    island_weighting: str = "uniform"
    """How the islands' pseudo-gradients are averaged: "uniform", or "tokens" (weighted by
    the inner steps each took since the fragment's last sync; an island that took none is left out)."""

    def __post_init__(self):
        check_int("num_replicas (K)", self.num_replicas, low=1)
        check_int("sync_period (H)", self.sync_period, low=1)
        if not isinstance(self.streaming, bool):
            raise ValueError(f"streaming must be True or False; got {self.streaming!r}")
        check_int("overlap_steps (V)", self.overlap_steps, low=0)
        check_number("alpha (α)", self.alpha, "[0, 1]", lambda a: 0.0 <= a <= 1.0)
        check_number("outer_lr (η_outer)", self.outer_lr, "(0, inf)", lambda a: a > 0.0)
        check_number("outer_momentum (β)", self.outer_momentum, "[0, 1)", lambda a: 0.0 <= a < 1.0)
        check_outer_optimizer(self.outer_optimizer)
        check_number("outer_b2", self.outer_b2, "[0, 1)", lambda a: 0.0 <= a < 1.0)
        resolve_order(self.fragment_order)
        codecs.check_format(self.compression)
        if self.outer_dtype not in OUTER_DTYPES:
            raise ValueError(f"outer_dtype must be one of {OUTER_DTYPES}; got {self.outer_dtype!r}")
        if not isinstance(self.error_feedback, bool):
            raise ValueError(f"error_feedback must be True or False; got {self.error_feedback!r}")
        if self.error_feedback and self.compression == "none":
            warnings.warn(
                "error_feedback=True has no effect with compression='none' (float32 loses "
                "nothing to carry); set compression to 'bf16', 'fp8', 'fp4' or 'topk' to use it",
                stacklevel=3,
            )
        check_number("error_decay", self.error_decay, "[0, 1]", lambda a: 0.0 <= a <= 1.0)
        if self.error_decay != 1.0 and not self.error_feedback:
            warnings.warn(
                f"error_decay={self.error_decay} has no effect with error_feedback=False (no "
                "error is carried); set error_feedback=True to use it",
                stacklevel=3,
            )
        check_number("topk_density", self.topk_density, "(0, 1]", lambda a: 0.0 < a <= 1.0)
        if (isinstance(self.topk_chunk, bool) or not isinstance(self.topk_chunk, int)
                or not 1 <= self.topk_chunk <= codecs.TOPK_MAX_CHUNK):
            raise ValueError(f"topk_chunk must be an integer in 1..{codecs.TOPK_MAX_CHUNK} (positions "
                             f"within a chunk travel as uint16); got {self.topk_chunk!r}")
        if isinstance(self.topk_bits, bool) or self.topk_bits not in codecs.TOPK_BITS:
            raise ValueError(f"topk_bits must be one of {codecs.TOPK_BITS}; got {self.topk_bits!r}")
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
        self._check_faults()
        self._check_delayed()
        self._check_speeds()

    def _check_delayed(self) -> None:
        if self.delayed_outer not in DELAYED_OUTER:
            raise ValueError(f"delayed_outer must be one of {DELAYED_OUTER}; got {self.delayed_outer!r}")
        check_int("outer_delay", self.outer_delay, low=1)
        if self.delayed_outer == "none":
            return
        if self.streaming and self.overlap_steps:
            raise ValueError(f"delayed_outer={self.delayed_outer!r} needs overlap_steps (V) = 0 (the "
                             f"exchange already overlaps whole rounds); got {self.overlap_steps}")
        if self.compression != "none":
            raise ValueError(f"delayed_outer={self.delayed_outer!r} supports compression='none' only; "
                             f"got {self.compression!r}")

    def _check_speeds(self) -> None:
        speeds = self.island_speed
        if isinstance(speeds, (list, tuple)):
            speeds = tuple(speeds)
            object.__setattr__(self, "island_speed", speeds)
            if len(speeds) != self.num_replicas:
                raise ValueError(f"island_speed needs one value per island (K={self.num_replicas}); "
                                 f"got {len(speeds)}")
        for s in speeds if isinstance(speeds, tuple) else (speeds,):
            check_number("island_speed", s, "[0, 1]", lambda x: 0.0 <= x <= 1.0)
        if not any(n > 0 for n in self.island_steps):
            raise ValueError(f"island_speed: at least one island must take an inner step per period "
                             f"(⌊s·H_eff⌋ >= 1, H_eff={self.schedule.period}); got {self.island_speed!r}")
        if self.island_weighting not in ISLAND_WEIGHTING:
            raise ValueError(f"island_weighting must be one of {ISLAND_WEIGHTING}; got {self.island_weighting!r}")

    @property
    def island_steps(self) -> tuple[int, ...]:
        """Inner steps each island takes per period H_eff: ⌊s_k·H_eff⌋."""
        speeds = self.island_speed if isinstance(self.island_speed, tuple) else (self.island_speed,) * self.num_replicas
        period = self.schedule.period
        return tuple(math.floor(float(s) * period + 1e-9) for s in speeds)

    @property
    def heterogeneous(self) -> bool:
        """Whether some island idles for part of each period."""
        return any(n < self.schedule.period for n in self.island_steps)

    def _check_faults(self) -> None:
        k = self.num_replicas
        try:
            drops = tuple((s, i) for s, i in self.drops)
        except (TypeError, ValueError):
            raise ValueError(f"drops must be a list of (step, island) pairs; got {self.drops!r}") from None
        object.__setattr__(self, "drops", drops)
        sched = Schedule.from_config(self)
        for s, i in drops:
            check_int("drops step", s, low=1)
            check_int("drops island", i, low=0)
            if i >= k:
                raise ValueError(f"drops island must be in 0..K-1 = 0..{k - 1}; got {i} (step {s})")
            if sched.sync_fragment(s) is None:
                raise ValueError(
                    f"drops step {s} is not a sync step: syncs happen at multiples of "
                    f"{sched.steps_between_syncs} (Δh), so island {i} would miss nothing"
                )
        probs = self.drop_prob
        if isinstance(probs, (list, tuple)):
            probs = tuple(probs)
            object.__setattr__(self, "drop_prob", probs)
            if len(probs) != k:
                raise ValueError(f"drop_prob needs one value per island (K={k}); got {len(probs)}")
        else:
            probs = (probs,)
        for p in probs:
            check_number("drop_prob", p, "[0, 1]", lambda x: 0.0 <= x <= 1.0)
        check_int("fault_seed", self.fault_seed, low=0)
        if isinstance(self.faults, str) or not all(isinstance(n, str) for n in self.faults):
            raise ValueError(f"faults must be a list of registered fault model names; got {self.faults!r}")
        object.__setattr__(self, "faults", tuple(self.faults))
        for name in self.faults:
            faults.get_fault_model(name)

    @property
    def schedule(self) -> Schedule:
        """When each fragment is synced and applied."""
        return Schedule.from_config(self)

    @property
    def codec(self) -> codecs.AbstractCodec:
        """The codec the `compression` knob names ("topk": built from the topk_* knobs)."""
        if self.compression == "topk":
            return codecs.TopK(self.topk_density, self.topk_chunk, self.topk_bits)
        return codecs.get_codec(self.compression)

    @property
    def fault_model(self) -> faults.AbstractFaultModel:
        """The drops, the coin and the named fault models asked for (non-finite islands are
        always left out of a sync by the sync itself)."""
        return faults.from_knobs(self.drops, self.island_drop_probs, self.fault_seed, self.faults)

    @property
    def island_drop_probs(self) -> tuple[float, ...]:
        """drop_prob as one value per island."""
        if isinstance(self.drop_prob, tuple):
            return tuple(float(p) for p in self.drop_prob)
        return (float(self.drop_prob),) * self.num_replicas

    @classmethod
    def from_maxtext(cls, cfg: Mapping[str, Any]) -> DiLoCoConfig:
        """Replay a MaxText DiLoCo run: its key names (ours are accepted too) and, for
        missing keys, MaxText's defaults. K is derived as MaxText derives it,
        `ici_diloco_parallelism × dcn_diloco_parallelism`, with `dcn_diloco_parallelism=-1`
        meaning the slices left over by the other DCN axes (`num_slices` / their product).
        DiLoCo-related keys this framework does not model are ignored with a warning.
        """
        ours = {f.name for f in dataclasses.fields(cls)}
        mt = {**MAXTEXT_DEFAULTS, **{k: v for k, v in cfg.items() if k not in ours}}
        unknown = sorted(k for k in cfg if k not in MAXTEXT_READ and k not in ours
                         and ("diloco" in k.lower() or "overlapping" in k.lower()))
        if unknown:
            warnings.warn(f"from_maxtext: ignoring DiLoCo-related keys this framework does not "
                          f"model: {', '.join(unknown)}", stacklevel=2)
        if mt.get("enable_diloco") is False:
            if mt["enable_streaming_diloco"]:
                raise ValueError("from_maxtext: enable_streaming_diloco=True needs enable_diloco=True")
            warnings.warn("from_maxtext: enable_diloco=False, so MaxText would train without "
                          "DiLoCo; building the DiLoCo config of the other keys", stacklevel=2)
        if mt["enable_streaming_diloco"] and mt["num_diloco_fragments"] is None:
            raise ValueError("from_maxtext: enable_streaming_diloco=True needs num_diloco_fragments "
                             "(MaxText has no default for it)")
        kwargs: dict[str, Any] = {ours_name: mt[name] for name, ours_name in MAXTEXT_NAMES.items()
                                  if name in mt and mt[name] is not None}
        kwargs["num_replicas"] = _maxtext_replicas(
            mt, any(k in cfg for k in ("ici_diloco_parallelism", "dcn_diloco_parallelism")))
        kwargs["fragment_order"] = "sequential" if mt["use_sequential_layers"] else "interleaved"
        kwargs.update({k: v for k, v in cfg.items() if k in ours})
        return cls(**kwargs)


def _maxtext_replicas(mt: Mapping[str, Any], parallelism_given: bool) -> int:
    """K = ici_diloco_parallelism × dcn_diloco_parallelism, as MaxText derives it (a given
    num_diloco_replicas must agree)."""
    ici, dcn = mt["ici_diloco_parallelism"], mt["dcn_diloco_parallelism"]
    if dcn == -1:
        others = [v for k, v in mt.items() if k.startswith("dcn_") and k.endswith("_parallelism")
                  and k != "dcn_diloco_parallelism" and v != -1]
        product = math.prod(others)
        slices = mt.get("num_slices", -1)
        if not isinstance(slices, int) or slices < 1:
            raise ValueError("from_maxtext: dcn_diloco_parallelism=-1 takes its size from "
                             f"num_slices, which must be given (an integer >= 1); got {slices!r}")
        if product < 1 or slices % product:
            raise ValueError(f"from_maxtext: num_slices={slices} must be divisible by the product "
                             f"of the other DCN parallelisms ({product}) to resolve "
                             "dcn_diloco_parallelism=-1")
        dcn = slices // product
    derived = ici * dcn
    given = mt.get("num_diloco_replicas")
    if given is None:
        return derived
    if parallelism_given and given != derived:
        raise ValueError(f"from_maxtext: num_diloco_replicas={given} disagrees with "
                         f"ici_diloco_parallelism × dcn_diloco_parallelism = {ici} × {dcn} = {derived}")
    return given
