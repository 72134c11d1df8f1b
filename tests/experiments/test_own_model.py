"""`--model PACKAGE.MODULE:FACTORY` end to end with the README's own model: training,
evaluation, checkpoints and an exact resume work as with the built-in transformer."""

import json
import shutil

import jax
import numpy as np
import pytest

from experiments import train
from diloco_eqx.models.io import build_model
from diloco_eqx.models.transformer import TransformerConfig, count_params
from tests.experiments.test_train import TINY, rows
from tests.models.test_io import readme_model_source

ARGS = [*TINY, "--model", "my_model:build", "--num-fragments", "2", "--sync-period", "4",
        "--overlap-steps", "1", "--steps", "16", "--eval-every", "8", "--checkpoint-every", "8"]


@pytest.fixture
def importable(tmp_path, monkeypatch):
    (tmp_path / "my_model.py").write_text(readme_model_source())
    monkeypatch.syspath_prepend(str(tmp_path))


@pytest.mark.slow  # end to end: a run and its resume (test_extending trains the same way in the fast set)
def test_own_model_trains_checkpoints_and_resumes_exactly(tmp_path, importable):
    out = tmp_path / "run"
    assert train.main([*ARGS, "--out", str(out)]) == 0
    meta = json.loads((out / "run.json").read_text())
    assert meta["status"] == "finished" and meta["model"]["factory"] == "my_model:build"
    config = TransformerConfig(**{k: v for k, v in meta["model"].items() if k not in ("factory", "params")})
    model, _ = build_model("my_model:build", config, jax.random.key(0))
    assert meta["model"]["params"] == count_params(model) == 256 * 32 * 2 + 2 * 4 * 32 * 32
    first = rows(out)
    evals = [r["eval_loss"] for r in first if r.get("eval")]
    assert len(evals) == 2 and evals[1] < evals[0] < np.log(256) + 0.05
    assert (out / "loss.png").stat().st_size > 1000
    # resume from step 8: the second half again, number for number
    shutil.rmtree(out / "checkpoints" / "16")
    assert train.main([*ARGS, "--out", str(out), "--resume"]) == 0
    again = rows(out)
    assert [r["step"] for r in again] == [r["step"] for r in first]
    for a, b in zip(first, again):
        assert a.get("loss") == b.get("loss") and a.get("eval_loss") == b.get("eval_loss"), a["step"]


def test_unknown_model_is_a_usage_error_before_anything_is_written(tmp_path, capsys):
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        train.main([*TINY, "--model", "my_model_nowhere:build", "--out", str(out)])
    assert e.value.code == 2 and not out.exists()
    assert "--model my_model_nowhere:build: cannot import my_model_nowhere" in capsys.readouterr().err
