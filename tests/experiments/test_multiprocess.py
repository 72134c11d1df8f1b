"""Real multi-process runs on localhost: jax.distributed with gloo, 2 processes x 2 devices."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import subprocess_env

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--num-replicas", "4", "--layers", "2", "--width", "32", "--heads", "2", "--seq-len", "16",
        "--global-batch", "8", "--sync-period", "6", "--streaming", "--num-fragments", "3",
        "--overlap-steps", "1", "--corpus", "markov", "--no-progress"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def launch(args, log, **env_extra):
    env = subprocess_env(**env_extra)  # each process asks for its own --devices
    return subprocess.Popen([sys.executable, "-m", "experiments.train", *args], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=open(log, "w"))


def launch_pair(args, out, tmp_path, tag, **env_extra):
    port = free_port()
    return [launch([*args, "--devices", "2", "--coordinator", f"localhost:{port}",
                    "--num-processes", "2", "--process-id", str(i), "--out", str(out)],
                   tmp_path / f"{tag}{i}.log", **env_extra) for i in (1, 0)]


def losses(out, k=4):
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return ([r["step"] for r in rows],
            np.array([[r.get(f"loss_island_{i}", r.get("eval_loss")) for i in range(k)] for r in rows]))


def single(args, out, **env_extra):
    subprocess.run([sys.executable, "-m", "experiments.train", *args, "--devices", "4", "--out", str(out)],
                   cwd=ROOT, env=subprocess_env(**env_extra), check=True, capture_output=True)


@pytest.mark.slow  # end to end: three training processes
@pytest.mark.parametrize("backend", ["shard_map", "drjax"])
def test_two_processes_equal_one(tmp_path, backend):
    """Two processes of 2 devices, on either backend, train like one process of 4 (shard_map)."""
    args = [*TINY, "--steps", "12", "--eval-every", "6", "--checkpoint-every", "6"]
    procs = launch_pair([*args, "--backend", backend], tmp_path / "two", tmp_path, "p")
    assert [p.wait(timeout=300) for p in procs] == [0, 0], (tmp_path / "p0.log").read_text()[-2000:]
    single(args, tmp_path / "one")
    steps2, l2 = losses(tmp_path / "two")
    steps1, l1 = losses(tmp_path / "one")
    assert steps2 == steps1 and len(steps1) == 12 + 2
    # gloo sums in another order than the in-process all-reduce: float32 rounding only
    np.testing.assert_allclose(l2, l1, rtol=1e-6)
    meta = json.loads((tmp_path / "two" / "run.json").read_text())
    assert meta["status"] == "finished" and len(meta["machine"]["devices"]) == 4
    assert sorted(p.name for p in (tmp_path / "two" / "checkpoints").iterdir()) == ["12", "6"]


@pytest.mark.slow  # end to end: three training processes
def test_own_model_two_processes_equal_one(tmp_path):
    """`--model` with the README's model, a module outside the package, across 2 processes."""
    from tests.models.test_io import readme_model_source

    (tmp_path / "my_model.py").write_text(readme_model_source())
    path = {"PYTHONPATH": f"{ROOT}{os.pathsep}{tmp_path}"}
    args = [*TINY, "--model", "my_model:build", "--steps", "12", "--eval-every", "6"]
    procs = launch_pair(args, tmp_path / "two", tmp_path, "p", **path)
    assert [p.wait(timeout=300) for p in procs] == [0, 0], (tmp_path / "p0.log").read_text()[-2000:]
    single(args, tmp_path / "one", **path)
    steps2, l2 = losses(tmp_path / "two")
    steps1, l1 = losses(tmp_path / "one")
    assert steps2 == steps1 and len(steps1) == 12 + 2
    np.testing.assert_allclose(l2, l1, rtol=1e-6)
    assert json.loads((tmp_path / "two" / "run.json").read_text())["model"]["factory"] == "my_model:build"


FAILING = [*TINY, "--steps", "60", "--eval-every", "10", "--checkpoint-every", "10"]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """Per-step losses of the run that the failing ones must reproduce once resumed."""
    out = tmp_path_factory.mktemp("straight") / "run"
    single(FAILING, out)
    return losses(out)


def wait_for_checkpoint(out, step, proc, log):
    deadline = time.time() + 300
    while not (out / "checkpoints" / str(step)).exists():
        assert time.time() < deadline and proc.poll() is None, log.read_text()[-2000:]
        time.sleep(0.2)


