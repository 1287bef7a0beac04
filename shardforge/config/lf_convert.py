"""A LLaMA-Factory training YAML read as a shardforge config (`shardforge convert lf.yaml`).

Each training key LF documents has a rule here (data: LF key -> what it becomes); keys whose counterpart would
change nothing in a shardforge run (do_train, overwrite_cache, ...) are noted as such; anything else is listed
as unknown, never silently dropped. LF's defaults that differ from ours are written out (packing is off
for every stage but pt, LoRA's alpha is twice its rank), so the converted run trains as the LF one would.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_args

from shardforge.config.schema import Tracker
from shardforge.errors import ConfigError

TRACKERS = get_args(Tracker)

# LF keys that need nothing in shardforge (the behaviour is built in, or belongs to HF Trainer's bookkeeping)
NOTHING_TO_DO = {
    "do_train": "a shardforge run always trains",
    "do_eval": "evaluation runs when data.eval or data.eval_fraction is set",
    "trust_remote_code": "models are built from their config with no remote code",
    "overwrite_cache": "the dataset cache is keyed by content: a change re-encodes",
    "overwrite_output_dir": "a run resumes from output_dir's checkpoints (checkpoint.resume)",
    "dataloader_num_workers": "batches come from the memory-mapped cache",
    "save_only_model": "checkpoints hold what resuming needs; final/ is the model",
    "flash_attn": "attention is SDPA (packed rows per document)",
    "enable_liger_kernel": "the LM head is fused with the loss already",
    "per_device_eval_batch_size": "evaluation uses train.micro_batch",
    "eval_strategy": "evaluation runs every train.eval_every steps",
    "ddp_find_unused_parameters": "not needed by FSDP2 / DDP here",
}

SCHEDULES = {
    "cosine": "cosine",
    "linear": "linear",
    "constant": "constant",
    "constant_with_warmup": "constant",
}
STAGES = {"pt": "pt", "sft": "sft", "rm": "rm", "dpo": "dpo", "kto": "kto", "ppo": "ppo"}
PREF_LOSSES = {"sigmoid": "sigmoid", "hinge": "hinge", "ipo": "ipo", "orpo": "orpo", "simpo": "simpo"}


@dataclass
class Converted:
    config: dict[str, Any]  # the shardforge config tree
    notes: list[str] = field(default_factory=list)  # how keys were read, where it is not one to one
    unknown: list[str] = field(default_factory=list)  # LF keys with no rule here


def _put(tree: dict, dotted: str, value: Any) -> None:
    *path, last = dotted.split(".")
    for key in path:
        tree = tree.setdefault(key, {})
    tree[last] = value


def _names(value: Any) -> list[str]:
    """LF's comma-separated lists (dataset: a,b; lora_target: q_proj,v_proj)."""
    items = value if isinstance(value, list) else str(value).split(",")
    return [str(v).strip() for v in items if str(v).strip()]


def _deepspeed(value: str, base: Path, out: Converted) -> None:
    """A DeepSpeed JSON's ZeRO stage and offload as FSDP2 / ZeRO settings."""
    path = Path(value) if Path(value).is_absolute() else base / value
    if path.is_file():
        zero = json.loads(path.read_text()).get("zero_optimization", {})
        stage = int(zero.get("stage", 0))
        offload_params = zero.get("offload_param", {}).get("device") == "cpu"
        offload_optim = zero.get("offload_optimizer", {}).get("device") == "cpu"
    else:  # LF's bundled names: ds_z0_config.json ... ds_z3_offload_config.json
        name = path.name
        digits = [int(c) for c in name if c.isdigit()]
        if not digits:
            raise ConfigError(f"deepspeed: {value!r} is not a file here and its name gives no ZeRO stage")
        stage, offload_params = digits[0], "offload" in name
        offload_optim = offload_params
        out.notes.append(f"deepspeed: {value} not found; ZeRO stage {stage} read from its name")
    if stage >= 2:
        _put(out.config, "parallel.zero_stage", stage)
    elif stage == 1:
        _put(out.config, "parallel.zero_stage", 1)
        _put(out.config, "parallel.dp_replicate", -1)
        _put(out.config, "parallel.dp_shard", 1)
        out.notes.append(
            "deepspeed ZeRO-1: parallel.zero_stage 1 over replicas (set dp_replicate to the world size)"
        )
    offload = "params" if offload_params else "optimizer" if offload_optim else "none"
    if offload != "none":
        _put(out.config, "parallel.offload", offload)
    out.notes.append(
        f"deepspeed: ZeRO-{stage} as FSDP2 / ZeRO (parallel.zero_stage {stage}, offload {offload})"
    )


