"""The web UI's form <-> config mapping, its path restriction and its auth requirement (no browser)."""

from __future__ import annotations

import re

import pytest
import yaml

from shardforge.config import load_config
from shardforge.errors import ConfigError
from shardforge.webui import form
from shardforge.webui.access import AUTH_ENV, Root, require_auth
from tests.conftest import REPO


def _documented_keys() -> set[str]:
    """Every key docs/config.md documents (a test elsewhere checks it documents every schema key)."""
    doc = (REPO / "docs" / "config.md").read_text()
    return set(re.findall(r"^\| `([a-z_.\[\]]+)` \|", doc, re.MULTILINE))


def test_every_config_key_is_a_form_field_or_inside_one():
    fields = {f.key for f in form.FIELDS}
    structured = {f.key for f in form.FIELDS if f.kind == "yaml"}
    unreachable = []
    for key in _documented_keys():
        parent = key.split("[]")[0]  # data.train[].path lives in the data.train field's YAML
        if (
            key not in fields
            and parent not in structured
            and not any(key.startswith(s + ".") for s in structured)
        ):
            unreachable.append(key)
    assert not unreachable, f"config keys the web UI cannot set: {unreachable}"
    assert set(form.CLI_ONLY) == {"--nproc", "--max-restarts"}  # launch options, not config keys


def test_fields_are_typed_from_the_schema():
    by = form.BY_KEY
    assert (by["train.lr"].kind, by["train.steps"].kind, by["data.packing"].kind) == ("number", "int", "bool")
    assert by["train.steps"].optional and not by["train.micro_batch"].optional
    assert by["parallel.zero_stage"].choices == (0, 1, 2, 3)
    assert by["method.stage"].choices == ("pt", "sft", "rm", "dpo", "kto", "grpo", "ppo")
    assert {by[k].kind for k in ("data.train", "method.lora.targets", "train.profile", "log.report_to")} == {
        "yaml"
    }
    assert by["data.train"].default is form.REQUIRED
    assert len({f.elem_id for f in form.FIELDS}) == len(form.FIELDS)


@pytest.mark.parametrize("example", sorted((REPO / "examples").glob("*.yaml")), ids=lambda p: p.name)
def test_every_example_config_survives_the_form(example, monkeypatch):
    """Loaded into the form and written back, each example is the same config."""
    monkeypatch.chdir(REPO)
    config = load_config(str(example))
    values = form.values_from_config(config)
    tree = form.tree_from_values(values)
    assert form.check(tree) == config
    assert load_config(None, base=yaml.safe_load(form.to_yaml(tree))) == config


def test_the_yaml_holds_only_what_differs_from_the_defaults(monkeypatch):
    monkeypatch.chdir(REPO)
    values = form.values_from_config(load_config("examples/demo.yaml"))
    values["parallel.zero_stage"] = "2"  # dropdowns hand back text
    values["train.profile"] = "{start: 5, steps: 2}"
    tree = form.tree_from_values(values)
    assert tree["parallel"] == {"zero_stage": 2} and tree["train"]["profile"] == {"start": 5, "steps": 2}
    assert "method" not in tree and "checkpoint" not in tree
    assert tree["data"]["train"] == [{"path": "examples/data/demo_alpaca.jsonl", "format": "alpaca"}]


@pytest.mark.parametrize(
    ("key", "raw", "message"),
    [
        ("parallel.zero_stage", "5", "parallel.zero_stage: '5' is not one of 0, 1, 2, 3"),
        ("train.micro_batch", 2.5, "train.micro_batch: 2.5 is not a whole number"),
        ("train.micro_batch", "", "train.micro_batch: a value is needed"),
        ("data.train", "[{path: a", "data.train: not valid YAML"),
    ],
)
def test_a_value_a_widget_cannot_hold_names_its_key(key, raw, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        form.tree_from_values({key: raw})


def test_validation_errors_are_the_configs_own_and_find_their_field():
    base = {"model": {"preset": "demo", "tokenizer": "t"}, "data": {"train": [{"path": "x.jsonl"}]}}
    values = form.values_from_config(load_config(None, base=base))
    values["parallel.offload"] = "optimizer"
    with pytest.raises(ConfigError) as error:
        form.check(form.tree_from_values(values))
    assert "parallel.offload=optimizer needs sharded states" in str(error.value)
    assert form.field_of_error(str(error.value)) == "parallel.offload"
    values["parallel.offload"], values["model.tokenizer"] = "none", ""
    with pytest.raises(ConfigError) as error:
        form.check(form.tree_from_values(values))
    assert form.field_of_error(str(error.value)) in ("model.tokenizer", "model.preset")
    assert form.field_of_error("data.train[0].path: no such file") == "data.train"


def test_paths_stay_inside_the_root(tmp_path):
    root = Root(tmp_path)
    assert root.resolve("runs/a") == tmp_path / "runs" / "a"
    assert root.resolve(tmp_path / "x") == tmp_path / "x"
    for outside in ("../elsewhere", "/etc/passwd", "runs/../../x"):
        with pytest.raises(ConfigError, match="outside the web UI's root"):
            root.resolve(outside, "model.path")
    (tmp_path / "link").symlink_to("/etc")
    with pytest.raises(ConfigError, match=r"'link/passwd' is outside"):
        root.resolve("link/passwd")
    datasets = [{"path": "d.jsonl"}, {"name": "n", "dataset_info": "../info.json"}]
    tree = {"output_dir": "runs/x", "model": {"path": "/models/m"}, "data": {"train": datasets}}
    assert form.paths_in(tree) == [("output_dir", "runs/x"), ("model.path", "/models/m"),
                                   ("data.train[0].path", "d.jsonl"),
                                   ("data.train[1].dataset_info", "../info.json")]  # fmt: skip
    with pytest.raises(ConfigError, match=r"model.path '/models/m' is outside"):
        root.check_all(form.paths_in(tree))
    with pytest.raises(ConfigError, match="no such folder"):
        Root(tmp_path / "missing")


def test_beyond_loopback_the_ui_needs_a_password(monkeypatch):
    monkeypatch.delenv(AUTH_ENV, raising=False)
    assert require_auth("127.0.0.1", None) == (None, None)
    with pytest.raises(ConfigError, match=r"--host 0.0.0.0 .* give --auth USER:PASSWORD"):
        require_auth("0.0.0.0", None)
    credentials, warning = require_auth("0.0.0.0", "ada:secret")
    assert credentials == ("ada", "secret") and "0.0.0.0" in warning
    monkeypatch.setenv(AUTH_ENV, "bob:pw")
    assert require_auth("0.0.0.0", None)[0] == ("bob", "pw")
    with pytest.raises(ConfigError, match="expected USER:PASSWORD"):
        require_auth("0.0.0.0", "nopassword")


def test_the_command_line_is_the_one_a_terminal_would_run():
    assert form.command_line("runs/x/webui-config.yaml", 1) == "shardforge train runs/x/webui-config.yaml"
    assert form.command_line("c.yaml", 4) == "shardforge train c.yaml --nproc 4"


def test_the_command_refuses_a_public_host_without_a_password(monkeypatch, capsys):
    from shardforge.cli import main

    monkeypatch.delenv(AUTH_ENV, raising=False)
    assert main(["webui", "--host", "0.0.0.0"]) == 2
    assert "give --auth USER:PASSWORD" in capsys.readouterr().err
    assert main(["webui", "--root", "/no/such/folder"]) == 2
