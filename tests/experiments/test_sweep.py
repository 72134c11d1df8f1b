"""The sweep runner: grid parsing, flags, and resuming a half-finished sweep."""

import io
import json

import pytest

from experiments import sweep

TINY = ["--corpus", "markov", "num_bytes=200000", "doc_bytes=20000", "--layers", "2", "--width", "32",
        "--heads", "2", "--seq-len", "32", "--global-batch", "4", "--steps", "8", "--sync-period", "4",
        "--eval-every", "8", "--checkpoint-every", "4", "--eval-batches", "2"]


def test_grid_points_and_flags():
    grid = sweep.parse_grid(["overlap-steps=0,1", "alpha=0,0.5", "streaming=true", "seed=3"])
    assert grid == {"overlap_steps": ["0", "1"], "alpha": ["0", "0.5"], "streaming": ["true"], "seed": ["3"]}
    pts = sweep.points(grid)
    assert len(pts) == 4 and pts[1] == {"overlap_steps": "0", "alpha": "0.5", "streaming": "true", "seed": "3"}
    assert sweep.point_name(pts[1]) == "overlap_steps=0,alpha=0.5,streaming=true,seed=3"
    assert sweep.point_flags(pts[1]) == ["--overlap-steps", "0", "--alpha", "0.5", "--streaming", "--seed", "3"]
    assert sweep.point_flags({"streaming": False}) == ["--no-streaming"]
    with pytest.raises(ValueError, match="--grid items are name=v1,v2"):
        sweep.parse_grid(["alpha"])


@pytest.mark.slow  # end to end: several training subprocesses
def test_half_finished_sweep_resumes_without_redoing(tmp_path):
    grid = {"seed": [0, 1, 2]}
    out = tmp_path / "sweep"
    sweep.run_sweep(out, {"seed": [0]}, TINY)  # one point done before the "crash"
    done = out / "seed=0" / "run.json"
    stamp = done.stat().st_mtime_ns
    # seed=1 was interrupted after its step-4 checkpoint: its run.json still says "running"
    sweep.run_sweep(out, {"seed": [1]}, TINY)
    meta1 = out / "seed=1" / "run.json"
    meta1.write_text(json.dumps({**json.loads(meta1.read_text()), "status": "running"}))
    log = io.StringIO()
    rows = sweep.run_sweep(out, grid, TINY, parallel=2, log=log)
    text = log.getvalue()
    assert "skip seed=0: finished" in text and "run  seed=0" not in text
    assert "run  seed=1" in text and "run  seed=2" in text
    assert done.stat().st_mtime_ns == stamp  # the finished point was not touched
    assert [r["seed"] for r in rows] == [0, 1, 2]
    assert all(r["eval_loss"] > 0 for r in rows)
    lines = (out / "summary.csv").read_text().splitlines()
    assert lines[0].startswith("seed,eval_loss") and len(lines) == 4
    assert [json.loads(x)["run"] for x in (out / "summary.jsonl").read_text().splitlines()] == \
        ["seed=0", "seed=1", "seed=2"]
    # different seeds train on different batches
    assert len({r["final_train_loss"] for r in rows}) == 3


def test_failed_point_is_reported(tmp_path, capsys):
    assert sweep.main(["--out", str(tmp_path / "s"), "--grid", "compression=int4", "--", *TINY]) == 1
    assert "1 sweep point(s) failed: compression=int4" in capsys.readouterr().err
    assert "compression must be one of" in (tmp_path / "s" / "compression=int4.log").read_text()


def test_one_seed_reports_no_spread_instead_of_nan():
    from experiments import sweep_overlap

    rows = [{"alpha": 0.0, "overlap_steps": v, "eval_loss": loss} for v, loss in ((0, 2.0), (1, 2.1))]
    result = sweep_overlap.analyse(rows)
    assert result["max_seed_spread_pct"] is None
    assert result["points"]["alpha=0.0,V=1"]["change_pct"] == pytest.approx(5.0)
    assert "nan" not in sweep_overlap.spread_line(result["max_seed_spread_pct"])
    two = sweep_overlap.analyse(rows + [{"alpha": 0.0, "overlap_steps": 0, "eval_loss": 2.2}])
    assert two["max_seed_spread_pct"] == pytest.approx(100 * 0.2 / 2.1)
    assert sweep_overlap.spread_line(two["max_seed_spread_pct"]) == "largest seed spread: 9.52% of the loss"


def test_topk_bytes_are_counted_from_the_payload():
    """A topk run's bytes, tensor by tensor, against a hand count. The TINY model's float
    leaves: embed, head and the two MLP matrices 8192 each, position 1024, attention
    qkv 2·32·96 = 6144 and out 2048, two norms of 2·32 = 64 and a final one of 32. With
    density 1%, chunks of 1024 and 2 bits: 8192 -> 8 chunks of k = 10 (20 code bytes, 160
    index bytes, 8 scales) = 212; 1024 -> 3 + 20 + 4 = 27; 6144 -> 15 + 120 + 24 = 159;
    2048 -> 5 + 40 + 8 = 53; 64 and 32 -> k = 1: 1 + 2 + 4 = 7."""
    from diloco_eqx.training import runner
    from experiments.train import parse_settings

    flags = [*TINY, "--no-streaming", "--compression", "topk", "--error-feedback",
             "--topk-density", "0.01", "--topk-chunk", "1024", "--topk-bits", "2"]
    job = runner.build(parse_settings(flags))
    payload = 4 * 212 + 27 + 159 + 53 + 3 * 7
    indices = 4 * 160 + 20 + 120 + 40 + 3 * 2
    assert (payload, indices) == (1108, 826)
    # 8 steps, H = 4: two syncs of twice the payload (comms.sync_bytes' convention)
    row = runner.describe_step(job)(8)
    assert (row["comm_bytes_per_island"], row["comm_index_bytes_per_island"]) == (2 * 2 * payload, 2 * 2 * indices)
