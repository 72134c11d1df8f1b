"""Seed statistics for experiment summaries: mean ± std over seeds, and paired differences.

Runs that share a seed share the model's initialization and the data order, so two methods
are compared by their per-seed difference; its mean gets a Student-t interval. A claim that
one method is lower than another holds when the whole interval is below zero, is
contradicted when it is above, and is unresolved when it spans zero.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np
from scipy import stats


def describe(values: Sequence[float]) -> dict[str, float]:
    """Mean, sample standard deviation (0 for one value) and n."""
    x = np.asarray(values, np.float64)
    return {"mean": float(x.mean()), "std": float(x.std(ddof=1)) if len(x) > 1 else 0.0, "n": len(x)}


def interval(values: Sequence[float], level: float = 0.95) -> dict[str, float]:
    """Mean of `values` with its Student-t interval at `level` (infinite for one value), and n."""
    x = np.asarray(values, np.float64)
    n, mean = len(x), float(x.mean())
    half = float(stats.t.ppf(0.5 + level / 2, n - 1) * x.std(ddof=1) / math.sqrt(n)) if n > 1 else math.inf
    return {"mean": mean, "lo": mean - half, "hi": mean + half, "n": n}


def paired(a: Mapping[int, float], b: Mapping[int, float], level: float = 0.95) -> dict[str, float]:
    """a − b over the seeds both have: mean difference, its t-interval at `level`, n, and the
    mean difference relative to b's mean (%)."""
    seeds = sorted(set(a) & set(b))
    if not seeds:
        raise ValueError("paired: the two methods share no seed")
    d = interval([a[s] - b[s] for s in seeds], level)
    mean, lo, hi = d["mean"], d["lo"], d["hi"]
    ref = float(np.mean([b[s] for s in seeds]))
    return {"diff": mean, "lo": lo, "hi": hi, "n": d["n"],
            "diff_pct": 100 * mean / ref, "lo_pct": 100 * lo / ref, "hi_pct": 100 * hi / ref}


def verdict(p: Mapping[str, float], margin_pct: float = 0.0) -> str:
    """For the claim "a is lower than b" from `paired(a, b)`; with `margin_pct`, the claim
    "a is at most margin_pct % above b" (parity within a margin)."""
    if margin_pct:
        return "holding" if p["hi_pct"] < margin_pct else "contradicted" if p["lo_pct"] > margin_pct else "unresolved"
    if p["hi"] < 0:
        return "holding"
    if p["lo"] > 0:
        return "contradicted"
    return "unresolved"
