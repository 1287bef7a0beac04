"""A LLaMA-Factory YAML read with LLaMA-Factory's meaning (`shardforge convert lf.yaml`).

A training YAML is resolved as LF's own parser resolves it: every key we map starts from LF's default
(`LF_DEFAULTS`: LF 0.9.5's hparams dataclasses and the transformers `TrainingArguments` it inherits), the
YAML's values on top, and the whole result is written out, so a key left out means LF's value, not ours.
Each mapped key has a rule (RULES); keys whose counterpart changes nothing in a shardforge run are noted
(NOTHING_TO_DO); a key we cannot honour is *unsupported*: the command refuses the file with the list (what
each would need) unless `--allow-unsupported`, and a key at LF's "off" value is harmless. tests/lf/ checks
the table and the rules against LF's own parser, and the schedule against transformers' schedulers.

A merge / export or inference YAML (LF's `examples/merge_lora`, `examples/inference`) is not a training run:
it converts to the equivalent `shardforge export` / `chat` command.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_args

from shardforge.config.schema import Tracker
from shardforge.errors import ConfigError

TRACKERS = get_args(Tracker)

# LF 0.9.5's defaults (with transformers 5's TrainingArguments) of every key a rule reads.
LF_DEFAULTS: dict[str, Any] = {
    "stage": "sft",
    "finetuning_type": "lora",
    "adapter_name_or_path": None,
    "quantization_bit": None,
    "quantization_method": "bnb",
    "quantization_type": "nf4",
    "lora_rank": 8,
    "lora_alpha": None,  # twice lora_rank
    "lora_dropout": 0.0,
    "lora_target": "all",
    "use_dora": False,
    "use_rslora": False,
    "freeze_trainable_layers": 2,
    "freeze_trainable_modules": "all",
    "freeze_extra_modules": None,
    "pref_beta": 0.1,
    "pref_ftx": 0.0,
    "pref_loss": "sigmoid",
    "simpo_gamma": 0.5,
    "dpo_label_smoothing": 0.0,
    "ref_model": None,
    "kto_chosen_weight": 1.0,
    "kto_rejected_weight": 1.0,
    "reward_model": None,
    "dataset": None,
    "eval_dataset": None,
    "dataset_dir": "data",
    "max_samples": None,
    "template": None,
    "default_system": None,
    "mix_strategy": "concat",
    "interleave_probs": None,
    "mask_history": False,
    "enable_thinking": True,
    "image_max_pixels": 768 * 768,
    "image_min_pixels": 32 * 32,
    "freeze_vision_tower": True,
    "freeze_multi_modal_projector": True,
    "freeze_language_model": False,
    "cutoff_len": 2048,
    "packing": None,  # pretraining packs, the other stages do not
    "neat_packing": False,
    "train_on_prompt": False,
    "val_size": 0.0,
    "preprocessing_num_workers": None,
    "logging_steps": 500,
    "save_strategy": "steps",
    "save_steps": 500,
    "save_total_limit": None,
    "plot_loss": False,
    "report_to": "none",
    "run_name": None,
    "per_device_train_batch_size": 8,
    "gradient_accumulation_steps": 1,
    "learning_rate": 5e-5,
    "num_train_epochs": 3.0,
    "max_steps": -1,
    "lr_scheduler_type": "linear",
    "lr_scheduler_kwargs": None,
    "warmup_ratio": None,
    "warmup_steps": 0,
    "weight_decay": 0.0,
    "adam_beta1": 0.9,
    "adam_beta2": 0.999,
    "adam_epsilon": 1e-8,
    "optim": "adamw_torch_fused",
    "max_grad_norm": 1.0,
    "seed": 42,
    "bf16": False,
    "fp16": False,
    "eval_strategy": "no",
    "eval_steps": None,
    "resume_from_checkpoint": None,
    "overwrite_output_dir": False,
    "ddp_timeout": 1800,
    "disable_gradient_checkpointing": False,
    "use_dft_loss": False,
    "neftune_noise_alpha": None,
    "loraplus_lr_ratio": None,
    "use_llama_pro": False,
    "pissa_init": False,
    "pissa_iter": 16,
    "oft_rank": 0,
    "oft_block_size": 32,
    "module_dropout": 0.0,
    "pure_bf16": False,
    "use_galore": False,
    "use_apollo": False,
    "use_badam": False,
    "use_adam_mini": False,
    "use_muon": False,
    "galore_target": "all",
    "galore_rank": 16,
    "galore_update_interval": 200,
    "galore_scale": 2.0,
    "galore_proj_type": "std",
    "galore_layerwise": False,
    "apollo_target": "all",
    "apollo_rank": 16,
    "apollo_update_interval": 200,
    "apollo_scale": 32.0,
    "apollo_proj": "random",
    "apollo_proj_type": "std",
    "apollo_scale_type": "channel",
    "apollo_layerwise": False,
    "apollo_scale_front": False,
    "badam_mode": "layer",
    "badam_start_block": None,
    "badam_switch_mode": "ascending",
    "badam_switch_interval": 50,
    "badam_update_ratio": 0.05,
    "badam_mask_mode": "adjacent",
}

# LF keys that need nothing in shardforge (the behaviour is built in, or belongs to HF Trainer's bookkeeping)
NOTHING_TO_DO = {
    "do_train": "a shardforge run always trains",
    "do_eval": "evaluation runs when data.eval or data.eval_fraction is set",
    "trust_remote_code": "models are built from their config with no remote code",
    "overwrite_cache": "the dataset cache is keyed by content: a change re-encodes",
    "dataloader_num_workers": "batches come from the memory-mapped cache",
    "save_only_model": "checkpoints hold what resuming needs; final/ is the model",
    "flash_attn": "attention is SDPA (packed rows per document)",
    "enable_liger_kernel": "the LM head is fused with the loss already",
    "per_device_eval_batch_size": "evaluation uses train.micro_batch",
    "ddp_find_unused_parameters": "not needed by FSDP2 / DDP here",
    "gradient_checkpointing": "read with disable_gradient_checkpointing (parallel.activation_checkpoint)",
    "upcast_layernorm": "norms compute in fp32 already",
    "double_quantization": "NF4's scales are quantized as in QLoRA",
    "data_seed": "data order follows train.seed",
    "logging_first_step": "the first step is logged",
}
# LF keys whose value at LF's "off" needs nothing, and otherwise has no counterpart (unsupported)
WANTS = {
    "pissa_init": "PiSSA initialisation",
"mixture_of_depths": "mixture-of-depths",
    "use_asft_loss": "the ASFT loss", "use_eaft_loss": "the EAFT loss",

    "fp8": "fp8 training", "do_predict": "prediction in a training run (shardforge eval after it)",
    "predict_with_generate": "prediction in a training run (shardforge eval after it)",
    "streaming": "LF's streaming (use data.streaming)",
    "additional_target": "training extra modules beside LoRA", "resize_vocab": "vocabulary resizing",
    "video_max_pixels": "video data", "use_unsloth": "Unsloth kernels",
    "shift_attn": "S^2-attention", "rope_scaling": "RoPE scaling at load", "use_kt": "KTransformers",
    "tokenized_path": "LF's pre-tokenized datasets",
    "tool_format": "a tool format other than the model's chat template's own",
    "preserve_thinking": "earlier turns' thoughts kept (the model's chat template decides)",
    "new_special_tokens": "added special tokens",
    "ppo_buffer_size": "LF's PPO options", "ppo_epochs": "LF's PPO options", "ppo_target": "LF's PPO options",
    "ppo_score_norm": "LF's PPO options", "ppo_whiten_rewards": "LF's PPO options",
}  # fmt: skip
# LF's "off" for the keys above where it is not False / None
OFF = {"mix_strategy": "concat",
       "video_max_pixels": 256 * 256, "ppo_buffer_size": 1, "ppo_epochs": 4, "ppo_target": 6.0}  # fmt: skip

SCHEDULES = {
    "cosine": "cosine",
    "linear": "linear",
    "constant": "constant",
    "constant_with_warmup": "constant",
}
STAGES = {"pt": "pt", "sft": "sft", "rm": "rm", "dpo": "dpo", "kto": "kto", "ppo": "ppo"}
PREF_LOSSES = {"sigmoid": "sigmoid", "hinge": "hinge", "ipo": "ipo", "orpo": "orpo", "simpo": "simpo"}
ADAMW = ("adamw_torch", "adamw_torch_fused", "adamw_hf")
ADAMW_8BIT = ("adamw_bnb_8bit", "adamw_8bit", "paged_adamw_8bit")  # bitsandbytes' (paging: not reproduced)
# LF's optimizer switches, in the order its create_custom_optimizer takes them (LoRA+ after apollo)
MENU = ("galore", "apollo", "badam", "adam_mini", "muon")
# each projected optimizer's keys: LF's suffix -> (ours, LF's type)
PROJECTED = {
    "galore": {"target": ("targets", str), "rank": ("rank", int), "update_interval": ("update_interval", int),
               "scale": ("scale", float), "proj_type": ("proj_type", str), "layerwise": ("layerwise", bool)},
    "apollo": {"target": ("targets", str), "rank": ("rank", int), "update_interval": ("update_interval", int),
               "scale": ("scale", float), "proj": ("proj", str), "proj_type": ("proj_type", str),
               "scale_type": ("scale_type", str), "scale_front": ("scale_front", bool),
               "layerwise": ("layerwise", bool)},
    "badam": {"mode": ("mode", str), "start_block": ("start_block", int), "switch_mode": ("switch_mode", str),
              "switch_interval": ("switch_interval", int), "update_ratio": ("update_ratio", float),
              "mask_mode": ("mask_mode", str)},
}  # fmt: skip
# LF's generic templates (not any model's own chat format): no counterpart, and `auto` would differ
GENERIC_TEMPLATES = ("alpaca", "default", "empty", "vicuna", "cpm", "ziya", "aquila", "belle", "intern")
INFER_KEYS = ("infer_backend", "export_dir")  # a merge / export or inference YAML has these, and no stage


@dataclass
class Converted:
    config: dict[str, Any]  # the shardforge config tree
    notes: list[str] = field(default_factory=list)  # how keys were read, where it is not one to one
    unsupported: list[str] = field(default_factory=list)  # "key: what it would need"
    command: str | None = None  # a merge / inference YAML: the equivalent shardforge command


def _put(tree: dict, dotted: str, value: Any) -> None:
    *path, last = dotted.split(".")
    for key in path:
        tree = tree.setdefault(key, {})
    tree[last] = value


def _names(value: Any) -> list[str]:
    """LF's comma-separated lists (dataset: a,b; lora_target: q_proj,v_proj)."""
    items = value if isinstance(value, list) else str(value).split(",")
    return [str(v).strip() for v in items if str(v).strip()]


