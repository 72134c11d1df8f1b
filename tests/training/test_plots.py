"""tools/plot_runs.py draws a PNG from run directories and rejects directories without metrics."""

import json
import re

import matplotlib.pyplot as plt
import pytest

from diloco_eqx.training import plots as plot_runs
from tools import plot_runs as plot_runs_cli


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
        plot_runs_cli.main([str(tmp_path)])
    assert "has no metrics.jsonl" in capsys.readouterr().err


def test_labels_name_the_settings_that_differ(tmp_path):
    fake_run(tmp_path / "a", "diloco", [5.0, 4.0])
    fake_run(tmp_path / "b", "diloco", [5.0, 4.1])
    settings = json.loads((tmp_path / "b" / "run.json").read_text())
    settings["settings"].update(sync_period=10, out="elsewhere")
    (tmp_path / "b" / "run.json").write_text(json.dumps(settings))
    runs = [tmp_path / "a", tmp_path / "b"]
    assert plot_runs.labels(runs, [plot_runs.read_settings(r) for r in runs]) == [
        "sync_period=30", "sync_period=10"]
    # identical settings: the directories tell them apart
    assert plot_runs.labels(runs[:1] * 2, [plot_runs.read_settings(runs[0])] * 2) == [
        "a (Streaming P=3, H=30)"] * 2


def test_default_out_is_beside_the_runs_not_the_working_directory(tmp_path, monkeypatch):
    fake_run(tmp_path / "a", "ddp", [5.0, 4.0, 3.0])
    fake_run(tmp_path / "b", "diloco", [5.0, 4.2, 3.1])
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    plot_runs_cli.main([str(tmp_path / "a")])
    assert (tmp_path / "a" / "loss.png").exists()
    plot_runs_cli.main([str(tmp_path / "a"), str(tmp_path / "b")])
    assert (tmp_path / "compare.png").exists() and not list(elsewhere.iterdir())


def test_loss_axis_is_logarithmic_with_syncs_ticked(tmp_path, monkeypatch):
    fake_run(tmp_path / "a", "diloco", [50.0, 4.0, 3.0, 2.9])
    rows = [json.loads(l) for l in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    rows[1]["sync_fragment"] = 1
    (tmp_path / "a" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    seen = {}
    real_savefig = plot_runs.plt.Figure.savefig

    def spy(fig, path, **kw):
        ax = fig.axes[0]
        seen["scale"] = ax.get_yscale()
        seen["ticks"] = [c for c in ax.collections if len(c.get_segments()) == 1]
        return real_savefig(fig, path, **kw)

    monkeypatch.setattr(plot_runs.plt.Figure, "savefig", spy)
    plot_runs.plot_runs([tmp_path / "a"], tmp_path / "x.png", smooth=1)
    assert seen["scale"] == "log"
    assert [c.get_segments()[0][0][0] for c in seen["ticks"]] == [2.0]  # the sync at step 2


@pytest.mark.parametrize("losses, shown", [([5.0, 4.0, 3.0, 1.9], {"2", "3", "4"}),
                                           ([2.3, 2.2, 2.1, 2.0], {"2", "2.1", "2.2", "2.3"}),
                                           ([6.0, 1.0, 0.2, 0.05], {"0.1", "1"})])
def test_log_axis_ticks_read_as_plain_numbers(tmp_path, losses, shown):
    fake_run(tmp_path / "a", "diloco", losses)
    fig = plot_runs.loss_figure([tmp_path / "a"], smooth=1)
    fig.canvas.draw()
    for ax in fig.axes:
        low, high = ax.get_ylim()
        texts = {t.get_text() for which in ("major", "minor") for t in ax.yaxis.get_ticklabels(which=which)
                 if t.get_text() and low <= t.get_position()[1] <= high}
        assert shown <= texts, texts
        assert all(re.fullmatch(r"\d+(\.\d+)?", t) for t in texts), texts
    plt.close(fig)
