"""`shardforge convert` against LLaMA-Factory's own code (0.9.5, in its own environment: reference_env.py):
every training example LF ships, and hand-written edge cases, are resolved by LF's argument parser and by our
converter, and compared key by key (what each LF key means in our config, below); the learning rate of every
step equals what transformers' scheduler gives under LF's arguments; a file LF rejects, or one with keys we
cannot honour, is refused, never converted into another run. LF's merge and inference YAMLs become the
equivalent commands."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from shardforge.config import load_config
from shardforge.config.lf_convert import convert_lf, is_training
from shardforge.config.lf_tables import LF_DEFAULTS
from shardforge.errors import ConfigError
from shardforge.train.optim import lr_factor
from tests.chat_templates import QWEN3_THINKING, QWEN_TOOLS, tokenizer_with
from tests.conftest import REPO
from tests.lf.reference_env import reference

pytestmark = pytest.mark.slow
STEPS = 37  # optimizer steps the schedules are compared over
BASE = {"model_name_or_path": "org/model", "dataset": "alpaca_en_demo", "output_dir": "out"}
EDGE: dict[str, dict[str, Any]] = {  # hand-written: LF's defaults, and each mapped key off its default
    "defaults": {},
    "kto": {"stage": "kto", "pref_beta": 0.25, "kto_chosen_weight": 1.5, "kto_rejected_weight": 0.5},
    "dpo": {"stage": "dpo", "pref_beta": 0.3, "pref_ftx": 0.5, "dpo_label_smoothing": 0.1},
    "ipo": {"stage": "dpo", "pref_loss": "ipo"},
    "ipo_smoothing": {"stage": "dpo", "pref_loss": "ipo", "dpo_label_smoothing": 0.1},  # LF rejects it
    "simpo": {"stage": "dpo", "pref_loss": "simpo", "simpo_gamma": 0.7},
    "rm_full": {"stage": "rm", "finetuning_type": "full", "bf16": True},
    "pt": {"stage": "pt", "cutoff_len": 512},
    "freeze": {"finetuning_type": "freeze", "freeze_trainable_layers": -3,
               "freeze_extra_modules": "embed_tokens"},
    "lora": {"lora_rank": 16, "lora_alpha": 8, "lora_dropout": 0.05, "lora_target": "q_proj,v_proj",
             "use_rslora": True},
    "dora": {"use_dora": True, "lora_rank": 4},
    "qlora": {"quantization_bit": 4},
    "optimizer": {"adam_beta1": 0.8, "adam_beta2": 0.95, "adam_epsilon": 1e-6, "weight_decay": 0.1,
                  "max_grad_norm": 0.5, "optim": "adamw_torch"},
    "warmup_steps": {"warmup_steps": 3, "lr_scheduler_type": "cosine", "learning_rate": 1e-4},
    "warmup_ratio": {"warmup_ratio": 0.1, "lr_scheduler_type": "linear"},
    "warmup_float": {"warmup_steps": 0.05, "lr_scheduler_type": "cosine"},
    "constant_warmup": {"lr_scheduler_type": "constant_with_warmup", "warmup_steps": 4},
    "constant": {"lr_scheduler_type": "constant"},
    "min_lr": {"lr_scheduler_type": "cosine_with_min_lr", "lr_scheduler_kwargs": {"min_lr_rate": 0.1},
               "warmup_ratio": 0.2},
    "steps_win": {"max_steps": 50, "num_train_epochs": 2.0},
    "epochs": {"num_train_epochs": 1.5},
    "batch": {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 4, "seed": 7},
    "saving": {"save_steps": 20, "save_total_limit": 2, "logging_steps": 5},
    "no_saving": {"save_strategy": "no"},
    "eval": {"val_size": 0.1, "eval_strategy": "steps", "eval_steps": 20},
    "eval_count": {"val_size": 100},
    "overwrite": {"overwrite_output_dir": True},
    "resume": {"resume_from_checkpoint": "out/checkpoint-10"},
    "packing": {"packing": True},
    "neat": {"neat_packing": True},
    "prompt": {"train_on_prompt": True, "cutoff_len": 1024},
    "chatml": {"template": "chatml"},
    "no_thinking": {"template": "qwen3", "enable_thinking": False},
    "fp16": {"fp16": True},
    "no_checkpointing": {"disable_gradient_checkpointing": True},
    "report": {"report_to": ["wandb", "tensorboard"], "run_name": "exp"},
    "dft": {"use_dft_loss": True},
    "dft_ignored_by_dpo": {"stage": "dpo", "use_dft_loss": True},
    "neftune": {"neftune_noise_alpha": 5},
    "loraplus": {"loraplus_lr_ratio": 16.0},
    "llama_pro": {"finetuning_type": "freeze", "use_llama_pro": True, "freeze_trainable_layers": 8},
    "pissa": {"pissa_init": True, "pissa_iter": -1, "pissa_convert": True},
    "pissa_fast": {"pissa_init": True},
    "pissa_dpo": {"stage": "dpo", "pissa_init": True},
    "pure_bf16": {"pure_bf16": True},
    # refused: keys LF honours that shardforge cannot
    "galore": {"use_galore": True, "finetuning_type": "full", "galore_target": "q_proj,v_proj",
               "galore_rank": 4},
    "galore_layerwise": {"use_galore": True, "finetuning_type": "full", "galore_layerwise": True},
    "apollo": {"use_apollo": True, "finetuning_type": "full", "apollo_proj": "svd",
               "apollo_scale_front": True},
    "badam": {"use_badam": True, "finetuning_type": "full", "badam_mode": "ratio", "badam_update_ratio": 0.1},
    "adam_mini": {"use_adam_mini": True, "finetuning_type": "full"},
    "muon": {"use_muon": True},
    "muon_under_loraplus": {"use_muon": True, "loraplus_lr_ratio": 4.0},
    "adamw_8bit": {"optim": "adamw_bnb_8bit"},
    "paged_8bit": {"optim": "paged_adamw_8bit", "finetuning_type": "full"},
    "galore_with_lora": {"use_galore": True},
    "galore_with_apollo": {"use_galore": True, "use_apollo": True, "finetuning_type": "full"},
    "galore_8bit": {"use_galore": True, "finetuning_type": "full", "optim": "adamw_bnb_8bit"},
    "int8": {"quantization_bit": 8},
    "hqq": {"quantization_bit": 4, "quantization_method": "hqq"},
    "fp4": {"quantization_bit": 4, "quantization_type": "fp4"},
    "kto_pair": {"stage": "dpo", "pref_loss": "kto_pair"},
    "oft": {"finetuning_type": "oft"},
    "oft_targets": {"finetuning_type": "oft", "oft_block_size": 16, "lora_target": "q_proj,v_proj"},
    "oft_rank": {"finetuning_type": "oft", "oft_rank": 4, "oft_block_size": 0},
    "alpaca_template": {"template": "alpaca"},
    "polynomial": {"lr_scheduler_type": "polynomial"},
    "adafactor": {"optim": "adafactor"},
    "epoch_saving": {"save_strategy": "epoch"},
    "hub_data": {"dataset_dir": "ONLINE"},
    "ppo_without_reward": {"stage": "ppo"},
    "ppo_lora_reward": {"stage": "ppo", "reward_model": "saves/rm"},
    "tool_format": {"tool_format": "glm4"},
}  # fmt: skip
REFUSED = {
    "ipo_smoothing", "galore_with_lora", "galore_with_apollo", "galore_8bit",
    "int8", "hqq", "fp4", "kto_pair", "oft_rank", "alpaca_template", "polynomial",
    "adafactor", "epoch_saving", "hub_data", "ppo_without_reward", "ppo_lora_reward", "tool_format",
    "pissa_dpo",
}  # fmt: skip
EXAMPLE_FOLDERS = ("train_lora", "train_full", "train_qlora", "extras")


def expected(lf: dict[str, Any]) -> dict[str, Any]:
    """What each LF key, as LF resolved it, means in a shardforge config (dotted key -> value)."""
    rank = int(lf["lora_rank"])
    stage, targets = lf["stage"], lf["lora_target"]
    packing = lf["packing"] if lf["packing"] is not None else stage == "pt"
    precision = "bf16" if lf["bf16"] else "fp16" if lf["fp16"] else "fp32"
    out = {
        "method.stage": stage, "method.finetuning": lf["finetuning_type"], "method.lora.rank": rank,
        "method.lora.alpha": float(lf["lora_alpha"] or 2 * rank), "method.lora.dropout": lf["lora_dropout"],
        "method.lora.targets": "all" if targets == ["all"] else targets, "method.lora.dora": lf["use_dora"],
        "method.lora.rslora": lf["use_rslora"],
        "method.freeze.trainable_layers": lf["freeze_trainable_layers"],
        "method.freeze.extra_modules": lf["freeze_extra_modules"] or [],
        "data.max_length": lf["cutoff_len"], "data.packing": bool(packing or lf["neat_packing"]),
        "data.train_on_prompt": lf["train_on_prompt"], "data.truncation": "lf",
        "data.pt_blocks": bool(stage == "pt" and packing and not lf["neat_packing"]),
        "data.template": "chatml" if lf["template"] == "chatml" else "auto",
        "data.enable_thinking": lf["enable_thinking"],
        "data.image_max_pixels": lf["image_max_pixels"], "data.image_min_pixels": lf["image_min_pixels"],
        "method.vision.freeze_tower": lf["freeze_vision_tower"],
        "method.vision.freeze_projector": lf["freeze_multi_modal_projector"],
        "method.vision.freeze_language_model": lf["freeze_language_model"],
        "train.micro_batch": lf["per_device_train_batch_size"],
        "train.grad_accum": lf["gradient_accumulation_steps"], "train.lr": lf["learning_rate"],
        "train.weight_decay": lf["weight_decay"], "train.clip": lf["max_grad_norm"] or None,
        "train.betas": (lf["adam_beta1"], lf["adam_beta2"]), "train.eps": lf["adam_epsilon"],
        "train.seed": lf["seed"], "train.log_every": lf["logging_steps"], "train.precision": precision,
        "checkpoint.every": lf["save_steps"] if lf["save_strategy"] == "steps" else None,
        "checkpoint.keep": lf["save_total_limit"],
        "checkpoint.resume": lf["resume_from_checkpoint"]
        or ("none" if lf["overwrite_output_dir"] else "auto"),
        "parallel.activation_checkpoint": "none" if lf["disable_gradient_checkpointing"] else "full",
        "output_dir": lf["output_dir"],
        "log.report_to": [n for n in lf["report_to"] if n != "none"], "log.plot": lf["plot_loss"],
        "train.eval_every": (lf["eval_steps"] or lf["logging_steps"])
        if lf["eval_strategy"] == "steps" else None,
    }  # fmt: skip
    if lf["max_steps"] > 0:
        out["train.steps"] = lf["max_steps"]
    else:
        out |= {"train.epochs": lf["num_train_epochs"], "train.steps": None}
    if stage == "kto":
        out |= {"method.kto.beta": lf["pref_beta"], "method.kto.desirable_weight": lf["kto_chosen_weight"],
                "method.kto.undesirable_weight": lf["kto_rejected_weight"]}  # fmt: skip
    else:
        out |= {"method.pref.beta": lf["pref_beta"], "method.pref.ftx": lf["pref_ftx"],
                "method.pref.loss": lf["pref_loss"], "method.pref.simpo_gamma": lf["simpo_gamma"],
                "method.pref.label_smoothing": lf["dpo_label_smoothing"]}  # fmt: skip
    size = lf["val_size"]
    out |= {"data.eval_count": int(size)} if size >= 1 else {"data.eval_fraction": size}
    if lf["quantization_bit"] == 4:
        out["model.quantize"] = "nf4"
    out["method.sft.loss"] = "dft" if lf["use_dft_loss"] and stage == "sft" else "cross_entropy"
    out["train.neftune_alpha"] = lf["neftune_noise_alpha"]
    out["method.lora.plus_lr_ratio"] = lf["loraplus_lr_ratio"]
    out["method.freeze.llama_pro"] = lf["use_llama_pro"] and lf["finetuning_type"] == "freeze"
    if lf["finetuning_type"] == "oft":
        out["method.oft.block_size"] = lf["oft_block_size"]
        out["method.oft.targets"] = "all" if targets == ["all"] else targets
    if lf["pure_bf16"]:
        out["model.dtype"] = "bfloat16"
    menu = [n for n in ("galore", "apollo", "badam", "adam_mini", "muon") if lf[f"use_{n}"]]
    lora_plus = lf["finetuning_type"] == "lora" and lf["loraplus_lr_ratio"] is not None
    chosen = menu[0] if menu and (menu[0] in ("galore", "apollo") or not lora_plus) else None
    eight = lf["optim"] in ("adamw_bnb_8bit", "adamw_8bit", "paged_adamw_8bit")
    out["train.optimizer.name"] = chosen or ("adamw_8bit" if eight else "adamw")
    if chosen in ("galore", "apollo"):
        out[f"train.optimizer.{chosen}.rank"] = lf[f"{chosen}_rank"]
        out[f"train.optimizer.{chosen}.layerwise"] = lf[f"{chosen}_layerwise"]
        target = lf[f"{chosen}_target"]
        out[f"train.optimizer.{chosen}.targets"] = "all" if target == ["all"] else target
        if lf[f"{chosen}_layerwise"]:
            out["train.clip"] = None
    if chosen == "apollo":
        out["train.optimizer.apollo.proj"] = lf["apollo_proj"]
        out["train.optimizer.apollo.scale_front"] = lf["apollo_scale_front"]
    if chosen == "badam":
        out["train.optimizer.badam.mode"] = lf["badam_mode"]
        out["train.optimizer.badam.update_ratio"] = lf["badam_update_ratio"]
    out["method.lora.init"] = "pissa" if lf["pissa_init"] else "default"
    out["method.lora.pissa_iter"] = lf["pissa_iter"] if lf["pissa_init"] else 16
    return out


def ours(config: Any, dotted: str) -> Any:
    value = config
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


@pytest.fixture(scope="module")
def lf_cases(tmp_path_factory) -> tuple[Any, dict[str, dict], dict[str, dict]]:
    ref = reference()
    examples = {}
    for folder in EXAMPLE_FOLDERS:
        for path in sorted((ref.src / "examples" / folder).rglob("*.yaml")):
            mapping = yaml.safe_load(path.read_text())
            if isinstance(mapping, dict) and is_training(mapping) and "model_name_or_path" in mapping:
                examples[str(path.relative_to(ref.src / "examples"))] = mapping
    cases = {**examples, **{f"edge:{k}": {**BASE, **v} for k, v in EDGE.items()}}
    keys = sorted({*LF_DEFAULTS, "output_dir", "model_name_or_path"})
    answers = ref.resolve(cases, keys, STEPS, tmp_path_factory.mktemp("lf"))
    return ref, cases, answers


def test_our_table_of_lf_defaults_is_lf_s_own(lf_cases):
    _, _, answers = lf_cases
    resolved = answers["edge:defaults"]["args"]
    differ = {}
    for key, ours_default in LF_DEFAULTS.items():
        if key in BASE:
            continue
        theirs = resolved[key]
        if key == "lora_alpha":  # LF's post-init: twice the rank when unset (our None)
            theirs = None if theirs == 2 * resolved["lora_rank"] else theirs
        if key == "report_to":  # transformers' [] is LF's "none"
            theirs = "none" if theirs == [] else theirs
        if key in ("lora_target", "freeze_trainable_modules", "galore_target", "apollo_target"):  # LF splits
            theirs = ",".join(theirs)
        if theirs != ours_default:
            differ[key] = (ours_default, theirs)
    assert not differ, differ


def test_every_lf_example_and_edge_case_converts_to_lf_s_meaning_or_is_refused(lf_cases, monkeypatch):
    ref, cases, answers = lf_cases
    monkeypatch.chdir(ref.src)  # LF reads deepspeed files (and data) from where it runs: its repository
    converted, refused = [], []
    for name, mapping in cases.items():
        answer = answers[name]
        try:
            out = convert_lf(mapping)
        except ConfigError as e:
            assert "error" in answer or name.startswith("edge:"), f"{name}: {e}"
            refused.append(name)
            continue
        if out.command is not None:  # a prediction YAML (do_predict): the eval command (test_lf_extras.py)
            assert mapping.get("do_predict") and out.command.startswith("shardforge eval "), name
            continue
        if "error" in answer or out.unsupported:  # LF rejects it, or it needs what we lack: never converted
            assert out.unsupported or "error" not in answer, f"{name}: LF rejects it ({answer['error']})"
            named = {*mapping, *LF_DEFAULTS, "reward_model_type"}  # each names the LF key it is about
            assert all(item.split(":")[0] in named for item in out.unsupported), (name, out.unsupported)
            refused.append(name)
            continue
        config = load_config(None, base=out.config)
        lf = answer["args"]
        for key, want in expected(lf).items():
            got = ours(config, key)
            if isinstance(got, tuple):
                got = tuple(got)
            same = got == want or (isinstance(want, float) and got == pytest.approx(want))
            assert same, (name, key, got, want)
        lrs = [config.train.lr * lr_factor(step, STEPS, config.train) for step in range(STEPS)]
        assert lrs == pytest.approx(answer["lr"], rel=1e-9, abs=1e-15), (name, lrs, answer["lr"])
        converted.append(name)
    print(f"converted: {sorted(converted)}\nrefused: {sorted(refused)}")
    assert {n.removeprefix("edge:") for n in refused if n.startswith("edge:")} == REFUSED
    examples = [n for n in converted if not n.startswith("edge:")]
    assert len(examples) >= 10, examples  # LF's own train_lora / train_full / train_qlora examples convert
    assert "train_lora/qwen3_lora_sft.yaml" in examples and "train_full/qwen3_full_sft.yaml" in examples


@pytest.mark.parametrize("name", ["z0", "z2", "z2_offload", "z3", "z3_offload", "z2_autotp"])
def test_deepspeed_files_are_read_for_what_they_say(lf_cases, monkeypatch, name):
    ref, _, _ = lf_cases
    name = f"examples/deepspeed/ds_{name}_config.json"  # LF's own files, from where LF runs
    monkeypatch.chdir(ref.src)
    config = load_config(None, base=convert_lf({**BASE, "deepspeed": name}).config)
    ds = json.loads((ref.src / name).read_text())
    zero = ds["zero_optimization"]
    params = (zero.get("offload_param") or {}).get("device") == "cpu"
    optim = (zero.get("offload_optimizer") or {}).get("device") == "cpu"
    assert config.parallel.zero_stage == zero["stage"]
    assert config.parallel.offload == ("params" if params else "optimizer" if optim else "none")
    assert config.parallel.tp == (ds.get("tensor_parallel") or {}).get("autotp_size", 1)
    monkeypatch.chdir(ref.src / "examples")  # not where LF would run: the file is not found, said so
    with pytest.raises(ConfigError, match=r"deepspeed: .* is not a file \(LLaMA-Factory reads it from the"):
        convert_lf({**BASE, "deepspeed": name})


def test_merge_and_inference_yamls_become_the_equivalent_commands(lf_cases):
    ref, _, _ = lf_cases
    commands = {}
    for folder in ("merge_lora", "inference"):
        for path in sorted((ref.src / "examples" / folder).glob("*.yaml")):
            mapping = yaml.safe_load(path.read_text())
            assert not is_training(mapping), path
            commands[f"{folder}/{path.name}"] = convert_lf(mapping)
    lora = commands["merge_lora/qwen3_lora_sft.yaml"]
    assert lora.command == (
        "shardforge export saves/qwen3-4b/lora/sft --to saves/qwen3_sft_merged --merge --base "
        "Qwen/Qwen3-4B-Instruct-2507"
    )
    assert commands["inference/qwen3_lora_sft.yaml"].command == (
        "shardforge chat Qwen/Qwen3-4B-Instruct-2507 --adapter saves/qwen3-4b/lora/sft"
    )
    assert commands["merge_lora/qwen3_gptq.yaml"].unsupported  # a GPTQ export is not ours to make
    assert all(c.command and c.command.startswith("shardforge ") for c in commands.values())


def test_the_command_refuses_what_it_cannot_honour_unless_allowed(lf_cases, tmp_path):
    ref, _, _ = lf_cases
    source = ref.src / "examples" / "extras" / "mod" / "llama3_full_sft.yaml"
    run = [sys.executable, "-m", "shardforge", "convert", str(source)]
    refused = subprocess.run(run, capture_output=True, text=True, cwd=REPO, timeout=120)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert (
        "mixture_of_depths: mixture-of-depths" in refused.stdout and "--allow-unsupported" in refused.stdout
    )
    allowed = subprocess.run(
        [*run, "--allow-unsupported", "--to", str(tmp_path / "ours.yaml")],
        capture_output=True, text=True, cwd=REPO, timeout=120,
    )  # fmt: skip
    assert allowed.returncode == 0, allowed.stdout + allowed.stderr
    text = (tmp_path / "ours.yaml").read_text()
    assert "# UNSUPPORTED (--allow-unsupported), not honoured: mixture_of_depths: mixture-of-depths" in text
    assert math.isclose(load_config(tmp_path / "ours.yaml").train.lr, 1e-5)
    merge = ref.src / "examples" / "merge_lora" / "qwen3_lora_sft.yaml"
    proc = subprocess.run([*run[:-1], str(merge)], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0 and "shardforge export saves/qwen3-4b/lora/sft" in proc.stdout, proc.stdout


def test_infer_seqlen_is_lf_s_own(lf_cases):
    """data.truncation: lf cuts by LF's own rule, over every (prompt, reply) length pair up to 40 tokens and
    cutoffs from 1 to 48."""
    from shardforge.data.truncate import infer_seqlen

    ref, _, _ = lf_cases
    grid = [(s, t, c) for s in range(0, 41, 3) for t in range(0, 41, 3) for c in range(1, 49, 5)]
    code = (  # importing lf_reference puts stand-ins for LF's multimodal imports first
        f"import json, sys; sys.path.insert(0, {str(Path(__file__).parent)!r}); import lf_reference\n"
        "from llamafactory.data.processor.processor_utils import infer_seqlen\n"
        "print(json.dumps([infer_seqlen(*x) for x in json.loads(sys.argv[1])]))"
    )
    proc = subprocess.run(
        [str(ref.python), "-c", code, json.dumps(grid)], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    theirs = [tuple(x) for x in json.loads(proc.stdout.strip().splitlines()[-1])]
    assert [infer_seqlen(*x) for x in grid] == theirs


@pytest.mark.parametrize(
    "example", ["qwen3_lora_dpo", "qwen3_lora_kto", "qwen3_lora_reward", "qwen3_lora_sft"]
)
def test_converted_lf_examples_keep_every_example_of_lf_s_demo_data(lf_cases, tmp_path, example):
    """LF's own examples converted and their data (LF's demo sets, through its dataset_info.json) prepared at
    a max_length most of them exceed: every record is kept, as LF's processors keep them (data.truncation:
    lf), where cutting at the right dropped the pairs whose prompt filled the row."""
    from tests.conftest import TOKENIZER

    ref, _, _ = lf_cases
    ours = tmp_path / "ours.yaml"
    source = ref.src / "examples" / "train_lora" / f"{example}.yaml"
    convert = [sys.executable, "-m", "shardforge", "convert", str(source), "--to", str(ours)]
    assert subprocess.run(convert, capture_output=True, text=True, cwd=ref.src, timeout=120).returncode == 0
    overrides = ["model.path=null", "model.preset=tiny-llama", f"model.tokenizer={TOKENIZER}",
                 "data.max_length=128", f"output_dir={tmp_path / 'run'}"]  # fmt: skip
    prepare = [sys.executable, "-m", "shardforge", "data", "prepare", str(ours), *overrides]
    proc = subprocess.run(prepare, capture_output=True, text=True, cwd=ref.src, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    stats = dict(kv.split("=") for kv in proc.stdout.split("train: ", 1)[1].splitlines()[0].split(", "))
    assert int(stats["truncated"]) > 0 and int(stats["dropped_no_target"]) == 0, stats
    per_record = 1 if example.endswith("sft") else 2
    assert int(stats["sequences"]) == per_record * int(stats["records"]), stats


def test_pretraining_blocks_are_lf_s_token_for_token(lf_cases, tmp_path, monkeypatch):
    """LF's pt example converted (data.pt_blocks) on LF's c4 demo: the blocks equal what LF's own data
    pipeline makes of the same file with the same tokenizer, token for token."""
    from shardforge.config import load_config
    from shardforge.data.build import build_data
    from shardforge.models.build import model_source
    from shardforge.objectives import build_objective, reading_of
    from tests.conftest import TOKENIZER

    ref, _, _ = lf_cases
    monkeypatch.chdir(ref.src)
    lf = yaml.safe_load((ref.src / "examples" / "train_lora" / "qwen3_lora_pretrain.yaml").read_text())
    converted = convert_lf(lf).config
    converted["model"] = {"preset": "tiny-llama", "tokenizer": str(TOKENIZER)}
    converted["data"] |= {"max_length": 256, "workers": 1, "cache_dir": str(tmp_path / "cache")}
    converted["output_dir"] = str(tmp_path / "run")
    config = load_config(None, base=converted)
    assert config.data.pt_blocks and [d.name for d in config.data.train] == ["c4_demo"]
    objective = build_objective(config.method)
    train, _ = build_data(config, model_source(config.model)[1], objective, reading_of(objective), True)
    ours = train.examples.tokens.tolist()
    blocks = ref.preprocess({"stage": "pt", "dataset": "c4_demo", "cutoff_len": 256}, TOKENIZER, tmp_path)
    theirs = [i for block in blocks["train"]["input_ids"] for i in block]
    assert len(ours) == len(theirs) and len(ours) % 256 == 0 and len(ours) > 100 * 256 and ours == theirs


def _multi_turn(folder: Path) -> Path:
    """A sharegpt data set of 3-turn conversations, some with a system message, some long: what LF's
    mask_history and default_system act on (its demo sets are single-turn)."""
    rows = []
    for i in range(12):
        turns = []
        for t in range(3):
            question = f"question {i}.{t} " + "word " * (3 + 7 * ((i + t) % 3))
            answer = f"answer {i}.{t} " + "reply " * (2 + 9 * ((i * t) % 4))
            turns += [{"from": "human", "value": question}, {"from": "gpt", "value": answer}]
        row = {"conversations": turns}
        if i % 4 == 0:
            row["system"] = f"system prompt {i}"
        rows.append(row)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "multi.json").write_text(json.dumps(rows))
    info = {"multi": {"file_name": "multi.json", "formatting": "sharegpt",
                      "columns": {"messages": "conversations", "system": "system"}}}  # fmt: skip
    (folder / "dataset_info.json").write_text(json.dumps(info))
    return folder


def _thoughts(folder: Path) -> Path:
    """An alpaca data set whose replies are a reasoning model's: a thought, then the answer (or, for some,
    the answer alone), what LF's enable_thinking keeps or removes."""
    rows = []
    for i in range(16):
        answer = f"answer {i} " + "so " * (1 + 5 * (i % 3))
        thought = f"<think>\nthinking {i} " + "hmm " * (2 + 4 * (i % 4)) + "\n</think>\n\n"
        rows.append(
            {
                "instruction": f"question {i} " + "why " * (i % 5),
                "input": "",
                "output": (thought if i % 3 else "") + answer,
            }
        )
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "thoughts.json").write_text(json.dumps(rows))
    (folder / "dataset_info.json").write_text(json.dumps({"thoughts": {"file_name": "thoughts.json"}}))
    return folder


