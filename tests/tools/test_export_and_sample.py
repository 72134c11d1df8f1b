"""tools/export_model.py and tools/sample.py on a real run: the exported outer model loads
with nothing DiLoCo and scores the run's final held-out loss; sampling is seeded and its
greedy text is the model's own argmax, from the run directory and from the export alike."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from experiments import train
from tests.experiments.test_train import TINY
from tests.helpers import subprocess_env
from tools import export_model
from tools import sample as sample_tool

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.xdist_group("export_run")  # one worker trains the run all three share

LOAD_ALONE = """
import sys, numpy as np, equinox as eqx
from diloco_eqx.models.io import load_model
model, loss_fn, config = load_model(sys.argv[1])
batches = np.load(sys.argv[2])
loss = float(np.mean([float(eqx.filter_jit(loss_fn)(model, b)) for b in batches]))
assert not [m for m in sys.modules if m.startswith("diloco_eqx.training")], "loading pulled in training"
print(repr(loss), config.vocab_size, config.seq_len)
"""


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("export") / "run"
    assert train.main([*TINY, "--steps", "12", "--eval-every", "6", "--checkpoint-every", "6",
                       "--sync-period", "4", "--num-fragments", "2", "--overlap-steps", "1",
                       "--out", str(out)]) == 0
    return out


def test_exported_model_scores_the_runs_final_evaluation_without_diloco(run, tmp_path):
    assert export_model.main([str(run), "--out", str(tmp_path / "exp")]) == 0
    meta = json.loads((tmp_path / "exp" / "model.json").read_text())
    final = json.loads((run / "run.json").read_text())["summary"]["eval_loss"]
    assert meta["step"] == 12 and meta["factory"] == "diloco_eqx.models.transformer:build"
    from diloco_eqx.training.saved_runs import load_outer_model

    held_out = np.stack(load_outer_model(run).job.held_out)
    np.save(tmp_path / "held_out.npy", held_out)
    proc = subprocess.run([sys.executable, "-c", LOAD_ALONE, str(tmp_path / "exp"), str(tmp_path / "held_out.npy")],
                          cwd=ROOT, env=subprocess_env(PYTHONPATH=str(ROOT)), capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    loss, vocab, seq_len = proc.stdout.split()
    assert float(loss) == pytest.approx(final, rel=1e-6) and (int(vocab), int(seq_len)) == (256, 32)
    assert meta["eval_loss"] == pytest.approx(final, rel=1e-6)
    # an earlier checkpoint on request; an existing export is not overwritten
    assert export_model.main([str(run), "--out", str(tmp_path / "exp6"), "--step", "6"]) == 0
    assert json.loads((tmp_path / "exp6" / "model.json").read_text())["step"] == 6
    with pytest.raises(SystemExit):
        export_model.main([str(run), "--out", str(tmp_path / "exp")])


def test_sample_is_seeded_and_greedy_matches_the_export(run, tmp_path, capsys):
    """The same seed, the same text: from the run directory and from its export (two loads
    of the same outer model), and another seed another text; greedy text from the export is
    the model's own argmax."""
    args = ["--prompt", "ab", "--tokens", "24"]
    assert sample_tool.main([str(run), *args, "--seed", "3"]) == 0
    first = capsys.readouterr().out
    assert export_model.main([str(run), "--out", str(tmp_path / "exp")]) == 0
    capsys.readouterr()
    assert sample_tool.main([str(tmp_path / "exp"), *args, "--seed", "3"]) == 0
    assert capsys.readouterr().out == first and first.startswith("ab")
    assert sample_tool.main([str(tmp_path / "exp"), *args, "--seed", "4"]) == 0
    assert capsys.readouterr().out != first  # (24 draws: equal text would be a 2^-24-ish accident)
    assert sample_tool.main([str(tmp_path / "exp"), *args, "--temperature", "0"]) == 0
    greedy = capsys.readouterr().out
    from diloco_eqx.models.io import load_model
    from diloco_eqx.models.sampling import sample

    model, _, config = load_model(tmp_path / "exp")
    ids = sample(model, list(b"ab"), 24, context=config.seq_len, temperature=0)
    assert greedy == "ab" + bytes(ids).decode("utf-8", errors="replace") + "\n"


def test_sample_refuses_bad_settings(run, capsys):
    for bad, message in ((["--tokens", "-1"], "--tokens must be >= 0"),
                         (["--temperature", "-0.5"], "--temperature must be >= 0"),
                         (["--prompt", ""], "--prompt must not be empty")):
        with pytest.raises(SystemExit):
            sample_tool.main([str(run), *bad])
        assert message in capsys.readouterr().err