@pytest.mark.slow  # end to end: four training processes
@pytest.mark.parametrize("stopped", [1, 0])
def test_hung_process_stops_the_other_within_the_heartbeat_timeout(tmp_path, straight, stopped):
    """SIGSTOP one of two processes (1, or 0, which holds the coordinator): the other stops
    with a one-line error naming the silent process within --heartbeat-timeout, exit 1; both
    restarted with --resume give the uninterrupted per-step losses."""
    timeout = 10
    out = tmp_path / "run"
    procs = dict(zip((1, 0), launch_pair([*FAILING, "--heartbeat-timeout", str(timeout)], out, tmp_path, "h")))
    survivor = 1 - stopped
    wait_for_checkpoint(out, 20, procs[0], tmp_path / "h0.log")
    os.kill(procs[stopped].pid, signal.SIGSTOP)
    hung = time.monotonic()
    try:
        assert procs[survivor].wait(timeout=3 * timeout) == 1
        took = time.monotonic() - hung
    finally:
        procs[stopped].kill()
        procs[stopped].wait()
    print(f"process {survivor} stopped {took:.1f} s after process {stopped} was")
    assert took < timeout + 1  # the watch fires within the timeout; + exit
    log = (tmp_path / f"h{survivor}.log").read_text()
    who = "the coordinator (process 0)" if stopped == 0 else "process 1"
    assert f"error: process {survivor} of 2 stopped: {who} sent no heartbeat for" in log
    assert "restart every process with --resume" in log and "Check failure" not in log
    resumed = launch_pair([*FAILING, "--resume"], out, tmp_path, "r")
    assert [p.wait(timeout=300) for p in resumed] == [0, 0], (tmp_path / "r0.log").read_text()[-2000:]
    steps_r, lr = losses(out)
    assert steps_r == straight[0]
    np.testing.assert_allclose(lr, straight[1], rtol=1e-6)


@pytest.mark.slow
def test_killed_process_stops_the_other_and_both_resume(tmp_path, straight):
    args = FAILING
    out = tmp_path / "run"
    p1, p0 = launch_pair(args, out, tmp_path, "k")
    deadline = time.time() + 300
    while not (out / "checkpoints" / "20").exists():
        assert time.time() < deadline and p0.poll() is None
        time.sleep(0.2)
    p1.kill()
    killed = time.time()
    assert p0.wait(timeout=120) == 1
    assert time.time() - killed < 60  # bounded: it does not hang
    log = (tmp_path / "k0.log").read_text()
    assert "error: process 0 of 2 stopped" in log and "--resume" in log
    procs = launch_pair([*args, "--resume"], out, tmp_path, "r")
    assert [p.wait(timeout=300) for p in procs] == [0, 0], (tmp_path / "r0.log").read_text()[-2000:]
    steps_r, lr = losses(out)
    assert steps_r == straight[0]
    np.testing.assert_allclose(lr, straight[1], rtol=1e-6)


@pytest.mark.slow  # end to end: five training processes
def test_one_island_per_process_of_data_2_by_fsdp_2(tmp_path):
    """The realistic layout: 2 processes × 4 devices, each process one island of (data 2 ×
    fsdp 2), islands across processes. Killed after a checkpoint and resumed, both processes
    give the per-step losses of one uninterrupted process with all 8 devices."""
    args = [*TINY, "--num-replicas", "2", "--data-parallel", "2", "--fsdp", "2",
            "--steps", "24", "--eval-every", "12", "--checkpoint-every", "6"]
    out, port = tmp_path / "run", free_port()

    def pair(extra, tag):
        return [launch([*args, *extra, "--devices", "1", "--coordinator", f"localhost:{port}",
                        "--num-processes", "2", "--process-id", str(i), "--out", str(out)],
                       tmp_path / f"{tag}{i}.log") for i in (1, 0)]

    p1, p0 = pair([], "k")
    deadline = time.time() + 400
    while not (out / "checkpoints" / "12").exists():
        assert time.time() < deadline and p0.poll() is None, (tmp_path / "k0.log").read_text()[-2000:]
        time.sleep(0.2)
    p1.kill()
    assert p0.wait(timeout=120) == 1
    port = free_port()
    procs = pair(["--resume"], "r")
    assert [p.wait(timeout=400) for p in procs] == [0, 0], (tmp_path / "r0.log").read_text()[-2000:]
    straight = tmp_path / "straight"
    subprocess.run([sys.executable, "-m", "experiments.train", *args, "--devices", "2", "--out", str(straight)],
                   cwd=ROOT, env=subprocess_env(), check=True, capture_output=True)
    steps_r, lr = losses(out, k=2)
    steps_s, ls = losses(straight, k=2)
    assert steps_r == steps_s and len(steps_s) == 24 + 2
    np.testing.assert_allclose(lr, ls, rtol=1e-6)
    meta = json.loads((out / "run.json").read_text())
    assert meta["status"] == "finished" and len(meta["machine"]["devices"]) == 8
