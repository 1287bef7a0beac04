from __future__ import annotations

import pytest
import yaml

from shardforge.config import dump_config, load_config
from shardforge.errors import ConfigError

GOOD = """\
output_dir: runs/x
model: {preset: tiny-llama, tokenizer: tok}
data:
  train: [{path: data/x.jsonl, format: alpaca}]
  max_length: 256
train:
  steps: 10
  lr: 3.0e-4
"""


def _write(tmp_path, text):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


def test_defaults_and_overrides(tmp_path):
    cfg = load_config(
        _write(tmp_path, GOOD), ["train.lr=1e-3", "data.packing=false", "train.betas=[0.9, 0.99]"]
    )
    assert cfg.train.lr == 1e-3 and cfg.data.packing is False and cfg.train.betas == (0.9, 0.99)
    assert cfg.method.stage == "sft" and cfg.parallel.tp == 1 and cfg.train.precision == "fp32"


def test_unknown_key_names_line_section_and_closest(tmp_path):
    path = _write(tmp_path, GOOD.replace("max_length: 256", "max_lenght: 256"))
    with pytest.raises(ConfigError) as err:
        load_config(path)
    msg = str(err.value)
    assert f"{path}:5:" in msg and "'data.max_lenght'" in msg and "section 'data'" in msg
    assert "did you mean 'max_length'" in msg


def test_unknown_section_suggests(tmp_path):
    with pytest.raises(ConfigError, match="did you mean 'train'"):
        load_config(_write(tmp_path, GOOD + "trian: {steps: 3}\n"))


def test_bad_value_names_key_value_and_allowed(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(_write(tmp_path, GOOD), ["train.schedule=cosin", "train.micro_batch=0"])
    msg = str(err.value)
    assert (
        "train.schedule = 'cosin'" in msg and "'cosine'" in msg and "override 'train.schedule=cosin'" in msg
    )
    assert "train.micro_batch = 0" in msg and "greater than or equal to 1" in msg


def test_bad_override_syntax():
    with pytest.raises(ConfigError, match="key=value"):
        load_config(None, ["train.lr"])


def test_model_needs_one_source(tmp_path):
    with pytest.raises(ConfigError, match=r"exactly one of model\.path"):
        load_config(_write(tmp_path, GOOD), ["model.path=/x"])


def test_dump_is_resolved_and_reloadable(tmp_path):
    cfg = load_config(_write(tmp_path, GOOD))
    out = tmp_path / "run" / "config.yaml"
    dump_config(cfg, out)
    data = yaml.safe_load(out.read_text())
    assert data["train"]["schedule"] == "cosine" and data["parallel"]["zero_stage"] == 0
    assert load_config(out) == cfg


def test_layouts_that_cannot_combine_are_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"parallel.ep=2 .*zero_stage to 2 or 3"):
        load_config(_write(tmp_path, GOOD), ["parallel.ep=2"])
    with pytest.raises(ConfigError, match=r"parallel.cp=2 with HSDP"):
        load_config(
            _write(tmp_path, GOOD), ["parallel.cp=2", "parallel.dp_replicate=2", "parallel.zero_stage=3"]
        )


def test_every_key_is_documented():
    """docs/config.md must describe every key of the schema."""
    from pathlib import Path

    from pydantic import BaseModel

    from shardforge.config.data_schema import DatasetSpec
    from shardforge.config.schema import Config

    doc = (Path(__file__).resolve().parents[2] / "docs" / "config.md").read_text()

    def keys(model: type[BaseModel], prefix: str = ""):
        for name, field in model.model_fields.items():
            if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
                yield from keys(field.annotation, f"{prefix}{name}.")
            else:
                yield prefix + name

    missing = [k for k in [*keys(Config), *keys(DatasetSpec, "data.train[].")] if f"`{k}`" not in doc]
    assert not missing, f"undocumented config keys: {missing}"


def test_invalid_yaml_points_at_line(tmp_path):
    with pytest.raises(ConfigError, match=r"c\.yaml:\d+:\d+: not valid YAML"):
        load_config(_write(tmp_path, "output_dir: x\nmodel:\n  - [1\n"))


def test_section_level_error_names_the_override(tmp_path):
    with pytest.raises(ConfigError, match=r"override 'model\.path=/x'.*exactly one of"):
        load_config(_write(tmp_path, GOOD), ["model.path=/x"])


def test_fp16_needs_fp32_master_weights(tmp_path):
    with pytest.raises(ConfigError, match=r"set model\.dtype=float32"):
        load_config(_write(tmp_path, GOOD), ["model.dtype=float16", "train.precision=fp16"])


def test_override_into_a_list_item(tmp_path):
    cfg = load_config(_write(tmp_path, GOOD), ["data.train.0.max_samples=5"])
    assert cfg.data.train[0].max_samples == 5
    with pytest.raises(ConfigError, match="not an index of a 1-item list"):
        load_config(_write(tmp_path, GOOD), ["data.train.3.max_samples=5"])
    with pytest.raises(ConfigError, match="'lr' is not a section"):
        load_config(_write(tmp_path, GOOD), ["train.lr.x=5"])


@pytest.mark.parametrize(
    ("value", "message"), [("0", "must be at least 1, got 0"), ("two", "expected an integer")]
)
def test_nproc_below_one_is_refused(value, message, capsys):
    from shardforge.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["train", "any.yaml", "--nproc", value])
    assert exit_info.value.code == 2
    assert f"argument --nproc: {message}" in capsys.readouterr().err


def test_a_model_folder_says_what_it_lacks(tmp_path):
    """A folder with config.json alone is refused for its missing weights, and a folder with weights but no
    tokenizer for its missing tokenizer, instead of failing later on data without trainable tokens."""
    from shardforge.config.schema import ModelSection
    from shardforge.errors import ModelError
    from shardforge.models import build_preset, save_model
    from shardforge.models.build import load_tokenizer, model_source

    folder = save_model(build_preset("tiny-llama", vocab_size=64), tmp_path / "model")
    (folder / "model.safetensors").unlink()
    with pytest.raises(
        ModelError,
        match=r"model.path: .*no model.safetensors or model.safetensors.index.json .*needs its weights",
    ):
        model_source(ModelSection(path=str(folder)))
    save_model(build_preset("tiny-llama", vocab_size=64), folder)  # weights back, still no tokenizer
    with pytest.raises(ModelError, match=r"model.path '.*model' has no tokenizer \(none of tokenizer.json"):
        load_tokenizer(ModelSection(path=str(folder)))
