"""The README's Python code blocks run as printed (in a fresh interpreter each, from the
repository root), so the examples cannot rot."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import subprocess_env

ROOT = Path(__file__).resolve().parents[1]
BLOCKS = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)


def test_readme_has_python_blocks():
    assert len(BLOCKS) >= 1


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_python_block_runs(index, tmp_path):
    env = subprocess_env(PYTHONPATH=str(ROOT))  # the block asks for its own devices
    proc = subprocess.run([sys.executable, "-c", BLOCKS[index]], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"README block {index}:\n{BLOCKS[index]}\n{proc.stderr[-3000:]}"
