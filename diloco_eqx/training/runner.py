"""One training run from a RunConfig: checks, data, model, steps, resume, the loop, outputs.

Writes to `out`: run.json (settings, config, versions, corpus; "status" running ->
finished or interrupted), metrics.jsonl (a line per step and per evaluation),
checkpoints/ and loss.png. Everything that can be wrong with the input is checked before
anything is written; only process 0 writes files in multi-process runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import platform
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import optax

import diloco_eqx as dl
from diloco_eqx.analysis import comms
from diloco_eqx.training import data, host_memory, multiprocess, sources, token_files
from diloco_eqx.training import tokenizer as tok_lib
from diloco_eqx.training.checkpoint import Checkpointer, key_from_json, key_to_json, last_complete_step
from diloco_eqx.training.config import RESUMABLE, RunConfig, fill
from diloco_eqx.training.loop import (
    Interrupted,
    LoopConfig,
    StopSignals,
    mean_loss,
    read_jsonl,
    train_loop,
    write_json,
)
from diloco_eqx.training.plots import plot_runs
from diloco_eqx.training.trackers import check_trackers, open_trackers
from diloco_eqx.models.io import build_model
from diloco_eqx.models.transformer import count_params


@dataclasses.dataclass
class Job:
    """What a run trains: built and checked before anything is written."""

    cfg: RunConfig
    mesh: Any
    corpus: data.Corpus
    train_ids: Any
    eval_ids: Any
    held_out: list
    train_ds: Any
    model: eqx.Module
    loss_fn: Callable
    state: Any
    algo: dl.DiLoCo | dl.DDP
    """The algorithm (its `step`, `step_placed`, `outer_model`)."""
    fragment_params: list[int]
    lr: optax.Schedule

    @property
    def schedule(self) -> dl.Schedule | None:
        return self.cfg.diloco.schedule if self.cfg.mode == "diloco" else None


def printed_warnings(fn, *args):
    """fn(*args), its warnings printed as one "warning: ..." line each."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fn(*args)
    for w in caught:
        print(f"warning: {w.message}", file=sys.stderr)
    return result


def inner_optimizer(cfg: RunConfig) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """AdamW (β2 = 0.95) after an optional global-norm clip; lr warms up, then cosine to 10%."""
    o = cfg.optim
    lr = optax.warmup_cosine_decay_schedule(0.0, o.lr, o.warmup, max(cfg.steps, o.warmup + 1),
                                            end_value=o.lr * 0.1)
    clip = optax.clip_by_global_norm(o.grad_clip) if o.grad_clip > 0 else optax.identity()
    return optax.chain(clip, optax.adamw(lr, b1=0.9, b2=0.95, weight_decay=o.weight_decay)), lr


def load_corpus(spec: tuple[str, ...], tokenizer: str = "bytes", saved: Path | None = None,
                distributed: bool = False) -> data.Corpus:
    """The corpus tokenized (cached, memory-mapped) with the run's tokenizer: the one `saved`
    in the run directory (--resume), else --tokenizer's; a BPE is trained on the training
    split only, in multi-process runs by process 0 for every process."""
    saved_tok = tok_lib.load(saved) if saved is not None else None
    path = sources.token_file(spec)
    if path is not None:
        tf = token_files.read_token_file(path)
        return data.Corpus.from_token_file(tf, token_files.token_file_tokenizer(tf, tokenizer, saved_tok))
    docs = sources.documents(spec)
    if saved_tok is None:
        train_ids = sources.split_names(docs.names)[0]
        make = lambda: tok_lib.from_spec(tokenizer, lambda: docs.texts(train_ids))  # noqa: E731
        shared = distributed and tok_lib.parse_spec(tokenizer)[0] == "bpe"
        saved_tok = tok_lib.from_process_0(make) if shared else make()
    return data.Corpus.from_source(docs, saved_tok)


