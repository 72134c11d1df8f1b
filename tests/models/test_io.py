"""diloco_eqx/models/io.py: models named PACKAGE.MODULE:FACTORY (the docs' own model among them), and
a model saved as a plain Equinox file and loaded back."""

import re
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from diloco_eqx.models.io import build_model, load_model, save_model
from diloco_eqx.models.transformer import Transformer, TransformerConfig

ROOT = Path(__file__).resolve().parents[2]
CONFIG = TransformerConfig(vocab_size=300, num_layers=2, width=32, num_heads=2, seq_len=16)


def readme_model_source() -> str:
    """The example model of docs/extending.md ("Your own model"), as printed there."""
    blocks = re.findall(r"```python\n(# my_model\.py.*?)```", (ROOT / "docs" / "extending.md").read_text(),
                        flags=re.S)
    assert len(blocks) == 1
    return blocks[0]


@pytest.fixture
def my_model(tmp_path, monkeypatch):
    """The README's my_model.py, importable."""
    (tmp_path / "my_model.py").write_text(readme_model_source())
    monkeypatch.syspath_prepend(str(tmp_path))
    return "my_model:build"


def test_default_factory_is_the_transformer():
    model, loss = build_model("diloco_eqx.models.transformer:build", CONFIG, jax.random.key(3))
    expected = Transformer(CONFIG, jax.random.key(3))
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(expected)))
    batch = np.arange(2 * 17).reshape(2, 17) % 300
    logits = np.asarray(eqx.filter_jit(lambda m, x: jax.vmap(m)(x))(model, batch[:, :-1]), np.float64)
    picked = np.take_along_axis(logits, batch[:, 1:, None], axis=-1)[..., 0]
    top = logits.max(-1)
    manual = np.mean(top + np.log(np.exp(logits - top[..., None]).sum(-1)) - picked)
    assert float(eqx.filter_jit(loss)(model, batch)) == pytest.approx(float(manual), rel=1e-5)


def test_readme_model_builds_with_the_run_settings(my_model):
    model, loss = build_model(my_model, CONFIG, jax.random.key(0))
    assert model.embed.shape == (300, 32) and model.layers.taps.shape == (2, 4, 32, 32)
    batch = jnp.zeros((3, 17), jnp.int32)
    # all-zero init of nothing: a fresh model is near uniform over the 300 tokens
    assert float(loss(model, batch)) == pytest.approx(np.log(300), abs=0.05)


@pytest.mark.parametrize("spec, message", [
    ("my_model", "--model must be PACKAGE.MODULE:FACTORY"),
    ("no_such_module_here:build", "cannot import no_such_module_here (ModuleNotFoundError"),
    ("diloco_eqx.models.transformer:nothing", "diloco_eqx.models.transformer has no function nothing"),
    ("diloco_eqx.models.transformer:count_params", "the factory must take (config, key)"),
    ("diloco_eqx.models.transformer:Transformer", "the factory must return (model, loss_fn)"),
])
def test_bad_model_names_say_what_is_wrong(spec, message):
    with pytest.raises(ValueError) as e:
        build_model(spec, CONFIG, jax.random.key(0))
    assert message in str(e.value)


@pytest.mark.parametrize("which", ["diloco_eqx.models.transformer:build", "my_model:build"])
def test_saved_model_loads_back_with_nothing_but_its_factory(tmp_path, my_model, which):
    model, loss = build_model(which, CONFIG, jax.random.key(1))
    model = eqx.filter_jit(lambda m: jax.tree.map(lambda x: x + 0.01, m))(model)  # not the init
    save_model(tmp_path / "export", model, which, CONFIG, extra={"step": 7})
    loaded, loaded_loss, config = load_model(tmp_path / "export")
    assert config == CONFIG
    for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(loaded)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    batch = (jnp.arange(2 * 17).reshape(2, 17) * 7) % 300
    assert float(eqx.filter_jit(loaded_loss)(loaded, batch)) == float(eqx.filter_jit(loss)(model, batch))
