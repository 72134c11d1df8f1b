"""Train a byte-level transformer with DDP, DiLoCo or Streaming DiLoCo.

    python -m experiments.train                      # the default Streaming DiLoCo job
    python -m experiments.train --mode ddp --out runs/ddp
    python -m experiments.train --no-streaming --sync-period 30 --out runs/diloco
    python -m experiments.train --out runs/x --resume  # continue from the latest checkpoint

Writes to --out: run.json (config, versions, corpus), metrics.jsonl (one line per step and
per evaluation), checkpoints/, loss.png. The default corpus is the running Python's own
standard library sources; `--corpus markov` is a synthetic source with a known optimum, and
any other value is a list of files, directories or globs.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import platform
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

MODES = ("diloco", "ddp")


@dataclasses.dataclass(frozen=True)
class Settings:
    """Everything that defines a run (the CLI's flags)."""

    mode: str = "diloco"
    num_replicas: int = 2
    sync_period: int = 30
    streaming: bool = True
    num_fragments: int = 3
    fragment_order: str = "interleaved"
    overlap_steps: int = 0
    alpha: float = 0.0
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    compression: str = "none"
    error_feedback: bool = False
    drops: tuple[str, ...] = ()
    drop_prob: tuple[float, ...] = (0.0,)
    fault_seed: int = 0
    steps: int = 600
    seed: int = 0
    layers: int = 4
    width: int = 128
    heads: int = 4
    seq_len: int = 128
    global_batch: int = 16
    lr: float = 3e-3
    warmup: int = 50
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    checkpoint_every: int = 100
    eval_every: int = 100
    eval_batches: int = 8
    eval_island: bool = False
    corpus: tuple[str, ...] = ("stdlib",)
    non_iid: bool = False
    devices: int | None = None
    coordinator: str | None = None
    num_processes: int = 1
    process_id: int = 0
    heartbeat_timeout: int = 30
    out: str = "runs/default"
    resume: bool = False
    progress: bool = True


RESUMABLE_CHANGES = ("resume", "progress", "out", "coordinator", "num_processes", "process_id",
                     "heartbeat_timeout", "devices", "checkpoint_every")
"""Settings a --resume may change: none of them changes a number the run computes (the
islands' layout over devices and processes, where checkpoints fall, what is printed)."""


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The module docstring as written, and each flag's default."""


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line and a pointer to --help, not the whole usage text."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n{self.prog} --help lists every flag\n")


