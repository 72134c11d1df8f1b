"""RunConfig: everything that defines a training run, as nested dataclasses.

Each knob is declared once, here or in the algorithm's `DiLoCoConfig` and the model's config
(the built-in transformer's `TransformerConfig`, or the dataclass a `--model` factory
declares), with its docstring beside it; `training.cli` derives the command line from these
fields (field metadata: `flag` to name a flag differently, `cli=False` to keep a field off
it, `parse` to read its string values). `RunConfig.flat()` is the run's settings as one flat
dict keyed like the flags, which `run.json` records and `--resume` compares.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from diloco_eqx.config import DELAYED_OUTER, ISLAND_WEIGHTING, DiLoCoConfig
from diloco_eqx.islands import registered_backends
from diloco_eqx.models.io import model_config_class
from diloco_eqx.models.transformer import TransformerConfig
from diloco_eqx.training.trackers import registered_trackers

MODES = ("diloco", "ddp")
DEFAULT_MODEL = "diloco_eqx.models.transformer:build"
RESUMABLE = ("resume", "tracker", "progress", "keep_host_memory", "out", "coordinator", "num_processes",
             "process_id", "heartbeat_timeout", "devices", "data_parallel", "fsdp", "backend", "checkpoint_every")
"""Settings a --resume may change: none of them changes a number the run computes (the
islands' layout over devices and processes, how the step is compiled, where checkpoints
fall, what is printed)."""
FILLED = ("vocab_size", "seq_len")
"""Model config fields the run fills in, when the model's dataclass declares them: the
tokenizer's vocabulary and the data's --seq-len. They are never model flags."""


def _parse_drop(item: str) -> tuple[int, int]:
    if not re.fullmatch(r"\d+:\d+", item):
        raise ValueError(f"--drops takes STEP:ISLAND pairs of integers (e.g. 30:1); got {item!r}")
    step, island = item.split(":")
    return int(step), int(island)


# the algorithm's knobs whose CLI spelling needs a word: how to read them from strings
DILOCO_FLAGS: dict[str, dict[str, Any]] = {
    "drops": {"parse": _parse_drop, "metavar": "STEP:ISLAND", "show": lambda v: [f"{s}:{i}" for s, i in v]},
    "drop_prob": {"parse": float, "join": lambda v: v[0] if len(v) == 1 else tuple(v),
                  "show": lambda v: list(v) if isinstance(v, tuple) else [v]},
    "fragment_order": {"parse": str},
    "delayed_outer": {"choices": DELAYED_OUTER},
    "island_weighting": {"choices": ISLAND_WEIGHTING},
    "island_speed": {"parse": float, "join": lambda v: v[0] if len(v) == 1 else tuple(v),
                     "show": lambda v: list(v) if isinstance(v, tuple) else [v]},
}


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """The inner optimizer: AdamW (β2 = 0.95) with linear warmup and cosine decay to 10%."""

    lr: float = 3e-3
    """Peak inner learning rate."""
    warmup: int = 50
    """Linear warmup steps."""
    weight_decay: float = 0.1
    """Decoupled weight decay of AdamW."""
    grad_clip: float = 1.0
    """Global-norm gradient clip (0: off)."""


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """What the islands train on."""

    corpus: tuple[str, ...] = ("stdlib",)
    """stdlib (the running Python's standard library sources) | markov [num_bytes=N
    branching=B seed=S doc_bytes=D] | files, directories or globs."""
    seq_len: int = 128
    """Tokens per sequence."""
    global_batch: int = 16
    """GBS: sequences per step over all islands (divisible by K)."""
    non_iid: bool = False
    """Each island trains only on its own contiguous block of files."""
    eval_batches: int = 8
    """Held-out batches of GBS windows per evaluation."""
    tokenizer: str = "bytes"
    """bytes (UTF-8 bytes are the tokens, vocabulary 256) | bpe:N (a byte-level BPE of
    vocabulary N trained on the training split at start and saved in the run directory)."""


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """One training run: the algorithm, the model, the inner optimizer, the data, and how
    the run is driven."""

    mode: str = dataclasses.field(default="diloco", metadata={"choices": MODES})
    """diloco: DiLoCo / Streaming DiLoCo; ddp: gradients averaged every step (the baseline)."""
    diloco: DiLoCoConfig = dataclasses.field(
        default_factory=lambda: DiLoCoConfig(sync_period=30, streaming=True, num_fragments=3),
        metadata={"fields": DILOCO_FLAGS})
    model_factory: str = dataclasses.field(default=DEFAULT_MODEL, metadata={
        "flag": "model", "group": "model", "metavar": "PACKAGE.MODULE:FACTORY"})
    """The model: a function factory(config, key) -> (model, loss_fn), given the model's
    settings (the factory's own config dataclass, or a TransformerConfig, with the
    tokenizer's vocabulary and --seq-len); the default is the built-in transformer."""
    model: Any = dataclasses.field(default_factory=lambda: TransformerConfig(width=128))
    """The model's settings: an instance of the config dataclass the model factory takes."""
    optim: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    steps: int = 600
    """Train until the global step reaches this."""
    seed: int = 0
    """Seed of the model's initialisation and the data order."""
    out: str = "runs/default"
    """Run directory."""
    resume: bool = False
    """Continue the run in --out from its latest checkpoint."""
    checkpoint_every: int = 100
    """Steps between checkpoints (one is also written at the end)."""
    eval_every: int = 100
    """Steps between held-out evaluations (0: only at the end)."""
    eval_island: bool = False
    """Also evaluate island 0."""
    devices: int | None = None
    """Device slices of the diloco axis (per process in multi-process runs); on CPU the run
    asks for devices × data-parallel × fsdp simulated host devices (default: none, islands
    vmapped on one device; with --data-parallel or --fsdp above 1: one slice per island)."""
    data_parallel: int = 1
    """Devices per island along "data": each island's batch rows are split over them."""
    fsdp: int = 1
    """Devices per island along "fsdp": each island's parameters and optimizer states are
    split over them (each leaf's largest axis divisible by this size)."""
    backend: str = dataclasses.field(default="shard_map", metadata={"choices": registered_backends()})
    """How the step reaches across islands: shard_map (manual over the diloco axis, every
    cross-island collective written out) or drjax (drjax's map and reduce under plain jit,
    collectives chosen by GSPMD); the numbers are the same. (--mode ddp always uses shard_map.)"""
    progress: bool = True
    """Show a progress bar."""
    keep_host_memory: bool = True
    """On the CPU, keep host memory that XLA frees for its next call (glibc only, set when
    the run starts JAX; see diloco_eqx/training/host_memory.py): otherwise each step faults
    its temporaries in afresh, which slows CPU steps (docs/performance.md). Off: the process
    returns large freed blocks to the system, as glibc does by default."""
    tracker: tuple[str, ...] = dataclasses.field(default=("jsonl",), metadata={"choices": registered_trackers()})
    """Where metrics go, one or more of: jsonl (metrics.jsonl, always written), tensorboard
    (event files in OUT/tensorboard), wandb (Weights & Biases; WANDB_MODE=offline works
    with no network)."""
    coordinator: str | None = dataclasses.field(default=None, metadata={"metavar": "HOST:PORT"})
    """Multi-process: address of process 0's coordination service; turns multi-process on
    (default: $JAX_COORDINATOR_ADDRESS)."""
    num_processes: int = 1
    """Multi-process: processes in the run (default: $JAX_NUM_PROCESSES or 1)."""
    process_id: int = 0
    """Multi-process: this process's index, 0..N-1 (default: $JAX_PROCESS_ID or 0)."""
    heartbeat_timeout: int = 30
    """Multi-process: seconds without a peer's heartbeat before the run stops with an error."""

    def flat(self) -> dict[str, Any]:
        """The settings as one flat dict keyed like the flags (lists for tuples)."""
        return _flatten(self)

    @property
    def distributed(self) -> bool:
        return self.coordinator is not None

    @property
    def island_devices(self) -> int:
        """Devices per island (data-parallel × fsdp)."""
        return self.data_parallel * self.fsdp

    @property
    def diloco_slices(self) -> int | None:
        """Device slices of the diloco axis this process asks for (None: no mesh)."""
        if self.devices is None and self.island_devices > 1:
            return self.diloco.num_replicas // self.num_processes
        return self.devices

    @property
    def tokens_per_step(self) -> int:
        return self.data.global_batch * self.data.seq_len

    @property
    def model_config(self) -> Any:
        """The model's config with the data's sequence length (where it declares `seq_len`)."""
        return fill(self.model, seq_len=self.data.seq_len)


def fill(model_config: Any, **values: Any) -> Any:
    """`model_config` with those of `values` (FILLED names) that its dataclass declares."""
    names = {f.name for f in dataclasses.fields(model_config)}
    return dataclasses.replace(model_config, **{k: v for k, v in values.items() if k in names})


def model_fields(cls) -> list[dataclasses.Field]:
    """The fields of a model config dataclass that are flags: its CLI fields but FILLED."""
    return [f for f in cli_fields(cls) if f.name not in FILLED]


def defaults_for_model(spec: str, default: RunConfig | None = None) -> RunConfig:
    """`default` (RunConfig's defaults) with the model `spec` names and its config's defaults
    (the RunConfig's own model settings where the factory takes the same dataclass)."""
    default = RunConfig() if default is None else default
    cls = model_config_class(spec)
    model = next((m for m in (default.model, RunConfig().model) if type(m) is cls), None) or cls()
    return dataclasses.replace(default, model_factory=spec, model=model)


def flag_name(field: dataclasses.Field) -> str:
    """The flag's dest name: the field's name, or its `flag` metadata."""
    return field.metadata.get("flag", field.name)


def cli_fields(cls) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if f.init and f.metadata.get("cli", True)]


def _flatten(obj, fields=cli_fields) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in fields(type(obj)):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            out.update(_flatten(value, model_fields if isinstance(obj, RunConfig) and f.name == "model"
                                else cli_fields))
            continue
        show = f.metadata.get("show") or DILOCO_FLAGS.get(f.name, {}).get("show")
        if show and isinstance(obj, DiLoCoConfig):
            value = show(value)
        elif f.name == "fragment_order" and not isinstance(value, str):
            value = getattr(value, "__name__", repr(value))
        out[flag_name(f)] = list(value) if isinstance(value, tuple) else value
    return out
