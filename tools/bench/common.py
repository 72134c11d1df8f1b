"""What every measurement shares: the sizes and meshes, the model, paired statistics, and
what a JSON records of its settings and machine."""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import time

DEVICES = 8
"""Simulated host devices on CPU (the island meshes need up to 8)."""
MESHES = {  # name -> make_mesh sizes
    "none": None,
    "2x1": dict(diloco=2),
    "2x2data": dict(diloco=2, data=2),
    "2x2fsdp": dict(diloco=2, fsdp=2),
    "2x4fsdp": dict(diloco=2, fsdp=4),
    "2x2datax2fsdp": dict(diloco=2, data=2, fsdp=2),
}
DTYPES = ("float32", "bfloat16")
K = 2
"""Islands in every measurement."""


@dataclasses.dataclass(frozen=True)
class Size:
    name: str
    layers: int
    width: int
    heads: int
    seq_len: int
    global_batch: int


SIZES = (
    Size("1M", layers=4, width=128, heads=4, seq_len=128, global_batch=16),
    Size("10M", layers=8, width=320, heads=8, seq_len=64, global_batch=8),
    Size("30M", layers=12, width=448, heads=8, seq_len=64, global_batch=4),
    Size("100M", layers=16, width=768, heads=12, seq_len=1024, global_batch=16),  # for an accelerator
)


def model(size: Size, dtype: str = "float32"):
    """The benchmark's transformer of `size`, its parameters in `dtype` (seed 0)."""
    import equinox as eqx
    import jax

    from diloco_eqx.models.transformer import Transformer, TransformerConfig

    m = Transformer(TransformerConfig(num_layers=size.layers, width=size.width,
                                      num_heads=size.heads, seq_len=size.seq_len), jax.random.key(0))
    return jax.tree.map(lambda x: x.astype(dtype) if eqx.is_inexact_array(x) else x, m)


def batch(size: Size | None = None, rows: int | None = None, seq_len: int | None = None, zeros: bool = False):
    """A (rows, seq_len + 1) token batch (`size`'s full batch by default), seed 0."""
    import numpy as np

    shape = (rows or size.global_batch, (seq_len or size.seq_len) + 1)
    return np.zeros(shape, np.int32) if zeros else np.random.default_rng(0).integers(0, 256, shape, dtype=np.int32)


def bench_mesh(name: str):
    """The mesh a MESHES name stands for (None: no mesh)."""
    import diloco_eqx as dl

    return None if MESHES[name] is None else dl.make_mesh(**MESHES[name])


def mode_name(mode: str, backend: str) -> str:
    """A mode's name on `backend` (drjax steps end in _drjax)."""
    return mode if backend == "shard_map" else f"{mode}_{backend}"


def fragment_params(m, cfg) -> list[int]:
    """Parameters in each of `cfg`'s fragments of `m`."""
    import equinox as eqx

    import diloco_eqx as dl

    return dl.Fragmentation.from_model(m, cfg).param_counts(eqx.filter(m, eqx.is_inexact_array))


def paired_interval(a, b) -> dict:
    """Mean of the paired ratios a[i] / b[i] with its 95% Student-t interval."""
    import numpy as np

    from experiments.stats import interval

    return interval(list(np.divide(a, b)))


def time_ratio(a, b) -> dict:
    """The mean paired ratio a / b with its 95% t-interval, under the JSON's key names."""
    ci = paired_interval(a, b)
    return {"mean": ci["mean"], "low": ci["lo"], "high": ci["hi"]}


def ratio_interval(a, b) -> dict:
    ci = paired_interval(a, b)
    return {"ratio": ci["mean"], "ratio_low": ci["lo"], "ratio_high": ci["hi"]}


def paired_difference(values) -> dict:
    """The mean of paired differences with its 95% interval, under the JSON's key names."""
    from experiments.stats import interval

    d = interval(list(values))
    return {"mean": d["mean"], "low": d["lo"], "high": d["hi"], "n": d["n"]}


def paired_ratios(times: dict, phases, over: str, under: str) -> dict:
    """Per phase: both variants' median seconds and the mean paired ratio `over` / `under`
    with its 95% t-interval."""
    import numpy as np

    out = {}
    for name in phases:
        ci = paired_interval(times[over, name], times[under, name])
        out[name] = {f"{over}_s": float(np.median(times[over, name])), f"{under}_s": float(np.median(times[under, name])),
                     "time_ratio": ci["mean"], "time_ratio_low": ci["lo"], "time_ratio_high": ci["hi"]}
    return out


def require_cpu(flag: str, why: str) -> None:
    import jax

    if jax.default_backend() != "cpu":
        raise SystemExit(f"{flag}: {why}; this machine's backend is {jax.default_backend()}")


def settings_and_machine(sync_period: int, num_fragments: int, reps: int, overlap_steps: int = 1) -> dict:
    """What a section's JSON records of its settings and machine (K = 2), XLA's flags among
    them (two runs may differ only in those)."""
    import jax

    from diloco_eqx.training import host_memory

    return {"settings": {"num_replicas": K, "sync_period": sync_period, "num_fragments": num_fragments,
                         "overlap_steps": overlap_steps, "reps": reps},
            "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                        "python": platform.python_version(), "jax": jax.__version__,
                        "libc": " ".join(platform.libc_ver()), "transparent_huge_pages": host_memory.transparent_huge_pages(),
                        "keep_host_memory": host_memory.kept(), "device": jax.devices()[0].device_kind,
                        "xla_flags": os.environ.get("XLA_FLAGS", "")}}


def write_json(path: str, result: dict) -> None:
    """`result` into `path`, whole or not at all (written beside it, then renamed)."""
    with open(path + ".part", "w") as f:
        json.dump(result, f, indent=2)
    os.replace(path + ".part", path)


def matmul_flops(n=None, reps=10, dtype=None) -> float:
    """FLOP/s of an n×n matmul in `dtype` (n = 8192 on an accelerator, 1024 on CPU)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    n = n or (1024 if jax.default_backend() == "cpu" else 8192)
    f = jax.jit(lambda a, b: a @ b)
    a = jnp.ones((n, n), dtype or jnp.float32)
    jax.block_until_ready(f(a, a))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(f(a, a))
        ts.append(time.perf_counter() - t0)
    return 2 * n**3 / float(np.median(ts))


def model_flops(size: Size, n_params: int) -> float:
    """Model FLOPs of one training step by the usual count: 6 per parameter per token
    (forward and backward matmuls) plus 12·layers·width·seq_len per token for attention's
    scores and weighted sums, counted over the full square as is customary. Unlike XLA's
    count it is the same for every compiler and needs no cost analysis of the scanned layers."""
    tokens = size.global_batch * size.seq_len
    return float(tokens * (6 * n_params + 12 * size.layers * size.width * size.seq_len))
