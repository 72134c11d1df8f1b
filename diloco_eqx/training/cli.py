"""Command lines derived from config dataclasses: one flag per field, its docstring as help.

`add_flags(group, default)` adds a flag for every scalar field of the dataclass instance
`default` (its values are the flags' defaults); `from_flags(default, args)` builds the
dataclass back from parsed arguments. Field metadata steers the rare field whose command
line differs from its Python form: `flag` (another name), `cli=False` (not a flag),
`parse` (a converter for each string), `join` (list of values -> field value), `choices`,
`metavar`. `RunConfig`'s nested sections become argument groups of one flat namespace.

The model's flags are the fields of the config dataclass its factory declares (see
`diloco_eqx.models.io`), so the command line is read twice: first for `--model` (on the
command line, else in the `--config` file), then with that model's flags.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import os
import re
import shutil
import sys
import tempfile
import textwrap
import types
import typing
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from diloco_eqx.models.io import resolve_factory
from diloco_eqx.models.transformer import TransformerConfig
from diloco_eqx.training.config import RunConfig, cli_fields, defaults_for_model, flag_name, model_fields
from diloco_eqx.training.config_files import config_flags, config_path, read_config
from diloco_eqx.training.tokenizer import parse_spec

GROUPS = {"diloco": "algorithm (the knobs of docs/algorithm.md)", "model": "model",
          "optim": "inner optimizer (AdamW, warmup + cosine decay)", "data": "data"}
MULTIPROCESS = ("coordinator", "num_processes", "process_id", "heartbeat_timeout")


@functools.cache
def field_docs(cls) -> dict[str, str]:
    """The docstring written under each field of a dataclass, from its source."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body
        for node, nxt in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                    and isinstance(nxt.value.value, str)):
                docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _meta(field: dataclasses.Field, extra: dict[str, dict]) -> dict[str, Any]:
    return {**field.metadata, **extra.get(field.name, {})}


def _kwargs(tp, default, meta: dict[str, Any]) -> dict[str, Any]:
    """argparse keyword arguments for a field of type `tp`."""
    if tp is bool:
        return {"action": argparse.BooleanOptionalAction, "default": default}
    kwargs: dict[str, Any] = {"default": default}
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        kinds = [a for a in args if a is not type(None)]
        many = [a for a in kinds if typing.get_origin(a) is tuple]
        tp = many[0] if many else kinds[0]
        args = typing.get_args(tp)
    if typing.get_origin(tp) is tuple:
        kwargs["nargs"] = "+"
        tp = args[0]
        if isinstance(default, tuple):
            kwargs["default"] = list(meta["show"](default) if "show" in meta else default)
        elif default is not None:
            kwargs["default"] = meta["show"](default) if "show" in meta else [default]
    kwargs["type"] = _usage_errors(meta["parse"]) if "parse" in meta else tp if tp in (int, float, str) else str
    for key in ("choices", "metavar"):
        if key in meta:
            kwargs[key] = meta[key]
    return kwargs


def _usage_errors(parse):
    """`parse`, with its ValueError's message shown as the usage error."""

    def typed(text: str):
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    typed.__name__ = getattr(parse, "__name__", "value")
    return typed


def add_flags(group, default, extra: dict[str, dict] | None = None,
              only: Sequence[str] | None = None) -> None:
    """A flag for every scalar field of the dataclass instance `default` (nested dataclass
    fields are skipped: give each its own group). `only` restricts to some fields."""
    extra = extra or {}
    hints = typing.get_type_hints(type(default))
    docs = field_docs(type(default))
    for field in cli_fields(type(default)):
        value = getattr(default, field.name)
        if dataclasses.is_dataclass(value) or (only is not None and field.name not in only):
            continue
        meta = _meta(field, extra)
        flag = "--" + flag_name(field).replace("_", "-")
        doc = docs.get(field.name)  # argparse reads % in a help text as a format
        group.add_argument(flag, dest=flag_name(field), help=doc and doc.replace("%", "%%"),
                           **_kwargs(hints[field.name], value, meta))