def _cast(key: str, kind: type, value: Any) -> Any:
    """`value` as LF's type for `key`, or a one-line error naming the key (LF's parser refuses it too)."""
    if kind is bool:
        if isinstance(value, bool):
            return value
        if str(value).lower() in ("true", "false"):
            return str(value).lower() == "true"
    else:
        try:
            if kind is int and float(value) != int(float(value)):
                raise ValueError
            return kind(float(value)) if kind is int else kind(value)
        except (TypeError, ValueError):
            pass
    raise ConfigError(f"{key}: {value!r} is not {'an' if kind is int else 'a'} {kind.__name__}")


def _deepspeed(value: Any, out: Converted) -> None:
    """A DeepSpeed config (a JSON file, found as transformers finds it: from the working directory, or an
    inline mapping) read for its ZeRO stage and offload."""
    if isinstance(value, dict):
        ds, where = value, "the inline deepspeed mapping"
    else:
        path = Path(str(value))
        if not path.is_file():
            raise ConfigError(
                f"deepspeed: {value} is not a file (LLaMA-Factory reads it from the working directory, "
                f"{Path.cwd()}; run convert from the folder LF would run from)"
            )
        try:
            ds = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"deepspeed: {path} is not valid JSON ({e})") from None
        where = str(path)
    zero = ds.get("zero_optimization") or {}
    stage = zero.get("stage", 0)
    if stage not in (0, 1, 2, 3):
        raise ConfigError(f"deepspeed: {where}: zero_optimization.stage {stage!r} is not 0, 1, 2 or 3")
    params = (zero.get("offload_param") or {}).get("device") in ("cpu", "nvme")
    optim = (zero.get("offload_optimizer") or {}).get("device") in ("cpu", "nvme")
    if stage:
        _put(out.config, "parallel.zero_stage", stage)
    offload = "params" if params else "optimizer" if optim else "none"
    if offload != "none":
        if stage < 2:
            out.unsupported.append(
                f"deepspeed: offload with ZeRO-{stage} (shardforge offloads sharded states)"
            )
        _put(out.config, "parallel.offload", offload)
    tp = (ds.get("tensor_parallel") or {}).get("autotp_size")
    if tp:  # DeepSpeed's automatic tensor parallel
        _put(out.config, "parallel.tp", int(tp))
    out.notes.append(
        f"deepspeed: {where}: ZeRO-{stage}, offload {offload}{f', tensor parallel {tp}' if tp else ''} "
        "(parallel.zero_stage, offload, tp)"
    )


