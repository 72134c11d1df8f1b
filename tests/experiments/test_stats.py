"""experiments/stats.py against hand-worked numbers."""

import math

import pytest

from experiments.stats import describe, paired, verdict


def test_describe():
    d = describe([1.0, 2.0, 4.0])
    assert d["mean"] == pytest.approx(7 / 3) and d["n"] == 3
    assert d["std"] == pytest.approx(math.sqrt(((1 - 7 / 3) ** 2 + (2 - 7 / 3) ** 2 + (4 - 7 / 3) ** 2) / 2))
    assert describe([5.0])["std"] == 0.0


def test_paired_t_interval_by_hand():
    # differences 0.10, 0.11, 0.12: mean 0.11, sd 0.01, t(0.975, 2) = 4.302653; half = 4.302653 · 0.01 / √3
    a = {0: 1.1, 1: 2.11, 2: 3.12, 7: 9.0}
    b = {0: 1.0, 1: 2.0, 2: 3.0}
    p = paired(a, b)
    half = 4.302653 * 0.01 / math.sqrt(3)
    assert p["n"] == 3 and p["diff"] == pytest.approx(0.11)
    assert (p["lo"], p["hi"]) == (pytest.approx(0.11 - half, rel=1e-6), pytest.approx(0.11 + half, rel=1e-6))
    assert p["diff_pct"] == pytest.approx(5.5)
    assert verdict(p) == "contradicted"  # a is higher than b, surely
    assert verdict(paired(b, a)) == "holding"
    assert verdict(paired({0: 1.0, 1: 2.1}, {0: 1.05, 1: 2.0})) == "unresolved"
    assert paired({0: 1.0}, {0: 2.0})["hi"] == math.inf
    with pytest.raises(ValueError, match="share no seed"):
        paired({0: 1.0}, {1: 1.0})


def test_parity_within_a_margin():
    # a 5.5% [4.7, 6.3]% above b (the case above): within 10% holds, within 3% is contradicted,
    # within 5% is unresolved (the interval straddles it)
    p = paired({0: 1.1, 1: 2.11, 2: 3.12}, {0: 1.0, 1: 2.0, 2: 3.0})
    assert p["lo_pct"] < 5.0 < p["hi_pct"] < 10.0 and p["lo_pct"] > 3.0
    assert verdict(p, margin_pct=10.0) == "holding"
    assert verdict(p, margin_pct=3.0) == "contradicted"
    assert verdict(p, margin_pct=5.0) == "unresolved"
