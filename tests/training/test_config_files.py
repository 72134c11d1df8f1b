"""`--config FILE`: YAML/JSON settings under the command line's flags, and a run's run.json
rerunning it exactly."""

import dataclasses
import json

import pytest

from diloco_eqx.training.cli import parse_settings
from diloco_eqx.training.config import RunConfig
from diloco_eqx.training.config_files import read_config
from experiments import train
from tests.experiments.test_train import TINY, rows

YAML = """\
diloco:
  sync_period: 10
  num-fragments: 2
  drops: ["5:1", "10:0"]
model:
  width: 48
  model: diloco_eqx.models.transformer:build
data:
  corpus: [markov, num_bytes=200000]
  non_iid: true
run:
  steps: 20
  progress: false
lr: 0.01
"""


def test_yaml_sections_and_flat_keys_become_settings(tmp_path):
    (tmp_path / "run.yaml").write_text(YAML)
    cfg = parse_settings(["--config", str(tmp_path / "run.yaml"), "--out", str(tmp_path / "x")])
    assert (cfg.diloco.sync_period, cfg.diloco.num_fragments, cfg.diloco.drops) == (10, 2, ((5, 1), (10, 0)))
    assert (cfg.model.width, cfg.data.corpus, cfg.data.non_iid) == (48, ("markov", "num_bytes=200000"), True)
    assert (cfg.steps, cfg.progress, cfg.optim.lr) == (20, False, 0.01)
    assert cfg.model.num_layers == RunConfig().model.num_layers  # not in the file: the default


def test_flags_override_the_file(tmp_path):
    (tmp_path / "run.json").write_text(json.dumps({"width": 48, "sync-period": 10, "streaming": False}))
    cfg = parse_settings(["--width", "64", "--config", str(tmp_path / "run.json"), "--streaming",
                          "--out", str(tmp_path / "x")])
    assert (cfg.model.width, cfg.diloco.sync_period, cfg.diloco.streaming) == (64, 10, True)


@pytest.mark.parametrize("text, name, message", [
    ("widht: 3\n", "a.yaml", "unknown setting 'widht' (did you mean 'width'?)"),
    ("streaming: maybe\n", "a.yaml", "streaming must be true or false; got 'maybe'"),
    ("- 1\n- 2\n", "a.yaml", "expected a mapping of settings; got list"),
    ("{width: [\n", "a.yaml", "not valid YAML"),
    ("{\"width\": 3,}", "a.json", "not valid JSON"),
    ("width = 3\n", "a.toml", "give a .yaml, .yml or .json file"),
])
def test_bad_config_files_name_the_problem(tmp_path, text, name, message):
    (tmp_path / name).write_text(text)
    with pytest.raises(ValueError) as e:
        parse_settings(["--config", str(tmp_path / name), "--out", str(tmp_path / "x")])
    assert f"--config {tmp_path / name}: " in str(e.value) and message in str(e.value)


def test_missing_config_file(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        read_config(str(tmp_path / "nowhere.yaml"))


def test_run_json_gives_back_every_setting_of_the_run(tmp_path):
    """What a rerun from run.json trains with: the recorded run's RunConfig, field for field
    (the run itself is deterministic given its settings; the slow test below reruns one)."""
    from diloco_eqx.training.loop import write_json

    argv = ["--steps", "8", "--sync-period", "4", "--num-fragments", "2", "--drops", "4:1", "--width", "48",
            "--tokenizer", "bpe:300", "--tracker", "jsonl", "tensorboard", "--no-progress", "--corpus", "markov",
            "num_bytes=1000", "--out", str(tmp_path / "a")]
    first = parse_settings(argv)
    write_json(tmp_path / "run.json", {"settings": first.flat() | {"resume": True}, "command": argv})
    again = parse_settings(["--config", str(tmp_path / "run.json"), "--out", str(tmp_path / "b")])
    assert again == dataclasses.replace(first, out=str(tmp_path / "b"))


@pytest.mark.slow  # two training runs
def test_run_json_reruns_the_run_exactly(tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    assert train.main([*TINY, "--steps", "8", "--eval-every", "4", "--sync-period", "4",
                       "--num-fragments", "2", "--out", str(first)]) == 0
    # a resumed run's run.json records --resume; a rerun from it starts afresh all the same
    meta = json.loads((first / "run.json").read_text())
    meta["settings"]["resume"] = True
    (first / "run.json").write_text(json.dumps(meta))
    assert train.main(["--config", str(first / "run.json"), "--out", str(second)]) == 0
    a, b = (json.loads((d / "run.json").read_text())["settings"] for d in (first, second))
    assert {k for k in a if a[k] != b[k]} == {"out", "resume"}
    assert rows(first) and [(r["step"], r.get("loss"), r.get("eval_loss")) for r in rows(first)] == [
        (r["step"], r.get("loss"), r.get("eval_loss")) for r in rows(second)]
