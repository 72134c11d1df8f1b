"""A run directory opened again after (or while) it trains: its settings, and the outer model
of one of its checkpoints, for tools that look at what the model learned.

The run is rebuilt from its own run.json on this process's devices alone (the islands'
layout over devices and processes changes no number), and the checkpoint is read without
writing anything into the run directory.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import equinox as eqx

from diloco_eqx.models.io import model_config_class
from diloco_eqx.training.checkpoint import Checkpointer
from diloco_eqx.training.cli import build_parser, parse_run_config
from diloco_eqx.training.config import RunConfig
from diloco_eqx.training.loop import read_jsonl


@dataclasses.dataclass(frozen=True)
class SavedModel:
    """The outer model of checkpoint `step` of a run, with what it was trained with."""

    cfg: RunConfig
    step: int
    model: eqx.Module
    job: object
    """The rebuilt `runner.Job`: its loss_fn, held-out batches, corpus."""


def run_settings(run_dir: str | Path) -> RunConfig:
    """The run's RunConfig from its run.json, laid out for this one process."""
    run_dir = Path(run_dir)
    if not (run_dir / "run.json").is_file():
        raise ValueError(f"{run_dir}: not a run directory (no run.json there)")
    cfg = parse_run_config(["--config", str(run_dir / "run.json"), "--out", str(run_dir), "--resume"],
                           build_parser("saved run"))
    return dataclasses.replace(cfg, devices=None, data_parallel=1, fsdp=1, coordinator=None,
                               num_processes=1, process_id=0, progress=False)


def load_outer_model(run_dir: str | Path, step: int | None = None) -> SavedModel:
    """The outer model (DDP: the model) of checkpoint `step` (default: the latest)."""
    from diloco_eqx.training.runner import build

    cfg = run_settings(run_dir)
    job = build(cfg)
    checkpointer = Checkpointer(Path(run_dir) / "checkpoints")
    try:
        steps = checkpointer.all_steps()
        if not steps or (step is not None and step not in steps):
            raise ValueError(f"{run_dir}: no checkpoint {'yet' if step is None else f'at step {step}'} "
                             f"(checkpoints: {', '.join(map(str, sorted(steps))) or 'none'})")
        step, state, _ = checkpointer.restore(job.state, step)
    finally:
        checkpointer.close()
    model = job.algo.outer_model(state)
    return SavedModel(cfg, step, model, job)


def model_config(run_dir: str | Path) -> Any:
    """The model settings the run built its model from (run.json's "model"), as the config
    dataclass its model factory takes."""
    cfg = run_settings(run_dir)
    built = json.loads((Path(run_dir) / "run.json").read_text())["model"]
    cls = model_config_class(cfg.model_factory)
    return cls(**{f.name: built[f.name] for f in dataclasses.fields(cls) if f.name in built})


def recorded_eval_loss(run_dir: str | Path, step: int) -> float | None:
    """The held-out loss the run recorded at `step`, if it evaluated there."""
    path = Path(run_dir) / "metrics.jsonl"
    rows = read_jsonl(path) if path.exists() else []
    losses = [r["eval_loss"] for r in rows if r.get("eval") and r.get("step") == step]
    return losses[-1] if losses else None
