"""What a days-long run meets, end to end through the CLI: a kill inside a checkpoint write, a
full disk, damaged checkpoints. Each ends either in the uninterrupted run's per-step losses
after --resume or in a one-line error that names the directory; never in wrong numbers."""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from diloco_eqx.training.checkpoint import PAUSE_IN_SAVE
from experiments import train
from tests.experiments.test_train import RESUME_ARGS, ROOT, TINY, _same_losses, rows, uninterrupted  # noqa: F401
from tests.helpers import subprocess_env

ARGS = RESUME_ARGS + ["--checkpoint-every", "10"]


def launch(args, log, **env):
    return subprocess.Popen([sys.executable, "-m", "experiments.train", *args], cwd=ROOT,
                            env=subprocess_env(**env), stdout=subprocess.DEVNULL, stderr=open(log, "w"))


def checkpoints(out):
    return sorted(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit())


def leftovers(out):
    return [p.name for p in (out / "checkpoints").iterdir() if "tmp" in p.name]


@pytest.mark.slow  # end to end: three training subprocesses
def test_kill_inside_a_checkpoint_write_resumes_from_the_previous_one(tmp_path, uninterrupted):
    out, log = tmp_path / "run", tmp_path / "killed.log"
    proc = launch(ARGS + ["--out", str(out)], log, **{PAUSE_IN_SAVE: "30"})
    deadline = time.time() + 300
    while "paused inside the save" not in log.read_text():
        assert time.time() < deadline and proc.poll() is None, log.read_text()[-2000:]
        time.sleep(0.05)
    assert [p for p in leftovers(out) if p.startswith("30.")]  # the write is under way
    proc.kill()
    proc.wait()
    assert checkpoints(out) == [10, 20]
    resumed = launch(ARGS + ["--out", str(out), "--resume"], tmp_path / "resumed.log")
    assert resumed.wait(timeout=300) == 0, (tmp_path / "resumed.log").read_text()[-2000:]
    assert "resumed from" in (tmp_path / "resumed.log").read_text() and "at step 20" in (tmp_path / "resumed.log").read_text()
    _same_losses(rows(out), uninterrupted)
    assert leftovers(out) == [] and checkpoints(out) == [30, 40]


@pytest.fixture
def small_disk(tmp_path):
    """A tmpfs of 8 MB, mounted for the test (needs root; skipped where mounting is refused)."""
    where = tmp_path / "disk"
    where.mkdir()
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(where)], capture_output=True)
    if mount.returncode:
        pytest.skip(f"cannot mount a small tmpfs here: {mount.stderr.decode().strip() or mount.returncode}")
    yield where
    subprocess.run(["umount", "-l", str(where)], check=False)


@pytest.mark.slow  # end to end: two training subprocesses
def test_full_disk_stops_with_a_clear_error_and_resumes_once_freed(small_disk, uninterrupted):
    out, filler, log = small_disk / "run", small_disk / "filler", small_disk.parent / "full.log"
    # room for two of this run's 1.4 MB checkpoints, not for a third beside them
    filler.write_bytes(b"\0" * (shutil.disk_usage(small_disk).free - int(3.8e6)))
    proc = launch(ARGS + ["--out", str(out)], log)
    assert proc.wait(timeout=300) == 1, log.read_text()[-2000:]
    err = log.read_text().strip().splitlines()
    assert err[-1].startswith(f"error: no space left on device in {out / 'checkpoints'} while saving checkpoint "
                              "step 30 (not kept; the last complete checkpoint, step 20, is intact)")
    assert "continue with: python -m experiments.train" in err[-1] and err[-1].endswith("--resume")
    assert not any("Traceback" in line for line in err)
    assert checkpoints(out) == [10, 20] and leftovers(out) == []
    filler.unlink()
    resumed = launch(ARGS + ["--out", str(out), "--resume"], small_disk.parent / "resumed.log")
    assert resumed.wait(timeout=300) == 0, (small_disk.parent / "resumed.log").read_text()[-2000:]
    _same_losses(rows(out), uninterrupted)
    assert json.loads((out / "run.json").read_text())["status"] == "finished"


def _truncate_arrays(ckpt):
    data = max((ckpt / "state" / "d").iterdir(), key=lambda p: p.stat().st_size)
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])


@pytest.mark.slow  # end to end: a training run and its resume
def test_damaged_checkpoint_is_passed_over_on_resume(tmp_path, capsys):
    """The latest checkpoint truncated: --resume says so, sets it aside, continues from the one
    before with the same numbers; every checkpoint damaged: a clear error, exit 2."""
    out = tmp_path / "run"
    args = TINY + ["--steps", "4", "--checkpoint-every", "2", "--eval-every", "4", "--out", str(out)]
    assert train.main(args) == 0
    clean = rows(out)
    _truncate_arrays(out / "checkpoints" / "4")
    capsys.readouterr()
    assert train.main(args + ["--resume"]) == 0
    err = capsys.readouterr().err
    assert (f"--resume: checkpoint step 4 in {out / 'checkpoints'} is damaged (unreadable: ValueError: " in err
            and f"moved to {out / 'checkpoints' / 'damaged-4'}; falling back to step 2" in err)
    assert f"resumed from {out / 'checkpoints'} at step 2" in err and "Traceback" not in err
    _same_losses(rows(out), clean)
    for ckpt in (2, 4):
        _truncate_arrays(out / "checkpoints" / str(ckpt))
    assert train.main(args + ["--resume"]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == (
        f"error: no intact checkpoint left in {out / 'checkpoints'} (damaged: steps 4, 2, kept as "
        "damaged-STEP); start the run again with another --out")
    assert sorted(os.listdir(out / "checkpoints")) == ["damaged-2", "damaged-4"]


@pytest.mark.slow  # end to end: a training run and its resume
def test_resume_drops_a_metrics_line_cut_short(tmp_path):
    """A crash or a full disk can cut the last line of metrics.jsonl; resume drops it."""
    out = tmp_path / "run"
    args = TINY + ["--steps", "4", "--checkpoint-every", "2", "--eval-every", "0", "--out", str(out)]
    assert train.main(args) == 0
    shutil.rmtree(out / "checkpoints" / "4")
    text = (out / "metrics.jsonl").read_text()
    (out / "metrics.jsonl").write_text(text + text.splitlines()[0][:25])
    assert train.main(args + ["--resume"]) == 0
    assert [r["step"] for r in rows(out)] == [1, 2, 3, 4]
