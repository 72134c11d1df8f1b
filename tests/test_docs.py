"""The documentation runs and cannot drift: every Python block of README.md and docs/*.md
runs as printed (a fresh interpreter each, from the repository root), and every knob table
is the one tools/knobs.py generates from the config dataclasses' declarations."""

import dataclasses
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from diloco_eqx.config import DiLoCoConfig
from diloco_eqx.training.cli import field_docs
from tests.helpers import subprocess_env
from tools import knobs

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^([ \t]*)```(\S*)[^\n]*\n(.*?)^\1```", re.S | re.M)


def _blocks(path: Path) -> list[tuple[str, str]]:
    """(language, code) of each fenced block of a page, dedented."""
    return [(m[2], textwrap.dedent(m[3])) for m in FENCE.finditer(path.read_text())]


BLOCKS = [(path, i, code) for path in PAGES
          for i, code in enumerate(code for lang, code in _blocks(path) if lang == "python")]


def _name(path: Path) -> str:
    return str(path.relative_to(ROOT))


def test_readme_and_docs_have_python_blocks():
    names = {_name(path) for path, _, _ in BLOCKS}
    assert {"README.md", "docs/tutorial.md"} <= names


def test_no_python_block_hides_under_another_name():
    """A block tagged `py`, `python3` or `pycon` would not be run: Python is tagged `python`."""
    for path in PAGES:
        tags = {lang for lang, _ in _blocks(path)}
        assert not tags & {"py", "python3", "pycon", "ipython", "Python"}, _name(path)


@pytest.mark.parametrize("path,index,code", BLOCKS, ids=[f"{_name(p)}-{i}" for p, i, _ in BLOCKS])
def test_python_block_runs(path, index, code):
    env = subprocess_env(PYTHONPATH=str(ROOT))  # a block that makes a mesh asks for its own devices
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{_name(path)} block {index}:\n{code}\n{proc.stderr[-3000:]}"


def test_readme_knob_tables_are_the_generated_ones():
    text = (ROOT / "README.md").read_text()
    assert knobs.BLOCK.search(text), "README.md has no generated knob table"
    assert knobs.fill(text) == text, "README.md's knob table is stale: python -m tools.knobs --write"


def test_every_docs_marker_expands():
    for path in sorted((ROOT / "docs").glob("*.md")):
        expanded = knobs.expand(path.read_text())
        assert "<!-- knobs" not in expanded, _name(path)
    config_page = (ROOT / "docs" / "configuration.md").read_text()
    assert "<!-- knobs: diloco_eqx.config.DiLoCoConfig -->" in config_page


def test_table_rows_are_the_declarations():
    """One row per field, in declaration order: name, flag, declared type, default (and the
    training command's default where it differs), the field's docstring."""
    lines = knobs.table("diloco_eqx.config.DiLoCoConfig").splitlines()
    fields = dataclasses.fields(DiLoCoConfig)
    assert len(lines) == 2 + len(fields)
    assert [line.split(" | ")[0] for line in lines[2:]] == [f"| `{f.name}`" for f in fields]
    row = dict(zip(["field", "flag", "type", "default", "run", "meaning"],
                   lines[2 + [f.name for f in fields].index("sync_period")].strip("| ").split(" | ")))
    assert row == {"field": "`sync_period`", "flag": "`--sync-period`", "type": "`int`", "default": "`100`",
                   "run": "`30`", "meaning": field_docs(DiLoCoConfig)["sync_period"]}
    streaming = lines[2 + [f.name for f in fields].index("streaming")]
    assert "`--[no-]streaming`" in streaming and "`False` | `True`" in streaming


def test_a_table_picks_fields_across_sections_and_escapes_pipes():
    table = knobs.table("diloco_eqx.training.config.RunConfig steps diloco.fragment_order data.corpus")
    rows = table.splitlines()[2:]
    assert [r.split(" | ")[0] for r in rows] == ["| `steps`", "| `diloco.fragment_order`", "| `data.corpus`"]
    assert "<code>str &#124; Order</code>" in rows[1]  # a pipe in a code span would split GitHub's cells
    assert r"\| markov" in rows[2] and "`('stdlib',)`" in rows[2]
    with pytest.raises(ValueError, match="no field 'nope'"):
        knobs.table("diloco_eqx.training.config.RunConfig nope")
    with pytest.raises(ValueError, match="names no config dataclass"):
        knobs.table("diloco_eqx.config.Nothing")


def test_write_regenerates_a_stale_table_and_check_reports_it(tmp_path):
    page = tmp_path / "page.md"
    spec = "diloco_eqx.training.config.OptimizerConfig"
    page.write_text(f"intro\n<!-- knobs:begin {spec} -->\n| old | table |\n<!-- knobs:end -->\nafter\n")
    assert knobs.main(["--check", str(page)]) == 1
    assert knobs.main(["--write", str(page)]) == 0
    assert page.read_text() == f"intro\n<!-- knobs:begin {spec} -->\n{knobs.table(spec)}\n<!-- knobs:end -->\nafter\n"
    assert knobs.main(["--check", str(page)]) == 0
