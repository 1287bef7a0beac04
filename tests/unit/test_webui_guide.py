"""The web UI's guided choices and pictures, without a browser: the sections a stage reads (the objectives'
declared traits, checked against what their code reads), the models and data sets found under a root (the
parameter count against transformers'), the presets (each the example it names), the planner chart's
figures, the curves of several runs, and the evaluate command."""

from __future__ import annotations

import inspect
import json
import re

import pytest
import yaml
from pydantic import BaseModel

from shardforge.config import load_config
from shardforge.config.method_schema import MethodSection
from shardforge.config.stages import STAGES
from shardforge.errors import ConfigError
from shardforge.objectives import method_sections, objective_class
from shardforge.webui import form, guide, pictures
from shardforge.webui.evaluate import eval_command
from tests.conftest import REPO, tiny_chat_model, write_jsonl

SUB_SECTIONS = {
    name
    for name, info in MethodSection.model_fields.items()
    if isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel)
}
ANY_STAGE = {"vision", "moe"}  # what the model is, not the stage: under "advanced"
FINETUNING = {"lora", "oft", "freeze"}


def _read_sections(cls: type) -> set[str]:
    """The method sub-sections an objective's own code (its class and the objective classes it derives
    from) reads: `method.<section>` and `self.<section> = self.method.<section>` aliases."""
    read: set[str] = set()
    for klass in cls.__mro__:
        if not klass.__module__.startswith("shardforge.objectives"):
            continue
        source = inspect.getsource(klass)
        read |= set(re.findall(r"method\.(\w+)", source)) & SUB_SECTIONS
    return read - ANY_STAGE - FINETUNING


@pytest.mark.parametrize("stage", sorted(STAGES))
def test_each_stage_declares_the_sections_its_code_reads(stage):
    cls = objective_class(stage)
    declared = set(cls.traits.sections)
    assert declared <= SUB_SECTIONS - ANY_STAGE - FINETUNING
    assert _read_sections(cls) <= declared, f"{stage} reads sections it does not declare"


def test_every_method_section_is_some_stages_or_finetunings():
    claimed = {s for stage in STAGES for s in objective_class(stage).traits.sections}
    assert claimed | ANY_STAGE | FINETUNING == SUB_SECTIONS


def test_the_sections_shown_follow_the_stage_and_the_finetuning():
    assert method_sections(MethodSection(stage="dpo", finetuning="lora")) == ("pref", "lora")
    assert guide.shown_sections("sft", "full") == set(guide.ALWAYS) | {"method.sft"}
    assert guide.shown_sections("ppo", "oft") == set(guide.ALWAYS) | {
        "method.rl", "method.ppo", "method.pref", "method.oft"
    }  # fmt: skip
    assert guide.shown_sections("pt", "freeze") == set(guide.ALWAYS) | {"method.freeze"}
    # every field is in a section the form draws: a stage's, a finetuning's, the common ones or advanced
    from shardforge.webui.app import ADVANCED

    drawn = set(guide.ALWAYS) | {f"method.{s}" for s in SUB_SECTIONS} | set(ADVANCED)
    assert {f.section for f in form.FIELDS} <= drawn
    for section, keys in guide.ESSENTIAL.items():  # the keys shown first are keys of their section
        assert {f"{section}.{k}" for k in keys} <= {f.key for f in form.FIELDS if f.section == section}
    from shardforge.webui.app import _sections

    grouped = _sections()
    assert [f.key for f in grouped["train (more)"]][:3] == ["train.min_lr_ratio", "train.warmup_from_zero",
                                                           "train.betas"]  # fmt: skip
    assert sum(len(v) for v in grouped.values()) == len(form.FIELDS) - 2  # and stage, finetuning on top


@pytest.mark.parametrize("name", list(guide.PRESETS))
def test_each_preset_is_the_example_it_names(name, monkeypatch):
    monkeypatch.chdir(REPO)
    values = form.values_from_tree(guide.preset_tree(name))
    example = load_config(str(guide.EXAMPLES / guide.PRESETS[name]))
    assert form.check(form.tree_from_values(values)) == example


def test_models_under_the_root_are_found_with_what_they_are(tmp_path):
    from transformers import AutoModelForCausalLM

    tiny_chat_model(tmp_path / "models" / "tiny", context=64)
    (tmp_path / ".hidden" / "m").mkdir(parents=True)
    (tmp_path / ".hidden" / "m" / "config.json").write_text('{"model_type": "llama"}')
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text('{"model_type": "no_such_family"}')
    found = {m.label: m for m in guide.model_choices(tmp_path)}
    assert [k for k in found if not k.startswith("preset: ")] == ["broken", "models/tiny"]
    hf_count = AutoModelForCausalLM.from_pretrained(tmp_path / "models" / "tiny").num_parameters()
    assert found["models/tiny"].about == f"llama, {hf_count / 1e6:.1f} M parameters, native backend"
    assert found["broken"].about.startswith("cannot train: unsupported model")
    assert found["preset: demo"].preset == "demo" and found["preset: demo"].path is None
    assert guide.tokenizer_folders(tmp_path) == ["models/tiny"]