Rule = Callable[[Any, dict, Converted], None]


def _simple(table: dict[str, tuple[str, type | None]]) -> dict[str, Rule]:
    """One-to-one keys: LF key -> (our key, LF's type)."""

    def rule(key: str, dotted: str, kind: type | None) -> Rule:
        return lambda v, lf, out: _put(
            out.config, dotted, v if kind is None or v is None else _cast(key, kind, v)
        )

    return {key: rule(key, dotted, kind) for key, (dotted, kind) in table.items()}


def _stage(value: Any, lf: dict, out: Converted) -> None:
    if value not in STAGES:
        raise ConfigError(f"stage: {value!r} is not one of LLaMA-Factory's {', '.join(STAGES)}")
    _put(out.config, "method.stage", STAGES[value])


def _finetuning(value: Any, lf: dict, out: Converted) -> None:
    if value not in ("lora", "oft", "freeze", "full"):
        raise ConfigError(f"finetuning_type: {value!r} is not one of lora, oft, freeze, full")
    for key in ("use_dora", "use_rslora"):  # LF's own checks
        if value != "lora" and _cast(key, bool, lf[key]):
            raise ConfigError(f"{key}: only valid for LoRA training (finetuning_type is {value})")
    _put(out.config, "method.finetuning", value)
    if value != "oft":
        return
    rank, block = _cast("oft_rank", int, lf["oft_rank"]), _cast("oft_block_size", int, lf["oft_block_size"])
    if rank and block:  # peft's OFTConfig takes one of the two
        raise ConfigError(f"oft_rank: {rank} with oft_block_size {block}; set one of them (the other 0)")
    if rank:
        out.unsupported.append(f"oft_rank: {rank} (shardforge's OFT is set by oft_block_size)")
    else:
        _put(out.config, "method.oft.block_size", block)
    if float(lf["module_dropout"]):
        out.unsupported.append(f"module_dropout: {lf['module_dropout']} (OFT's multiplicative dropout)")
    names = _names(lf["lora_target"])  # LF adapts lora_target's modules with OFT too (oft_target is unread)
    _put(out.config, "method.oft.targets", "all" if names == ["all"] else names)
    if "oft_target" in lf:
        out.notes.append("oft_target: LLaMA-Factory 0.9.5 reads lora_target for OFT's modules, as here")


def _datasets(key: str) -> Rule:
    def rule(value: Any, lf: dict, out: Converted) -> None:
        if value is None:
            return
        folder = str(lf["dataset_dir"])
        if folder == "ONLINE" or (
            folder.count("/") == 1 and not Path(folder).exists() and "://" not in folder
        ):
            out.unsupported.append(
                f"dataset_dir: {folder} (datasets from a hub; shardforge reads local files: download the "
                "dataset and point dataset_dir at its folder)"
            )
            return
        limit = lf["max_samples"]
        specs = [
            {"name": n, "dataset_info": str(Path(folder) / "dataset_info.json"),
             **({"max_samples": _cast("max_samples", int, limit)} if limit else {})}
            for n in _names(value)
        ]  # fmt: skip
        _put(out.config, key, specs)

    return rule


