"""`--config FILE`: a run's settings from YAML or JSON, as flags the command line overrides.

A config file holds settings keyed like the flags (`sync_period: 30` or `sync-period: 30`),
flat or under the sections of `--help` (`diloco:`, `model:`, `optim:`, `data:`, `run:`); the
`model:` keys are the fields of the model's config dataclass (the `--model` factory's own).
An earlier run's `run.json` is a config too: its recorded `settings` (without `resume`), so
`--config runs/x/run.json --out runs/y` runs the same job again. The file's settings become
flags placed before the command line's own, so every flag given there wins.
"""

from __future__ import annotations

import argparse
import difflib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

SECTIONS = ("diloco", "model", "optim", "data", "run")
SUFFIXES = (".yaml", ".yml", ".json")
NOT_FROM_RUN = ("resume",)
"""Settings of a recorded run that a rerun does not take: it starts afresh."""


def config_path(argv: Sequence[str]) -> str | None:
    """The value of `--config` in `argv`, if any."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    return pre.parse_known_args(list(argv))[0].config


def read_config(path: str) -> dict[str, Any]:
    """The flat settings of a YAML/JSON config file or a run's run.json (keys with `_`)."""
    p = Path(path)
    if p.suffix not in SUFFIXES:
        raise ValueError(f"--config {path}: give a .yaml, .yml or .json file")
    if not p.is_file():
        raise ValueError(f"--config {path}: no such file")
    text = p.read_text()
    try:
        raw = json.loads(text) if p.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as e:
        raise ValueError(f"--config {path}: not valid {p.suffix[1:].upper()}: {e}") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ValueError(f"--config {path}: expected a mapping of settings; got {type(raw).__name__}")
    if isinstance(raw.get("settings"), dict) and "command" in raw:  # a run's run.json
        raw = {k: v for k, v in raw["settings"].items() if k not in NOT_FROM_RUN}
    flat: dict[str, Any] = {}
    for key, value in raw.items():
        key = str(key).replace("-", "_")
        if key in SECTIONS and isinstance(value, dict):
            flat.update({str(k).replace("-", "_"): v for k, v in value.items()})
        else:
            flat[key] = value
    return flat


def config_flags(settings: dict[str, Any], parser: argparse.ArgumentParser, path: str,
                 model_note: str | None = None) -> list[str]:
    """The command-line flags that say what `settings` says (None leaves the default); an
    unknown key's error ends with `model_note` (what the model takes)."""
    actions = {a.dest: a for a in parser._actions if a.option_strings and a.dest != "help"}
    actions.pop("config", None)
    argv: list[str] = []
    for key, value in settings.items():
        action = actions.get(key)
        if action is None:
            near = difflib.get_close_matches(key, list(actions), n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            note = f"; {model_note}" if model_note else ""
            raise ValueError(f"--config {path}: unknown setting {key!r}{hint}; settings are the flags' "
                             f"names, listed by --help{note}")
        if value is None:
            continue
        flag = action.option_strings[0]
        if isinstance(action, argparse.BooleanOptionalAction):
            if not isinstance(value, bool):
                raise ValueError(f"--config {path}: {key} must be true or false; got {value!r}")
            argv.append(flag if value else "--no-" + flag[2:])
        elif action.nargs == "+":
            values = value if isinstance(value, list) else [value]
            if values:
                argv += [flag, *map(str, values)]
            else:
                parser.set_defaults(**{key: []})
        else:
            argv += [flag, str(value)]
    return argv
