"""The entry points run from any directory: the `diloco-train` console script, and every
experiment script both as a file and as a module (experiments/ is installed with the package)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ["train", "sweep", "sweep_overlap", "reproduce_streaming", "custom_fragment_order"]


def _run(args, cwd):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


# by default the training script and one sweep script, each as a file and as a module (each
# run is a fresh interpreter importing jax); the slow set runs every script both ways
@pytest.mark.parametrize("name,form", [
    (n, f) if n in ("train", "sweep_overlap") else pytest.param(n, f, marks=pytest.mark.slow)
    for n in SCRIPTS for f in ("file", "module")])
def test_experiment_scripts_run_as_files_and_modules_outside_the_repo(name, form, tmp_path):
    args = ([sys.executable, str(ROOT / "experiments" / f"{name}.py"), "--help"] if form == "file"
            else [sys.executable, "-m", f"experiments.{name}", "--help"])
    proc = _run(args, tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage:" in proc.stdout


def test_console_script_is_the_training_command(tmp_path):
    script = Path(sys.executable).parent / "diloco-train"
    proc = _run([str(script), "--help"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for flag in ("--num-replicas", "--sync-period", "--streaming", "--compression", "--faults",
                 "--layers", "--lr", "--global-batch", "--resume", "--coordinator"):
        assert flag in proc.stdout
    assert "usage: diloco-train" in proc.stdout
