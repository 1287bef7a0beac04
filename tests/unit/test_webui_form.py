"""The web UI's form <-> config mapping, its path restriction and its auth requirement (no browser)."""

from __future__ import annotations

import json
import re
import types
import typing

import pytest
import yaml
from pydantic import BaseModel

from shardforge.config import load_config
from shardforge.config.paths import file_refs
from shardforge.config.schema import Config
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
    # a checkbox has two values: a key whose default is None (unset) is a three-way choice instead
    assert not [f.key for f in form.FIELDS if f.kind == "bool" and (f.optional or f.default is None)]
    thinking = by["data.enable_thinking"]
    assert thinking.choices == (None, True, False)
    assert [form.parse_value(thinking, form.widget_value(thinking, v)) for v in (None, True, False)] == [
        None,
        True,
        False,
    ]
    assert form.tree_from_values({"data.enable_thinking": "None"}) == {}


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
    with pytest.raises(ConfigError, match="no such folder"):
        Root(tmp_path / "missing")


def _schema_path_keys(section: type[BaseModel], prefix: str = "") -> set[str]:
    """Every key of the schema whose type marks a file or folder (FileRef), by walking the section classes."""
    keys = set()
    for name, info in section.model_fields.items():
        annotation = info.annotation
        if "FileRef(" in repr(info.metadata) + repr(annotation):
            keys.add(prefix + name)
        listed = typing.get_origin(annotation) is list
        options = typing.get_args(annotation) if listed or typing.get_origin(annotation) else (annotation,)
        for inner in options:
            if isinstance(inner, type) and issubclass(inner, BaseModel):
                keys |= _schema_path_keys(inner, f"{prefix}{name}{'[]' if listed else ''}.")
    return keys


def _config_naming(values: dict[str, str]):
    """A config that sets every path-valued key of the schema (each to its value in `values`)."""
    tree = {
        "output_dir": values["output_dir"],
        "model": {"path": values["model.path"], "tokenizer": values["model.tokenizer"],
                  "adapter": values["model.adapter"]},
        "data": {
            "train": [{"path": values["data.train[].path"]},
                      {"name": "n", "dataset_info": values["data.train[].dataset_info"]}],
            "eval": [{"path": values["data.eval[].path"]},
                     {"name": "n", "dataset_info": values["data.eval[].dataset_info"]}],
            "cache_dir": values["data.cache_dir"],
        },
        "method": {
            "stage": "ppo", "finetuning": "lora",
            "pref": {"ref": values["method.pref.ref"]},
            "ppo": {"critic": values["method.ppo.critic"]},
            "rl": {"rewards": [{"model": values["method.rl.rewards[].model"]}]},
        },
        "checkpoint": {"resume": values["checkpoint.resume"]},
        "log": {"tracking_uri": values["log.tracking_uri"]},
    }  # fmt: skip
    return Config.model_validate(tree)


def test_every_path_valued_key_is_kept_inside_the_root(tmp_path):
    """Found by its type in the schema, not by a list of names: each key set outside the root is refused,
    naming the key; inside, all pass."""
    keys = _schema_path_keys(Config)
    assert {"method.pref.ref", "method.ppo.critic", "checkpoint.resume", "log.tracking_uri"} <= keys
    root = Root(tmp_path)
    inside = {key: f"in/{key.replace('[]', '')}" for key in keys}
    config = _config_naming(inside)
    assert {re.sub(r"\[\d+\]", "[]", key) for key, _, _ in file_refs(config)} == keys
    root.check_config(config)
    for key in sorted(keys):
        with pytest.raises(
            ConfigError, match=rf"{re.escape(key.split('[]')[0])}.* is outside the web UI's root"
        ):
            root.check_config(_config_naming({**inside, key: "/elsewhere/x"}))
    # words that are settings, and URLs, name no path
    settings = {**inside, "method.pref.ref": "auto", "method.ppo.critic": "head", "checkpoint.resume": "none"}
    root.check_config(_config_naming({**settings, "log.tracking_uri": "http://mlflow:5000"}))
    with pytest.raises(ConfigError, match=r"log\.tracking_uri"):
        root.check_config(_config_naming({**settings, "log.tracking_uri": "file:///elsewhere/mlruns"}))


def test_a_model_inside_the_root_that_reads_a_folder_outside_is_refused(tmp_path):
    root = Root(tmp_path / "root") if (tmp_path / "root").mkdir() is None else None
    adapter = tmp_path / "root" / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(
        json.dumps({"base_model_name_or_path": str(tmp_path / "base")})
    )
    with pytest.raises(ConfigError, match=r"adapter.*it reads .*base.* is outside"):
        root.check_model(adapter, "adapter")
    run = tmp_path / "root" / "run"
    (run / "final").mkdir(parents=True)
    (run / "final" / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "../../base"}))
    with pytest.raises(ConfigError, match="is outside"):
        root.check_model(run, "model")
    (tmp_path / "root" / "base").mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "base"}))
    assert root.check_model(adapter, "adapter") == adapter
    values = {key: "in/x" for key in _schema_path_keys(Config)} | {"model.adapter": str(adapter)}
    root.check_config(_config_naming(values))
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "/elsewhere/base"}))
    with pytest.raises(ConfigError, match=r"model.adapter \(it reads /elsewhere/base\)"):
        root.check_config(_config_naming(values))


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


def test_a_launched_run_keeps_its_dataset_cache_inside_the_root(monkeypatch):
    from shardforge.webui.app import CACHE_DIR, WebUI

    monkeypatch.chdir(REPO)
    ui = WebUI(Root(REPO))
    launched = {}

    def launch(*args):
        launched["args"] = args
        return types.SimpleNamespace(command=["python", "-m", "shardforge", "train"])

    monkeypatch.setattr(ui.runs, "launch", launch)
    values = form.values_from_config(load_config("examples/demo.yaml"))
    message = ui.launch(1, None, *(values[k] for k in ui.keys))
    assert "error" not in message, message
    assert launched["args"][3] == (f"data.cache_dir={REPO / CACHE_DIR}",)
    values["data.cache_dir"] = "my-cache"
    ui.launch(1, None, *(values[k] for k in ui.keys))
    assert launched["args"][3] == ()
