"""Wall-clock and compute utilization of DDP / DiLoCo / Streaming DiLoCo on a slow link.

A discrete-event model of one worker over a run of steps:
- a step is a forward pass (a fraction `forward_fraction` of the pure-compute step time)
  then a backward pass over the layers in reverse order, each layer's share proportional to
  its parameter count;
- a layer's gradient (DDP) or outer gradient (DiLoCo) can leave as soon as that layer's
  backward is done, so the reduction overlaps the rest of the backward pass;
- one link, first in first out: a transfer of n parameters takes
  latency + n · bits · ring_factor / bandwidth, where ring_factor = 2(M−1)/M for M workers
  (1 for the two-worker case);
- what a transfer blocks: DDP, vanilla DiLoCo and Streaming DiLoCo without overlap block
  the next step until their transfers end; with overlap V >= 1 a fragment synced at step t
  only blocks step t+V+1 (its apply happens at the end of step t+V); with delayed outer
  updates (`outer_delay` d >= 1 rounds, naive or eager) an exchange started at step t
  blocks only step t + d·period + 1, the step after the sync that uses it.
Compute utilization is compute time / wall-clock time, in steady state: a transfer still in
flight when the simulated steps end counts only the stall it would cause.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from diloco_eqx._checks import check_int, check_number
from diloco_eqx.orders import layer_groups
from diloco_eqx.schedule import Schedule

METHODS = ("ddp", "diloco", "streaming")


@dataclasses.dataclass(frozen=True)
class Method:
    """What is sent when: "ddp" (every step), "diloco" (all layers every H steps) or
    "streaming" (one fragment of layers every round(H/P) steps, applied V steps later)."""

    kind: str
    sync_period: int = 1
    num_fragments: int = 1
    overlap_steps: int = 0
    bits: int = 16
    fragment_order: str = "interleaved"
    outer_delay: int = 0
    """Rounds an exchange may stay in flight (delayed_outer naive or eager; 0: none)."""

    def __post_init__(self):
        if self.kind not in METHODS:
            raise ValueError(f"method must be one of {METHODS}; got {self.kind!r}")
        check_int("sync_period (H)", self.sync_period, low=1)
        check_int("num_fragments (P)", self.num_fragments, low=1)
        check_int("overlap_steps (V)", self.overlap_steps, low=0)
        check_int("bits", self.bits, low=1)
        check_int("outer_delay", self.outer_delay, low=0)
        if self.outer_delay and self.kind == "ddp":
            raise ValueError("outer_delay applies to diloco and streaming methods, not ddp")


@dataclasses.dataclass(frozen=True)
class Workload:
    layer_params: tuple[int, ...]
    """Parameters of each layer, in forward order (embeddings may be folded into the ends)."""
    step_time: float
    """Seconds of pure compute per step."""
    forward_fraction: float = 1 / 3
    num_workers: int = 2

    def __post_init__(self):
        check_number("step_time", self.step_time, "(0, inf)", lambda x: x > 0)
        check_number("forward_fraction", self.forward_fraction, "(0, 1)", lambda x: 0 < x < 1)
        check_int("num_workers", self.num_workers, low=2)
        if not self.layer_params or min(self.layer_params) < 0:
            raise ValueError(f"layer_params must be non-negative counts; got {self.layer_params}")

    @property
    def ring_factor(self) -> float:
        return 2 * (self.num_workers - 1) / self.num_workers

    def backward_done(self) -> list[float]:
        """Time into a step at which each layer's backward pass ends."""
        total = sum(self.layer_params)
        back = self.step_time * (1 - self.forward_fraction)
        done, t = [0.0] * len(self.layer_params), self.step_time * self.forward_fraction
        for layer in reversed(range(len(self.layer_params))):
            t += back * self.layer_params[layer] / total
            done[layer] = t
        return done


@dataclasses.dataclass(frozen=True)
class Result:
    wall_time: float
    compute_time: float
    bits_sent: float

    @property
    def utilization(self) -> float:
        return self.compute_time / self.wall_time


