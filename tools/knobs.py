"""Knob tables generated from the config dataclasses' own declarations.

Each row is one field: its name, its flag, its declared type, its default and the docstring
written under it (read by the same `field_docs` that gives the training CLI its help), so a
table cannot drift from the code. A marker names what to tabulate:

    <!-- knobs: diloco_eqx.config.DiLoCoConfig -->                   a class: its defaults
    <!-- knobs: diloco_eqx.training.config.RunConfig.optim -->        a section of the run:
                                                                     the run's defaults
    <!-- knobs: diloco_eqx.training.config.RunConfig steps diloco.sync_period -->
                                                                     chosen fields, in order

A bare class or section lists its scalar fields (nested sections have tables of their own).
A dataclass that is not one of RunConfig's sections is read as a model's config, as `--model`
takes it: the fields the run fills in (the vocabulary, the sequence length) are not flags.
A class's table gains a column "`diloco-train` default" when the training command's default differs.
The docs' build (docs/hooks.py) replaces each one-line marker with its table. README.md,
which is read as it is, keeps its table between `<!-- knobs:begin SPEC -->` and
`<!-- knobs:end -->`:

    python -m tools.knobs --write     # rewrite README.md's tables
    python -m tools.knobs --check     # exit 1 if they differ from the generated ones
"""

from __future__ import annotations

import argparse
import dataclasses
import html
import importlib
import re
import sys
from pathlib import Path
from typing import Any

from diloco_eqx.training.cli import field_docs
from diloco_eqx.training.config import RunConfig, cli_fields, flag_name, model_fields

ROOT = Path(__file__).resolve().parents[1]
MARKER = re.compile(r"^<!-- knobs: (?P<spec>[^>]+?) -->$", re.M)
BLOCK = re.compile(r"^<!-- knobs:begin (?P<spec>[^>]+?) -->\n.*?^<!-- knobs:end -->$", re.M | re.S)
COLUMNS = ("field", "flag", "type", "default", "meaning")
SAME = "same as default"  # a Row's run_default where the command's default is the class's


@dataclasses.dataclass(frozen=True)
class Row:
    """One field of a config dataclass, as declared."""

    path: str  # dotted from the spec's target: "sync_period", "diloco.sync_period"
    flag: str | None
    type: str
    default: Any
    doc: str
    run_default: Any = SAME


def resolve(spec: str) -> tuple[Any, bool, list[str]]:
    """(the instance whose fields and defaults are tabulated, whether the spec named a class
    rather than a section of one, the chosen field paths) of a spec: a dotted path to a
    dataclass, optionally continued by field names into its nested sections, then optional
    field paths separated by spaces."""
    target, *fields = spec.split()
    parts = target.split(".")
    for i in range(len(parts) - 1, 0, -1):
        try:
            module = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        cls = getattr(module, parts[i], None)
        if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
            break
        instance = cls()
        for name in parts[i + 1:]:
            instance = getattr(instance, name, None)
            if not dataclasses.is_dataclass(instance):
                raise ValueError(f"knobs: {target}: {name} is not a section (a nested dataclass)")
        return instance, i + 1 == len(parts), fields
    raise ValueError(f"knobs: {target!r} names no config dataclass (module.Class[.section...])")


def _declared_type(field: dataclasses.Field) -> str:
    if isinstance(field.type, str):  # as written, under `from __future__ import annotations`
        return field.type
    return re.sub(r"\b(?:[A-Za-z_]\w*\.)+", "", getattr(field.type, "__name__", str(field.type)))


def _field(cls: type, name: str) -> dataclasses.Field:
    try:
        return next(f for f in dataclasses.fields(cls) if f.name == name)
    except StopIteration:
        raise ValueError(f"knobs: {cls.__name__} has no field {name!r}") from None


def _rows_of(instance: Any, paths: list[str]) -> list[Row]:
    rows = []
    for path in paths:
        obj = instance
        *sections, name = path.split(".")
        for section in sections:
            obj = getattr(obj, section)
        cls = type(obj)
        field = _field(cls, name)
        flag = "--" + flag_name(field).replace("_", "-") if field in _flagged(cls) else None
        rows.append(Row(path, flag, _declared_type(field), getattr(obj, name), field_docs(cls).get(name, "")))
    return rows