def _template(value: Any, lf: dict, out: Converted) -> None:
    if value is None:
        out.notes.append("template unset: the tokenizer's own chat template (data.template: auto)")
        _put(out.config, "data.template", "auto")
    elif value == "chatml":
        _put(out.config, "data.template", "chatml")
    elif value in GENERIC_TEMPLATES:
        out.unsupported.append(
            f"template: {value} (LF's generic {value} format is not a model's own template)"
        )
    else:
        _put(out.config, "data.template", "auto")
        out.notes.append(f"template: {value} -> data.template: auto (the model's own chat template)")


def _quantization(value: Any, lf: dict, out: Converted) -> None:
    if value is None:
        return
    bits, method, kind = (
        _cast("quantization_bit", int, value),
        lf["quantization_method"],
        lf["quantization_type"],
    )
    if (bits, method, kind) == (4, "bnb", "nf4"):
        _put(out.config, "model.quantize", "nf4")
    else:
        out.unsupported.append(
            f"quantization_bit: {bits} ({method}, {kind}): shardforge quantizes a base to 4-bit NF4 only"
        )


def _lora_alpha(value: Any, lf: dict, out: Converted) -> None:
    if value is None:
        value = 2 * _cast("lora_rank", int, lf["lora_rank"])
        out.notes.append("lora_alpha unset: LLaMA-Factory's default, twice lora_rank")
    _put(out.config, "method.lora.alpha", _cast("lora_alpha", float, value))


def _lora_target(value: Any, lf: dict, out: Converted) -> None:
    names = _names(value)
    _put(out.config, "method.lora.targets", "all" if names == ["all"] else names)


def _freeze_modules(value: Any, lf: dict, out: Converted) -> None:
    if _names(value) != ["all"]:
        out.unsupported.append(f"freeze_trainable_modules: {value} (only whole layers train under freeze)")


def _pref(name: str, kind: type) -> Rule:
    """pref_beta / pref_ftx: DPO's, or KTO's under stage kto (LF reads the same keys for both)."""

    def rule(value: Any, lf: dict, out: Converted) -> None:
        key = f"pref_{name}"
        if lf["stage"] == "kto" and name == "ftx":
            if float(value):
                out.unsupported.append(f"{key}: {value} (an SFT term in KTO)")
            return
        section = "kto" if lf["stage"] == "kto" else "pref"
        _put(out.config, f"method.{section}.{name}", _cast(key, kind, value))

    return rule


def _pref_loss(value: Any, lf: dict, out: Converted) -> None:
    if float(lf["dpo_label_smoothing"]) and value != "sigmoid":  # LF's own check
        raise ConfigError(f"dpo_label_smoothing: only valid with pref_loss sigmoid (it is {value})")
    if value not in PREF_LOSSES:
        out.unsupported.append(f"pref_loss: {value} (shardforge has {', '.join(PREF_LOSSES)})")
    else:
        _put(out.config, "method.pref.loss", PREF_LOSSES[value])


def _reward_model(value: Any, lf: dict, out: Converted) -> None:
    if value is None:
        if lf["stage"] == "ppo":
            out.unsupported.append("reward_model: unset (LF's PPO needs a reward model)")
        return
    if lf.get("reward_model_type", "lora") != "full":
        out.unsupported.append(
            f"reward_model_type: {lf.get('reward_model_type', 'lora')} (shardforge reads a full reward "
            "model folder: export the rm run merged and set reward_model_type: full)"
        )
    _put(out.config, "method.rl.rewards", [{"model": str(value)}])


def _packing(value: Any, lf: dict, out: Converted) -> None:
    packing = lf["stage"] == "pt" if value is None else _cast("packing", bool, value)
    neat = _cast("neat_packing", bool, lf["neat_packing"])
    _put(out.config, "data.packing", packing or neat)
    if lf["stage"] == "pt" and packing and not neat:  # LF concatenates the documents and cuts blocks
        _put(out.config, "data.pt_blocks", True)
    if value or neat:  # LF's data arguments: packing asked for shortens rows by one (not pt's default)
        _put(out.config, "data.max_length", _cast("cutoff_len", int, lf["cutoff_len"]) - 1)
        out.notes.append("packing: true -> data.max_length is cutoff_len - 1, as LF's data arguments make it")
    if packing and not neat and lf["stage"] != "pt":
        out.notes.append(
            "packing: LF lets a packed row's documents attend to each other; shardforge's packed rows "
            "attend per document (as LF's neat_packing)"
        )


def _mixing(value: Any, lf: dict, out: Converted) -> None:
    if value not in ("concat", "interleave_under", "interleave_over"):
        mixes = "concat, interleave_under, interleave_over"
        out.unsupported.append(f"mix_strategy: {value} (shardforge mixes {mixes})")
        return
    _put(out.config, "data.mix", value)
    probs = lf["interleave_probs"]
    if probs is not None:
        _put(out.config, "data.mix_probs", [_cast("interleave_probs", float, p) for p in _names(probs)])


def _val_size(value: Any, lf: dict, out: Converted) -> None:
    size = float(value)
    if size >= 1:
        if size != int(size):
            raise ConfigError(f"val_size: {value}: a fraction below 1 or a whole number of examples")
        _put(out.config, "data.eval_count", int(size))
    elif size > 0:
        _put(out.config, "data.eval_fraction", size)


def _schedule(value: Any, lf: dict, out: Converted) -> None:
    kwargs = lf["lr_scheduler_kwargs"] or {}
    if isinstance(kwargs, str):
        kwargs = json.loads(kwargs)
    if value == "cosine_with_min_lr" and set(kwargs) == {"min_lr_rate"}:
        _put(out.config, "train.schedule", "cosine")
        _put(out.config, "train.min_lr_ratio", float(kwargs["min_lr_rate"]))
        return
    if value not in SCHEDULES or kwargs:
        out.unsupported.append(
            f"lr_scheduler_type: {value}{f' with {kwargs}' if kwargs else ''} (shardforge has linear, "
            "cosine, constant, constant_with_warmup and cosine_with_min_lr with min_lr_rate)"
        )
        return
    _put(out.config, "train.schedule", SCHEDULES[value])
    _put(out.config, "train.min_lr_ratio", 0.0)  # transformers' schedules decay to 0