Rule = Callable[[Any, dict, Converted], None]


def _simple(dotted: str, cast: Callable[[Any], Any] = lambda v: v) -> Rule:
    return lambda value, lf, out: _put(out.config, dotted, cast(value))


def _stage(value: Any, lf: dict, out: Converted) -> None:
    if value not in STAGES:
        raise ConfigError(f"stage: {value!r} is not one of LLaMA-Factory's {', '.join(STAGES)}")
    _put(out.config, "method.stage", STAGES[value])


def _dataset(key: str) -> Rule:
    def rule(value: Any, lf: dict, out: Converted) -> None:
        info = str(Path(lf.get("dataset_dir", "data")) / "dataset_info.json")
        limit = lf.get("max_samples")
        specs = [
            {"name": n, "dataset_info": info, **({"max_samples": limit} if limit else {})}
            for n in _names(value)
        ]
        _put(out.config, key, specs)

    return rule


def _template(value: Any, lf: dict, out: Converted) -> None:
    _put(out.config, "data.template", "auto")
    out.notes.append(f"template: {value} -> data.template: auto (the tokenizer's own chat template)")


def _quantization(value: Any, lf: dict, out: Converted) -> None:
    if int(value) != 4:
        raise ConfigError(f"quantization_bit: {value}: shardforge quantizes to 4 bits (NF4) only")
    _put(out.config, "model.quantize", "nf4")


def _lora_target(value: Any, lf: dict, out: Converted) -> None:
    names = _names(value)
    _put(out.config, "method.lora.targets", "all" if names == ["all"] else names)


def _pref_loss(value: Any, lf: dict, out: Converted) -> None:
    if value not in PREF_LOSSES:
        raise ConfigError(f"pref_loss: {value!r}; shardforge has {', '.join(PREF_LOSSES)}")
    _put(out.config, "method.pref.loss", PREF_LOSSES[value])


def _schedule(value: Any, lf: dict, out: Converted) -> None:
    if value not in SCHEDULES:
        raise ConfigError(f"lr_scheduler_type: {value!r}; shardforge has {', '.join(sorted(set(SCHEDULES)))}")
    _put(out.config, "train.schedule", SCHEDULES[value])
    if value == "constant_with_warmup":
        out.notes.append("lr_scheduler_type constant_with_warmup -> constant with train.warmup")


def _epochs(value: Any, lf: dict, out: Converted) -> None:
    if "max_steps" not in lf or int(lf["max_steps"]) <= 0:
        _put(out.config, "train.epochs", float(value))
        _put(out.config, "train.steps", None)


def _precision(name: str) -> Rule:
    def rule(value: Any, lf: dict, out: Converted) -> None:
        if value:
            _put(out.config, "train.precision", name)

    return rule


def _report_to(value: Any, lf: dict, out: Converted) -> None:
    names = [n for n in _names(value) if n != "none"]
    if "all" in names:  # transformers' "all": every integration installed; ours are these
        names = list(TRACKERS)
    _put(out.config, "log.report_to", [n for n in names if n in TRACKERS])
    others = [n for n in names if n not in TRACKERS]
    if others:
        out.unknown.append(f"report_to: {', '.join(others)} (log.report_to offers {', '.join(TRACKERS)})")


