"""`pip install` puts only `diloco_eqx` into site-packages: setuptools' own package discovery,
read from pyproject.toml as a build reads it, finds no other top-level name, every package
folder under diloco_eqx/ is found, and the package imports nothing from the checkout's
top-level models/, experiments/ or tools/ (which an install does not carry)."""

import re
import subprocess
import sys
import warnings
import zipfile
from pathlib import Path

import pytest

from setuptools.config.pyprojecttoml import read_configuration

ROOT = Path(__file__).resolve().parents[1]


def installed_packages() -> list[str]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # setuptools calls its [tool.setuptools] table beta
        config = read_configuration(ROOT / "pyproject.toml", expand=True)
    return config["tool"]["setuptools"]["packages"]


def test_only_diloco_eqx_is_a_top_level_package():
    packages = installed_packages()
    assert {name.split(".")[0] for name in packages} == {"diloco_eqx"}
    assert "diloco_eqx.models" in packages and "diloco_eqx.training" in packages
    folders = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "diloco_eqx").rglob("*.py")
               if "__pycache__" not in p.parts}
    assert folders <= set(packages), f"package folders without __init__.py: {folders - set(packages)}"


def test_the_package_imports_nothing_outside_itself_from_the_checkout():
    outside = re.compile(r"^\s*(from|import)\s+(models|experiments|tools|tests)\b", re.M)
    found = [f"{p.relative_to(ROOT)}: {m.group(0).strip()}" for p in (ROOT / "diloco_eqx").rglob("*.py")
             for m in outside.finditer(p.read_text())]
    assert not found, found


@pytest.mark.slow
def test_the_built_wheel_holds_only_diloco_eqx(tmp_path):
    """A real (non-editable) build: the wheel pip makes from the checkout holds diloco_eqx,
    its data files and its metadata, and nothing else at the top level."""
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(ROOT)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (wheel,) = tmp_path.glob("diloco_eqx-*.whl")
    with zipfile.ZipFile(wheel) as z:
        top = {name.split("/")[0] for name in z.namelist()}
        names = z.namelist()
    assert {t for t in top if not t.endswith(".dist-info")} == {"diloco_eqx"}, sorted(top)
    for module in ("diloco_eqx/diloco.py", "diloco_eqx/models/transformer.py", "diloco_eqx/training/cli.py"):
        assert module in names
