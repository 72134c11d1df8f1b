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


def process_mesh(devices_per_process: int | None) -> jax.sharding.Mesh:
    """The diloco axis over every process's devices, process by process."""
    per = devices_per_process or len(jax.local_devices())
    return dl.make_mesh(devices=[
        d for p in range(jax.process_count())
        for d in sorted((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id)[:per]
    ])


def process_rows(global_batch: int) -> tuple[int, int]:
    """The rows of each global batch this process's islands train on."""
    share = global_batch // jax.process_count()
    return jax.process_index() * share, (jax.process_index() + 1) * share


class GlobalBatches:
    """This process's rows of each global batch, as one global array over the diloco axis.
    Passes the iterator's state through, for checkpoints."""

    def __init__(self, it: Iterator[np.ndarray], mesh: jax.sharding.Mesh, shape: tuple[int, ...]):
        self._it, self._shape = it, shape
        self._sharding = jax.sharding.NamedSharding(mesh, mesh_lib.ISLANDS)

    def __iter__(self) -> GlobalBatches:
        return self

    def __next__(self) -> jax.Array:
        return jax.make_array_from_process_local_data(self._sharding, next(self._it), self._shape)

    def get_state(self):
        return self._it.get_state()

    def set_state(self, state) -> None:
        self._it.set_state(state)


def sync_processes(name: str) -> None:
    """Wait until every process reaches this point."""
    from jax.experimental import multihost_utils

    multihost_utils.sync_global_devices(name)
