"""--tracker: every metrics.jsonl number reaches TensorBoard and W&B (offline) at its step,
settings go in as hyper-parameters, a resumed run leaves no step twice, and a missing
package is a clear error before anything is written."""

import functools
import importlib
import json
import math
import shutil
import struct
import sys
import time
from pathlib import Path

import pytest

from diloco_eqx.training import runner, trackers
from diloco_eqx.training.cli import build_parser
from diloco_eqx.training.loop import read_jsonl
from experiments import train
from tests.experiments.test_train import TINY

SETTINGS = {"steps": 10, "lr": 0.003, "corpus": ["markov", "num_bytes=200000"], "devices": None,
            "streaming": True, "mode": "diloco"}


@functools.cache
def has_wandb() -> bool:
    """Whether wandb imports (asked when a test needs to know, not at collection)."""
    try:
        importlib.import_module("wandb")
    except ImportError:
        return False
    return True


def names() -> list[str]:
    """Every tracker that can run here."""
    return ["jsonl", "tensorboard", *(["wandb"] if has_wandb() else [])]


@pytest.fixture(scope="module", autouse=True)
def wandb_offline(tmp_path_factory):
    """W&B offline and silent, its directories under tmp: no network, nothing in $HOME."""
    root = tmp_path_factory.mktemp("wandb-home")
    with pytest.MonkeyPatch.context() as mp:
        for var, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DIR": root / "dir",
                           "WANDB_CACHE_DIR": root / "cache", "WANDB_CONFIG_DIR": root / "config",
                           "WANDB_DATA_DIR": root / "data", "WANDB_ERROR_REPORTING": "false"}.items():
            mp.setenv(var, str(value))
        yield


def needs_wandb():
    """Skip, saying how to install it, where wandb is not importable."""
    pytest.importorskip("wandb", reason="wandb is not importable: pip install -e \".[wandb]\"")


# ------------------------------------------------------------------------- reading back


def tensorboard_points(out: Path) -> dict[str, dict[int, float]]:
    """tag -> {step: value} of OUT/tensorboard as TensorBoard reads it (purges applied);
    fails if a step of a tag appears twice."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    points = {}
    for tag in acc.Tags()["scalars"]:
        events = acc.Scalars(tag)
        steps = [e.step for e in events]
        assert len(steps) == len(set(steps)), f"{tag}: a step twice in {steps}"
        points[tag] = {e.step: e.value for e in events}
    return points


def tensorboard_hparams(out: Path) -> dict:
    """The hyper-parameters (name -> value) of OUT/tensorboard's hparams session."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    data = plugin_data_pb2.HParamsPluginData.FromString(
        acc.PluginTagToContent("hparams")["_hparams_/session_start_info"])
    return {k: getattr(v, v.WhichOneof("kind")) for k, v in data.session_start_info.hparams.items()}


def wandb_records(path: Path):
    """The protobuf records of a .wandb file (W&B's log format: a 7-byte file header, then
    32 KiB blocks of chunks, each a 7-byte header: crc32, length, kind (1 full, 2 first,
    3 middle, 4 last))."""
    from wandb.proto import wandb_internal_pb2

    data, i, pending = path.read_bytes(), 7, b""
    assert data[:4] == b":W&B" and struct.unpack("<H", data[4:6])[0] == 0xBEE1
    while i + 7 <= len(data):
        if 32768 - i % 32768 < 7:  # a block's tail too short for a header is padding
            i += 32768 - i % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[i:i + 7])
        if kind == 0:
            break
        pending, i = pending + data[i + 7:i + 7 + length], i + 7 + length
        if kind in (1, 4):
            yield wandb_internal_pb2.Record.FromString(pending)
            pending = b""


def finished_records(path: Path, wait_s: float = 60.0) -> list:
    """The records of a session's .wandb file once its last is the exit record: W&B buffers
    the file (flushing every 15 s and at the end), so a file read before its exit record may
    lack rows; if the end never comes, the error names what was there."""
    deadline = time.monotonic() + wait_s
    while True:
        late = time.monotonic() > deadline
        try:
            records = list(wandb_records(path))
        except Exception:  # a file caught mid-write; past the wait, its error is the answer
            if late:
                raise
            records = []
        if records and records[-1].HasField("exit"):
            return records
        if late:
            siblings = sorted(p.name for p in path.parent.parent.iterdir())
            raise AssertionError(f"{path} has no exit record after {wait_s:.0f} s: "
                                 f"{[r.WhichOneof('record_type') for r in records]}; sessions: {siblings}")
        time.sleep(0.1)


