"""`pip install` puts only `diloco_eqx` into site-packages: setuptools' own package discovery,
read from pyproject.toml as a build reads it, finds no other top-level name, every package
folder under diloco_eqx/ is found, and the package imports nothing from the checkout's
top-level models/, experiments/ or tools/ (which an install does not carry)."""

import re
import warnings
from pathlib import Path

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
