"""experiments/train.py end to end: outputs, bad input, and resume after SIGKILL."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from experiments import train

ROOT = Path(__file__).resolve().parents[2]
MODEL = ["--layers", "2", "--width", "32", "--heads", "2", "--seq-len", "32", "--global-batch",
         "4", "--no-progress"]
TINY = ["--corpus", "markov", "num_bytes=200000", "doc_bytes=20000", *MODEL]


def rows(out):
    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def test_tiny_run_writes_everything(tmp_path):
    out = tmp_path / "run"
    assert train.main(TINY + ["--steps", "12", "--eval-every", "6", "--checkpoint-every", "6",
                              "--out", str(out), "--devices", "2", "--eval-island"]) == 0
    meta = json.loads((out / "run.json").read_text())
    assert meta["status"] == "finished"
    assert meta["corpus"]["bytes"] > 0 and meta["versions"]["jax"].startswith("0.10")
    assert meta["settings"]["sync_period"] == 30 and meta["schedule"]["period"] == 30
    records = rows(out)
    steps = [r for r in records if not r.get("eval")]
    evals = [r for r in records if r.get("eval")]
    assert [r["step"] for r in steps] == list(range(1, 13))
    assert {"loss", "loss_island_0", "loss_island_1", "lr", "tokens", "wall_time", "step_time",
            "comm_bytes_per_island"} <= set(steps[0])
    assert steps[-1]["tokens"] == 12 * 4 * 32
    assert [r["step"] for r in evals] == [6, 12] and "eval_loss_island_0" in evals[0]
    summary = meta["summary"]
    assert summary["eval_loss"] == pytest.approx(evals[-1]["eval_loss"], rel=1e-5)
    assert summary["entropy_rate"] == pytest.approx(0.6931, abs=1e-3)
    assert (out / "loss.png").stat().st_size > 1000
    assert sorted(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit()) == [6, 12]


def test_ddp_and_vanilla_modes_run(tmp_path):
    for extra in (["--mode", "ddp"], ["--no-streaming", "--sync-period", "3"]):
        out = tmp_path / extra[1]
        assert train.main(TINY + ["--steps", "6", "--eval-every", "6", "--out", str(out)] + extra) == 0
        meta = json.loads((out / "run.json").read_text())
        assert meta["status"] == "finished"
        steps = [r for r in rows(out) if not r.get("eval")]
        if extra[1] == "ddp":
            assert steps[-1]["comm_bytes_per_island"] == 6 * 2 * meta["model"]["params"] * 4
        else:
            assert steps[-1]["comm_bytes_per_island"] == 2 * 2 * meta["model"]["params"] * 4


@pytest.mark.parametrize("argv,message", [
    (["--corpus", "/no/such/dir/*.txt"], "matches no file"),
    (["--corpus", "{empty}/*.txt"], "is empty"),
    (["--corpus", "markov", "doc_bytes=20000", "--seq-len", "30000"],
     "seq_len=30000 leaves 0 windows"),
    (["--compression", "int4"], "compression must be one of ('none', 'bf16', 'fp8', 'fp4')"),
    (["--drops", "7:0"], "drops step 7 is not a sync step"),
    (["--drop-prob", "0.1", "0.2", "0.3"], "drop_prob needs one value per island (K=2); got 3"),
])
def test_bad_input_leaves_no_run_directory(tmp_path, capsys, argv, message):
    (tmp_path / "e1.txt").write_text("")
    (tmp_path / "e2.txt").write_text("")
    argv = [a.replace("{empty}", str(tmp_path)) for a in argv]
    out = tmp_path / "run"
    assert train.main(MODEL + argv + ["--out", str(out)]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.parametrize("argv,message", [
    (["--global-batch", "5"], "--global-batch (GBS)=5 must be divisible by --num-replicas (K)=2"),
    (["--mode", "async"], "invalid choice: 'async'"),
    (["--drops", "30"], "--drops takes STEP:ISLAND pairs of integers (e.g. 30:1); got '30'"),
    (["--coordinator", "localhost"], "--coordinator must be HOST:PORT; got 'localhost'"),
    (["--num-processes", "2"], "--num-processes > 1 needs --coordinator HOST:PORT"),
    (["--coordinator", "h:1", "--num-processes", "2", "--process-id", "2"],
     "--process-id must be in 0..--num-processes-1 = 0..1; got 2"),
    (["--coordinator", "h:1", "--num-processes", "4", "--process-id", "0", "--num-replicas", "2",
      "--global-batch", "4"], "--num-replicas (K)=2 must be divisible by --num-processes=4"),
])
def test_bad_flags_are_usage_errors(tmp_path, capsys, argv, message):
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        train.main(TINY + argv + ["--out", str(out)])
    assert e.value.code == 2 and message in capsys.readouterr().err
    assert not out.exists()


def test_refuses_to_overwrite_or_resume_with_other_settings(tmp_path, capsys):
    out = tmp_path / "run"
    assert train.main(TINY + ["--steps", "2", "--out", str(out)]) == 0
    assert train.main(TINY + ["--steps", "2", "--out", str(out)]) == 2
    assert "already holds a run" in capsys.readouterr().err
    assert train.main(TINY + ["--steps", "4", "--lr", "0.1", "--out", str(out), "--resume"]) == 2
    assert "lr: 0.003 -> 0.1" in capsys.readouterr().err


def _run(args, **kw):
    return subprocess.Popen([sys.executable, "-m", "experiments.train", *args], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, **kw)


def test_resume_after_sigkill_gives_identical_losses(tmp_path):
    args = TINY + ["--steps", "40", "--checkpoint-every", "10", "--eval-every", "20",
                   "--overlap-steps", "1", "--alpha", "0.5", "--sync-period", "6"]
    killed, clean = tmp_path / "killed", tmp_path / "clean"
    proc = _run(args + ["--out", str(killed)])
    deadline = time.time() + 120
    while time.time() < deadline:
        done = [p for p in (killed / "checkpoints").glob("*") if p.name.isdigit()]
        if any(int(p.name) >= 20 for p in done) and (killed / "metrics.jsonl").exists():
            break
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert json.loads((killed / "run.json").read_text())["status"] == "running"
    resumed = _run(args + ["--out", str(killed), "--resume"])
    reference = _run(args + ["--out", str(clean)])
    for p in (resumed, reference):
        assert p.wait(timeout=300) == 0, p.stderr.read().decode()[-2000:]
    a, b = rows(killed), rows(clean)
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for ra, rb in zip(a, b):
        for key in ("loss", "loss_island_0", "loss_island_1", "eval_loss"):
            assert ra.get(key) == rb.get(key), (ra["step"], key)
    assert json.loads((killed / "run.json").read_text())["status"] == "finished"
