"""Where a run's metrics go: metrics.jsonl always, TensorBoard and Weights & Biases on request.

The training loop hands every row (a step's metrics, an evaluation) to one `Tracker` (the
interface is defined beside the loop, in loop.py); `open_trackers` fans each row out to the
backends `--tracker` names. A backend is one final class registered by name with
`register_tracker`.

Every backend other than jsonl gets the row's numbers as scalars at the row's "step":
a step row's field `loss` is tag `train/loss`, an evaluation row's `eval_loss` is
`eval/eval_loss` (so the two rows' `wall_time` stay apart), a list field `x` is
`train/x/0`, `train/x/1`, ...; strings, booleans (the `eval` marker) and missing values
are skipped, and "step" is the x-axis itself. On disk, in the run directory OUT:

- `metrics.jsonl`: every row as JSON (the run's own record: the summary and the plot read it);
- `tensorboard/`: tensorboardX event files, one per session; the run's settings as
  hyper-parameters (written by the session that starts the directory);
- `wandb/`: one `offline-run-*` directory per session (unless WANDB_MODE says otherwise),
  all of one W&B run whose id is kept in `wandb/run_id`; the settings are its config.

Resume: metrics.jsonl drops lines past the restored step (a new run: every leftover line);
TensorBoard gets a purge step there, so a reader discards the interrupted session's later
points; W&B's history only grows, so the resumed W&B run is not sent the rows a previous
session already sent it (up to the last step metrics.jsonl held before resuming): those
points stay the earlier session's, the same numbers but for their timings. A new run in a
used directory starts a new W&B run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import importlib
import json
import numbers
import os
import secrets
import time
from pathlib import Path
from typing import Any, ClassVar, final

from diloco_eqx._registry import Registry
from diloco_eqx.training.loop import JsonlWriter, Tracker, _complete_records


@dataclasses.dataclass(frozen=True)
class Session:
    """What a backend opens with: the run directory, the run's settings, and where a
    resumed run restarts."""

    out: Path
    settings: dict[str, Any]
    keep_through: int | None = None
    """A resumed run: the restored step, past which earlier rows are dropped; None: a new run."""
    logged_through: int | None = None
    """The last step metrics.jsonl held before this session (None: a new run)."""


def scalars(record: dict[str, Any]) -> tuple[int, dict[str, float]]:
    """A row's step and its numbers, tagged `train/KEY` or `eval/KEY` (lists: `KEY/i`)."""
    section = "eval" if record.get("eval") else "train"
    out: dict[str, float] = {}
    for key, value in record.items():
        if key not in ("step", "eval"):
            _add(out, f"{section}/{key}", value)
    return int(record["step"]), out


def _add(out: dict[str, float], tag: str, value: Any) -> None:
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _add(out, f"{tag}/{i}", item)
    elif isinstance(value, numbers.Real) and not isinstance(value, bool):
        out[tag] = float(value)


@final
class JsonlTracker(JsonlWriter):
    """metrics.jsonl, every row as one JSON line; always open (`--tracker` or not)."""

    requires: ClassVar[tuple[str, str] | None] = None

    def __init__(self, session: Session):
        super().__init__(session.out / "metrics.jsonl", keep_through=session.keep_through or 0)


@final
class TensorBoardTracker:
    """tensorboardX event files in OUT/tensorboard, flushed every second; a session that
    finds earlier files starts its own with a purge step one past the restored step (a new
    run: step 1, so that leftover points are dropped)."""

    requires: ClassVar[tuple[str, str] | None] = ("tensorboardX", "pip install -e .")
    HEADLINE = ("eval/eval_loss", "train/loss")
    """The metrics the hyper-parameter table shows beside each run's settings."""

    def __init__(self, session: Session):
        from tensorboardX import SummaryWriter

        logdir = session.out / "tensorboard"
        earlier = sorted(logdir.glob("events.out.tfevents.*"))
        purge = (session.keep_through or 0) + 1 if earlier else None
        # sessions started within one second would share a file name: number them
        self._writer = SummaryWriter(str(logdir), purge_step=purge,
                                     flush_secs=1, max_queue=1000, filename_suffix=f".{len(earlier):04d}")
        if not earlier:
            self._hparams(session.settings)

    def _hparams(self, settings: dict[str, Any]) -> None:
        from tensorboardX.summary import hparams

        shown = {k: json.dumps(v, default=str) if isinstance(v, (list, tuple, dict)) else v
                 for k, v in settings.items()}
        for summary in hparams(shown, dict.fromkeys(self.HEADLINE)):
            self._writer.file_writer.add_summary(summary)

    def write(self, record: dict[str, Any]) -> None:
        from tensorboardX.proto.summary_pb2 import Summary

        # one event per row, all its scalars in it: the writer's queue costs time per event
        step, values = scalars(record)
        summary = Summary(value=[Summary.Value(tag=tag, simple_value=v) for tag, v in values.items()])
        self._writer.file_writer.add_summary(summary, step)

    def close(self) -> None:
        self._writer.close()


