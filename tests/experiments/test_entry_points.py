"""The entry points: the `diloco-train` console script from any directory, and every
experiment script as a module from the checkout's root, the way the docs run them
(experiments/ is not installed with the package)."""

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


# by default the training script and one sweep script (each run is a fresh interpreter
# importing jax); the slow set runs every script
@pytest.mark.parametrize("name", [n if n in ("train", "sweep_overlap") else pytest.param(n, marks=pytest.mark.slow)
                                  for n in SCRIPTS])
def test_experiment_scripts_run_as_modules_from_the_checkout(name):
    proc = _run([sys.executable, "-m", f"experiments.{name}", "--help"], ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage:" in proc.stdout


def test_the_experiments_are_not_installed(tmp_path):
    """Outside the checkout there is no top-level `experiments` package to collide with."""
    proc = _run([sys.executable, "-c", "import importlib.util as u; print(u.find_spec('experiments'))"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "None"


def test_console_script_is_the_training_command(tmp_path):
    script = Path(sys.executable).parent / "diloco-train"
    proc = _run([str(script), "--help"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for flag in ("--num-replicas", "--sync-period", "--streaming", "--compression", "--faults",
                 "--layers", "--lr", "--global-batch", "--resume", "--coordinator"):
        assert flag in proc.stdout
    assert "usage: diloco-train" in proc.stdout