def saved_tokenizer(cfg: RunConfig) -> Path | None:
    """OUT/tokenizer.json of the run --resume continues (None for a new run, or one whose
    tokenizer is bytes or the ids of its token file)."""
    path = Path(cfg.out) / "tokenizer.json"
    if not cfg.resume:
        return None
    if path.is_file():
        return path
    if tok_lib.parse_spec(cfg.data.tokenizer)[0] == "bpe":
        raise ValueError(f"--resume: the run in {cfg.out} uses --tokenizer {cfg.data.tokenizer} but "
                         f"{path} is missing; start a new run with another --out")
    return None


def build_mesh(cfg: RunConfig):
    """None (islands vmapped on one device), the diloco axis, or the island mesh."""
    slices, per = cfg.diloco_slices, cfg.island_devices
    if slices and len(jax.local_devices()) < slices * per:
        raise ValueError(f"--devices {slices} × --data-parallel {cfg.data_parallel} × --fsdp "
                         f"{cfg.fsdp} needs {slices * per} devices; only {len(jax.local_devices())} "
                         "are visible (jax was started before XLA_FLAGS could ask for more)")
    if cfg.distributed:  # island k lives on process k·N/K
        return multiprocess.process_mesh(slices, cfg.data_parallel, cfg.fsdp)
    if not slices:
        return None
    if per == 1:
        return dl.make_mesh(slices)
    return dl.make_mesh(diloco=slices, data=cfg.data_parallel, fsdp=cfg.fsdp)


def build(cfg: RunConfig) -> Job:
    """Data, model, state and step of a run (nothing written yet)."""
    mesh = build_mesh(cfg)
    d = cfg.data
    corpus = printed_warnings(load_corpus, d.corpus, d.tokenizer, saved_tokenizer(cfg), cfg.distributed)
    train_ids, eval_ids = corpus.split()
    rows = multiprocess.process_rows(d.global_batch) if cfg.distributed else None
    train_ds = data.train_batches(corpus, train_ids, seq_len=d.seq_len, global_batch=d.global_batch,
                                  num_islands=cfg.diloco.num_replicas, seed=cfg.seed,
                                  non_iid=d.non_iid, rows=rows)
    held_out = data.eval_batches(corpus, eval_ids, seq_len=d.seq_len, batch_size=d.global_batch,
                                 max_batches=d.eval_batches)
    model_config = fill(cfg.model_config, vocab_size=corpus.vocab_size)
    model, loss_fn = build_model(cfg.model_factory, model_config, jax.random.key(cfg.seed))
    inner, lr = inner_optimizer(cfg)
    if cfg.mode == "diloco":
        algo = dl.DiLoCo(cfg.diloco, loss_fn, inner, mesh=mesh, backend=cfg.backend)
        frags = dl.Fragmentation.from_model(model, cfg.diloco)
        fragment_params = frags.param_counts(eqx.filter(model, eqx.is_inexact_array))
    else:
        algo = dl.DDP(cfg.diloco.num_replicas, loss_fn, inner, mesh=mesh)
        fragment_params = [count_params(model)]
    state = algo.init(model)  # DiLoCo checks the layer stack against the fragment knobs here
    return Job(cfg, mesh, corpus, train_ids, eval_ids, held_out, train_ds, model, loss_fn, state,
               algo, fragment_params, lr)


def check_out(cfg: RunConfig, out: Path) -> None:
    """Refuse to overwrite a run, to resume nothing, or to resume with settings that change
    the run's numbers."""
    has_run = (out / "run.json").exists()
    if has_run and not cfg.resume:
        raise ValueError(f"--out {out} already holds a run; pass --resume to continue it or "
                         "choose another --out")
    if cfg.resume and not has_run:
        raise ValueError(f"--resume: nothing to resume in {out} (no run.json there); leave out "
                         "--resume to start a new run")
    if cfg.resume:
        import json

        previous = json.loads((out / "run.json").read_text())["settings"]
        defaults = RunConfig().flat()  # a setting newer than the run: its default is what it ran with
        changed = {k: (previous.get(k, defaults.get(k)), v) for k, v in cfg.flat().items()
                   if previous.get(k, defaults.get(k)) != v and k not in RESUMABLE}
        if changed:
            hint = " (--steps sets the length of the learning-rate schedule)" if "steps" in changed else ""
            raise ValueError(
                f"--resume with settings that change the numbers of the run in {out}: "
                + ", ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in changed.items()) + hint
                + "; resume with the run's own settings, or start a new run with another --out")