def lf_labels(example: Any) -> list[int]:
    """An example's targets as LF writes its labels: the token where trained, -100 elsewhere."""
    return [t if f else -100 for t, f in zip(example.input_ids, example.trained, strict=True)]


def _qwen3(stage: str, dataset: str, thinking: bool) -> tuple:
    """A case under LF's qwen3 template (its enable_thinking given when off) and ours, the model's own."""
    lf = {"template": "qwen3"} | ({} if thinking else {"enable_thinking": False})
    return stage, dataset, lf, {"template": "auto", "enable_thinking": thinking}


CASES = {  # (LF's arguments, our data section's) beyond stage, dataset and cutoff
    "sft-alpaca": ("sft", "alpaca_en_demo", {}, {}),
    "sft-identity": ("sft", "identity", {}, {}),
    "dpo": ("dpo", "dpo_en_demo", {}, {}),
    "rm": ("rm", "dpo_en_demo", {}, {}),
    "kto": ("kto", "kto_en_demo", {}, {}),
    "default_system": (
        "sft",
        "alpaca_en_demo",
        {"default_system": "Be brief."},
        {"default_system": "Be brief."},
    ),
    "multi-turn": ("sft", "multi", {}, {}),
    "mask_history": ("sft", "multi", {"mask_history": True}, {"mask_history": True}),
    "multi-system": ("sft", "multi", {"default_system": "Be kind."}, {"default_system": "Be kind."}),
    "mix-probs": (
        "sft",
        "alpaca_en_demo,identity",
        {"mix_strategy": "interleave_under", "interleave_probs": "0.7,0.3"},
        {"mix": "interleave_under", "mix_probs": [0.7, 0.3]},
    ),
    "mix-over": (
        "sft",
        "identity,alpaca_en_demo",
        {"mix_strategy": "interleave_over"},
        {"mix": "interleave_over"},
    ),
    "val_size": ("sft", "alpaca_en_demo", {"val_size": 0.1}, {"eval_fraction": 0.1}),
    "val_count": ("kto", "kto_en_demo", {"val_size": 25}, {"eval_count": 25}),
    # the model's own chat template (tests/chat_templates.py) against LF's template of that family
    "tools": ("sft", "glaive_toolcall_en_demo", {"template": "qwen"}, {"template": "auto"}),
    "tools-zh": ("sft", "glaive_toolcall_zh_demo", {"template": "qwen"}, {"template": "auto"}),
    "tools-mask_history": (
        "sft",
        "glaive_toolcall_en_demo",
        {"template": "qwen", "mask_history": True},
        {"template": "auto", "mask_history": True},
    ),
    "thinking": _qwen3("sft", "alpaca_en_demo", True),
    "no-thinking": _qwen3("sft", "alpaca_en_demo", False),
    "thoughts": _qwen3("sft", "thoughts", True),
    "thoughts-off": _qwen3("sft", "thoughts", False),
    "dpo-no-thinking": _qwen3("dpo", "dpo_en_demo", False),
}
TEMPLATES = {"qwen": QWEN_TOOLS, "qwen3": QWEN3_THINKING}  # LF's template -> the family's own, in Jinja


