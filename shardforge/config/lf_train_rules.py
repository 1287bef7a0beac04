"""The rules for LLaMA-Factory's training keys: length, schedule, optimizer, precision, checkpoints, logging
and DeepSpeed's parallel layout."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from shardforge.config.lf_tables import ADAMW, ADAMW_8BIT, MENU, PROJECTED, SCHEDULES, TRACKERS
from shardforge.config.lf_values import Converted, cast, names_of, put
from shardforge.errors import ConfigError


def read_schedule(value: Any, lf: dict, out: Converted) -> None:
    kwargs = lf["lr_scheduler_kwargs"] or {}
    if isinstance(kwargs, str):
        kwargs = json.loads(kwargs)
    if value == "cosine_with_min_lr" and set(kwargs) == {"min_lr_rate"}:
        put(out.config, "train.schedule", "cosine")
        put(out.config, "train.min_lr_ratio", float(kwargs["min_lr_rate"]))
        return
    if value not in SCHEDULES or kwargs:
        out.unsupported.append(
            f"lr_scheduler_type: {value}{f' with {kwargs}' if kwargs else ''} (shardforge has linear, "
            "cosine, constant, constant_with_warmup and cosine_with_min_lr with min_lr_rate)"
        )
        return
    put(out.config, "train.schedule", SCHEDULES[value])
    put(out.config, "train.min_lr_ratio", 0.0)  # transformers' schedules decay to 0


def read_warmup(value: Any, lf: dict, out: Converted) -> None:
    """transformers 5: warmup_steps below 1 is a ratio of the steps (rounded up); warmup_ratio the same;
    its warmup starts at rate 0."""
    put(out.config, "train.warmup_from_zero", True)
    ratio = lf["warmup_ratio"]
    steps = float(value)
    if ratio is not None and float(ratio) > 0:
        put(out.config, "train.warmup_ratio", float(ratio))
    elif 0 < steps < 1:
        put(out.config, "train.warmup_ratio", steps)
    else:
        put(out.config, "train.warmup", cast("warmup_steps", int, value))


def read_length(value: Any, lf: dict, out: Converted) -> None:
    steps = cast("max_steps", int, lf["max_steps"])
    if steps > 0:
        put(out.config, "train.steps", steps)
    else:
        put(out.config, "train.epochs", cast("num_train_epochs", float, value))
        put(out.config, "train.steps", None)


def read_optimizer(value: Any, lf: dict, out: Converted) -> None:
    """`optim` (transformers' choice of AdamW), and LF's own optimizer switches on top of it."""
    menu = [name for name in MENU if cast(f"use_{name}", bool, lf[f"use_{name}"])]
    if str(value) in ADAMW_8BIT and not menu:
        put(out.config, "train.optimizer.name", "adamw_8bit")
    elif str(value) not in ADAMW:
        known = ", ".join(ADAMW + ADAMW_8BIT)
        out.unsupported.append(f"optim: {value} (shardforge's AdamW: {known}; 8-bit with no use_* optimizer)")
    if menu:
        _menu(menu, lf, out)
    betas = (cast("adam_beta1", float, lf["adam_beta1"]), cast("adam_beta2", float, lf["adam_beta2"]))
    put(out.config, "train.betas", list(betas))
    put(out.config, "train.eps", cast("adam_epsilon", float, lf["adam_epsilon"]))


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
    put(out.config, "train.optimizer.name", name)
    for suffix, (ours, kind) in PROJECTED.get(name, {}).items():
        value = lf[f"{name}_{suffix}"]
        if ours == "targets":
            names = names_of(value)
            value = "all" if names == ["all"] else names
        elif value is not None:
            value = cast(f"{name}_{suffix}", kind, value)
        put(out.config, f"train.optimizer.{name}.{ours}", value)
    if steps_layerwise(lf):
        out.notes.append(
            f"{name}_layerwise: the same update after the backward (docs/optimizers.md), with no gradient "
            f"clipping (train.clip: null), as LF's per-parameter steps never clip"
        )


def steps_layerwise(lf: dict) -> bool:
    """LF steps each parameter in its gradient hook (layer-wise GaLore / APOLLO, taken first)."""
    for name in ("galore", "apollo"):
        if cast(f"use_{name}", bool, lf[f"use_{name}"]):
            return cast(f"{name}_layerwise", bool, lf[f"{name}_layerwise"])
    return False


def read_precision(value: Any, lf: dict, out: Converted) -> None:
    bf16, fp16 = cast("bf16", bool, value), cast("fp16", bool, lf["fp16"])
    put(out.config, "train.precision", "bf16" if bf16 else "fp16" if fp16 else "fp32")
    if fp16:
        put(out.config, "model.dtype", "float32")  # fp16 keeps fp32 master weights, as HF's amp
    if cast("pure_bf16", bool, lf["pure_bf16"]):  # LF keeps the trained weights in bf16: no fp32 masters
        if fp16:
            raise ConfigError("pure_bf16: with fp16: true (LF computes in bf16); set one of them")
        put(out.config, "model.dtype", "bfloat16")
        out.notes.append("pure_bf16: model.dtype: bfloat16 (weights, gradients and optimizer states in bf16)")


def read_saving(value: Any, lf: dict, out: Converted) -> None:
    if value == "steps":
        put(out.config, "checkpoint.every", cast("save_steps", int, lf["save_steps"]))
    elif value != "no":
        out.unsupported.append(f"save_strategy: {value} (shardforge checkpoints every N steps)")
    limit = lf["save_total_limit"]
    put(out.config, "checkpoint.keep", None if limit is None else cast("save_total_limit", int, limit))


def read_evaluating(value: Any, lf: dict, out: Converted) -> None:
    if value == "steps":
        every = lf["eval_steps"] if lf["eval_steps"] is not None else lf["logging_steps"]
        put(out.config, "train.eval_every", cast("eval_steps", int, every))
    elif value != "no":
        out.unsupported.append(f"eval_strategy: {value} (shardforge evaluates every N steps)")


def read_resuming(value: Any, lf: dict, out: Converted) -> None:
    """LF resumes from output_dir's last checkpoint unless overwrite_output_dir (or an explicit one)."""
    if lf["resume_from_checkpoint"]:
        put(out.config, "checkpoint.resume", str(lf["resume_from_checkpoint"]))
    else:
        put(out.config, "checkpoint.resume", "none" if cast("overwrite_output_dir", bool, value) else "auto")


def read_report_to(value: Any, lf: dict, out: Converted) -> None:
    names = [n for n in names_of(value) if n != "none"]
    if "all" in names:  # transformers' "all": every integration installed; ours are these
        names = list(TRACKERS)
    put(out.config, "log.report_to", [n for n in names if n in TRACKERS])
    others = [n for n in names if n not in TRACKERS]
    if others:
        out.unsupported.append(f"report_to: {', '.join(others)} (log.report_to offers {', '.join(TRACKERS)})")


def read_checkpointing(value: Any, lf: dict, out: Converted) -> None:
    """LF turns on the model's gradient checkpointing unless disable_gradient_checkpointing."""
    off = cast("disable_gradient_checkpointing", bool, value)
    put(out.config, "parallel.activation_checkpoint", "none" if off else "full")


def read_deepspeed(value: Any, out: Converted) -> None:
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
        put(out.config, "parallel.zero_stage", stage)
    offload = "params" if params else "optimizer" if optim else "none"
    if offload != "none":
        if stage < 2:
            out.unsupported.append(
                f"deepspeed: offload with ZeRO-{stage} (shardforge offloads sharded states)"
            )
        put(out.config, "parallel.offload", offload)
    tp = (ds.get("tensor_parallel") or {}).get("autotp_size")
    if tp:  # DeepSpeed's automatic tensor parallel
        put(out.config, "parallel.tp", int(tp))
    out.notes.append(
        f"deepspeed: {where}: ZeRO-{stage}, offload {offload}{f', tensor parallel {tp}' if tp else ''} "
        "(parallel.zero_stage, offload, tp)"
    )