def describe_step(job: Job) -> Callable[[int], dict[str, Any]]:
    """Per-step fields beside the step's metrics: lr, tokens, bytes sent, next sync."""
    cfg, schedule = job.cfg, job.schedule
    wire = dl.codecs.bits_per_value(cfg.diloco.compression if cfg.mode == "diloco" else "none") / 8
    sparse, codec = None, cfg.diloco.codec
    if cfg.mode == "diloco" and codec.index_bytes(cfg.diloco.topk_chunk):  # values, indices, scales
        sizes = comms.fragment_tensor_sizes(job.model, cfg.diloco)
        sparse = ([comms.codec_sync_bytes(s, codec) for s in sizes], [comms.codec_index_bytes(s, codec) for s in sizes])

    def describe(t: int) -> dict[str, Any]:
        row = {"lr": float(job.lr(t - 1)), "tokens": t * cfg.tokens_per_step,
               "comm_bytes_per_island": comms.bytes_sent(t, job.fragment_params, schedule, wire)}
        if sparse is not None:
            row["comm_bytes_per_island"] = comms.bytes_sent(t, job.fragment_params, schedule, fragment_bytes=sparse[0])
            row["comm_index_bytes_per_island"] = comms.bytes_sent(t, job.fragment_params, schedule,
                                                                  fragment_bytes=sparse[1])
        if schedule is not None:
            row["outer_lr"] = cfg.diloco.outer_lr
            row["next_sync"] = schedule.next_sync(t)
        return row

    return describe


def evaluator(job: Job) -> Callable[[Any], dict[str, float]]:
    """Held-out loss of the outer model (DDP: its one model), per token and in bits per byte,
    and optionally island 0's."""
    eval_loss = eqx.filter_jit(job.loss_fn)
    per_token = tok_lib.bytes_per_token(job.corpus.tokenizer, job.held_out)

    def evaluate(state) -> dict[str, float]:
        model = job.algo.outer_model(state)
        losses = {"eval_loss": mean_loss(eval_loss, model, job.held_out)}
        if per_token is not None:  # the ids of a token file of unknown tokenizer have no bytes
            losses["eval_bits_per_byte"] = tok_lib.bits_per_byte(losses["eval_loss"], per_token)
        if job.cfg.mode == "diloco" and job.cfg.eval_island:
            losses["eval_loss_island_0"] = mean_loss(eval_loss, state.island(0), job.held_out)
        return losses

    return evaluate


def metadata(job: Job, argv: list[str]) -> dict[str, Any]:
    """run.json's description of the run."""
    cfg, schedule, corpus = job.cfg, job.schedule, job.corpus
    diloco = dataclasses.asdict(cfg.diloco) | {"fragment_order": str(cfg.diloco.fragment_order)}
    return {
        "settings": cfg.flat(),
        "status": "running",
        "diloco_config": diloco,
        "schedule": None if schedule is None else {
            "steps_between_syncs": schedule.steps_between_syncs, "period": schedule.period},
        "model": dataclasses.asdict(cfg.model_config) | {"vocab_size": corpus.vocab_size,
                                                         "factory": cfg.model_factory,
                                                         "params": count_params(job.model)},
        "fragment_params": job.fragment_params,
        "tokenizer": corpus.tokenizer.describe(),
        "corpus": corpus.metadata | {"train_documents": len(job.train_ids),
                                     "eval_documents": len(job.eval_ids),
                                     "eval_unigram_entropy": corpus.unigram_entropy(job.eval_ids),
                                     "entropy_rate": corpus.entropy_rate},
        "tokens_per_step": cfg.tokens_per_step,
        "versions": _versions(),
        "machine": {"platform": platform.platform(), "devices": [str(d) for d in jax.devices()]},
        "command": argv,
    }