def wandb_run(out: Path, run_id: str = "*") -> tuple[dict[int, dict[str, float]], dict, set[str]]:
    """({step: {key: value}}, config, run ids) over every session's .wandb file in
    OUT/wandb (of one run id if given); fails if a step appears in two sessions."""
    history, config, ids = {}, {}, set()
    for path in sorted((out / "wandb").glob(f"offline-run-*/run-{run_id}.wandb")):
        seen = {}
        for r in finished_records(path):
            if r.HasField("run"):
                ids.add(r.run.run_id)
                config |= {u.key: json.loads(u.value_json) for u in r.run.config.update if u.key != "_wandb"}
            if r.HasField("history"):
                row = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item}
                assert r.history.step.num not in seen, f"step {r.history.step.num} twice in {path}"
                seen[r.history.step.num] = {k: v for k, v in row.items() if not k.startswith("_")}
        assert not set(seen) & set(history), f"steps in two sessions: {sorted(set(seen) & set(history))}"
        history |= seen
    return history, config, ids


def expected(records) -> dict[str, dict[int, float]]:
    """tag -> {step: value} the tag scheme promises for metrics.jsonl rows."""
    out: dict[str, dict[int, float]] = {}
    for r in records:
        for key, value in r.items():
            if key not in ("step", "eval") and isinstance(value, (int, float)) and not isinstance(value, bool):
                out.setdefault(f"{'eval' if r.get('eval') else 'train'}/{key}", {})[r["step"]] = float(value)
    return out


def same(a: float, b: float) -> bool:
    """Equal, NaN equal to NaN."""
    return (math.isnan(a) and math.isnan(b)) or a == b


# ------------------------------------------------------------------------- real runs


def train_tiny(out: Path, *extra: str) -> list[dict]:
    """A tiny CLI run with every tracker (8 steps, syncs every 4, evaluations at 4 and 8);
    its metrics.jsonl rows."""
    assert train.main([*TINY, "--steps", "8", "--eval-every", "4", "--checkpoint-every", "4",
                       "--sync-period", "4", "--num-fragments", "2", "--eval-island",
                       "--tracker", *names(), "--out", str(out), *extra]) == 0
    records = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in records if not r.get("eval")] == list(range(1, 9))
    assert [r["step"] for r in records if r.get("eval")] == [4, 8]
    return records


@pytest.mark.slow  # end to end: a training run
def test_real_run_reaches_every_tracker(tmp_path):
    records = train_tiny(tmp_path)
    check_tensorboard(tmp_path, records)
    if has_wandb():  # (without wandb, the hand-made W&B tests below say why they are skipped)
        check_wandb(tmp_path, records)


@pytest.mark.slow
def test_real_run_killed_and_resumed_leaves_each_step_once(tmp_path):
    first = train_tiny(tmp_path)
    shutil.rmtree(tmp_path / "checkpoints" / "8")  # as if killed after step 8's rows, before its checkpoint
    records = train_tiny(tmp_path, "--resume")  # restarts from step 4
    check_tensorboard(tmp_path, records)
    assert len(list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))) == 2
    # steps 5..8 are the resumed session's (its own wall times), not the interrupted one's
    before = {r["step"]: r["wall_time"] for r in first if not r.get("eval")}
    assert tensorboard_points(tmp_path)["train/wall_time"] != pytest.approx(before, rel=1e-6)
    if has_wandb():  # the first session sent steps 1..8; the resumed one does not send them again
        check_wandb(tmp_path, first)
        assert {r["step"]: r["loss"] for r in records if not r.get("eval")} == {
            r["step"]: r["loss"] for r in first if not r.get("eval")}