def build_parser() -> argparse.ArgumentParser:
    d = Settings()
    p = _Parser(
        prog="python -m experiments.train",
        description=__doc__,
        formatter_class=_HelpFormatter,
    )
    g = p.add_argument_group("algorithm (the knobs of ALGORITHM.md)")
    g.add_argument("--mode", choices=MODES, default=d.mode,
                   help="diloco: DiLoCo / Streaming DiLoCo; ddp: gradients averaged every step")
    g.add_argument("--num-replicas", type=int, default=d.num_replicas, help="K, islands")
    g.add_argument("--sync-period", type=int, default=d.sync_period, help="H, inner steps between syncs")
    g.add_argument("--streaming", action=argparse.BooleanOptionalAction, default=d.streaming,
                   help="Streaming DiLoCo (default) or, with --no-streaming, vanilla DiLoCo")
    g.add_argument("--num-fragments", type=int, default=d.num_fragments, help="P (streaming)")
    g.add_argument("--fragment-order", default=d.fragment_order,
                   help="interleaved | sequential | a registered order")
    g.add_argument("--overlap-steps", type=int, default=d.overlap_steps, help="V (streaming)")
    g.add_argument("--alpha", type=float, default=d.alpha, help="α, apply blend (streaming)")
    g.add_argument("--outer-lr", type=float, default=d.outer_lr, help="η_outer")
    g.add_argument("--outer-momentum", type=float, default=d.outer_momentum, help="β, Nesterov")
    g.add_argument("--compression", default=d.compression,
                   help="pseudo-gradient format on the wire: none (float32) | bf16 | fp8 | fp4")
    g.add_argument("--error-feedback", action=argparse.BooleanOptionalAction,
                   default=d.error_feedback,
                   help="carry each island's quantization error into its next sync")
    g = p.add_argument_group("simulated island faults")
    g.add_argument("--drops", nargs="+", default=list(d.drops), metavar="STEP:ISLAND",
                   help="island ISLAND misses the sync at STEP (e.g. --drops 30:1 60:0)")
    g.add_argument("--drop-prob", nargs="+", type=float, default=list(d.drop_prob),
                   help="chance an island misses a sync: one value, or one per island")
    g.add_argument("--fault-seed", type=int, default=d.fault_seed, help="seed of the drop coin")
    g = p.add_argument_group("model and inner optimizer (AdamW, warmup + cosine decay)")
    g.add_argument("--layers", type=int, default=d.layers)
    g.add_argument("--width", type=int, default=d.width)
    g.add_argument("--heads", type=int, default=d.heads)
    g.add_argument("--seq-len", type=int, default=d.seq_len, help="tokens (bytes) per sequence")
    g.add_argument("--global-batch", type=int, default=d.global_batch,
                   help="GBS sequences per step over all islands (divisible by K)")
    g.add_argument("--lr", type=float, default=d.lr, help="peak inner learning rate")
    g.add_argument("--warmup", type=int, default=d.warmup, help="linear warmup steps")
    g.add_argument("--weight-decay", type=float, default=d.weight_decay)
    g.add_argument("--grad-clip", type=float, default=d.grad_clip, help="global-norm clip (0: off)")
    g = p.add_argument_group("run")
    g.add_argument("--steps", type=int, default=d.steps)
    g.add_argument("--seed", type=int, default=d.seed)
    g.add_argument("--out", default=d.out, help="run directory")
    g.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    g.add_argument("--checkpoint-every", type=int, default=d.checkpoint_every)
    g.add_argument("--eval-every", type=int, default=d.eval_every)
    g.add_argument("--eval-batches", type=int, default=d.eval_batches,
                   help="held-out batches of GBS windows per evaluation")
    g.add_argument("--eval-island", action="store_true", help="also evaluate island 0")
    g.add_argument("--corpus", nargs="+", default=list(d.corpus),
                   help="stdlib (default) | markov | files, directories or globs")
    g.add_argument("--non-iid", action="store_true",
                   help="each island trains only on its own contiguous block of files")
    g.add_argument("--devices", type=int, default=d.devices,
                   help="simulated host devices on the diloco axis (default: none, islands vmapped)")
    g.add_argument("--no-progress", dest="progress", action="store_false")
    g = p.add_argument_group(
        "multi-process (jax.distributed; defaults from JAX_COORDINATOR_ADDRESS, "
        "JAX_NUM_PROCESSES, JAX_PROCESS_ID)")
    g.add_argument("--coordinator", default=d.coordinator, metavar="HOST:PORT",
                   help="address of process 0's coordination service; turns multi-process on")
    g.add_argument("--num-processes", type=int, default=None, help="processes in the run")
    g.add_argument("--process-id", type=int, default=None, help="this process's index, 0..N-1")
    g.add_argument("--heartbeat-timeout", type=int, default=d.heartbeat_timeout,
                   help="seconds without a peer's heartbeat before the run stops with an error")
    return p


