"""experiments/train.py end to end: outputs, bad input, and resume after SIGKILL."""

import json
import os
import shutil
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
    import jax

    assert meta["corpus"]["bytes"] > 0 and meta["versions"]["jax"] == jax.__version__
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


@pytest.mark.slow  # two end-to-end runs
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


@pytest.mark.slow  # two end-to-end runs
def test_islands_of_data_2_by_fsdp_2_train_like_one_device(tmp_path):
    """--devices 2 --data-parallel 2 --fsdp 2: 2 islands of 4 devices, each splitting its
    rows over "data" and its parameters over "fsdp"; the same losses as islands vmapped on
    one device, and a finished run with its checkpoint."""
    common = TINY + ["--global-batch", "8", "--steps", "6", "--sync-period", "3", "--eval-every", "6",
                     "--checkpoint-every", "6"]
    mesh, flat = tmp_path / "mesh", tmp_path / "flat"
    assert train.main(common + ["--devices", "2", "--data-parallel", "2", "--fsdp", "2", "--out", str(mesh)]) == 0
    assert train.main(common + ["--out", str(flat)]) == 0
    got, want = rows(mesh), rows(flat)
    assert [r["step"] for r in got] == [r["step"] for r in want] == [1, 2, 3, 4, 5, 6, 6]
    for a, b in zip(got, want):
        for key in ("loss_island_0", "loss_island_1", "eval_loss"):
            if key in b:
                assert a[key] == pytest.approx(b[key], rel=2e-5)
    meta = json.loads((mesh / "run.json").read_text())
    assert meta["status"] == "finished" and meta["settings"]["fsdp"] == 2
    assert (mesh / "checkpoints" / "6").exists()


