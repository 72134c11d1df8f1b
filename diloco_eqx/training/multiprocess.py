"""Runs over several processes on JAX's own runtime: start-up, the diloco mesh in process
order, and global batches assembled from each process's own rows.

Island k lives on process k·N/K (N processes, K islands); each process reads only its
islands' rows of every global batch and `GlobalBatches` hands them to
`jax.make_array_from_process_local_data`, so a multi-process step sees the same global
batch as a one-process run.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

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
    jax.distributed.initialize(
        coordinator, num_processes, process_id,
        heartbeat_timeout_seconds=heartbeat_timeout, shutdown_timeout_seconds=heartbeat_timeout,
    )


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