def check_tensorboard(out: Path, records: list[dict]) -> None:
    """Every number of `records` is in OUT/tensorboard at its step, each step once."""
    want, got = expected(records), tensorboard_points(out)
    assert {"train/loss", "train/loss_island_0", "train/loss_island_1", "train/pseudo_grad_norm",
            "train/sync_fragment", "eval/eval_loss", "eval/eval_loss_island_0", "eval/wall_time"} <= set(want)
    assert set(got) == set(want)
    for tag, points in want.items():  # event files hold float32
        assert got[tag] == pytest.approx(points, rel=1e-6), tag
    hp = tensorboard_hparams(out)
    assert (hp["steps"], hp["sync_period"], hp["tracker"]) == (8.0, 4.0, json.dumps(names()))


def check_wandb(out: Path, sent: list[dict]) -> None:
    """Every number of `sent` is in the W&B run at its step, each step once; one run id."""
    history, config, ids = wandb_run(out)
    assert ids == {(out / "wandb" / "run_id").read_text().strip()}
    assert config["steps"] == 8 and config["tracker"] == names()
    assert sorted(history) == list(range(1, 9))
    for tag, points in expected(sent).items():
        for step, value in points.items():
            assert same(history[step][tag], value), (tag, step)


# ------------------------------------------------------------------------- hand-made rows


def rows(steps, shift=0.0):
    """Step rows with a list field, a NaN, a string and a bool; an evaluation every 5."""
    for t in steps:
        yield {"step": t, "loss": 1.0 / t + shift, "loss_island": [t + shift, -t], "note": "x",
               "flag": True, "tokens": 2048 * t, "grad": math.nan if t == 3 else 0.5, "none": None}
        if t % 5 == 0:
            yield {"step": t, "eval": True, "eval_loss": 2.0 + shift, "eval_bits_per_byte": 3.0,
                   "wall_time": 9.0 + shift}


def session(out, steps, keep_through, kinds, shift=0.0):
    """One session of the trackers `kinds` writing `rows(steps, shift)`."""
    fan = trackers.open_trackers(kinds, out, SETTINGS, keep_through=keep_through)
    for row in rows(steps, shift):
        fan.write(row)
    fan.close()


def test_tags_numbers_only_lists_per_item():
    step, values = trackers.scalars(next(rows([3])))
    assert step == 3 and set(values) == {"train/loss", "train/loss_island/0", "train/loss_island/1",
                                         "train/tokens", "train/grad"}
    assert values["train/loss_island/1"] == -3.0 and math.isnan(values["train/grad"])
    assert trackers.scalars(list(rows([5]))[1]) == (
        5, {"eval/eval_loss": 2.0, "eval/eval_bits_per_byte": 3.0, "eval/wall_time": 9.0})


def test_tensorboard_resume_purges_the_interrupted_points(tmp_path):
    session(tmp_path, range(1, 8), keep_through=None, kinds=("tensorboard",))
    session(tmp_path, range(5, 11), keep_through=4, shift=100.0, kinds=("tensorboard",))
    got = tensorboard_points(tmp_path)
    assert sorted(got["train/loss"]) == list(range(1, 11))
    assert got["train/loss"] == pytest.approx({t: 1.0 / t + (100.0 if t > 4 else 0.0) for t in range(1, 11)})
    assert got["train/loss_island/0"][2] == 2.0 and math.isnan(got["train/grad"][3])
    assert got["eval/eval_loss"] == {5: 102.0, 10: 102.0} and got["eval/eval_bits_per_byte"][10] == 3.0
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2, 3, 4, 5, 5, 6, 7, 8, 9, 10, 10]


def test_wandb_resume_continues_the_run_without_resending(tmp_path):
    needs_wandb()
    session(tmp_path, range(1, 8), keep_through=None, kinds=("wandb",))
    # W&B names an offline session's directory by the second it started in: a resume within
    # the same second as the first session (which no real run can do) would share it. The
    # first started before it ended, so the resume waits for the second after that (on a
    # loaded machine the first session's start can come a second after the test's)
    ended = time.time()
    time.sleep(max(0.0, math.floor(ended) + 1.05 - time.time()))
    session(tmp_path, range(5, 11), keep_through=4, shift=100.0, kinds=("wandb",))
    history, config, ids = wandb_run(tmp_path)
    assert len(ids) == 1 and config == SETTINGS
    assert sorted(history) == list(range(1, 11))
    # 5..7 came from the first session (not sent again), 8..10 from the resumed one
    assert [history[t]["train/loss"] for t in range(1, 11)] == pytest.approx(
        [1.0 / t + (100.0 if t > 7 else 0.0) for t in range(1, 11)])
    assert history[5]["eval/eval_loss"] == 2.0 and history[10]["eval/eval_loss"] == 102.0
    assert history[5]["train/loss_island/1"] == -5.0 and math.isnan(history[3]["train/grad"])