RULES: dict[str, Rule] = {
    "model_name_or_path": _simple("model.path"),
    "adapter_name_or_path": _simple("model.adapter"),
    "quantization_bit": _quantization,
    "stage": _stage,
    "finetuning_type": _simple("method.finetuning"),
    "lora_rank": _simple("method.lora.rank", int),
    "lora_alpha": _simple("method.lora.alpha", float),
    "lora_dropout": _simple("method.lora.dropout", float),
    "lora_target": _lora_target,
    "use_dora": _simple("method.lora.dora", bool),
    "use_rslora": _simple("method.lora.rslora", bool),
    "freeze_trainable_layers": _simple("method.freeze.trainable_layers", int),
    "freeze_extra_modules": lambda v, lf, out: _put(out.config, "method.freeze.extra_modules", _names(v)),
    "pref_beta": _simple("method.pref.beta", float),
    "pref_loss": _pref_loss,
    "pref_ftx": _simple("method.pref.ftx", float),
    "simpo_gamma": _simple("method.pref.simpo_gamma", float),
    "dpo_label_smoothing": _simple("method.pref.label_smoothing", float),
    "ref_model": _simple("method.pref.ref"),
    "kto_chosen_weight": _simple("method.kto.desirable_weight", float),
    "kto_rejected_weight": _simple("method.kto.undesirable_weight", float),
    "dataset": _dataset("data.train"),
    "eval_dataset": _dataset("data.eval"),
    "dataset_dir": lambda v, lf, out: None,  # read with dataset
    "max_samples": lambda v, lf, out: None,  # read with dataset
    "template": _template,
    "cutoff_len": _simple("data.max_length", int),
    "packing": _simple("data.packing", bool),
    "neat_packing": lambda v, lf, out: _put(out.config, "data.packing", True) if v else None,
    "train_on_prompt": _simple("data.train_on_prompt", bool),
    "val_size": _simple("data.eval_fraction", float),
    "preprocessing_num_workers": _simple("data.workers", int),
    "output_dir": _simple("output_dir", str),
    "logging_steps": _simple("train.log_every", int),
    "save_steps": _simple("checkpoint.every", int),
    "save_total_limit": _simple("checkpoint.keep", int),
    "plot_loss": _simple("log.plot", bool),
    "report_to": _report_to,
    "run_name": _simple("log.run_name"),
    "per_device_train_batch_size": _simple("train.micro_batch", int),
    "gradient_accumulation_steps": _simple("train.grad_accum", int),
    "learning_rate": _simple("train.lr", float),
    "num_train_epochs": _epochs,
    "max_steps": lambda v, lf, out: _put(out.config, "train.steps", int(v)) if int(v) > 0 else None,
    "lr_scheduler_type": _schedule,
    "warmup_ratio": _simple("train.warmup_ratio", float),
    "warmup_steps": _simple("train.warmup", int),
    "weight_decay": _simple("train.weight_decay", float),
    "max_grad_norm": _simple("train.clip", float),
    "seed": _simple("train.seed", int),
    "bf16": _precision("bf16"),
    "fp16": _precision("fp16"),
    "eval_steps": _simple("train.eval_every", int),
    "resume_from_checkpoint": lambda v, lf, out: _put(out.config, "checkpoint.resume", v) if v else None,
    "ddp_timeout": lambda v, lf, out: _put(out.config, "parallel.timeout_minutes", max(1.0, int(v) / 60)),
}


def convert_lf(lf: dict[str, Any], base: Path = Path(".")) -> Converted:
    """`lf`: the LF YAML's mapping; `base`: the folder relative paths in it (a deepspeed JSON) start from."""
    out = Converted({"data": {"packing": lf.get("stage", "sft") == "pt"}})  # LF packs pretraining only
    if lf.get("finetuning_type") == "lora" and "lora_alpha" not in lf:  # LF: alpha = 2 x rank by default
        _put(out.config, "method.lora.alpha", 2.0 * int(lf.get("lora_rank", 8)))
        out.notes.append("lora_alpha unset: LLaMA-Factory's default, twice lora_rank")
    for key, value in lf.items():
        if value is None:
            continue
        if key == "deepspeed":
            _deepspeed(str(value), base, out)
        elif key in RULES:
            RULES[key](value, lf, out)
        elif key in NOTHING_TO_DO:
            out.notes.append(f"{key}: nothing to set ({NOTHING_TO_DO[key]})")
        else:
            out.unknown.append(key)
    return out
