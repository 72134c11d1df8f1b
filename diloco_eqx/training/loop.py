"""The training loop: steps, progress, held-out evaluation, metric rows, checkpoints.

The loop dispatches step t+1 before it reads step t's metrics, so the host never makes the
device wait for logging. Everything it needs to continue a run (state, data iterator
position, RNG, elapsed time) goes into each checkpoint; `metrics.jsonl` lines past the
restored step are dropped on resume, so a resumed run's file reads as one uninterrupted run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

import equinox as eqx
import numpy as np
from tqdm import tqdm

from diloco_eqx.training.checkpoint import Checkpointer


class Interrupted(Exception):
    """Training stopped on a signal, after the step in flight and a checkpoint of it."""

    def __init__(self, step: int, signum: int):
        super().__init__(f"interrupted by {signal.Signals(signum).name} at step {step}")
        self.step, self.signum = step, signum


class StopSignals:
    """While active, SIGINT and SIGTERM ask the loop to stop at the next step boundary
    instead of killing the process mid-step; a second signal stops at once.

    `requested()` says whether to stop; with `across_processes` every process learns of a
    signal any one of them received (a small all-gather per step), so all stop together.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, across_processes: bool = False):
        self.signum: int | None = None
        self._across = across_processes
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame) -> None:
        if self.signum is not None:  # asked twice: stop now
            signal.signal(signum, self._previous.get(signum, signal.SIG_DFL))
            raise KeyboardInterrupt
        self.signum = signum

    def requested(self) -> int | None:
        """The signal to stop on, if any process received one; else None."""
        if not self._across:
            return self.signum
        from jax.experimental import multihost_utils

        seen = multihost_utils.process_allgather(np.int32(self.signum or 0))
        return int(np.max(seen)) or None


@dataclasses.dataclass(frozen=True)
class LoopConfig:
    steps: int
    """Train until the global step t reaches this."""
    eval_every: int = 100
    checkpoint_every: int = 100
    tokens_per_step: int = 0
    progress: bool = True


class Tracker(Protocol):
    """What the loop writes its rows to (one dict per step or evaluation): metrics.jsonl
    below, or the backends `trackers.open_trackers` fans out to."""

    def write(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class JsonlWriter:
    """Appends one JSON object per line; on resume keeps only lines up to `keep_through`
    (and drops a last line cut short by a crash or a full disk)."""

    def __init__(self, path: str | os.PathLike, keep_through: int | None = None):
        self.path = Path(path)
        if keep_through is not None and self.path.exists():
            kept = [r for r in _complete_records(self.path) if r[1].get("step", 0) <= keep_through]
            _atomic_write(self.path, "".join(line + "\n" for line, _ in kept))
        self._file = open(self.path, "a")  # noqa: SIM115 - closed in close()

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record, allow_nan=True) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def _complete_records(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """(line, record) of every line that parses; only a file's last line can be cut short."""
    out = []
    for line in path.read_text(errors="replace").splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            if line.strip():
                out.append((line, json.loads(line)))
    return out


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_json(path: str | os.PathLike, obj: Any) -> None:
    """Write JSON so that a reader never sees half a file."""
    _atomic_write(Path(path), json.dumps(obj, indent=2, default=str) + "\n")


def mean_loss(loss_fn: Callable, model: eqx.Module, batches: list[np.ndarray]) -> float:
    """Mean of `loss_fn` (jit it once, outside) over equally sized held-out batches."""
    return float(np.mean([float(loss_fn(model, b)) for b in batches]))


class _Progress:
    """Writes each step's metrics row and evaluation, and keeps the progress bar."""

    def __init__(self, cfg: LoopConfig, start_step: int, metrics: Tracker,
                 describe: Callable[[int], dict[str, Any]], t0: float):
        self.cfg, self.start, self.metrics, self.describe, self.t0 = cfg, start_step, metrics, describe, t0
        self.rate: float | None = None
        self.bar = tqdm(total=cfg.steps, initial=start_step, disable=not cfg.progress, file=sys.stderr,
                        dynamic_ncols=True, mininterval=1.0)

    def record(self, m, step_time: float) -> None:
        row = {**dict(m), **self.describe(m["step"])}
        row["wall_time"] = time.perf_counter() - self.t0
        row["step_time"] = step_time
        self.metrics.write(row)
        # tokens/s over recent steps; a step that includes compilation is not a rate
        r = self.cfg.tokens_per_step / max(step_time, 1e-9)
        self.rate = r if self.rate is None or row["step"] == self.start + 2 else 0.9 * self.rate + 0.1 * r
        self.bar.update(row["step"] - self.bar.n)
        self.bar.set_postfix(loss=f"{row['loss']:.3f}", tok_s=f"{self.rate:,.0f}",
                             next_sync=row.get("next_sync", "-"), refresh=False)

    def evaluated(self, t: int, losses: dict[str, float]) -> None:
        self.metrics.write({"step": t, "eval": True, **losses, "wall_time": time.perf_counter() - self.t0})
        self.bar.write(f"step {t}: " + "  ".join(f"{k} {v:.4f}" for k, v in losses.items()))


def train_loop(
    state: eqx.Module,
    step_fn: Callable,
    batches: Iterator,
    *,
    cfg: LoopConfig,
    start_step: int,
    metrics: Tracker,
    evaluate: Callable[[eqx.Module], dict[str, float]],
    describe: Callable[[int], dict[str, Any]],
    checkpointer: Checkpointer | None = None,
    extra: Callable[[], dict[str, Any]] = dict,
    elapsed: float = 0.0,
    stop: Callable[[], int | None] = lambda: None,
) -> eqx.Module:
    """Run `step_fn` from `start_step` to `cfg.steps`; returns the final state.

    `metrics` gets every step's row and every evaluation's; `batches` is a grain iterator
    (its `get_state()` goes into checkpoints); `evaluate` gives held-out losses of a state;
    `describe(t)` adds per-step fields (learning rates, tokens, bytes sent, next sync);
    `extra()` adds JSON-able fields to every checkpoint.
    `stop()` is asked after every step: a signal number there ends the loop with the step
    recorded and checkpointed, raising `Interrupted`.
    """
    t0 = time.perf_counter() - elapsed
    progress = _Progress(cfg, start_step, metrics, describe, t0)
    pending, t = None, start_step
    try:
        last = time.perf_counter()
        while t < cfg.steps:
            state, m = step_fn(state, next(batches))
            t += 1
            if pending is not None:
                progress.record(*pending)
            now = time.perf_counter()
            # the loop's period: with step t+1 dispatched before step t is read, this is the
            # device's step time once the pipeline is full
            pending, last = (m, now - last), now
            signum = stop()
            eval_due = cfg.eval_every and (t % cfg.eval_every == 0 or t == cfg.steps)
            ckpt_due = checkpointer and (t % cfg.checkpoint_every == 0 or t == cfg.steps or signum)
            if eval_due or ckpt_due or signum:
                progress.record(*pending)
                pending = None
                if eval_due:
                    progress.evaluated(t, evaluate(state))
                if ckpt_due:
                    snapshot = {"data": batches.get_state(), "elapsed": time.perf_counter() - t0, **extra()}
                    checkpointer.save(t, state, snapshot)
                last = time.perf_counter()
            if signum:
                raise Interrupted(t, signum)
        if pending is not None:
            progress.record(*pending)
    finally:
        progress.bar.close()
    return state