def test_a_new_run_in_a_used_directory_continues_nothing(tmp_path):
    """Not --resume (keep_through None): leftover rows are dropped, W&B starts another run."""
    session(tmp_path, range(1, 8), keep_through=None, kinds=names())
    old_id = (tmp_path / "wandb" / "run_id").read_text() if has_wandb() else None
    session(tmp_path, range(1, 4), keep_through=None, shift=100.0, kinds=names())
    assert [r["loss"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1.0 / t + 100.0 for t in (1, 2, 3)]
    assert tensorboard_points(tmp_path)["train/loss"] == pytest.approx({t: 1.0 / t + 100.0 for t in (1, 2, 3)})
    if has_wandb():
        new_id = (tmp_path / "wandb" / "run_id").read_text().strip()
        history, _, ids = wandb_run(tmp_path, new_id)
        assert new_id != old_id.strip() and ids == {new_id}
        assert {t: row["train/loss"] for t, row in history.items()} == {t: 1.0 / t + 100.0 for t in (1, 2, 3)}


def test_jsonl_is_always_written_and_unchanged(tmp_path):
    session(tmp_path, range(1, 3), keep_through=None, kinds=("tensorboard",))
    assert read_jsonl(tmp_path / "metrics.jsonl") == [json.loads(json.dumps(r)) for r in rows(range(1, 3))]


def test_close_closes_every_tracker_even_after_a_failure():
    closed = []

    class Closing:
        def __init__(self, name, error=None):
            self.name, self.error = name, error

        def write(self, record) -> None: ...

        def close(self) -> None:
            closed.append(self.name)
            if self.error:
                raise self.error

    with pytest.raises(OSError, match="disk full"):
        trackers.FanOut([Closing("fine"), Closing("failing", OSError("disk full"))]).close()
    assert sorted(closed) == ["failing", "fine"]


def test_registry_matches_the_flag_choices():
    choices = {a.dest: a.choices for a in build_parser("t")._actions}["tracker"]
    assert tuple(choices) == trackers.registered_trackers() == ("jsonl", "tensorboard", "wandb")
    with pytest.raises(ValueError, match=r"--tracker must be among jsonl, tensorboard, wandb; got 'mlflow'"):
        trackers.check_trackers(["mlflow"])


def test_missing_wandb_stops_before_anything_is_written(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    message = r'--tracker wandb needs the wandb package.*install it with: pip install -e "\.\[wandb\]"'
    with pytest.raises(ValueError, match=message):
        trackers.check_trackers(["jsonl", "wandb"])
    monkeypatch.setattr(runner, "build", lambda cfg: pytest.fail("built the run before refusing it"))
    out = tmp_path / "run"
    assert train.main([*TINY, "--tracker", "wandb", "--out", str(out)]) == 2
    assert not out.exists()
    assert '--tracker wandb needs the wandb package' in capsys.readouterr().err


def test_a_resumed_wandb_session_starts_in_a_second_of_its_own(tmp_path):
    """A resumed session waits until no directory of its run carries the current second: W&B
    names a session's directory by that second, and a session sharing the previous one's
    directory would lose its rows. Another run's directory does not make it wait."""
    import datetime

    now = f"{datetime.datetime.now():%Y%m%d_%H%M%S}"
    (tmp_path / f"offline-run-{now}-abcd").mkdir()
    trackers.fresh_second(tmp_path, "abcd")
    assert f"{datetime.datetime.now():%Y%m%d_%H%M%S}" != now
    trackers.fresh_second(tmp_path, "other")  # another run's directory does not matter