def from_flags(default, args: argparse.Namespace, extra: dict[str, dict] | None = None):
    """The dataclass `default` with every field that has a flag taken from `args`; nested
    dataclass fields are built the same way (their metadata "fields" steer their flags)."""
    extra = extra or {}
    changes = {}
    for field in cli_fields(type(default)):
        value = getattr(default, field.name)
        if dataclasses.is_dataclass(value):
            changes[field.name] = from_flags(value, args, field.metadata.get("fields"))
            continue
        if not hasattr(args, flag_name(field)):
            continue
        got = getattr(args, flag_name(field))
        meta = _meta(field, extra)
        if isinstance(got, list):
            got = meta["join"](got) if "join" in meta else tuple(got)
        changes[field.name] = got
    return dataclasses.replace(default, **changes)


class Parser(argparse.ArgumentParser):
    """Usage errors as one line and a pointer to --help, not the whole usage text; a flag it
    does not know also names the model's own flags (`model_note`)."""

    run_default: RunConfig | None = None
    """The RunConfig whose values are the flags' defaults (build_parser sets it)."""
    model_note: str | None = None

    def error(self, message: str):
        if message.startswith("unrecognized arguments") and self.model_note:
            message += f" ({self.model_note})"
        self.exit(2, f"{self.prog}: error: {message}\n{self.prog} --help lists every flag\n")


def model_note(default: RunConfig) -> str:
    """What the model of `default` takes: its factory, config dataclass and flags."""
    flags = ", ".join("--" + flag_name(f).replace("_", "-") for f in model_fields(type(default.model)))
    return (f"the model {default.model_factory} ({type(default.model).__name__}) takes "
            f"{flags or 'no flags'}")


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The description as written, and each flag's default."""


def build_parser(prog: str, description: str | None = None, default: RunConfig | None = None) -> Parser:
    """The training command line: one group per section of `RunConfig`; the model group holds
    the flags of `default.model`'s dataclass (a ValueError names a field whose flag another
    setting already has)."""
    default = RunConfig() if default is None else default
    parser = Parser(prog=prog, description=description, formatter_class=HelpFormatter)
    parser.run_default, parser.model_note = default, model_note(default)
    grouped = {f.name: f.metadata["group"] for f in cli_fields(RunConfig) if "group" in f.metadata}
    for field in dataclasses.fields(RunConfig):
        if field.name == "model":  # its own fields come last, so a clash is caught as theirs
            model_group = _model_group(parser, default, [n for n, g in grouped.items() if g == "model"])
        elif field.name in GROUPS:
            group = parser.add_argument_group(GROUPS[field.name])
            add_flags(group, default, only=[n for n, g in grouped.items() if g == field.name])
            add_flags(group, getattr(default, field.name), field.metadata.get("fields"))
    run_fields = [f.name for f in cli_fields(RunConfig) if f.name not in GROUPS and f.name not in grouped]
    add_flags(parser.add_argument_group("run"), default, only=[f for f in run_fields if f not in MULTIPROCESS])
    add_flags(parser.add_argument_group(
        "multi-process (jax.distributed; defaults from JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, "
        "JAX_PROCESS_ID)"), default, only=MULTIPROCESS)
    parser.set_defaults(coordinator=None, num_processes=None, process_id=None)
    parser.add_argument("--config", metavar="FILE", help=(
        "Settings from a YAML or JSON file keyed like the flags (flat, or under diloco: model: "
        "optim: data: run:), or an earlier run's run.json to run it again; flags given here "
        "override it."))
    _add_model_flags(model_group, default)
    return parser


def _model_group(parser: Parser, default: RunConfig, run_flags: list[str]):
    cls = type(default.model)
    group = parser.add_argument_group(GROUPS["model"] if cls is TransformerConfig
                                      else f"{GROUPS['model']} ({cls.__name__})")
    add_flags(group, default, only=run_flags)
    return group


def _add_model_flags(group, default: RunConfig) -> None:
    cls = type(default.model)
    try:
        add_flags(group, default.model, only=[f.name for f in model_fields(cls)])
    except argparse.ArgumentError as e:
        raise ValueError(f"--model {default.model_factory}: a field of its config {cls.__name__} has "
                         f"the flag of another setting ({e}); name the field differently or give it "
                         "another flag with metadata={'flag': ...}") from None


