"""tools/soak.py: the analysis on hand-made numbers, and (slow) a 5,000-step run that grows nothing."""

import json
import math

import numpy as np
import pytest

from tests.helpers import subprocess_env
from tools import soak


def sample(step, rss=100.0, fds=10, threads=20, ckpts=2, tmps=0):
    return soak.Sample(time_s=step / 100, step=step, rss_mb=rss, fds=fds, threads=threads,
                       checkpoints=ckpts, tmp_checkpoints=tmps)


def test_analysis_on_known_numbers(tmp_path):
    assert soak.least_squares_slope([0, 1, 2, 3], [2, 5, 8, 11]) == pytest.approx(3.0)
    assert soak.least_squares_slope([0, 1, 2, 3], [0, 1, 1, 0]) == pytest.approx(0.0)
    assert math.isnan(soak.least_squares_slope([5, 5], [1, 2]))
    centres, medians = soak.bin_medians([1, 2, 3, 150, 160, 170], [1, 2, 900, 5, 6, 7], width=100)
    assert centres.tolist() == [50.0, 150.0] and medians.tolist() == [2.0, 6.0]

    # 4 ms per step plus 0.1 ms per 1,000 steps, one wild step in ten: whole 100-step bins
    # give the slope exactly, the outliers moving every bin's median alike
    steps = np.arange(100, 2000)
    times = 0.004 + 1e-7 * steps
    times[steps % 10 == 1] += 0.05
    f = soak.step_time_figures(steps, times)
    assert f["step_time_slope_ms_per_1k_steps"] == pytest.approx(0.1, rel=1e-9)
    assert f["step_time_median_ms"] == pytest.approx(4.0 + 0.1 * 1.05, abs=0.02)
    assert f["step_time_slope_pct_of_median_per_1k_steps"] == pytest.approx(
        100 * 0.1 / f["step_time_median_ms"])
    # a slow first 50 steps (compilation) is left out; the part-filled first bin barely counts
    early = np.arange(1, 100)
    times = np.concatenate([np.where(early <= 50, 1.0, 0.004 + 1e-7 * early), times])
    f = soak.step_time_figures(np.concatenate([early, steps]), times)
    assert f["step_time_slope_ms_per_1k_steps"] == pytest.approx(0.1, rel=0.02)

    # 1,000 steps: RSS climbs in the first half, then 2 MB per 1,000 steps; the samples at
    # step 1,000 (final evaluation, checkpoint, plot) are left out
    samples = [sample(0, rss=5.0)] + [
        sample(s, rss=100 + (s if s <= 500 else 500 + 0.002 * (s - 500)), fds=12 if s == 30 else 10,
               threads=21 if s > 900 else 20, ckpts=min(2, s // 50), tmps=int(s % 50 == 0))
        for s in range(10, 1000, 10)] + [sample(1000, rss=900.0, fds=99, threads=99)]  # the epilogue
    r = soak.rss_figures(samples, 1000)
    assert r["rss_slope_mb_per_1k_steps"] == pytest.approx(2.0)
    assert r["rss_first_quarter_median_mb"] == pytest.approx(100 + 130)  # steps 10..250
    # last quarter: steps 760..990 (1,000 is the epilogue), median at step 875
    assert r["rss_quarter_median_diff_mb"] == pytest.approx(600 + 0.002 * 375 - 230)
    c = soak.count_figures(samples, 1000, checkpoint_every=50)
    assert (c["fds_max_first_quarter"], c["fds_max_last_quarter"]) == (12, 10)
    assert (c["threads_max_first_quarter"], c["threads_max_last_quarter"]) == (20, 21)
    assert (c["checkpoints_max"], c["tmp_checkpoints_max"], c["checkpoints_plus_tmp_max"]) == (2, 1, 3)
    assert c["checkpoints_max_between_saves"] == 2  # the temporary ones appear at steps 50, 100, ...


def test_watching_helpers(tmp_path, capsys):
    path = tmp_path / "metrics.jsonl"
    tail = soak.MetricsTail(path)
    assert tail.last_step() == 0  # not written yet
    path.write_text('{"step": 1}\n{"step": 2}\n{"step": 3, "lo')  # the last line half written
    assert tail.last_step() == 2
    with open(path, "a") as f:
        f.write('ss": 1.0}\n{"step": 3, "eval": true}\n')
    assert tail.last_step() == 3
    assert tail.last_step() == 3  # nothing new

    (tmp_path / "checkpoints" / "50").mkdir(parents=True)
    (tmp_path / "checkpoints" / "100").mkdir()
    (tmp_path / "checkpoints" / f"150{soak.TMP_MARK}-123").mkdir()
    assert soak.checkpoint_counts(tmp_path / "checkpoints") == (2, 1)
    assert soak.checkpoint_counts(tmp_path / "nowhere") == (0, 0)

    for bad, message in ((["--steps", "100"], "--steps must be at least 400"),
                         (["--interval", "0"], "--interval must be in"),
                         (["--out", str(tmp_path)], "already exists")):
        with pytest.raises(SystemExit):
            soak.parse_args(bad)
        assert message in capsys.readouterr().err


@pytest.mark.slow  # 1.5 to 2 minutes on 2 CPU cores
def test_5000_steps_grow_nothing(tmp_path):
    steps = 5000
    run = soak.run_soak(steps, 50, 250, tmp_path / "run", env=subprocess_env())
    assert run["returncode"] == 0, run["log_tail"]
    assert run["status"] == "finished"
    f = soak.analyse(run["samples"], run["rows"], steps, checkpoint_every=50)
    assert f["last_step"] == steps and f["samples"] > 100
    # RSS over the second half, measured on 2 CPU cores: -1.2 MB per 1,000 steps without
    # checkpoints; -0.1 to +4.7 with one every 50 steps (tensorstore's Python bindings leak
    # ~60 KB per orbax save, ~1.3 MB per 1,000 steps here, and the heap grows in MB jumps);
    # a leak of ~7 KB a step, or ~350 KB a save, fails however that noise falls
    assert f["rss_slope_mb_per_1k_steps"] < 6.0, f
    # step time: |slope| up to 7% of the median per 1,000 steps when other jobs' load on the
    # machine changed mid-run; steps that slow by more than half over the run fail
    assert abs(f["step_time_slope_pct_of_median_per_1k_steps"]) < 10.0, f
    # keep=2: two between saves; during one, the new checkpoint (temporary, then renamed)
    # stands beside the two old ones until the oldest is removed
    assert f["checkpoints_max_between_saves"] <= 2 and f["checkpoints_plus_tmp_max"] <= 3, f
    assert f["fds_max_last_quarter"] <= f["fds_max_first_quarter"] + 2, f
    assert f["threads_max_last_quarter"] <= f["threads_max_first_quarter"] + 2, f
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["4950", "5000"]

    args = soak.parse_args(["--out", str(tmp_path / "unused")])
    result = json.loads(soak.to_json(soak.report({**run, "figures": f}, args)))
    assert len(result["timeline"]) == f["samples"] and "RSS slope" in soak.format_table(result)
    print(soak.format_table(result))  # shown with pytest -s