def _warmup(value: Any, lf: dict, out: Converted) -> None:
    """transformers 5: warmup_steps below 1 is a ratio of the steps (rounded up); warmup_ratio the same;
    its warmup starts at rate 0."""
    _put(out.config, "train.warmup_from_zero", True)
    ratio = lf["warmup_ratio"]
    steps = float(value)
    if ratio is not None and float(ratio) > 0:
        _put(out.config, "train.warmup_ratio", float(ratio))
    elif 0 < steps < 1:
        _put(out.config, "train.warmup_ratio", steps)
    else:
        _put(out.config, "train.warmup", _cast("warmup_steps", int, value))


def _length(value: Any, lf: dict, out: Converted) -> None:
    steps = _cast("max_steps", int, lf["max_steps"])
    if steps > 0:
        _put(out.config, "train.steps", steps)
    else:
        _put(out.config, "train.epochs", _cast("num_train_epochs", float, value))
        _put(out.config, "train.steps", None)


def _optimizer(value: Any, lf: dict, out: Converted) -> None:
    """`optim` (transformers' choice of AdamW), and LF's own optimizer switches on top of it."""
    menu = [name for name in MENU if _cast(f"use_{name}", bool, lf[f"use_{name}"])]
    if str(value) in ADAMW_8BIT and not menu:
        _put(out.config, "train.optimizer.name", "adamw_8bit")
    elif str(value) not in ADAMW:
        known = ", ".join(ADAMW + ADAMW_8BIT)
        out.unsupported.append(f"optim: {value} (shardforge's AdamW: {known}; 8-bit with no use_* optimizer)")
    if menu:
        _menu(menu, lf, out)
    betas = (_cast("adam_beta1", float, lf["adam_beta1"]), _cast("adam_beta2", float, lf["adam_beta2"]))
    _put(out.config, "train.betas", list(betas))
    _put(out.config, "train.eps", _cast("adam_epsilon", float, lf["adam_epsilon"]))


def _menu(menu: list[str], lf: dict, out: Converted) -> None:
    """LF's use_galore / use_apollo / use_badam / use_adam_mini / use_muon, with LF's own checks and the one
    its create_custom_optimizer takes when several are set."""
    whole = [name for name in menu if name in ("galore", "apollo", "badam")]
    if len(whole) > 1:
        raise ConfigError(
            f"use_{whole[0]} with use_{whole[1]}: LLaMA-Factory takes one of GaLore, APOLLO, BAdam"
        )
    if whole and lf["finetuning_type"] == "lora":
        raise ConfigError(f"use_{whole[0]}: LLaMA-Factory does not combine it with LoRA (finetuning_type)")
    lora_plus = lf["finetuning_type"] == "lora" and lf["loraplus_lr_ratio"] is not None
    name = menu[0] if menu[0] in ("galore", "apollo") or not lora_plus else None
    for other in menu:
        if other != name:
            taken = name or "LoRA+ (loraplus_lr_ratio)"
            out.notes.append(f"use_{other}: LLaMA-Factory builds {taken} instead, as shardforge does")
    if name is None:
        return
    _put(out.config, "train.optimizer.name", name)
    for suffix, (ours, kind) in PROJECTED.get(name, {}).items():
        value = lf[f"{name}_{suffix}"]
        if ours == "targets":
            names = _names(value)
            value = "all" if names == ["all"] else names
        elif value is not None:
            value = _cast(f"{name}_{suffix}", kind, value)
        _put(out.config, f"train.optimizer.{name}.{ours}", value)
    if _layerwise(lf):
        out.notes.append(
            f"{name}_layerwise: the same update after the backward (docs/optimizers.md), with no gradient "
            f"clipping (train.clip: null), as LF's per-parameter steps never clip"
        )


def _layerwise(lf: dict) -> bool:
    """LF steps each parameter in its gradient hook (layer-wise GaLore / APOLLO, taken first)."""
    for name in ("galore", "apollo"):
        if _cast(f"use_{name}", bool, lf[f"use_{name}"]):
            return _cast(f"{name}_layerwise", bool, lf[f"{name}_layerwise"])
    return False


def _precision(value: Any, lf: dict, out: Converted) -> None:
    bf16, fp16 = _cast("bf16", bool, value), _cast("fp16", bool, lf["fp16"])
    _put(out.config, "train.precision", "bf16" if bf16 else "fp16" if fp16 else "fp32")
    if fp16:
        _put(out.config, "model.dtype", "float32")  # fp16 keeps fp32 master weights, as HF's amp
    if _cast("pure_bf16", bool, lf["pure_bf16"]):  # LF keeps the trained weights in bf16: no fp32 masters
        if fp16:
            raise ConfigError("pure_bf16: with fp16: true (LF computes in bf16); set one of them")
        _put(out.config, "model.dtype", "bfloat16")
        out.notes.append("pure_bf16: model.dtype: bfloat16 (weights, gradients and optimizer states in bf16)")


def _saving(value: Any, lf: dict, out: Converted) -> None:
    if value == "steps":
        _put(out.config, "checkpoint.every", _cast("save_steps", int, lf["save_steps"]))
    elif value != "no":
        out.unsupported.append(f"save_strategy: {value} (shardforge checkpoints every N steps)")
    limit = lf["save_total_limit"]
    _put(out.config, "checkpoint.keep", None if limit is None else _cast("save_total_limit", int, limit))