def parse_settings(argv: list[str] | None = None) -> Settings:
    parser = build_parser()
    args = vars(parser.parse_args(argv))
    args["corpus"] = tuple(args["corpus"])
    env = os.environ
    if args["coordinator"] is None and env.get("JAX_COORDINATOR_ADDRESS"):
        args["coordinator"] = env["JAX_COORDINATOR_ADDRESS"]
    for name, var, default in (("num_processes", "JAX_NUM_PROCESSES", 1),
                               ("process_id", "JAX_PROCESS_ID", 0)):
        if args[name] is None:
            args[name] = int(env[var]) if env.get(var) else default
    if args["coordinator"] is not None and not re.fullmatch(r"[^\s:]+:\d+", args["coordinator"]):
        parser.error(f"--coordinator must be HOST:PORT; got {args['coordinator']!r}")
    if args["num_processes"] < 1 or not 0 <= args["process_id"] < args["num_processes"]:
        parser.error(f"--process-id must be in 0..--num-processes-1 = 0..{args['num_processes'] - 1}; "
                     f"got {args['process_id']}")
    if args["num_processes"] > 1 and args["coordinator"] is None:
        parser.error("--num-processes > 1 needs --coordinator HOST:PORT (process 0's address)")
    if args["num_replicas"] % args["num_processes"]:
        parser.error(f"--num-replicas (K)={args['num_replicas']} must be divisible by "
                     f"--num-processes={args['num_processes']}: each process runs K/N islands")
    args["drops"] = tuple(args["drops"])
    args["drop_prob"] = tuple(args["drop_prob"])
    for item in args["drops"]:
        if not re.fullmatch(r"\d+:\d+", item):
            parser.error(f"--drops takes STEP:ISLAND pairs of integers (e.g. 30:1); got {item!r}")
    settings = Settings(**args)
    for name in ("num_replicas", "sync_period", "steps", "layers", "width", "heads", "seq_len",
                 "global_batch", "checkpoint_every", "eval_batches"):
        if getattr(settings, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1; got {getattr(settings, name)}")
    for name in ("warmup", "eval_every"):
        if getattr(settings, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must be >= 0; got {getattr(settings, name)}")
    if settings.global_batch % settings.num_replicas:
        parser.error(f"--global-batch (GBS)={settings.global_batch} must be divisible by "
                     f"--num-replicas (K)={settings.num_replicas}")
    if settings.devices is not None and (settings.devices < 1 or settings.num_replicas % settings.devices):
        parser.error(f"--devices must be >= 1 and divide --num-replicas (K)={settings.num_replicas}; "
                     f"got {settings.devices}")
    problem = unwritable(Path(settings.out))
    if problem:
        parser.error(f"--out {settings.out}: {problem}")
    return settings


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


def _use_host_devices(n: int) -> None:
    """Ask XLA for n CPU devices; only works before jax starts its backend."""
    flag = f"--xla_force_host_platform_device_count={n}"
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} {flag}".strip()


def run(settings: Settings) -> dict[str, Any]:
    """Run (or resume) one training job; returns the summary written to run.json."""
    if settings.devices:
        _use_host_devices(settings.devices)
    import warnings

    import equinox as eqx
    import jax
    import optax

    distributed = settings.coordinator is not None
    if distributed:
        # CPU collectives across processes go through gloo; GPU/TPU backends ignore this.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            settings.coordinator, settings.num_processes, settings.process_id,
            heartbeat_timeout_seconds=settings.heartbeat_timeout,
            shutdown_timeout_seconds=settings.heartbeat_timeout,
        )
    primary = jax.process_index() == 0

    import diloco_eqx as dl
    from diloco_eqx import comms, compression, data
    from diloco_eqx.checkpoint import Checkpointer, key_from_json, key_to_json
    from diloco_eqx.ddp import init_ddp_state, make_ddp_step
    from diloco_eqx.fragments import Fragmentation
    from diloco_eqx.loop import (
        Interrupted,
        JsonlWriter,
        LoopConfig,
        StopSignals,
        mean_loss,
        read_jsonl,
        train_loop,
        write_json,
    )
    from models.transformer import Transformer, TransformerConfig, count_params, loss_fn

    s = settings
    out = Path(s.out)
    # ---- everything that can be wrong with the input is checked before `out` is touched
    with warnings.catch_warnings(record=True) as config_warnings:
        warnings.simplefilter("always")
        cfg = dl.DiLoCoConfig(
            num_replicas=s.num_replicas, sync_period=s.sync_period, streaming=s.streaming,
            num_fragments=s.num_fragments, fragment_order=s.fragment_order,
            overlap_steps=s.overlap_steps, alpha=s.alpha, outer_lr=s.outer_lr,
            outer_momentum=s.outer_momentum, compression=s.compression,
            error_feedback=s.error_feedback,
            drops=tuple(tuple(int(x) for x in d.split(":")) for d in s.drops),
            drop_prob=s.drop_prob[0] if len(s.drop_prob) == 1 else s.drop_prob,
            fault_seed=s.fault_seed,
        )
    for w in config_warnings:
        print(f"warning: {w.message}", file=sys.stderr)
    model_cfg = TransformerConfig(num_layers=s.layers, width=s.width, num_heads=s.heads,
                                  seq_len=s.seq_len)
    check_out(s, out)
    if s.devices and len(jax.local_devices()) < s.devices:
        raise ValueError(f"--devices {s.devices}: only {len(jax.local_devices())} devices are "
                         "visible; jax was started before XLA_FLAGS could ask for more")
    if distributed:  # every process's devices, process by process: island k lives on process k·N/K
        per_process = s.devices or len(jax.local_devices())
        mesh = dl.make_mesh(devices=[
            dev for p in range(jax.process_count())
            for dev in sorted((d for d in jax.devices() if d.process_index == p), key=lambda d: d.id)[:per_process]
        ])
    else:
        mesh = dl.make_mesh(s.devices) if s.devices else None
    with warnings.catch_warnings(record=True) as corpus_warnings:
        warnings.simplefilter("always")
        corpus = load_corpus(s.corpus, data)
    for w in corpus_warnings:
        print(f"warning: {w.message}", file=sys.stderr)
    train_ids, eval_ids = corpus.split()
    share = s.global_batch // jax.process_count()  # this process's islands' rows
    rows = (jax.process_index() * share, (jax.process_index() + 1) * share)
    train_ds = data.train_batches(corpus, train_ids, seq_len=s.seq_len, global_batch=s.global_batch,
                                  num_islands=s.num_replicas, seed=s.seed, non_iid=s.non_iid,
                                  rows=rows if distributed else None)
    held_out = data.eval_batches(corpus, eval_ids, seq_len=s.seq_len, batch_size=s.global_batch,
                                 max_batches=s.eval_batches)
    key = jax.random.key(s.seed)
    model = Transformer(model_cfg, key)
    if s.mode == "diloco":
        Fragmentation.from_model(model, cfg)  # checks layers vs fragments before writing

    # ---- build
    schedule = dl.Schedule.from_config(cfg) if s.mode == "diloco" else None
    lr = optax.warmup_cosine_decay_schedule(0.0, s.lr, s.warmup, max(s.steps, s.warmup + 1),
                                            end_value=s.lr * 0.1)
    inner = optax.chain(
        optax.clip_by_global_norm(s.grad_clip) if s.grad_clip > 0 else optax.identity(),
        optax.adamw(lr, b1=0.9, b2=0.95, weight_decay=s.weight_decay),
    )
    params = eqx.filter(model, eqx.is_inexact_array)
    if s.mode == "diloco":
        state = dl.init_state(model, inner, cfg, mesh)
        step_fn = dl.make_train_step(cfg, loss_fn, inner, mesh)
        fragment_params = Fragmentation.from_model(model, cfg).param_counts(params)
    else:
        state = init_ddp_state(model, inner, mesh)
        step_fn = make_ddp_step(s.num_replicas, loss_fn, inner, mesh)
        fragment_params = [count_params(model)]
    tokens_per_step = s.global_batch * s.seq_len
    wire_bytes = compression.bits_per_value(s.compression if s.mode == "diloco" else "none") / 8

    def describe(t: int) -> dict[str, Any]:
        row = {"lr": float(lr(t - 1)), "tokens": t * tokens_per_step,
               "comm_bytes_per_island": comms.bytes_sent(t, fragment_params, schedule, wire_bytes)}
        if schedule is not None:
            row["outer_lr"] = cfg.outer_lr
            row["next_sync"] = schedule.next_sync(t)
        return row

    eval_loss = eqx.filter_jit(loss_fn)

    def evaluate(state) -> dict[str, float]:
        if s.mode == "ddp":
            return {"eval_loss": mean_loss(eval_loss, state.model, held_out)}
        losses = {"eval_loss": mean_loss(eval_loss, step_fn.outer_model(state), held_out)}
        if s.eval_island:
            losses["eval_loss_island_0"] = mean_loss(eval_loss, state.island(0), held_out)
        return losses

    if distributed:  # every process has passed the checks before any of them writes
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("diloco_eqx: settings checked")
    out.mkdir(parents=True, exist_ok=True)
    checkpointer = Checkpointer(out / "checkpoints")
    batches = iter(train_ds.to_iter_dataset())
    if distributed:
        batches = _GlobalBatches(batches, mesh, (s.global_batch, s.seq_len + 1))
    start, elapsed = 0, 0.0
    if s.resume and checkpointer.latest_step() is None:
        print(f"--resume: no checkpoint in {out / 'checkpoints'} yet; starting from step 0",
              file=sys.stderr)
    elif s.resume:
        start, state, extra = checkpointer.restore(state)
        batches.set_state(extra["data"])
        key = key_from_json(extra["rng"])
        elapsed = extra["elapsed"]
        print(f"resumed from {out / 'checkpoints'} at step {start}", file=sys.stderr)
    unigram = corpus.unigram_entropy(eval_ids)
    meta = {
        "settings": _comparable(s),
        "status": "running",
        "diloco_config": dataclasses.asdict(cfg) | {"fragment_order": str(cfg.fragment_order)},
        "schedule": None if schedule is None else {
            "steps_between_syncs": schedule.steps_between_syncs, "period": schedule.period},
        "model": dataclasses.asdict(model_cfg) | {"params": count_params(model)},
        "fragment_params": fragment_params,
        "corpus": corpus.metadata | {"train_documents": len(train_ids),
                                     "eval_documents": len(eval_ids),
                                     "eval_unigram_entropy": unigram,
                                     "entropy_rate": corpus.entropy_rate},
        "tokens_per_step": tokens_per_step,
        "versions": _versions(),
        "machine": {"platform": platform.platform(), "devices": [str(d) for d in jax.devices()]},
        "command": sys.argv,
    }
    if primary:
        write_json(out / "run.json", meta)
    print(f"{s.mode}{' streaming' if s.streaming and s.mode == 'diloco' else ''}: "
          f"{count_params(model):,} params, corpus {corpus.name} "
          f"({corpus.metadata['bytes']:,} bytes, {len(train_ids)} train / {len(eval_ids)} held-out files), "
          f"{tokens_per_step} tokens/step, out {out}"
          + (f", process {jax.process_index()} of {jax.process_count()}" if distributed else ""),
          file=sys.stderr)
    writer = JsonlWriter(out / "metrics.jsonl", keep_through=start) if primary else _Discard()
    signals = StopSignals(across_processes=distributed)
    try:
        with signals:
            state = train_loop(
                state, step_fn, batches,
                cfg=LoopConfig(steps=s.steps, eval_every=s.eval_every,
                               checkpoint_every=s.checkpoint_every, tokens_per_step=tokens_per_step,
                               progress=s.progress and primary),
                start_step=start, metrics=writer, evaluate=evaluate, describe=describe,
                checkpointer=checkpointer, extra=lambda: {"rng": key_to_json(key)}, elapsed=elapsed,
                stop=signals.requested,
            )
    except Interrupted as e:
        if primary:
            write_json(out / "run.json", meta | {"status": "interrupted", "interrupted_at": e.step})
            _plot(out)
        raise
    finally:
        writer.close()
        checkpointer.close()
    final = evaluate(state)
    if not primary:  # process 0 writes the summary, the plot and run.json
        return dict(final)
    records = read_jsonl(out / "metrics.jsonl")
    steps_rows = [r for r in records if not r.get("eval")]
    summary = {
        **final,
        "final_train_loss": steps_rows[-1]["loss"] if steps_rows else math.nan,
        "eval_unigram_entropy": unigram,
        "entropy_rate": corpus.entropy_rate,
        "steps": s.steps,
        "tokens": s.steps * tokens_per_step,
        "wall_time": steps_rows[-1]["wall_time"] if steps_rows else 0.0,
        "comm_bytes_per_island": describe(s.steps)["comm_bytes_per_island"],
    }
    _plot(out)
    write_json(out / "run.json", meta | {"status": "finished", "summary": summary})
    print(f"held-out loss {final['eval_loss']:.4f} nats/byte (unigram entropy of held-out bytes "
          f"{unigram:.4f}" + (f", source optimum {corpus.entropy_rate:.4f}" if corpus.entropy_rate else "")
          + f"); wrote {out}", file=sys.stderr)
    return summary


