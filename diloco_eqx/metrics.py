"""What a step reports: the metrics fetched lazily to the host."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import numpy as np
from jaxtyping import Array

from diloco_eqx import mesh as mesh_lib
from diloco_eqx.schedule import Schedule


class StepMetrics(Mapping):
    """The step's metrics, fetched from the device on first access (so the host can
    dispatch the next step before reading this one).

    Keys: "step" (t), "loss" (mean over islands), "loss_island_{i}", any other scalar the
    step reports; with a schedule, on sync steps also "sync_fragment", "pseudo_grad_norm"
    (norm of the mean pseudo-gradient), "outer_update_norm", "islands_contributed" (islands
    in the mean: not dropped, finite) and, with compression, "compression_error"
    (‖decoded − sent‖/‖sent‖, mean over islands); on apply steps "apply_fragment". With the
    deferred exchange the sync diagnostics arrive one step later, with "exchanged_fragment".
    On apply steps also "islands_reset": islands whose applied fragment was not finite and
    that were reset to the outer model with fresh inner optimizer state.
    """

    SYNC_KEYS = ("pseudo_grad_norm", "outer_update_norm")
    ISLAND_SYNC_KEYS = ("compression_error",)
    """Per-island sync metrics, reported as their mean over islands."""
    SPECIAL = ("step", "loss_island", "islands_contributed", "reset_island", *SYNC_KEYS, *ISLAND_SYNC_KEYS)

    def __init__(self, device_metrics: dict[str, Array], schedule: Schedule | None = None,
                 exchange_delay: int = 0):
        self._device = device_metrics
        self._schedule = schedule
        self._delay = exchange_delay
        self._host: dict[str, float | int] | None = None

    def _fetch(self) -> dict[str, float | int]:
        if self._host is None:
            m = mesh_lib.to_host({k: v for k, v in self._device.items() if v is not None})
            t = int(m["step"])
            losses = np.asarray(m["loss_island"], np.float64)
            host: dict[str, float | int] = {"step": t, "loss": float(losses.mean())}
            host.update({f"loss_island_{i}": float(x) for i, x in enumerate(losses)})
            host.update({k: float(v) for k, v in m.items() if k not in self.SPECIAL})
            if self._schedule is not None:
                host.update(self._events(t, m))
            self._host = host
        return self._host

    def _events(self, t: int, m: dict) -> dict[str, float | int]:
        """Sync, exchange and apply entries of step t."""
        out: dict[str, float | int] = {}
        synced = self._schedule.sync_fragment(t)
        if synced is not None:
            out["sync_fragment"] = synced
        exchanged = self._schedule.sync_fragment(t - self._delay)
        if exchanged is not None:
            if self._delay:
                out["exchanged_fragment"] = exchanged
            out.update({k: float(m[k]) for k in self.SYNC_KEYS})
            out["islands_contributed"] = int(m["islands_contributed"])
            out.update({k: float(np.mean(m[k])) for k in self.ISLAND_SYNC_KEYS if k in m})
        applied = self._schedule.apply_fragment(t)
        if applied is not None:
            out["apply_fragment"] = applied
            out["islands_reset"] = int(np.sum(m["reset_island"]))
        return out

    def __getitem__(self, key: str):
        return self._fetch()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._fetch())

    def __len__(self) -> int:
        return len(self._fetch())

    def __repr__(self) -> str:
        return f"StepMetrics({self._fetch()})"