def _flagged(cls: type) -> list[dataclasses.Field]:
    """The fields of `cls` that are flags of the training command: all of a section of
    RunConfig's own (the run, the algorithm, the optimizer, the data); of any other dataclass,
    which the command takes as a model's config, those the run does not fill in itself."""
    sections = {type(getattr(RunConfig(), f.name)) for f in dataclasses.fields(RunConfig) if f.name != "model"}
    return cli_fields(cls) if cls is RunConfig or cls in sections else model_fields(cls)


def _run_default(cls: type) -> Any | None:
    """The training command's defaults for `cls`: RunConfig's section of that type, if any."""
    run = RunConfig()
    for field in dataclasses.fields(RunConfig):
        value = getattr(run, field.name)
        if type(value) is cls:
            return value
    return None


def rows(spec: str) -> list[Row]:
    """The table's rows for a spec (see the module docstring)."""
    instance, is_class, fields = resolve(spec)
    cls = type(instance)
    if not fields:
        fields = [f.name for f in dataclasses.fields(cls)
                  if f.init and not dataclasses.is_dataclass(getattr(instance, f.name))]
    out = _rows_of(instance, fields)
    run = _run_default(cls) if is_class and cls is not RunConfig else None
    if run is not None:
        out = [dataclasses.replace(r, run_default=getattr(run, r.path))
               if "." not in r.path and getattr(run, r.path) != r.default else r for r in out]
    return out


def _code(text: str) -> str:
    """`text` as inline code that survives a table cell in both GitHub's and Python-Markdown's
    tables (a pipe inside backticks splits GitHub's cells)."""
    if "|" in text:
        return "<code>" + html.escape(text).replace("|", "&#124;") + "</code>"
    return f"`{text}`"


def _prose(text: str) -> str:
    """A docstring as a table cell: pipes outside code spans escaped."""
    pieces = re.split(r"(`[^`]*`)", text)
    return "".join(_code(p[1:-1]) if p.startswith("`") else p.replace("|", r"\|") for p in pieces)


def _value(value: Any) -> str:
    if callable(value) and not isinstance(value, type):
        return _code(getattr(value, "__name__", repr(value)))
    return _code(repr(value))


def table(spec: str) -> str:
    """The markdown table of a spec."""
    got = rows(spec)
    extra = any(r.run_default is not SAME for r in got)
    head = [*COLUMNS[:4], *(["`diloco-train` default"] if extra else []), COLUMNS[4]]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in got:
        cells = [_code(r.path), _flag_cell(r), _code(r.type), _value(r.default)]
        if extra:
            cells.append("" if r.run_default is SAME else _value(r.run_default))
        cells.append(_prose(r.doc))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _flag_cell(r: Row) -> str:
    if r.flag is None:
        return "—"
    if r.type == "bool":
        return _code("--[no-]" + r.flag[2:])
    return _code(r.flag)


def expand(text: str) -> str:
    """Every one-line marker of `text` replaced by its table (the docs' build)."""
    return MARKER.sub(lambda m: table(m["spec"]), text)


def fill(text: str) -> str:
    """Every begin/end block of `text` with its table regenerated (README.md)."""
    return BLOCK.sub(lambda m: f"<!-- knobs:begin {m['spec']} -->\n{table(m['spec'])}\n<!-- knobs:end -->", text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.knobs", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--write", action="store_true", help="rewrite the files' tables")
    what.add_argument("--check", action="store_true", help="exit 1 if a table differs")
    what.add_argument("--table", metavar="SPEC", help="print the table of SPEC")
    p.add_argument("files", nargs="*", default=[str(ROOT / "README.md")], help="default: README.md")
    a = p.parse_args(argv)
    if a.table:
        print(table(a.table))
        return 0
    stale = []
    for name in a.files:
        path = Path(name)
        text = path.read_text()
        new = fill(text)
        if new != text:
            stale.append(name)
            if a.write:
                path.write_text(new)
    if a.check and stale:
        print(f"knob tables out of date in {', '.join(stale)}: run python -m tools.knobs --write",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
