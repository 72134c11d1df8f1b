"""tools/benchmark.py --quick writes a complete JSON and compiles each step once (slow)."""

import json

import pytest

from tools import benchmark


@pytest.mark.slow
def test_quick_benchmark_json(tmp_path):
    path = tmp_path / "bench.json"
    benchmark.main(["--quick", "--reps", "5", "--json", str(path)])
    result = json.loads(path.read_text())
    assert result["compilations"] == 1
    mem = result["memory"]
    assert mem["diloco_bytes"] > mem["plain_bytes"] > 0
    extra = mem["diloco_bytes"] - mem["plain_bytes"]
    assert abs(extra / mem["expected_extra_bytes"] - 1) < 0.10
    low = mem["bfloat16"]  # the outer side stays float32: b_outer = 4 whatever the islands use
    assert abs(low["extra_bytes"] / low["expected_extra_bytes"] - 1) < 0.10
    assert low["expected_extra_bytes"] == 2 * low["params"] * 4
    phases = {(r["mode"], r["phase"]) for r in result["rows"]}
    for mode in ("diloco", "streaming"):
        assert {(mode, p) for p in ("nonsync", "sync", "amortized")} <= phases
    assert ("streaming", "apply") in phases and ("plain", "step") in phases
    for r in result["rows"]:
        assert set(r) >= {"size", "mode", "phase", "median_s", "ratio_to_plain"}
        assert r["median_s"] > 0 and r["size"] == "1M"