def model_spec(argv: Sequence[str], settings: dict[str, Any]) -> str | None:
    """The `--model` of `argv` (the last one given), else the config file's `model`."""
    pre = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    pre.add_argument("--model")
    given = pre.parse_known_args(list(argv))[0].model
    if given is None and isinstance(settings.get("model"), str):
        given = settings["model"]
    return given


def parse_run_config(argv: Sequence[str] | None, parser: Parser) -> RunConfig:
    """A RunConfig from the command line (and the JAX_* environment for multi-process runs).
    Flag-level problems exit with a usage error; the algorithm's own checks raise
    ValueError naming the knob. Another model than `parser`'s (`--model`, on the command
    line or in the config file) rebuilds the parser with that model's flags."""
    argv = sys.argv[1:] if argv is None else list(argv)
    path = config_path(argv)
    settings = read_config(path) if path is not None else {}
    default = parser.run_default or RunConfig()
    spec = model_spec(argv, settings)
    if spec is not None and spec != default.model_factory:
        try:
            default = defaults_for_model(spec, default)
            parser = build_parser(parser.prog, parser.description, default)
        except ValueError as e:
            parser.error(str(e))
    if path is not None:
        argv = config_flags(settings, parser, path, parser.model_note) + argv
    args = parser.parse_args(argv)
    env = os.environ
    if args.coordinator is None and env.get("JAX_COORDINATOR_ADDRESS"):
        args.coordinator = env["JAX_COORDINATOR_ADDRESS"]
    for name, var, fallback in (("num_processes", "JAX_NUM_PROCESSES", 1), ("process_id", "JAX_PROCESS_ID", 0)):
        if getattr(args, name) is None:
            setattr(args, name, int(env[var]) if env.get(var) else fallback)
    check_flags(args, parser)
    return from_flags(default, args)