def check_out(s: Settings, out: Path) -> None:
    """Refuse to overwrite a run, to resume nothing, or to resume with settings that change
    the run's numbers."""
    has_run = (out / "run.json").exists()
    if has_run and not s.resume:
        raise ValueError(f"--out {out} already holds a run; pass --resume to continue it or "
                         "choose another --out")
    if s.resume and not has_run:
        raise ValueError(f"--resume: nothing to resume in {out} (no run.json there); leave out "
                         "--resume to start a new run")
    if s.resume:
        previous = _read_json(out / "run.json")["settings"]
        changed = {k: (previous.get(k), v) for k, v in _comparable(s).items()
                   if previous.get(k) != v and k not in RESUMABLE_CHANGES}
        if changed:
            hint = " (--steps sets the length of the learning-rate schedule)" if "steps" in changed else ""
            raise ValueError(
                f"--resume with settings that change the numbers of the run in {out}: "
                + ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in changed.items()) + hint
                + "; resume with the run's own settings, or start a new run with another --out")


def _plot(out: Path) -> None:
    try:
        from tools.plot_runs import plot_runs

        plot_runs([out], out / "loss.png")
    except ImportError as e:  # plotting is a convenience; the run itself is complete
        print(f"warning: no loss plot ({e})", file=sys.stderr)


