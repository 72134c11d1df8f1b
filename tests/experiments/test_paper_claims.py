"""experiments/paper_claims.py and sweep_overlap.py: the seed-paired analyses against
hand-worked numbers, on run directories written here."""

import json
import math

import pytest

from experiments import paper_claims as pc
from experiments import sweep_overlap


def _fake_run(out, name, rows):
    (out / name).mkdir(parents=True)
    (out / name / "run.json").write_text(json.dumps({"status": "finished"}))
    (out / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_outer_vs_island_at_each_offset_of_the_period(tmp_path):
    study = pc.FULL
    late = [s for s in range(5, study.steps + 1, 5) if s > study.steps // 2]
    for seed in (0, 1, 2):
        # outer 0.01·(seed + 3) below island 0 at offset 10, level elsewhere; the first half
        # (ignored) has the outer parameters far above
        rows = [{"step": 5, "eval": True, "eval_loss": 9.0, "eval_loss_island_0": 1.0}]
        for s in late:
            island = 2.0 + seed
            outer = island - (0.01 * (seed + 3) if s % 30 == 10 else 0.0)
            rows += [{"step": s, "loss": 3.0}, {"step": s, "eval": True, "eval_loss": outer,
                                                 "eval_loss_island_0": island}]
        _fake_run(tmp_path, f"{pc.DRIFT},seed={seed}", rows)
    got = {r["offset"]: r for r in pc.analyse_period(study, tmp_path)}
    assert sorted(got) == list(range(0, 30, 5))
    # differences −0.03, −0.04, −0.05: mean −0.04, sd 0.01, half-width t(0.975, 2)·0.01/√3
    half = 4.302653 * 0.01 / math.sqrt(3)
    assert got[10]["diff"] == pytest.approx(-0.04) and got[10]["n"] == 3
    assert (got[10]["lo"], got[10]["hi"]) == (pytest.approx(-0.04 - half, rel=1e-5), pytest.approx(-0.04 + half, rel=1e-5))
    assert got[10]["verdict"] == "holding"  # the whole interval is below 0
    assert got[10]["island_0"] == pytest.approx(3.0)  # mean of 2, 3, 4
    assert got[0]["diff"] == 0.0 and got[0]["verdict"] == "unresolved"


def test_overlap_sweep_pairs_each_V_with_V0_by_seed():
    rows = [{"alpha": "0.0", "overlap_steps": v, "seed": s, "eval_loss": loss}
            for v, losses in ((0, (2.0, 2.2)), (5, (2.02, 2.222))) for s, loss in enumerate(losses)]
    pt = sweep_overlap.analyse(rows)["points"]["alpha=0.0,V=5"]
    # per-seed differences 0.02 and 0.022 over a V=0 mean of 2.1: +1.0% with a 2-seed interval
    # t(0.975, 1)·sd/√2 = 12.7062·0.0014142/1.4142 = 0.012706
    assert pt["vs_V0"]["diff_pct"] == pytest.approx(100 * 0.021 / 2.1)
    assert pt["vs_V0"]["lo_pct"] == pytest.approx(100 * (0.021 - 12.706205 * 0.001) / 2.1, rel=1e-5)
    assert pt["change_pct"] == pytest.approx(100 * (2.121 / 2.1 - 1))
    assert "vs_V0" not in sweep_overlap.analyse(rows)["points"]["alpha=0.0,V=0"]


def test_overlap_trend_by_hand():
    # seed 0: +0.3% per step of V exactly; seed 1: +0.5%; seed 2: +0.4% -> mean 0.4, sd 0.1
    rows = [{"method": f"V{v}", "overlap_steps": v, "seed": s, "eval_loss": 2.0 * (1 + slope * v / 100)}
            for s, slope in enumerate((0.3, 0.5, 0.4)) for v in pc.OVERLAPS]
    t = pc.overlap_trend([*rows, {"method": "fp4", "overlap_steps": 0, "seed": 0, "eval_loss": 9.0}])
    half = 4.302653 * 0.1 / math.sqrt(3)
    assert t["slope_pct_per_step"] == pytest.approx(0.4) and t["n"] == 3
    assert (t["lo"], t["hi"]) == (pytest.approx(0.4 - half, rel=1e-5), pytest.approx(0.4 + half, rel=1e-5))
    assert t["verdict_cost_grows_with_V"] == "holding"
    assert pc.overlap_trend(rows[:4]) == {}  # no seed with every V
