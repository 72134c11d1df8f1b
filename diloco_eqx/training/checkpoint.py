"""Checkpoints of a whole run: train state, data iterator position and RNG, saved together.

Built on orbax-checkpoint's `CheckpointManager`: each array is written by the process(es)
that hold its shards and restored straight into the target sharding, which is what a
state laid out over a multi-device (and, later, multi-process) `diloco` axis needs. A
save is written into a temporary directory and renamed when complete, so a crash mid-write
leaves no checkpoint that `latest_step` would pick up.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import numpy as np
import orbax.checkpoint as ocp


class Checkpointer:
    """Keeps the last `keep` checkpoints of a run under `directory`."""

    def __init__(self, directory: str | os.PathLike, keep: int = 2):
        self.directory = Path(directory).absolute()
        self._manager = ocp.CheckpointManager(
            self.directory,
            # Synchronous saves: the train step donates the state's buffers right after.
            options=ocp.CheckpointManagerOptions(
                max_to_keep=keep, create=True, enable_async_checkpointing=False
            ),
            item_names=("state", "extra"),
        )

    def save(self, step: int, state: eqx.Module, extra: dict[str, Any]) -> None:
        """Save `state`'s arrays and a JSON-able `extra` (data iterator state, RNG, ...)."""
        self._manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(eqx.filter(state, eqx.is_array)),
                extra=ocp.args.JsonSave(extra),
            ),
        )

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def restore(self, like: eqx.Module, step: int | None = None) -> tuple[int, eqx.Module, dict]:
        """(step, state, extra) of checkpoint `step` (default: latest), with the structure,
        dtypes and shardings of `like`."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        arrays, static = eqx.partition(like, eqx.is_array)
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, arrays)
        out = self._manager.restore(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract), extra=ocp.args.JsonRestore()
            ),
        )
        return step, eqx.combine(out["state"], static), dict(out["extra"])

    def close(self) -> None:
        self._manager.close()


def key_to_json(key: jax.Array) -> list[int]:
    return np.asarray(jax.random.key_data(key)).tolist()


def key_from_json(data: list[int]) -> jax.Array:
    return jax.random.wrap_key_data(np.asarray(data, np.uint32))