def resume_command(argv: list[str]) -> str:
    """The command line that continues this run."""
    args = [a for a in argv if a != "--resume"]
    return " ".join(["python -m experiments.train", *args, "--resume"])


class _Discard:
    """Stands in for the metrics writer on processes other than 0: process 0 writes every row."""

    def write(self, row) -> None:
        """Drop the row (process 0 has the same one)."""

    def close(self) -> None:
        """Nothing to flush."""


class _GlobalBatches:
    """This process's rows of each global batch, as one global array over the diloco axis."""

    def __init__(self, it, mesh, shape):
        import jax

        import diloco_eqx as dl

        self._it, self._shape = it, shape
        self._sharding = jax.sharding.NamedSharding(mesh, dl.islands.ISLANDS)

    def __iter__(self):
        return self

    def __next__(self):
        import jax

        return jax.make_array_from_process_local_data(self._sharding, next(self._it), self._shape)

    def get_state(self):
        return self._it.get_state()

    def set_state(self, state) -> None:
        self._it.set_state(state)


def load_corpus(spec: tuple[str, ...], data):
    if spec == ("stdlib",):
        return data.Corpus.stdlib()
    if spec[0] == "markov":
        kw = dict(a.split("=", 1) for a in spec[1:])
        try:
            return data.Corpus.markov(**{k: int(v) for k, v in kw.items()})
        except TypeError as e:
            raise ValueError(f"--corpus markov takes key=value options num_bytes, branching, "
                             f"seed, doc_bytes; got {' '.join(spec[1:])}") from e
    return data.Corpus.from_files(list(spec))