@pytest.mark.parametrize("case", sorted(CASES))
def test_lf_s_data_encodes_as_lf_encodes_it_record_for_record(lf_cases, tmp_path, monkeypatch, case):
    """LF's demo data sets (and multi-turn conversations) read through a dataset_info.json and encoded by
    LF's own pipeline and ours, with the chatml template and LF's truncation at a cutoff most examples
    exceed: the same token ids and the same targets (LF's labels), sequence for sequence, a preference
    pair's chosen and rejected, a KTO example and its KL pair; default_system and mask_history as LF's."""
    from shardforge.config import load_config
    from shardforge.data.build import build_data
    from shardforge.models.build import model_source
    from shardforge.objectives import build_objective, reading_of
    from tests.conftest import TOKENIZER

    ref, _, _ = lf_cases
    stage, dataset, lf_extra, our_extra = CASES[case]
    made = {"multi": _multi_turn, "thoughts": _thoughts}
    folder = made[dataset](tmp_path / "data") if dataset in made else ref.src / "data"
    template = lf_extra.get("template")
    tokenizer = tokenizer_with(TEMPLATES[template], tmp_path / "tok") if template in TEMPLATES else TOKENIZER
    lf_args = {"stage": stage, "dataset": dataset, "cutoff_len": 96, "dataset_dir": str(folder), **lf_extra}
    theirs = ref.preprocess(lf_args, tokenizer, tmp_path)
    specs = [{"name": n, "dataset_info": str(folder / "dataset_info.json")} for n in dataset.split(",")]
    config = load_config(None, base={
        "model": {"preset": "tiny-llama", "tokenizer": str(tokenizer)}, "method": {"stage": stage},
        "data": {"train": specs, "template": "chatml", "max_length": 96, "truncation": "lf", "packing": False,
                 "cache": False, "workers": 1, **our_extra},
        "train": {"seed": 42},  # LF's default seed: its mixing and its val_size split draw from it
        "output_dir": str(tmp_path / "run"),
    })  # fmt: skip
    objective = build_objective(config.method)
    how = reading_of(objective, config.data.default_system)
    splits = build_data(config, model_source(config.model)[1], objective, how, True)
    prefixes = {"dpo": ("chosen_", "rejected_"), "rm": ("chosen_", "rejected_"), "kto": ("", "kl_")}
    prefixes = prefixes.get(stage, ("",))
    assert set(theirs) == {"train", "eval"} if case.startswith("val") else {"train"}
    for (split, columns), rows in zip(theirs.items(), splits, strict=False):
        ours = [rows.examples[i] for i in range(len(rows.examples))]
        labelled = [(list(e.input_ids), lf_labels(e)) for e in ours]
        groups = [tuple(labelled[j : j + len(prefixes)]) for j in range(0, len(labelled), len(prefixes))]
        lf_groups = [
            tuple((columns[f"{p}input_ids"][i], columns[f"{p}labels"][i]) for p in prefixes)
            for i in range(len(columns[f"{prefixes[0]}input_ids"]))
        ]
        assert len(groups) == len(lf_groups) > 0, split
        first = next((i for i, (a, b) in enumerate(zip(groups, lf_groups, strict=True)) if a != b), None)
        assert first is None, (split, first)
