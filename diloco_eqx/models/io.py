"""Models by name, and a model saved as a plain Equinox file.

A model is named `PACKAGE.MODULE:FACTORY`: `factory(config, key)` returns `(model, loss_fn)`
and `loss_fn(model, batch)` is the mean next-token loss of int32[B, T+1] rows. `config` is
the run's model settings: an instance of the frozen dataclass the factory declares, either
as an attribute (`build.config = MyConfig`) or as the annotation of its first parameter
(`def build(config: MyConfig, key)`); without one it is a `TransformerConfig` (vocabulary,
sequence length, layers, width, heads, MLP ratio; a model may read only some of them). The
training command makes that dataclass's fields its model flags and config-file keys.

`save_model` writes a model's leaves with `eqx.tree_serialise_leaves` beside a JSON file
naming its factory and config, so `load_model` rebuilds it with nothing but the factory,
JAX and Equinox.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import os
import re
import sys
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

import equinox as eqx
import jax

from diloco_eqx.models.transformer import TransformerConfig

SPEC = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")
WEIGHTS, CONFIG = "model.eqx", "model.json"


def resolve_factory(spec: str) -> Callable:
    """The function `PACKAGE.MODULE:FACTORY` names (the current directory is importable too)."""
    if not SPEC.fullmatch(spec):
        raise ValueError(f"--model must be PACKAGE.MODULE:FACTORY (e.g. diloco_eqx.models.transformer:build); got {spec!r}")
    module_name, name = spec.split(":")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"--model {spec}: cannot import {module_name} ({type(e).__name__}: {e})") from e
    factory = getattr(module, name, None)
    if not callable(factory):
        raise ValueError(f"--model {spec}: {module_name} has no function {name}")
    return factory


def config_class(factory: Callable, spec: str) -> type:
    """The config dataclass `factory` declares: its `config` attribute, else the annotation of
    its first parameter when that is a dataclass, else `TransformerConfig`. It must be a frozen
    dataclass with a default for every field (the defaults of the model's flags)."""
    declared = getattr(factory, "config", None)
    if declared is None:
        try:
            hints = typing.get_type_hints(factory)
            first = next(iter(inspect.signature(factory).parameters), None)
        except (NameError, TypeError, ValueError):  # an annotation it cannot resolve, a builtin
            hints, first = {}, None
        annotated = hints.get(first)
        declared = annotated if isinstance(annotated, type) and dataclasses.is_dataclass(annotated) \
            else TransformerConfig
    name = getattr(declared, "__name__", repr(declared))
    if not (isinstance(declared, type) and dataclasses.is_dataclass(declared)):
        raise ValueError(f"--model {spec}: its config {name} must be a dataclass")
    if not declared.__dataclass_params__.frozen:
        raise ValueError(f"--model {spec}: its config {name} must be frozen "
                         "(@dataclasses.dataclass(frozen=True))")
    missing = [f.name for f in dataclasses.fields(declared) if f.init and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ValueError(f"--model {spec}: its config {name} needs a default for every field "
                         f"(the flags' defaults); none for {', '.join(missing)}")
    return declared


def model_config_class(spec: str) -> type:
    """The config dataclass of the factory `spec` names."""
    return config_class(resolve_factory(spec), spec)


def build_model(spec: str, config: Any, key: jax.Array) -> tuple[eqx.Module, Callable]:
    """`(model, loss_fn)` from the factory `spec` names, checked for shape."""
    factory = resolve_factory(spec)
    try:
        inspect.signature(factory).bind(config, key)
    except TypeError as e:
        raise ValueError(f"--model {spec}: the factory must take (config, key); {e}") from None
    built = factory(config, key)
    if not (isinstance(built, tuple) and len(built) == 2 and isinstance(built[0], eqx.Module)
            and callable(built[1])):
        raise ValueError(f"--model {spec}: the factory must return (model, loss_fn) with an "
                         f"equinox Module first; got {type(built).__name__}")
    return built


def save_model(directory: str | os.PathLike, model: eqx.Module, spec: str, config: Any,
               extra: dict[str, Any] | None = None) -> Path:
    """Write `model` to DIRECTORY/model.eqx and its factory and config to DIRECTORY/model.json."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    eqx.tree_serialise_leaves(out / WEIGHTS, model)
    meta = {"factory": spec, "config": dataclasses.asdict(config), **(extra or {})}
    (out / CONFIG).write_text(json.dumps(meta, indent=2) + "\n")
    return out


def load_model(directory: str | os.PathLike) -> tuple[eqx.Module, Callable, Any]:
    """`(model, loss_fn, config)` saved by `save_model` (config: the factory's config dataclass)."""
    directory = Path(directory)
    meta = json.loads((directory / CONFIG).read_text())
    config = model_config_class(meta["factory"])(**meta["config"])
    like, loss_fn = build_model(meta["factory"], config, jax.random.key(0))
    return eqx.tree_deserialise_leaves(directory / WEIGHTS, like), loss_fn, config