def test_data_sets_under_the_root_files_and_dataset_info_entries(tmp_path):
    for folder in ("data", "lf"):
        (tmp_path / folder).mkdir()
    write_jsonl(tmp_path / "data" / "a.jsonl", [{"instruction": "x", "output": "y"}])
    write_jsonl(tmp_path / "data" / "b.jsonl", [{"messages": [{"role": "user", "content": "x"}]}])
    (tmp_path / "data" / "notes.json").write_text('{"not": "records"}')
    lf = tmp_path / "lf"
    write_jsonl(lf / "identity.jsonl", [{"instruction": "hi", "output": "hello"}])
    (lf / "dataset_info.json").write_text(json.dumps({"identity": {"file_name": "identity.jsonl"},
                                                       "hub_only": {"hf_hub_url": "org/x"}}))  # fmt: skip
    tiny = tiny_chat_model(tmp_path / "model", context=64)
    write_jsonl(tiny / "inside.jsonl", [{"instruction": "x", "output": "y"}])  # a model's folder: skipped
    choices = guide.dataset_choices(tmp_path)
    assert [(c.label, c.entry) for c in choices] == [
        ("data/a.jsonl (alpaca)", {"path": "data/a.jsonl", "format": "alpaca"}),
        ("data/b.jsonl (openai)", {"path": "data/b.jsonl", "format": "openai"}),
        ("identity (lf/dataset_info.json)", {"name": "identity", "dataset_info": "lf/dataset_info.json"}),
    ]
    labels = ["identity (lf/dataset_info.json)", "data/a.jsonl (alpaca)", "gone"]
    assert guide.train_entries(labels, choices) == [choices[2].entry, choices[0].entry]


def test_the_plan_chart_draws_the_planners_figures(monkeypatch):
    from shardforge.models.build import planning_shape
    from shardforge.planner.hardware import GIB, cluster_for
    from shardforge.planner.search import Planner

    monkeypatch.chdir(REPO)
    config = load_config("examples/demo.yaml")
    plan = Planner(config, planning_shape(config.model), cluster_for(config.hardware, 2)).search()
    rows = pictures.plan_rows(plan)
    for i, c in enumerate(plan.ranked, 1):
        mine = [r for r in rows if r["layout"] == f"#{i} {c.layout.describe()}"]
        memory = sum(r["value"] for r in mine if r["what"] == "memory GiB")
        assert memory == pytest.approx(c.memory.device_bytes / GIB, abs=1e-3)
        assert sum(r["value"] for r in mine if r["what"] == "step s") == pytest.approx(c.time.total, rel=1e-4)
    figure = pictures.plan_figure(plan)
    assert [ax.get_title() for ax in figure.axes] == [
        "memory per device by part",
        "estimated step time by part",
    ]
    assert figure.axes[0].lines[0].get_ydata()[0] == plan.cluster.device.memory_gib
    html = pictures.table_html(rows, "figures")
    assert html.count("<tr>") == len(rows) + 1 and "<caption>figures</caption>" in html


def test_curves_overlay_runs(tmp_path):
    for name, losses in (("a", [3.0, 2.0]), ("b", [4.0])):
        lines = [json.dumps({"step": i + 1, "loss": v, "lr": 0.1, "mfu": 0.2}) for i, v in enumerate(losses)]
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text("\n".join([*lines, '{"step": 9, "lo']))  # a torn line
    one = pictures.curve_rows({"a": tmp_path / "a"})
    assert one["loss"] == [
        {"step": 1, "series": "loss", "value": 3.0},
        {"step": 2, "series": "loss", "value": 2.0},
    ]
    two = pictures.curve_rows({"a": tmp_path / "a", "b": tmp_path / "b"})
    assert {r["series"] for r in two["loss"]} == {"a: loss", "b: loss"} and two["reward"] == []


