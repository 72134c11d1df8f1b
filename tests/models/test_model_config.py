"""A `--model` factory's own config dataclass: its fields are the model flags and the config
file's model keys, their values reach the factory, run.json and --resume record them, and
bad input names the model and what it takes (models/conv.py is the example)."""

import dataclasses
import json

import jax
import pytest

from diloco_eqx.models.io import load_model, model_config_class, save_model
from diloco_eqx.models.transformer import TransformerConfig
from diloco_eqx.training import cli
from diloco_eqx.training.config import RunConfig, defaults_for_model
from models.conv import ConvConfig, build

DATA = ["--corpus", "markov", "num_bytes=200000", "doc_bytes=20000", "--seq-len", "16",
        "--global-batch", "4", "--no-progress"]
CONV = ["--model", "models.conv:build", "--width", "16", "--kernel", "3", "--layers", "2",
        "--num-fragments", "2", "--sync-period", "2"]


def conv_params(vocab: int, width: int, layers: int, kernel: int) -> int:
    return 2 * vocab * width + layers * kernel * width * width


def test_config_values_reach_the_factory_and_run_json(tmp_path, capsys):
    out = tmp_path / "run"
    assert cli.main([*DATA, *CONV, "--steps", "2", "--eval-every", "0", "--out", str(out)]) == 0
    meta = json.loads((out / "run.json").read_text())
    settings = meta["settings"]
    assert settings["model"] == "models.conv:build"
    assert (settings["width"], settings["kernel"], settings["layers"]) == (16, 3, 2)
    assert "heads" not in settings and "mlp_ratio" not in settings and settings["seq_len"] == 16
    # the factory built the model these values describe: its parameter count says so
    assert meta["model"] == {"vocab_size": 256, "width": 16, "layers": 2, "kernel": 3,
                             "factory": "models.conv:build", "params": conv_params(256, 16, 2, 3)}
    # --resume compares the model's own settings with the run's
    capsys.readouterr()
    assert cli.main([*DATA, *CONV, "--kernel", "5", "--steps", "2", "--out", str(out), "--resume"]) == 2
    assert "kernel: 3 -> 5" in capsys.readouterr().err
    # the run's run.json gives the same settings back
    again = cli.parse_settings(["--config", str(out / "run.json"), "--out", str(tmp_path / "again")])
    assert again.model == ConvConfig(width=16, layers=2, kernel=3) and again.model_factory == "models.conv:build"


def test_config_file_takes_the_models_fields(tmp_path):
    (tmp_path / "flat.yaml").write_text("model: models.conv:build\nkernel: 5\n")
    (tmp_path / "section.yaml").write_text("model:\n  width: 8\n  layers: 3\n")
    cfg = cli.parse_settings(["--config", str(tmp_path / "flat.yaml"), "--out", str(tmp_path / "a")])
    assert cfg.model == ConvConfig(kernel=5)
    cfg = cli.parse_settings(["--model", "models.conv:build", "--config", str(tmp_path / "section.yaml"),
                              "--kernel", "2", "--out", str(tmp_path / "b")])
    assert cfg.model == ConvConfig(width=8, layers=3, kernel=2)
    assert cfg.flat()["width"] == 8 and "vocab_size" not in cfg.flat()


def test_unknown_flag_or_key_names_the_model_and_its_fields(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        cli.parse_settings(["--model", "models.conv:build", "--heads", "2", "--out", str(tmp_path / "a")])
    assert e.value.code == 2
    assert ("unrecognized arguments: --heads 2 (the model models.conv:build (ConvConfig) takes "
            "--width, --layers, --kernel)") in capsys.readouterr().err
    (tmp_path / "bad.yaml").write_text("model:\n  heads: 2\n")
    with pytest.raises(ValueError, match=r"unknown setting 'heads'.*the model models\.conv:build "
                                         r"\(ConvConfig\) takes --width, --layers, --kernel"):
        cli.parse_settings(["--model", "models.conv:build", "--config", str(tmp_path / "bad.yaml"),
                            "--out", str(tmp_path / "b")])


def test_the_built_in_transformer_keeps_its_flags(tmp_path):
    cfg = cli.parse_settings(["--layers", "3", "--heads", "2", "--out", str(tmp_path / "a")])
    assert cfg.model == dataclasses.replace(RunConfig().model, num_layers=3, num_heads=2)
    assert model_config_class("diloco_eqx.models.transformer:build") is TransformerConfig
    # a parser made for another model gives the transformer its usual defaults back
    conv = defaults_for_model("models.conv:build")
    parser = cli.build_parser("t", default=conv)
    cfg = cli.parse_run_config(["--model", "diloco_eqx.models.transformer:build", "--out", str(tmp_path / "b")],
                               parser)
    assert cfg.model == RunConfig().model and cfg == RunConfig(out=str(tmp_path / "b"))


FACTORIES = '''
import dataclasses
from models.conv import build as conv_build


@dataclasses.dataclass(frozen=True)
class Small:
    width: int = 8
    """Channels."""
    kernel: int = 2
    """Taps."""


def declared(config, key):
    from models.conv import ConvConfig
    return conv_build(ConvConfig(width=config.width, layers=2, kernel=config.kernel), key)


declared.config = Small


def untyped(config, key):
    return conv_build(config, key)


@dataclasses.dataclass
class Loose:
    width: int = 8


def loose(config, key):
    return conv_build(config, key)


loose.config = Loose


@dataclasses.dataclass(frozen=True)
class NoDefault:
    width: int


def no_default(config: NoDefault, key):
    return conv_build(config, key)


@dataclasses.dataclass(frozen=True)
class Clash:
    steps: int = 3
    """Takes --steps, a training setting."""


def clash(config: Clash, key):
    return conv_build(config, key)
'''


@pytest.fixture
def factories(tmp_path, monkeypatch):
    (tmp_path / "config_factories.py").write_text(FACTORIES)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "config_factories"


def test_a_config_attribute_declares_the_dataclass(factories, tmp_path):
    cfg = cli.parse_settings(["--model", f"{factories}:declared", "--kernel", "3", "--out", str(tmp_path / "a")])
    assert type(cfg.model).__name__ == "Small" and (cfg.model.width, cfg.model.kernel) == (8, 3)
    # without a declaration a factory gets the run's TransformerConfig, as before
    assert model_config_class(f"{factories}:untyped") is TransformerConfig


@pytest.mark.parametrize("name, message", [
    ("loose", "its config Loose must be frozen"),
    ("no_default", "its config NoDefault needs a default for every field (the flags' defaults); none for width"),
    ("clash", "a field of its config Clash has the flag of another setting"),
])
def test_bad_config_declarations_are_usage_errors(factories, tmp_path, capsys, name, message):
    with pytest.raises(SystemExit) as e:
        cli.parse_settings(["--model", f"{factories}:{name}", "--out", str(tmp_path / "a")])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_saved_model_loads_back_with_its_own_config(tmp_path):
    config = ConvConfig(vocab_size=300, width=8, layers=2, kernel=3)
    model, _ = build(config, jax.random.key(0))
    save_model(tmp_path / "export", model, "models.conv:build", config)
    _, _, loaded = load_model(tmp_path / "export")
    assert loaded == config