@final
class WandbTracker:
    """One W&B run for the whole run directory: offline unless WANDB_MODE says otherwise,
    files under OUT/wandb, the run id in OUT/wandb/run_id so that a resumed session
    continues the same run."""

    requires: ClassVar[tuple[str, str] | None] = ("wandb", 'pip install -e ".[wandb]"')

    def __init__(self, session: Session):
        import wandb

        id_file = session.out / "wandb" / "run_id"
        resumed = session.keep_through is not None and id_file.exists()
        known = id_file.read_text().strip() if resumed else None
        # rows a previous session sent this run are not sent again (its steps only grow)
        self._skip_through = session.logged_through if known else None
        id_file.parent.mkdir(parents=True, exist_ok=True)
        if known:
            fresh_second(id_file.parent, known)
        self._run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", "diloco_eqx"), name=session.out.resolve().name,
            dir=str(session.out), id=known or secrets.token_hex(4), resume="allow",
            config=session.settings, mode=os.environ.get("WANDB_MODE", "offline"),
            settings=wandb.Settings(console="off"))  # the run's own stderr stays as it is
        if not known:  # a new run (or one that had no W&B run yet)
            id_file.write_text(self._run.id + "\n")

    def write(self, record: dict[str, Any]) -> None:
        step, values = scalars(record)
        if self._skip_through is None or step > self._skip_through:
            self._run.log(values, step=step)

    def close(self) -> None:
        self._run.finish()


def fresh_second(root: Path, run_id: str) -> None:
    """Wait until no session directory of `run_id` under `root` carries the current second:
    W&B names a session's directory by the second it starts in, so a resumed session that
    started within the same second as the previous one would write into that one's files
    (and lose its rows)."""
    while any(root.glob(f"*-{datetime.datetime.now():%Y%m%d_%H%M%S}-{run_id}")):
        time.sleep(0.05)


TRACKERS: Registry[type] = Registry(
    "tracker", "a class taking a Session, with write(record) and close()",
    lambda c: isinstance(c, type) and callable(getattr(c, "write", None)) and hasattr(c, "requires"))
TRACKERS.register("jsonl", JsonlTracker)
TRACKERS.register("tensorboard", TensorBoardTracker)
TRACKERS.register("wandb", WandbTracker)


def register_tracker(name: str, tracker: type, *, overwrite: bool = False) -> None:
    """Make `tracker` (a class: `tracker(session)` opens it; `requires` is None or (module,
    install command)) selectable as `--tracker name`."""
    TRACKERS.register(name, tracker, overwrite=overwrite)


registered_trackers = TRACKERS.names


def check_trackers(names: tuple[str, ...] | list[str]) -> None:
    """ValueError naming --tracker if a name is unknown or its package is not importable
    (run before anything is written)."""
    for name in names:
        if name not in TRACKERS:
            raise ValueError(f"--tracker must be among {', '.join(registered_trackers())}; got {name!r}")
        needs = TRACKERS[name].requires
        if needs is None:
            continue
        try:
            importlib.import_module(needs[0])
        except ImportError as e:
            raise ValueError(f"--tracker {name} needs the {needs[0]} package, which is not importable "
                             f"({e}); install it with: {needs[1]}") from e


class FanOut:
    """Every row to every tracker; `close()` closes them all, even after one fails."""

    def __init__(self, trackers: list[Tracker]):
        self.trackers = trackers

    def write(self, record: dict[str, Any]) -> None:
        for tracker in self.trackers:
            tracker.write(record)

    def close(self) -> None:
        with contextlib.ExitStack() as stack:  # each is closed even if another one raises
            for tracker in self.trackers:
                stack.callback(tracker.close)


def open_trackers(names: tuple[str, ...] | list[str], out: str | os.PathLike, settings: dict[str, Any],
                  keep_through: int | None = None) -> FanOut:
    """The trackers `names` (jsonl always among them) for the run in `out`; `keep_through`:
    the step a resumed run restarts from (rows past it are dropped), None for a new run."""
    check_trackers(names)
    out = Path(out)
    session = Session(out, settings, keep_through, _last_step(out / "metrics.jsonl"))
    opened: list[Tracker] = []
    try:
        for name in dict.fromkeys(("jsonl", *names)):
            opened.append(TRACKERS[name](session))
    except BaseException:
        FanOut(opened).close()
        raise
    return FanOut(opened)


def _last_step(path: Path) -> int | None:
    """The step of the last complete line of a metrics file (None: no file or no line)."""
    records = _complete_records(path) if path.exists() else []
    steps = [r["step"] for _, r in records if isinstance(r.get("step"), int)]
    return steps[-1] if steps else None