def _comparable(s: Settings) -> dict[str, Any]:
    d = dataclasses.asdict(s)
    return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}


def _read_json(path: Path) -> dict:
    import json

    return json.loads(path.read_text())


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for pkg in ("jax", "jaxlib", "equinox", "optax", "grain", "orbax-checkpoint", "numpy"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def main(argv: list[str] | None = None) -> int:
    settings = parse_settings(argv)
    out = Path(settings.out)
    existed = out.exists()
    if settings.devices:  # before anything imports jax
        _use_host_devices(settings.devices)
    from diloco_eqx.loop import Interrupted

    try:
        run(settings)
    except Interrupted as e:
        print(f"{e}; checkpoint saved in {out / 'checkpoints'}; continue with: "
              f"{resume_command(sys.argv[1:] if argv is None else argv)}", file=sys.stderr)
        return 128 + e.signum
    except (ValueError, FileNotFoundError) as e:
        if not existed and out.exists() and not (out / "run.json").exists() and settings.process_id == 0:
            shutil.rmtree(out, ignore_errors=True)
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:
        if settings.coordinator is None:
            raise
        # A peer died or the link broke: say so and leave now, without waiting for the
        # distributed runtime's shutdown barrier (which the dead peer would never reach).
        print(f"error: process {settings.process_id} of {settings.num_processes} stopped: "
              f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}\n"
              f"  a peer process probably failed; restart every process with --resume to continue "
              f"from the last checkpoint in {out / 'checkpoints'}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