def test_the_runs_tab_overlays_the_chosen_runs_on_the_launched_one(tmp_path):
    from shardforge.webui.access import Root
    from shardforge.webui.app import WebUI

    for name in ("a", "b"):
        (tmp_path / "runs" / name).mkdir(parents=True)
        (tmp_path / "runs" / name / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n")
    ui = WebUI(Root(tmp_path))
    assert ui.scan()[4]["choices"] == ["runs/a", "runs/b"]
    status, figure, text, drawn, *_ = ui.watch(["runs/a", "runs/b", "../outside"], None)
    assert status == "no run launched yet" and text == "runs/a: loss 2 at step 1; runs/b: loss 2 at step 1"
    assert [ax.get_title() for ax in figure.axes] == ["loss"]  # no reward, lr, ... points: no such plots
    assert [line.get_label() for line in figure.axes[0].lines] == ["runs/a: loss", "runs/b: loss"]
    again = ui.watch(["runs/a", "runs/b"], drawn)  # nothing changed: nothing drawn again
    assert again[1] == again[2] == {"__type__": "update"} and again[3] == drawn
    with (tmp_path / "runs" / "b" / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"step": 2, "loss": 1.5, "lr": 0.1}) + "\n")
    _, figure, text, _, *_ = ui.watch(["runs/a", "runs/b"], drawn)
    assert [ax.get_title() for ax in figure.axes if ax.get_visible()] == ["loss", "learning rate"]
    assert text.endswith("runs/b: loss 1.5 at step 2; runs/b: lr 0.1 at step 2")


def test_length_bins_count_every_record():
    bins = pictures.length_bins([1, 5, 40, 40, 199], bins=20)
    assert sum(b["records"] for b in bins) == 5 and bins[0] == {"from": 0, "to": 9, "records": 2}
    assert bins[-1]["from"] <= 199 <= bins[-1]["to"]


def test_the_evaluate_command():
    files = [{"path": "data/a.jsonl", "format": "alpaca"}]
    assert eval_command("m", files, "", "eval/m", 8, 16) == [
        "eval", "m", "--out", "eval/m", "--data", "data/a.jsonl", "--max-samples", "8",
        "--max-new-tokens", "16",
    ]  # fmt: skip
    named = [{"name": "identity", "dataset_info": "lf/dataset_info.json"}]
    assert eval_command("m", named, "", "o", None, None)[4:] == [
        "--data", "identity", "--dataset-info", "lf/dataset_info.json"
    ]  # fmt: skip
    assert eval_command("m", [], " shardforge_tiny_mc ", "o", 5, None)[4:] == [
        "--tasks", "shardforge_tiny_mc", "--limit", "5"
    ]  # fmt: skip
    with pytest.raises(ConfigError, match="records at most is -3; give a whole number >= 1"):
        eval_command("m", files, "", "o", -3, None)
    with pytest.raises(ConfigError, match="one of the two"):
        eval_command("m", files, "t", "o", None, None)
    with pytest.raises(ConfigError, match="dataset_info files; pick from one"):
        eval_command("m", [*named, {"name": "x", "dataset_info": "other.json"}], "", "o", None, None)


def test_values_from_a_tree_fill_every_field_and_keep_paths_plain():
    values = form.values_from_tree(yaml.safe_load((REPO / "examples" / "demo_lora.yaml").read_text()))
    assert set(values) == set(form.BY_KEY)
    assert values["model.path"] == "runs/demo/final" and values["method.lora.rank"] == 8
    assert values["parallel.zero_stage"] == str(form.BY_KEY["parallel.zero_stage"].default)


def test_whatever_lies_under_the_root_the_pickers_list_without_failing(tmp_path):
    """Files of any bytes named like data, a dataset_info.json of any text, a config.json of any text: the
    scans skip what they cannot read and never raise."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    names = st.sampled_from(["a.jsonl", "b.json", "c.txt", "dataset_info.json", "config.json", "d.parquet"])

    @settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(st.lists(st.tuples(names, st.binary(max_size=200) | st.text(max_size=200)), max_size=4))
    def scan(files):
        root = tmp_path / "fuzz"
        if root.exists():
            import shutil

            shutil.rmtree(root)
        (root / "x").mkdir(parents=True)
        for name, content in files:
            path = root / "x" / name
            path.write_bytes(content) if isinstance(content, bytes) else path.write_text(content)
        for choice in guide.dataset_choices(root):
            assert choice.entry.get("path", "x/").startswith("x/")
        for model in guide.model_choices(root):
            assert model.about

    scan()


def test_the_data_picker_lists_every_local_entry_of_lfs_own_dataset_info(tmp_path):
    """LLaMA-Factory 0.9.5's data/ folder as it ships: every entry with a local file is listed, by name,
    none of its raw files (they mean what their entries say); hub-only entries are not offered."""
    import shutil

    from tests.lf.reference_env import reference

    shutil.copytree(reference().src / "data", tmp_path / "data")
    info = json.loads((tmp_path / "data" / "dataset_info.json").read_text())
    listed = [c.entry for c in guide.dataset_choices(tmp_path)]
    local = [name for name, entry in info.items() if "file_name" in entry]
    assert listed == [{"name": name, "dataset_info": "data/dataset_info.json"} for name in local]
    assert len(local) < len(info)  # LF's list has hub-only entries too
