"""Checkpoints of a whole run: train state, data iterator position and RNG, saved together.

Built on orbax-checkpoint's `CheckpointManager`: each array is written by the process(es)
that hold its shards and restored straight into the target sharding, which is what a
state laid out over a multi-device (and multi-process) `diloco` axis needs. A save is
written into a temporary directory and renamed when complete, so a crash mid-write leaves
no checkpoint that `latest_step` would pick up (and the next start removes the leftover).

Each checkpoint also carries a fingerprint of its arrays (two wrapping sums of their bits
per leaf), checked on restore: a truncated or garbled file is found whether the storage
layer notices it or would hand back wrong numbers. `restore_intact` falls back past
damaged checkpoints, setting each aside under a name orbax does not read.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jaxtyping import Array, UInt32

from diloco_eqx.training import multiprocess

PAUSE_IN_SAVE = "DILOCO_EQX_TEST_PAUSE_IN_SAVE"
"""Test hook: with this environment variable set to a step, the save of that step stops
inside the write (its temporary directory exists, the checkpoint is not committed), prints
a line saying so and waits, so that a test can kill the process there."""


class DamagedCheckpoint(ValueError):
    """A checkpoint that cannot be read back as it was written."""


class _Extra(ocp.handlers.JsonCheckpointHandler):
    """The JSON item of a checkpoint; holds the test hook that pauses inside a save."""

    pause_now = False

    async def async_save(self, directory, item=None, args=None):
        if self.pause_now:
            print(f"{PAUSE_IN_SAVE}: paused inside the save in {directory}", file=sys.stderr, flush=True)
            while True:
                time.sleep(60)
        return await super().async_save(directory, item, args)


class _Leftovers(logging.Filter):
    """Drops asyncio's reports of storage futures whose error was already raised to us."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "exception was never retrieved" not in record.getMessage()


def _quiet_leftovers() -> None:
    """After orbax gives up on a damaged read or a failed write, the storage layer's other
    futures still finish with the same error: asyncio logs each as never retrieved, and their
    callbacks find orbax's event loop closed. Both repeat an error already reported, as
    screens of traceback; silence just those two (idempotent)."""
    log = logging.getLogger("asyncio")
    if not any(isinstance(f, _Leftovers) for f in log.filters):
        log.addFilter(_Leftovers())
    previous = sys.unraisablehook
    if getattr(previous, "_diloco_eqx", False):
        return

    def hook(unraisable):
        if not (isinstance(unraisable.exc_value, RuntimeError) and str(unraisable.exc_value) == "Event loop is closed"):
            previous(unraisable)

    hook._diloco_eqx = True
    sys.unraisablehook = hook


class Checkpointer:
    """Keeps the last `keep` checkpoints of a run under `directory`."""

    def __init__(self, directory: str | os.PathLike, keep: int = 2):
        self.directory = Path(directory).absolute()
        _quiet_leftovers()
        self._extra = _Extra()
        registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
        for args in (ocp.args.JsonSave, ocp.args.JsonRestore):
            registry.add("extra", args, self._extra)
        for args in (ocp.args.StandardSave, ocp.args.StandardRestore):
            registry.add("state", args, ocp.StandardCheckpointHandler())
        self._manager = ocp.CheckpointManager(
            self.directory,
            # Synchronous saves: the train step donates the state's buffers right after.
            options=ocp.CheckpointManagerOptions(
                max_to_keep=keep, create=True, enable_async_checkpointing=False,
                cleanup_tmp_directories=True,
            ),
            handler_registry=registry,
        )
        pause = os.environ.get(PAUSE_IN_SAVE)
        self._pause_at = int(pause) if pause else None

    def save(self, step: int, state: eqx.Module, extra: dict[str, Any]) -> None:
        """Save `state`'s arrays and a JSON-able `extra` (data iterator state, RNG, ...).

        A write that fails (a full disk, say) removes its partial checkpoint and raises
        OSError naming the directory and the last complete checkpoint, which is untouched."""
        arrays = eqx.filter(state, eqx.is_array)
        self._check_space(step, sum(x.nbytes for x in jax.tree.leaves(arrays)))
        extra = {**extra, "fingerprint": fingerprint(arrays).tolist()}
        self._extra.pause_now = step == self._pause_at
        try:
            self._manager.save(step, args=ocp.args.Composite(
                state=ocp.args.StandardSave(arrays), extra=ocp.args.JsonSave(extra)))
        except Exception as e:
            self._remove_partial(step)
            raise self._write_error(step, e) from e

    def _check_space(self, step: int, nbytes: int) -> None:
        """Refuse a save the disk cannot hold before writing any of it (a write that runs out
        of space midway leaves the storage layer's callbacks failing noisily)."""
        need = int(1.25 * nbytes) + (1 << 16)
        free = shutil.disk_usage(self.directory).free
        if _on_any_process(free < need):  # all processes save, or none
            raise self._write_error(step, OSError(errno.ENOSPC, f"No space left: checkpoint step {step} "
                                                  f"needs about {need:,} bytes, {free:,} are free"))

    def _write_error(self, step: int, e: Exception) -> OSError:
        text = (e.strerror if isinstance(e, OSError) else None) or _first_line(e) or type(e).__name__
        full = getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or "No space left" in text
        code = errno.ENOSPC if full else getattr(e, "errno", None) or errno.EIO
        last = self.latest_step()
        return OSError(code, f"{'no space left on device' if full else 'write failed'} in {self.directory} "
                       f"while saving checkpoint step {step} (not kept; the last complete checkpoint, "
                       f"{'step ' + str(last) if last is not None else 'none'}, is intact): {text}")

    def _remove_partial(self, step: int) -> None:
        if jax.process_index() == 0:
            for tmp in self.directory.glob(f"{step}.orbax-checkpoint-tmp*"):
                shutil.rmtree(tmp, ignore_errors=True)
        self._manager.reload()

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self._manager.all_steps())

    def restore(self, like: eqx.Module, step: int | None = None) -> tuple[int, eqx.Module, dict]:
        """(step, state, extra) of checkpoint `step` (default: latest), with the structure,
        dtypes and shardings of `like`; DamagedCheckpoint if it does not read back as saved."""
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        try:
            out, problem = self._read(like, step), None
        except Exception as e:
            out, problem = None, f"unreadable: {type(e).__name__}: {_first_line(e)}"
        if _on_any_process(problem is not None):  # the fingerprint is collective: all or none
            raise DamagedCheckpoint(problem or "unreadable on another process")
        return step, out[0], _checked(out)

    def _read(self, like: eqx.Module, step: int) -> tuple[eqx.Module, dict]:
        arrays, static = eqx.partition(like, eqx.is_array)
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, arrays)
        out = self._manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract), extra=ocp.args.JsonRestore()))
        return eqx.combine(out["state"], static), dict(out["extra"])

    def restore_intact(self, like: eqx.Module, say: Callable[[str], None] = print
                       ) -> tuple[int, eqx.Module, dict] | None:
        """The latest checkpoint that reads back as saved, setting damaged ones aside (each
        reported through `say`); None if there is none; DamagedCheckpoint if every one is."""
        damaged = []
        for step in sorted(self.all_steps(), reverse=True):
            try:
                return self.restore(like, step)
            except DamagedCheckpoint as e:
                aside = self._set_aside(step)
                damaged.append(step)
                older = [s for s in self.all_steps() if s < step]
                say(f"checkpoint step {step} in {self.directory} is damaged ({e}); moved to {aside}; "
                    + (f"falling back to step {max(older)}" if older else "no earlier checkpoint"))
        if damaged:
            raise DamagedCheckpoint(
                f"no intact checkpoint left in {self.directory} (damaged: steps "
                f"{', '.join(map(str, damaged))}, kept as damaged-STEP); start the run again with another "
                "--out")
        return None

    def _set_aside(self, step: int) -> Path:
        aside = self.directory / f"damaged-{step}"
        if jax.process_index() == 0:
            if aside.exists():
                shutil.rmtree(aside)
            os.replace(self.directory / str(step), aside)
        if jax.process_count() > 1:
            multiprocess.sync_processes(f"diloco_eqx: checkpoint {step} set aside")
        self._manager.reload()
        return aside

    def close(self) -> None:
        self._manager.close()


