"""Runs over several processes on JAX's own runtime: start-up, the diloco mesh in process
order, and global batches assembled from each process's own rows.

Island k lives on process k·N/K (N processes, K islands); each process reads only its
islands' rows of every global batch and `GlobalBatches` hands them to
`jax.make_array_from_process_local_data`, so a multi-process step sees the same global
batch as a one-process run.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator

import jax
import numpy as np

import diloco_eqx as dl
from diloco_eqx import mesh as mesh_lib


def use_host_devices(n: int) -> None:
    """Ask XLA for n CPU devices; works until jax first initialises its backend."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def initialize(coordinator: str, num_processes: int, process_id: int, heartbeat_timeout: int) -> None:
    """Join the run's processes (jax.distributed); CPU collectives go through gloo."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # GPU/TPU ignore it
    # The runtime's own heartbeat aborts the process with a native stack trace; give it twice
    # the time, so that `PeerWatch` (at heartbeat_timeout) finds a silent peer first and says so.
    jax.distributed.initialize(
        coordinator, num_processes, process_id,
        heartbeat_timeout_seconds=2 * heartbeat_timeout + 10, shutdown_timeout_seconds=heartbeat_timeout,
    )


class PeerWatch:
    """A heartbeat of our own over the runtime's key-value store, to find a hung peer.

    A thread bumps this process's counter every timeout/10 s and reads every peer's. A peer
    whose counter has not moved (stopped, hung or dead), or a store that has not answered (the
    coordinator, process 0, is stopped), is lost once that has lasted the timeout less one beat,
    counted from when this process last saw a change, so within `timeout` of the peer's last
    beat; `on_lost(who, silent_s)` is called from a second thread that only reads clocks, so
    it fires even while a store call blocks.
    A process that leaves (`stop`) marks itself done and is not waited for.
    """

    PREFIX = "diloco_eqx/heartbeat/"

    def __init__(self, timeout: float, on_lost: Callable[[str, float], None]):
        from jax._src import distributed

        self._client, self.timeout, self._on_lost = distributed.global_state.client, timeout, on_lost
        self._me, self._n = jax.process_index(), jax.process_count()
        now = time.monotonic()
        self._seen: dict[int, tuple[str, float]] = {p: ("", now) for p in range(self._n) if p != self._me}
        self._answered, self._done = now, threading.Event()

    def __enter__(self) -> PeerWatch:
        for target in (self._beat, self._check):
            threading.Thread(target=target, daemon=True, name=f"diloco_eqx{target.__name__}").start()
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self._done.set()
        if exc_type is None:  # a process that failed stays silent: its peers must not wait for it
            with contextlib.suppress(Exception):
                self._client.key_value_set(f"{self.PREFIX}{self._me}", "done", allow_overwrite=True)

    def _beat(self) -> None:
        count = 0
        while not self._done.wait(self.timeout / 10):
            count += 1
            self._client.key_value_set(f"{self.PREFIX}{self._me}", str(count), allow_overwrite=True)
            values = dict(self._client.key_value_dir_get(self.PREFIX))
            now = self._answered = time.monotonic()
            for p, (last, since) in self._seen.items():
                value = values.get(f"{self.PREFIX}{p}", last)
                self._seen[p] = (value, since if value == last and value != "done" else now)

    def _check(self) -> None:
        limit = 0.9 * self.timeout
        while not self._done.wait(min(0.25, self.timeout / 40)):
            now = time.monotonic()
            if now - self._answered > limit:
                return self._on_lost("the coordinator (process 0)", now - self._answered)
            for p, (_, since) in self._seen.items():
                if now - since > limit:
                    return self._on_lost(f"process {p}", now - since)


def process_mesh(slices_per_process: int | None, data: int = 1, fsdp: int = 1) -> jax.sharding.Mesh:
    """The mesh over every process's devices, process by process: the diloco axis spans
    the processes, each island's data × fsdp devices sit in one process."""
    per = slices_per_process * data * fsdp if slices_per_process else len(jax.local_devices())
    devices = [d for p in range(jax.process_count())
               for d in sorted((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id)[:per]]
    if data * fsdp == 1:
        return dl.make_mesh(devices=devices)
    return dl.make_mesh(devices=devices, diloco=len(devices) // (data * fsdp), data=data, fsdp=fsdp)


def process_rows(global_batch: int) -> tuple[int, int]:
    """The rows of each global batch this process's islands train on."""
    share = global_batch // jax.process_count()
    return jax.process_index() * share, (jax.process_index() + 1) * share


class GlobalBatches:
    """This process's rows of each global batch, as one island-major global array (K,
    GBS/K, ...) over the mesh (islands over "diloco", rows over "data"). Passes the
    iterator's state through, for checkpoints."""

    def __init__(self, it: Iterator[np.ndarray], mesh: jax.sharding.Mesh, num_islands: int,
                 shape: tuple[int, ...]):
        self._it, self._k = it, num_islands
        self._shape = (num_islands, shape[0] // num_islands, *shape[1:])
        self._sharding = mesh_lib.batch_sharding(mesh)

    def __iter__(self) -> GlobalBatches:
        return self

    def __next__(self) -> jax.Array:
        rows = next(self._it)
        local = rows.reshape(-1, self._shape[1], *rows.shape[1:])
        return jax.make_array_from_process_local_data(self._sharding, local, self._shape)

    def get_state(self):
        return self._it.get_state()

    def set_state(self, state) -> None:
        self._it.set_state(state)


def sync_processes(name: str) -> None:
    """Wait until every process reaches this point."""
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices(name)