def _evaluating(value: Any, lf: dict, out: Converted) -> None:
    if value == "steps":
        every = lf["eval_steps"] if lf["eval_steps"] is not None else lf["logging_steps"]
        _put(out.config, "train.eval_every", _cast("eval_steps", int, every))
    elif value != "no":
        out.unsupported.append(f"eval_strategy: {value} (shardforge evaluates every N steps)")


def _resuming(value: Any, lf: dict, out: Converted) -> None:
    """LF resumes from output_dir's last checkpoint unless overwrite_output_dir (or an explicit one)."""
    if lf["resume_from_checkpoint"]:
        _put(out.config, "checkpoint.resume", str(lf["resume_from_checkpoint"]))
    else:
        _put(
            out.config, "checkpoint.resume", "none" if _cast("overwrite_output_dir", bool, value) else "auto"
        )


def _report_to(value: Any, lf: dict, out: Converted) -> None:
    names = [n for n in _names(value) if n != "none"]
    if "all" in names:  # transformers' "all": every integration installed; ours are these
        names = list(TRACKERS)
    _put(out.config, "log.report_to", [n for n in names if n in TRACKERS])
    others = [n for n in names if n not in TRACKERS]
    if others:
        out.unsupported.append(f"report_to: {', '.join(others)} (log.report_to offers {', '.join(TRACKERS)})")


def _checkpointing(value: Any, lf: dict, out: Converted) -> None:
    """LF turns on the model's gradient checkpointing unless disable_gradient_checkpointing."""
    off = _cast("disable_gradient_checkpointing", bool, value)
    _put(out.config, "parallel.activation_checkpoint", "none" if off else "full")


def _dft(value: Any, lf: dict, out: Converted) -> None:
    if not _cast("use_dft_loss", bool, value):
        return
    if lf["stage"] == "sft":
        _put(out.config, "method.sft.loss", "dft")
    else:  # LF's SFT trainer alone reads it
        out.notes.append(f"use_dft_loss: LLaMA-Factory's stage {lf['stage']} ignores it, as shardforge does")


def _loraplus(value: Any, lf: dict, out: Converted) -> None:
    if value is None:
        return
    if lf["finetuning_type"] != "lora":  # LF's own check
        raise ConfigError("loraplus_lr_ratio: only valid for LoRA training (finetuning_type: lora)")
    _put(out.config, "method.lora.plus_lr_ratio", _cast("loraplus_lr_ratio", float, value))
    if "loraplus_lr_embedding" in lf:
        out.notes.append("loraplus_lr_embedding: shardforge adapts no embedding, so it changes nothing")


def _llama_pro(value: Any, lf: dict, out: Converted) -> None:
    if not _cast("use_llama_pro", bool, value):
        return
    if lf["finetuning_type"] == "full":  # LF's own check
        raise ConfigError("use_llama_pro: only valid for freeze or LoRA training (finetuning_type)")
    if lf["finetuning_type"] != "freeze":
        out.unsupported.append("use_llama_pro with finetuning_type lora (LoRA on LLaMA Pro's blocks)")
        return
    _put(out.config, "method.freeze.llama_pro", True)
    out.notes.append(
        "use_llama_pro: the model must be expanded first (`shardforge expand MODEL --blocks N --to DIR`, "
        "LF's scripts/llama_pro.py); freeze_trainable_layers is the number of blocks added"
    )


def _pissa(value: Any, lf: dict, out: Converted) -> None:
    if not _cast("pissa_init", bool, value):
        return
    if lf["stage"] in ("ppo", "kto") or (lf["stage"] == "dpo" and lf["pref_loss"] not in ("orpo", "simpo")):
        raise ConfigError(
            f"pissa_init: LLaMA-Factory refuses PiSSA for stage {lf['stage']} (a reference model)"
        )
    if lf["finetuning_type"] != "lora":  # LF's own check
        raise ConfigError("pissa_init: only valid for LoRA training (finetuning_type: lora)")
    _put(out.config, "method.lora.init", "pissa")
    _put(out.config, "method.lora.pissa_iter", _cast("pissa_iter", int, lf["pissa_iter"]))
    out.notes.append(
        "pissa_init: the adapter is written as the plain LoRA it amounts to (rank 2r, over the original "
        "base), as LF's pissa_convert: true writes it, whatever pissa_convert says"
    )


def _optional(key: str, dotted: str, kind: type) -> Rule:
    """A key whose LF default (None, 0, an empty list) means: leave ours unset."""
    return lambda v, lf, out: _put(out.config, dotted, _cast(key, kind, v)) if v else None


