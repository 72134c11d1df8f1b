"""tools/plot_runs.py draws a PNG from run directories and rejects directories without metrics."""

import json

import pytest

from tools import plot_runs


def fake_run(path, mode, losses):
    path.mkdir()
    (path / "run.json").write_text(json.dumps({"settings": {"mode": mode, "streaming": True,
                                                            "num_fragments": 3, "sync_period": 30}}))
    lines = [{"step": i + 1, "loss": l, "loss_island_0": l + 0.1, "loss_island_1": l - 0.1,
              "tokens": (i + 1) * 100} for i, l in enumerate(losses)]
    lines.append({"step": len(losses), "eval": True, "eval_loss": losses[-1]})
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))


def test_plots_several_runs(tmp_path):
    fake_run(tmp_path / "a", "ddp", [5.0, 4.0, 3.0, 2.5])
    fake_run(tmp_path / "b", "diloco", [5.0, 4.2, 3.1, 2.6])
    out = plot_runs.plot_runs([tmp_path / "a", tmp_path / "b"], tmp_path / "x.png", smooth=2)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plot_runs.load_run(tmp_path / "a")[0] == "a (DDP)"
    assert plot_runs.load_run(tmp_path / "b")[0] == "b (Streaming P=3, H=30)"
    assert plot_runs._smooth([1.0, 3.0, 5.0], 2) == [1.0, 2.0, 4.0]


def test_missing_metrics_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit):
        plot_runs.main([str(tmp_path)])
    assert "has no metrics.jsonl" in capsys.readouterr().err