@pytest.mark.parametrize("argv,message", [
    (["--corpus", "/no/such/dir/*.txt"], "matches no file"),
    (["--corpus", "{empty}/*.txt"], "is empty"),
    (["--corpus", "markov", "doc_bytes=20000", "--seq-len", "30000"],
     "seq_len=30000 leaves 0 windows"),
    (["--compression", "int4"], "compression must be one of ('none', 'bf16', 'fp8', 'fp4', 'topk')"),
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
    (["--data-parallel", "3"], "--data-parallel=3 must divide each island's batch"),
    (["--fsdp", "0"], "--fsdp must be >= 1; got 0"),
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


@pytest.fixture(scope="module")
def two_step_run(tmp_path_factory):
    """A finished 2-step run of TINY, trained once for the tests below (each takes a copy)."""
    out = tmp_path_factory.mktemp("two_steps") / "run"
    assert train.main(TINY + ["--steps", "2", "--out", str(out)]) == 0
    return out


@pytest.mark.xdist_group("two_step_run")
def test_refuses_to_overwrite_or_resume_with_other_settings(tmp_path, capsys, two_step_run):
    out = Path(shutil.copytree(two_step_run, tmp_path / "run"))
    assert train.main(TINY + ["--steps", "2", "--out", str(out)]) == 2
    assert "already holds a run" in capsys.readouterr().err
    assert train.main(TINY + ["--steps", "4", "--lr", "0.1", "--out", str(out), "--resume"]) == 2
    assert "lr: 0.003 -> 0.1" in capsys.readouterr().err
    # a run.json without a setting stands for that setting's default: resuming with it is fine
    meta = json.loads((out / "run.json").read_text())
    for newer in ("outer_optimizer", "tokenizer", "model"):
        del meta["settings"][newer]
    (out / "run.json").write_text(json.dumps(meta))
    assert train.main(TINY + ["--steps", "2", "--out", str(out), "--resume", "--outer-optimizer", "adam"]) == 2
    assert "outer_optimizer: 'nesterov' -> 'adam'" in capsys.readouterr().err
    assert train.main(TINY + ["--steps", "2", "--out", str(out), "--resume"]) == 0


def _run(args, **kw):
    return subprocess.Popen([sys.executable, "-m", "experiments.train", *args], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, **kw)


RESUME_ARGS = TINY + ["--steps", "40", "--eval-every", "20", "--overlap-steps", "1", "--alpha",
                      "0.5", "--sync-period", "6"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Metrics of the run the interrupted ones must reproduce (checkpoint spacing does not
    change any number, so one run serves every test here)."""
    out = tmp_path_factory.mktemp("clean") / "run"
    p = _run(RESUME_ARGS + ["--out", str(out)])
    assert p.wait(timeout=300) == 0, p.stderr.read().decode()[-2000:]
    return rows(out)


def _same_losses(a, b):
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for ra, rb in zip(a, b):
        for key in ("loss", "loss_island_0", "loss_island_1", "eval_loss"):
            assert ra.get(key) == rb.get(key), (ra["step"], key)


def _wait_for(condition, proc, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline and not condition():
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        time.sleep(0.05)


@pytest.mark.slow  # end to end: three training subprocesses
def test_resume_after_sigkill_gives_identical_losses(tmp_path, uninterrupted):
    args = RESUME_ARGS + ["--checkpoint-every", "10"]
    killed = tmp_path / "killed"
    proc = _run(args + ["--out", str(killed)])
    _wait_for(lambda: any(int(p.name) >= 20 for p in (killed / "checkpoints").glob("*") if p.name.isdigit())
              and (killed / "metrics.jsonl").exists(), proc)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert json.loads((killed / "run.json").read_text())["status"] == "running"
    resumed = _run(args + ["--out", str(killed), "--resume"])
    assert resumed.wait(timeout=300) == 0, resumed.stderr.read().decode()[-2000:]
    _same_losses(rows(killed), uninterrupted)
    assert json.loads((killed / "run.json").read_text())["status"] == "finished"


@pytest.mark.slow  # end to end: three training subprocesses
def test_sigterm_checkpoints_the_step_in_flight_and_resumes_exactly(tmp_path, uninterrupted):
    """A scheduler's SIGTERM mid-run with no checkpoint due: the step in flight finishes, is
    checkpointed, run.json says "interrupted", the plot is drawn, one line says how to
    resume, and --resume continues with the uninterrupted losses."""
    args = RESUME_ARGS + ["--checkpoint-every", "100"]
    out = tmp_path / "termed"
    proc = _run(args + ["--out", str(out)])
    _wait_for(lambda: (out / "metrics.jsonl").exists()
              and len((out / "metrics.jsonl").read_text().splitlines()) >= 20, proc)
    proc.send_signal(signal.SIGTERM)
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 128 + signal.SIGTERM, err[-2000:]
    meta = json.loads((out / "run.json").read_text())
    stopped = meta["interrupted_at"]
    assert meta["status"] == "interrupted" and 20 <= stopped < 40
    assert sorted(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit()) == [stopped]
    assert [r["step"] for r in rows(out) if not r.get("eval")] == list(range(1, stopped + 1))
    assert (out / "loss.png").exists()
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"interrupted by SIGTERM at step {stopped}; checkpoint saved in ")
    assert last.endswith("--resume") and "continue with: python -m experiments.train" in last
    resumed = _run(args + ["--out", str(out), "--resume"])
    assert resumed.wait(timeout=300) == 0, resumed.stderr.read().decode()[-2000:]
    _same_losses(rows(out), uninterrupted)


@pytest.mark.xdist_group("two_step_run")
def test_resume_refuses_a_changed_step_count(tmp_path, capsys, two_step_run):
    out = Path(shutil.copytree(two_step_run, tmp_path / "run"))
    assert train.main(TINY + ["--steps", "4", "--out", str(out), "--resume"]) == 2
    err = capsys.readouterr().err
    assert "steps: 2 -> 4" in err and "length of the learning-rate schedule" in err
    # settings that change no number may differ
    assert train.main(TINY + ["--steps", "2", "--checkpoint-every", "7", "--out", str(out), "--resume"]) == 0


def test_resume_with_nothing_to_resume(tmp_path, capsys):
    empty = tmp_path / "empty"
    assert train.main(TINY + ["--steps", "2", "--out", str(empty), "--resume"]) == 2
    assert f"--resume: nothing to resume in {empty} (no run.json there)" in capsys.readouterr().err
    assert not empty.exists()
    # a run killed before its first checkpoint: resuming starts again from step 0
    out = tmp_path / "early"
    assert train.main(TINY + ["--steps", "3", "--checkpoint-every", "100", "--eval-every", "0",
                              "--out", str(out)]) == 0
    shutil.rmtree(out / "checkpoints")
    capsys.readouterr()
    assert train.main(TINY + ["--steps", "3", "--checkpoint-every", "100", "--eval-every", "0",
                              "--out", str(out), "--resume"]) == 0
    err = capsys.readouterr().err
    assert f"--resume: no checkpoint in {out / 'checkpoints'} yet; starting from step 0" in err
    assert [r["step"] for r in rows(out)] == [1, 2, 3]


@pytest.mark.parametrize("where,message", [
    ("/proc/diloco_eqx_run", "cannot write in /proc"),
    ("{file}/run", "is not a directory"),
    ("{file}", "exists and is not a directory"),
])
def test_unwritable_out_is_refused_before_anything_loads(tmp_path, capsys, where, message):
    (tmp_path / "file").write_text("x")
    where = where.replace("{file}", str(tmp_path / "file"))
    t0 = time.perf_counter()
    with pytest.raises(SystemExit) as e:
        train.parse_settings(TINY + ["--out", where])
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and len(err.strip().splitlines()) == 2
    assert time.perf_counter() - t0 < 1.0


def test_usage_errors_are_one_line_and_a_hint(capsys):
    with pytest.raises(SystemExit):
        train.main(["--mode", "async"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2 and "invalid choice: 'async'" in lines[0] and "--help" in lines[1]


@pytest.mark.slow  # three end-to-end runs
def test_backend_flag_and_switching_backend_on_resume(tmp_path):
    """--backend drjax trains like shard_map; a run checkpointed by one backend resumes on the
    other (the state serves both) with the same losses."""
    common = TINY + ["--steps", "8", "--sync-period", "4", "--eval-every", "8", "--checkpoint-every", "4",
                     "--devices", "2"]
    first, second = tmp_path / "shard_map", tmp_path / "drjax"
    assert train.main(common + ["--out", str(first)]) == 0
    assert train.main(common + ["--backend", "drjax", "--out", str(second)]) == 0
    assert json.loads((second / "run.json").read_text())["settings"]["backend"] == "drjax"
    for a, b in zip(rows(second), rows(first), strict=True):
        for key in ("loss_island_0", "loss_island_1", "eval_loss"):
            if key in b:
                assert a[key] == pytest.approx(b[key], rel=2e-5)
    # as if shard_map had stopped at step 4: resume it on drjax
    shutil.rmtree(first / "checkpoints" / "8")
    assert train.main(common + ["--backend", "drjax", "--out", str(first), "--resume"]) == 0
    for a, b in zip(rows(first), rows(second), strict=True):
        for key in ("loss_island_0", "loss_island_1", "eval_loss"):
            if key in b:
                assert a[key] == pytest.approx(b[key], rel=2e-5)


@pytest.mark.slow  # end to end: two training runs
@pytest.mark.parametrize("variant", [
    ["--no-streaming", "--sync-period", "3", "--delayed-outer", "eager", "--outer-delay", "2"],
    ["--sync-period", "4", "--num-fragments", "2", "--island-speed", "1", "0.5", "--island-weighting", "tokens"],
])
def test_variant_runs_resume_exactly(tmp_path, variant, capsys):
    """Eager updates (per-island outer copies and exchanges in flight) and heterogeneous
    islands through the CLI: resumed from the step-6 checkpoint, every loss repeats."""
    args = TINY + ["--steps", "12", "--eval-every", "6", "--checkpoint-every", "6", *variant]
    full = tmp_path / "full"
    assert train.main(args + ["--out", str(full)]) == 0
    cut = tmp_path / "cut"
    shutil.copytree(full, cut)
    shutil.rmtree(cut / "checkpoints" / "12")
    capsys.readouterr()
    assert train.main(args + ["--out", str(cut), "--resume"]) == 0
    assert "at step 6" in capsys.readouterr().err
    _same_losses(rows(cut), rows(full))
    assert [r["step"] for r in rows(cut) if not r.get("eval")] == list(range(1, 13))