def check_flags(a: argparse.Namespace, parser: Parser) -> None:
    """The checks that concern the command line itself (each names its flag)."""
    if a.coordinator is not None and not re.fullmatch(r"[^\s:]+:\d+", a.coordinator):
        parser.error(f"--coordinator must be HOST:PORT; got {a.coordinator!r}")
    if a.num_processes < 1 or not 0 <= a.process_id < a.num_processes:
        parser.error(f"--process-id must be in 0..--num-processes-1 = 0..{a.num_processes - 1}; "
                     f"got {a.process_id}")
    if a.num_processes > 1 and a.coordinator is None:
        parser.error("--num-processes > 1 needs --coordinator HOST:PORT (process 0's address)")
    if a.num_replicas % a.num_processes:
        parser.error(f"--num-replicas (K)={a.num_replicas} must be divisible by "
                     f"--num-processes={a.num_processes}: each process runs K/N islands")
    model = ("layers", "width", "heads") if isinstance(getattr(parser.run_default, "model", None),
                                                      TransformerConfig) else ()
    for name in ("num_replicas", "sync_period", "steps", *model, "seq_len",
                 "global_batch", "checkpoint_every", "eval_batches"):
        if getattr(a, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1; got {getattr(a, name)}")
    for name in ("warmup", "eval_every"):
        if getattr(a, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must be >= 0; got {getattr(a, name)}")
    if a.global_batch % a.num_replicas:
        parser.error(f"--global-batch (GBS)={a.global_batch} must be divisible by "
                     f"--num-replicas (K)={a.num_replicas}")
    if a.devices is not None and (a.devices < 1 or a.num_replicas % (a.devices * a.num_processes)):
        parser.error(f"--devices must be >= 1, and --devices × --num-processes must divide "
                     f"--num-replicas (K)={a.num_replicas}; got {a.devices} × {a.num_processes}")
    for name in ("data_parallel", "fsdp"):
        if getattr(a, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1; got {getattr(a, name)}")
    try:
        resolve_factory(a.model)
    except ValueError as e:
        parser.error(str(e))
    try:
        parse_spec(a.tokenizer)
    except ValueError as e:
        parser.error(str(e))
    island = a.global_batch // a.num_replicas
    if island % a.data_parallel:
        parser.error(f"--data-parallel={a.data_parallel} must divide each island's batch, "
                     f"--global-batch / --num-replicas = {island} rows")


# ---------------------------------------------------------------- the training command

PROG = "diloco-train"
DESCRIPTION = """Train a language model with DDP, DiLoCo or Streaming DiLoCo.

    diloco-train                                     # the default Streaming DiLoCo job
    diloco-train --mode ddp --out runs/ddp
    diloco-train --no-streaming --sync-period 30 --out runs/diloco
    diloco-train --out runs/x --resume               # continue from the latest checkpoint
    diloco-train --config run.yaml --tokenizer bpe:4096 --tracker jsonl tensorboard

(`python -m experiments.train` is the same command.) Writes to --out: run.json (settings,
config, versions, corpus), metrics.jsonl (one line per step and per evaluation),
checkpoints/, loss.png. The default corpus is the running Python's own standard library
sources; `--corpus markov` is a synthetic source with a known optimum, and any other value
is a list of files, directories or globs."""


def unwritable(out: Path) -> str | None:
    """Why a run could not write into `out` (None if it can), found without writing there:
    the nearest existing directory on its path gets a probe file, removed at once."""
    if out.exists() and not out.is_dir():
        return "exists and is not a directory"
    parent = out
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        return f"{parent} is not a directory"
    try:
        with tempfile.TemporaryFile(dir=parent):
            pass
    except OSError as e:
        return f"cannot write in {parent} ({e.strerror or e})"
    return None


def parse_settings(argv: Sequence[str] | None = None, prog: str = PROG) -> RunConfig:
    """The RunConfig of a command line; usage errors exit (status 2) with one line, the
    algorithm's checks raise ValueError naming the knob; config warnings are printed."""
    parser = build_parser(prog, DESCRIPTION)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = parse_run_config(argv, parser)
    for w in caught:
        print(f"warning: {w.message}", file=sys.stderr)
    problem = unwritable(Path(cfg.out))
    if problem:
        parser.error(f"--out {cfg.out}: {problem}")
    return cfg


def resume_command(prog: str, argv: Sequence[str]) -> str:
    """The command line that continues this run."""
    return " ".join([prog, *(a for a in argv if a != "--resume"), "--resume"])


def write_error(e: OSError, out: Path) -> str:
    """What a failed write means for the run in `out`: the checkpointer's own words, or the
    file that could not be written and the last complete checkpoint."""
    if e.filename is None and str(out) in str(e):
        return e.strerror or str(e)
    from diloco_eqx.training.checkpoint import last_complete_step

    last = last_complete_step(out / "checkpoints")
    last = "none" if last is None else f"step {last}"
    return (f"cannot write {e.filename or 'in ' + str(out)}: {e.strerror or e} (the last complete "
            f"checkpoint in {out / 'checkpoints'}: {last})")


def main(argv: Sequence[str] | None = None, prog: str = PROG) -> int:
    """Run the training command; the exit status (0, 2 for bad input, 128+signal when
    interrupted, 1 when a peer process failed or the run directory could not be written)."""
    from diloco_eqx.training.loop import Interrupted
    from diloco_eqx.training.runner import run

    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        cfg = parse_settings(argv, prog)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(cfg.out)
    existed = out.exists()
    try:
        run(cfg, [prog, *argv])
    except Interrupted as e:
        print(f"{e}; checkpoint saved in {out / 'checkpoints'}; continue with: "
              f"{resume_command(prog, argv)}", file=sys.stderr)
        return 128 + e.signum
    except (ValueError, FileNotFoundError) as e:
        if not existed and out.exists() and not (out / "run.json").exists() and cfg.process_id == 0:
            shutil.rmtree(out, ignore_errors=True)
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # the run directory's disk filled up, or it stopped being writable
        print(f"error: {write_error(e, out)}; free space (or fix {out}) and continue with: "
              f"{resume_command(prog, argv)}", file=sys.stderr, flush=True)
        if cfg.distributed:
            os._exit(1)
        return 1
    except Exception as e:
        if not cfg.distributed:
            raise
        # A peer died or the link broke: say so and leave now, without waiting for the
        # distributed runtime's shutdown barrier (which the dead peer would never reach).
        print(f"error: process {cfg.process_id} of {cfg.num_processes} stopped: "
              f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}\n"
              f"  a peer process probably failed; restart every process with --resume to continue "
              f"from the last checkpoint in {out / 'checkpoints'}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)
    return 0