RULES: dict[str, Rule] = {
    **_simple(
        {
            "model_name_or_path": ("model.path", str),
            "adapter_name_or_path": ("model.adapter", None),
            "lora_rank": ("method.lora.rank", int),
            "lora_dropout": ("method.lora.dropout", float),
            "use_dora": ("method.lora.dora", bool),
            "use_rslora": ("method.lora.rslora", bool),
            "freeze_trainable_layers": ("method.freeze.trainable_layers", int),
            "simpo_gamma": ("method.pref.simpo_gamma", float),
            "dpo_label_smoothing": ("method.pref.label_smoothing", float),
            "kto_chosen_weight": ("method.kto.desirable_weight", float),
            "kto_rejected_weight": ("method.kto.undesirable_weight", float),
            "cutoff_len": ("data.max_length", int),
            "train_on_prompt": ("data.train_on_prompt", bool),
            "mask_history": ("data.mask_history", bool),
            "enable_thinking": ("data.enable_thinking", bool),
            "image_max_pixels": ("data.image_max_pixels", int),
            "image_min_pixels": ("data.image_min_pixels", int),
            "freeze_vision_tower": ("method.vision.freeze_tower", bool),
            "freeze_multi_modal_projector": ("method.vision.freeze_projector", bool),
            "freeze_language_model": ("method.vision.freeze_language_model", bool),
            "output_dir": ("output_dir", str),
            "logging_steps": ("train.log_every", int),
            "plot_loss": ("log.plot", bool),
            "per_device_train_batch_size": ("train.micro_batch", int),
            "gradient_accumulation_steps": ("train.grad_accum", int),
            "learning_rate": ("train.lr", float),
            "weight_decay": ("train.weight_decay", float),
            "seed": ("train.seed", int),
        }
    ),
    "quantization_bit": _quantization,
    "stage": _stage,
    "finetuning_type": _finetuning,
    "lora_alpha": _lora_alpha,
    "lora_target": _lora_target,
    "freeze_trainable_modules": _freeze_modules,
    "freeze_extra_modules": lambda v, lf, out: (
        _put(out.config, "method.freeze.extra_modules", _names(v)) if v else None
    ),
    "pref_beta": _pref("beta", float),
    "pref_loss": _pref_loss,
    "pref_ftx": _pref("ftx", float),
    "ref_model": _optional("ref_model", "method.pref.ref", str),
    "reward_model": _reward_model,
    "dataset": _datasets("data.train"),
    "eval_dataset": _datasets("data.eval"),
    "template": _template,
    "packing": _packing,
    "val_size": _val_size,
    "preprocessing_num_workers": _optional("preprocessing_num_workers", "data.workers", int),
    "save_strategy": _saving,
    "report_to": _report_to,
    "run_name": _optional("run_name", "log.run_name", str),
    "default_system": _optional("default_system", "data.default_system", str),
    "mix_strategy": _mixing,
    "num_train_epochs": _length,
    "lr_scheduler_type": _schedule,
    "warmup_steps": _warmup,
    "optim": _optimizer,
    "max_grad_norm": lambda v, lf, out: _put(
        out.config, "train.clip", None if _layerwise(lf) else _cast("max_grad_norm", float, v) or None
    ),
    "bf16": _precision,
    "eval_strategy": _evaluating,
    "overwrite_output_dir": _resuming,
    "ddp_timeout": lambda v, lf, out: _put(
        out.config, "parallel.timeout_minutes", max(1.0, _cast("ddp_timeout", int, v) / 60)
    ),
    "disable_gradient_checkpointing": _checkpointing,
    "use_dft_loss": _dft,
    "neftune_noise_alpha": _optional("neftune_noise_alpha", "train.neftune_alpha", float),
    "loraplus_lr_ratio": _loraplus,
    "use_llama_pro": _llama_pro,
    "pissa_init": _pissa,
}
# keys read by another key's rule (quantization_bit's, dataset's, ...) or by _deepspeed
READ_WITH = frozenset({
    "quantization_method", "quantization_type", "dataset_dir", "max_samples", "neat_packing", "save_steps",
    "save_total_limit", "max_steps", "lr_scheduler_kwargs", "warmup_ratio", "adam_beta1", "adam_beta2",
    "adam_epsilon", "fp16", "eval_steps", "resume_from_checkpoint", "reward_model_type", "deepspeed",
    "interleave_probs", "loraplus_lr_embedding", "pissa_iter", "pissa_convert", "oft_rank", "oft_block_size",
    "module_dropout", "oft_target", "pure_bf16", "use_galore", "use_apollo", "use_badam", "use_adam_mini",
    "use_muon", "galore_target", "galore_rank", "galore_update_interval", "galore_scale", "galore_proj_type",
    "galore_layerwise", "apollo_target", "apollo_rank", "apollo_update_interval", "apollo_scale",
    "apollo_proj", "apollo_proj_type", "apollo_scale_type", "apollo_scale_front", "apollo_layerwise",
    "badam_mode", "badam_start_block", "badam_switch_mode", "badam_switch_interval", "badam_update_ratio",
    "badam_mask_mode", "badam_verbose",
})  # fmt: skip


def is_training(lf: dict[str, Any]) -> bool:
    """A training YAML, as opposed to LF's merge / export and inference ones."""
    return "stage" in lf or not any(k in lf for k in INFER_KEYS)


def convert_lf(lf: dict[str, Any]) -> Converted:
    """`lf`: the LF YAML's mapping, resolved against LF_DEFAULTS (relative paths in it, a deepspeed JSON
    among them, are read from the working directory, as LF reads them)."""
    if not is_training(lf):
        return _command(lf)
    if _cast("do_predict", bool, lf.get("do_predict", False)) and not _cast(
        "do_train", bool, lf.get("do_train", False)
    ):
        return _predict(lf)
    if not lf.get("model_name_or_path"):
        raise ConfigError("model_name_or_path: missing (LLaMA-Factory needs the model to train)")
    given = {k: v for k, v in lf.items() if v is not None or k not in LF_DEFAULTS}
    resolved = {**LF_DEFAULTS, **given}
    out = Converted({"data": {"truncation": "lf"}})  # LF's processors shorten prompt and reply each
    for key, rule in RULES.items():
        if key in resolved:
            rule(resolved[key], resolved, out)
    if "deepspeed" in given:
        _deepspeed(given["deepspeed"], out)
    for key, value in given.items():
        if key in RULES or key in READ_WITH:
            continue
        if key in NOTHING_TO_DO:
            out.notes.append(f"{key}: nothing to set ({NOTHING_TO_DO[key]})")
        elif value in (None, False, "", OFF.get(key, False)) or (key == "report_to" and value == "none"):
            out.notes.append(f"{key}: {value!r} is LF's default, nothing to set")
        else:
            out.unsupported.append(f"{key}: {WANTS.get(key, 'no counterpart in shardforge')}")
    return out