def last_complete_step(directory: str | os.PathLike) -> int | None:
    """The newest committed checkpoint under `directory`, from the directory names alone (no
    orbax call: safe from any thread, and while a peer holds the runtime)."""
    steps = [int(p.name) for p in Path(directory).glob("*") if p.name.isdigit()]
    return max(steps) if steps else None


def _on_any_process(flag: bool) -> bool:
    if jax.process_count() == 1:
        return flag
    from jax.experimental import multihost_utils

    return bool(np.max(multihost_utils.process_allgather(np.int32(flag))))


def _first_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0][:300] if str(e).strip() else ""


def _checked(out: tuple[eqx.Module, dict]) -> dict:
    """The extra of a restored checkpoint, once its arrays match the fingerprint saved with
    them (a checkpoint saved without a fingerprint has none to check)."""
    state, extra = out
    saved = extra.pop("fingerprint", None)
    if saved is None:
        return extra
    arrays = eqx.filter(state, eqx.is_array)
    got = fingerprint(arrays)
    if got.shape != np.shape(saved) or not np.array_equal(got, np.asarray(saved, np.uint32)):
        leaves = jax.tree_util.tree_leaves_with_path(arrays)
        bad = [jax.tree_util.keystr(p) for (p, _), a, b in zip(leaves, got, np.asarray(saved))
               if not np.array_equal(a, b)]
        raise DamagedCheckpoint(f"its arrays differ from the fingerprint saved with them: {', '.join(bad[:3])}")
    return extra


def _words(x: Array) -> UInt32[Array, " n"]:
    """The bits of `x` as a flat run of uint32 words."""
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32).ravel()
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[x.dtype.itemsize]
    return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32).ravel()


@jax.jit
def _sums(leaves: list[Array]) -> UInt32[Array, "leaves 2"]:
    def one(x):
        w = _words(x)
        odd = 2 * jnp.arange(w.size, dtype=jnp.uint32) + 1  # odd: any one changed word changes the sum
        return jnp.stack([jnp.sum(w, dtype=jnp.uint32), jnp.sum(w * odd, dtype=jnp.uint32)])

    return jnp.stack([one(x) for x in leaves]) if leaves else jnp.zeros((0, 2), jnp.uint32)


def fingerprint(arrays: Any) -> np.ndarray:
    """(leaves, 2) uint32: the plain and the position-weighted wrapping sum of each array's
    bits. Every process computes the same one (the reduction is collective)."""
    out = _sums(jax.tree.leaves(arrays))
    return np.asarray(out.addressable_data(0), np.uint32)


def key_to_json(key: jax.Array) -> list[int]:
    return np.asarray(jax.random.key_data(key)).tolist()


def key_from_json(data: list[int]) -> jax.Array:
    return jax.random.wrap_key_data(np.asarray(data, np.uint32))