def run(cfg: RunConfig, argv: list[str] | None = None) -> dict[str, Any]:
    """Run (or resume) one training job; returns the summary written to run.json."""
    if cfg.keep_host_memory and host_memory.before_cpu_backend():  # as from the command line
        host_memory.keep_freed_memory()
    if cfg.diloco_slices:
        multiprocess.use_host_devices(cfg.diloco_slices * cfg.island_devices)
    out = Path(cfg.out)
    watch = contextlib.nullcontext()
    if cfg.distributed:
        multiprocess.initialize(cfg.coordinator, cfg.num_processes, cfg.process_id, cfg.heartbeat_timeout)
        watch = multiprocess.PeerWatch(cfg.heartbeat_timeout, lambda who, s: _peer_lost(cfg, out, who, s))
    with watch:
        return _checked_run(cfg, out, argv)


def _checked_run(cfg: RunConfig, out: Path, argv: list[str] | None) -> dict[str, Any]:
    check_out(cfg, out)
    check_trackers(cfg.tracker)
    job = build(cfg)
    if cfg.distributed:  # every process has passed the checks before any of them writes
        multiprocess.sync_processes("diloco_eqx: settings checked")
    out.mkdir(parents=True, exist_ok=True)
    if jax.process_index() == 0 and not cfg.resume and job.corpus.tokenizer.kind == "bpe":
        job.corpus.tokenizer.save(out / "tokenizer.json")  # first: all the run writes uses its ids
    checkpointer = Checkpointer(out / "checkpoints")
    try:
        return _train(job, out, checkpointer, metadata(job, sys.argv if argv is None else argv))
    finally:
        checkpointer.close()


def _train(job: Job, out: Path, checkpointer: Checkpointer, meta: dict[str, Any]) -> dict[str, Any]:
    cfg, primary = job.cfg, jax.process_index() == 0
    batches = iter(job.train_ds.to_iter_dataset())
    step_fn = job.algo.step
    if cfg.distributed:  # batches arrive island-major and placed
        batches = multiprocess.GlobalBatches(batches, job.mesh, cfg.diloco.num_replicas,
                                             (cfg.data.global_batch, cfg.data.seq_len + 1))
        step_fn = job.algo.step_placed
    state, start, elapsed, key = _restore(job, out, checkpointer, batches)
    if primary:
        write_json(out / "run.json", meta)
    _announce(job, out)
    keep_through = start if cfg.resume else None  # a new run: a new W&B run, no leftover rows
    writer = open_trackers(cfg.tracker, out, meta["settings"], keep_through) if primary else _Discard()
    signals = StopSignals(across_processes=cfg.distributed)
    loop_cfg = LoopConfig(steps=cfg.steps, eval_every=cfg.eval_every, checkpoint_every=cfg.checkpoint_every,
                          tokens_per_step=cfg.tokens_per_step, progress=cfg.progress and primary)
    evaluate = evaluator(job)
    try:
        with signals:
            state = train_loop(state, step_fn, batches, cfg=loop_cfg, start_step=start, metrics=writer,
                               evaluate=evaluate, describe=describe_step(job), checkpointer=checkpointer,
                               extra=lambda: {"rng": key_to_json(key)}, elapsed=elapsed, stop=signals.requested)
    except Interrupted as e:
        if primary:
            write_json(out / "run.json", meta | {"status": "interrupted", "interrupted_at": e.step})
            _plot(out)
        raise
    finally:
        writer.close()
    return _finish(job, out, meta, evaluate(state), primary)


def _restore(job: Job, out: Path, checkpointer: Checkpointer, batches):
    """(state, start step, elapsed seconds, RNG key): fresh, or from the latest checkpoint."""
    state, start, elapsed, key = job.state, 0, 0.0, jax.random.key(job.cfg.seed)
    if not job.cfg.resume:
        return state, start, elapsed, key
    restored = checkpointer.restore_intact(state, say=lambda line: print(f"--resume: {line}", file=sys.stderr))
    if restored is None:
        print(f"--resume: no checkpoint in {out / 'checkpoints'} yet; starting from step 0", file=sys.stderr)
    else:
        start, state, extra = restored
        batches.set_state(extra["data"])
        key, elapsed = key_from_json(extra["rng"]), extra["elapsed"]
        print(f"resumed from {out / 'checkpoints'} at step {start}", file=sys.stderr)
    return state, start, elapsed, key