# LF's generating arguments' defaults (hparams/generating_args.py): it samples unless do_sample is false
GENERATION = {"do_sample": True, "temperature": 0.95, "top_p": 0.7, "top_k": 50, "max_new_tokens": 1024,
              "repetition_penalty": 1.0}  # fmt: skip
PREDICT_KEYS = {"model_name_or_path", "adapter_name_or_path", "stage", "do_predict", "predict_with_generate",
                "finetuning_type", "eval_dataset", "dataset_dir", "template", "cutoff_len", "max_samples",
                "default_system", "output_dir", "seed", *GENERATION}  # fmt: skip


def _predict(lf: dict[str, Any]) -> Converted:
    """LF's do_predict YAML (predict_with_generate, BLEU / ROUGE) as the equivalent `shardforge eval`."""
    out = Converted({})
    model = lf.get("model_name_or_path")
    if not model:
        raise ConfigError("model_name_or_path: missing (the model to predict with)")
    if not lf.get("eval_dataset"):
        raise ConfigError("eval_dataset: missing (LLaMA-Factory predicts on eval_dataset)")
    if not _cast("predict_with_generate", bool, lf.get("predict_with_generate", False)):
        out.unsupported.append(
            "predict_with_generate: false (prediction by logits; shardforge eval generates)"
        )
    adapters = _names(lf["adapter_name_or_path"]) if lf.get("adapter_name_or_path") else []
    if len(adapters) > 1:
        raise ConfigError(f"adapter_name_or_path: {len(adapters)} adapters; shardforge eval takes one")
    folder = Path(str(lf.get("dataset_dir", "data")))
    gen = {k: lf.get(k, v) for k, v in GENERATION.items()}
    parts = ["shardforge", "eval", str(model), "--data", ",".join(_names(lf["eval_dataset"])),
             "--dataset-info", str(folder / "dataset_info.json")]  # fmt: skip
    if adapters:
        parts += ["--adapter", adapters[0]]
    if lf.get("template") == "chatml":
        parts += ["--template", "chatml"]
    elif lf.get("template") in GENERIC_TEMPLATES:
        out.unsupported.append(f"template: {lf['template']} (LF's generic {lf['template']} format)")
    parts += ["--cutoff-len", str(_cast("cutoff_len", int, lf.get("cutoff_len", 2048)))]
    for key, flag in (("max_samples", "--max-samples"), ("default_system", "--system"), ("seed", "--seed")):
        if lf.get(key) is not None:
            parts += [flag, str(lf[key])]
    parts += ["--max-new-tokens", str(_cast("max_new_tokens", int, gen["max_new_tokens"]))]
    if _cast("do_sample", bool, gen["do_sample"]):
        sampling = {
            "--temperature": ("temperature", float),
            "--top-p": ("top_p", float),
            "--top-k": ("top_k", int),
        }
        for flag, (key, kind) in sampling.items():
            parts += [flag, str(_cast(key, kind, gen[key]))]
    else:
        parts += ["--temperature", "0"]
    if float(gen["repetition_penalty"]) != 1.0:
        parts += ["--repetition-penalty", str(_cast("repetition_penalty", float, gen["repetition_penalty"]))]
    parts += ["--out", str(lf.get("output_dir", "eval"))]
    out.command = shlex.join(parts)
    for key in lf:
        if key not in PREDICT_KEYS:
            out.notes.append(f"{key}: not part of the equivalent command")
    return out


def _command(lf: dict[str, Any]) -> Converted:
    """LF's merge / export YAML as `shardforge export`, its inference YAML as `shardforge chat`."""
    model = lf.get("model_name_or_path")
    if not model:
        raise ConfigError("model_name_or_path: missing (the model to export or chat with)")
    adapters = _names(lf["adapter_name_or_path"]) if lf.get("adapter_name_or_path") else []
    if len(adapters) > 1:
        raise ConfigError(f"adapter_name_or_path: {len(adapters)} adapters; shardforge merges one at a time")
    out = Converted({})
    if "export_dir" in lf:
        source = adapters[0] if adapters else model
        base = f" --base {shlex.quote(str(model))}" if adapters else ""
        merge = " --merge" if adapters else ""
        out.command = (
            f"shardforge export {shlex.quote(str(source))} --to {shlex.quote(str(lf['export_dir']))}"
        )
        out.command += merge + base
        if lf.get("export_quantization_bit"):
            out.unsupported.append("export_quantization_bit: quantized export (GPTQ)")
    else:
        out.command = f"shardforge chat {shlex.quote(str(model))}"
        if adapters:
            out.command += f" --adapter {shlex.quote(adapters[0])}"
        if lf.get("infer_backend", "huggingface") not in ("huggingface", "hf"):
            out.notes.append(f"infer_backend: {lf['infer_backend']} -> shardforge's own engine")
    known = {"model_name_or_path", "adapter_name_or_path", "export_dir", "infer_backend", "template",
             "trust_remote_code", "finetuning_type", "export_size", "export_device", "export_legacy_format",
             "export_quantization_bit"}  # fmt: skip
    for key in lf:
        if key not in known:
            out.notes.append(f"{key}: not part of the equivalent command")
    return out