def _schedule(method: Method) -> Schedule:
    return Schedule(method.sync_period, method.num_fragments, method.overlap_steps)


def _synced_layers(method: Method, num_layers: int, t: int) -> list[int] | None:
    """Layers whose (outer) gradients leave at the end of step t (1-based), or None.

    Streaming fragments here are the P groups of layers an order makes (the library's
    fragments 1..P; this model folds the embeddings into the layers, so there is no
    separate fragment 0)."""
    if method.kind == "ddp":
        return list(range(num_layers))
    if method.kind == "diloco":
        return list(range(num_layers)) if t % method.sync_period == 0 else None
    f = _schedule(method).sync_fragment(t)
    if f is None:
        return None
    return list(layer_groups(method.fragment_order, num_layers, method.num_fragments + 1)[f])


def simulate(workload: Workload, method: Method, bandwidth_gbps: float, latency: float = 0.0,
             steps: int | None = None) -> Result:
    """Run the event model for `steps` steps (default: 4 sync periods, at least 40 steps)."""
    check_number("bandwidth_gbps", bandwidth_gbps, "(0, inf)", lambda x: x > 0)
    check_number("latency", latency, "[0, inf)", lambda x: x >= 0)
    n_layers = len(workload.layer_params)
    if method.kind == "streaming":
        period = _schedule(method).period
    else:
        period = method.sync_period
    steps = steps or max(40, 4 * period)
    done_at = workload.backward_done()
    delay = (method.overlap_steps if method.kind == "streaming" else 0) + method.outer_delay * period
    bits_per_param = method.bits * workload.ring_factor
    start, link_free, bits = 0.0, 0.0, 0.0
    due: dict[int, float] = {}  # step index -> time its start must wait for
    for t in range(1, steps + 1):
        start = max(start, due.pop(t, 0.0))
        layers = _synced_layers(method, n_layers, t)
        if layers:
            for layer in sorted(layers, key=lambda l: done_at[l]):
                n = workload.layer_params[layer]
                link_free = max(link_free, start + done_at[layer]) + latency + (
                    n * bits_per_param / (bandwidth_gbps * 1e9)
                )
                bits += n * bits_per_param
            due[t + delay + 1] = max(due.get(t + delay + 1, 0.0), link_free)
        start += workload.step_time
    # Transfers still in flight at the end stall only the steps they would have blocked
    # (steady state: the run goes on computing past its last step).
    end = start
    for s_blocked, ready in due.items():
        end = max(end, ready - (s_blocked - steps - 1) * workload.step_time)
    return Result(wall_time=end, compute_time=steps * workload.step_time, bits_sent=bits)


def required_bandwidth(workload: Workload, method: Method, utilization: float,
                       latency: float = 0.0, steps: int | None = None) -> float:
    """Smallest bandwidth (Gbit/s, to 0.1%) at which the run reaches `utilization`."""
    check_number("utilization", utilization, "(0, 1)", lambda x: 0 < x < 1)
    lo, hi = 1e-4, 1e6
    if simulate(workload, method, hi, latency, steps).utilization < utilization:
        return math.inf  # latency alone keeps it below the target
    while hi / lo > 1.001:
        mid = math.sqrt(lo * hi)
        if simulate(workload, method, mid, latency, steps).utilization >= utilization:
            hi = mid
        else:
            lo = mid
    return hi


def uniform_layers(total_params: float, num_layers: int) -> tuple[int, ...]:
    """`total_params` split evenly over `num_layers` layers."""
    check_int("num_layers", num_layers, low=1)
    return tuple([int(round(total_params / num_layers))] * num_layers)


def bandwidth_table(workload: Workload, methods: Sequence[tuple[str, Method]],
                    targets: Sequence[float] = (0.5, 0.8, 0.9, 0.95, 0.99),
                    latency: float = 0.0) -> dict[str, list[float]]:
    """{method name: required Gbit/s for each utilization target}."""
    return {name: [required_bandwidth(workload, m, u, latency) for u in targets]
            for name, m in methods}