def _announce(job: Job, out: Path) -> None:
    cfg, corpus = job.cfg, job.corpus
    kind = cfg.mode + (" streaming" if cfg.diloco.streaming and cfg.mode == "diloco" else "")
    size = f"{corpus.metadata['tokens']:,} tokens" + (
        f" of {corpus.metadata['bytes']:,} bytes" if "bytes" in corpus.metadata else "")
    print(f"{kind}: {count_params(job.model):,} params, corpus {corpus.name} ({size}, tokenizer "
          f"{corpus.tokenizer.spec}, {len(job.train_ids)} train / {len(job.eval_ids)} held-out "
          f"documents), {cfg.tokens_per_step} tokens/step, out {out}"
          + (f", process {jax.process_index()} of {jax.process_count()}" if cfg.distributed else ""),
          file=sys.stderr)


def _finish(job: Job, out: Path, meta: dict, final: dict[str, float], primary: bool) -> dict[str, Any]:
    """The summary in run.json ("finished"), the plot, and the closing line."""
    if not primary:  # process 0 writes the summary, the plot and run.json
        return dict(final)
    cfg, corpus = job.cfg, job.corpus
    steps_rows = [r for r in read_jsonl(out / "metrics.jsonl") if not r.get("eval")]
    unigram = meta["corpus"]["eval_unigram_entropy"]
    summary = {
        **final,
        "final_train_loss": steps_rows[-1]["loss"] if steps_rows else math.nan,
        "eval_unigram_entropy": unigram,
        "entropy_rate": corpus.entropy_rate,
        "steps": cfg.steps,
        "tokens": cfg.steps * cfg.tokens_per_step,
        "wall_time": steps_rows[-1]["wall_time"] if steps_rows else 0.0,
        **{k: v for k, v in describe_step(job)(cfg.steps).items() if k.startswith("comm_")},
    }
    _plot(out)
    write_json(out / "run.json", meta | {"status": "finished", "summary": summary})
    bits = f", {final['eval_bits_per_byte']:.4f} bits/byte" if "eval_bits_per_byte" in final else ""
    print(f"held-out loss {final['eval_loss']:.4f} nats/token{bits} (unigram entropy of held-out "
          f"tokens {unigram:.4f}" + (f", source optimum {corpus.entropy_rate:.4f}" if corpus.entropy_rate else "")
          + f"); wrote {out}", file=sys.stderr)
    return summary


def _plot(out: Path) -> None:
    plot_runs([out], out / "loss.png")


def _peer_lost(cfg: RunConfig, out: Path, who: str, silent: float) -> None:
    """A peer has been silent for --heartbeat-timeout seconds: say so and leave at once (this
    process would otherwise wait in a collective the peer never joins)."""
    last = last_complete_step(out / "checkpoints")
    last = "none yet" if last is None else f"step {last}"
    print(f"error: process {cfg.process_id} of {cfg.num_processes} stopped: {who} sent no heartbeat "
          f"for {silent:.0f} s (--heartbeat-timeout {cfg.heartbeat_timeout}): it is hung, stopped or dead\n"
          f"  restart every process with --resume to continue from the last checkpoint in "
          f"{out / 'checkpoints'} ({last})", file=sys.stderr, flush=True)
    os._exit(1)


class _Discard:
    """Stands in for the metrics writer on processes other than 0: process 0 writes every row."""

    def write(self, row) -> None:
        """Drop the row (process 0 has the same one)."""

    def close(self) -> None:
        """Nothing to flush."""


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for pkg in ("jax", "jaxlib", "equinox", "optax", "grain", "orbax-checkpoint", "numpy"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "not installed"
    return out
