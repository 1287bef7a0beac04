"""The rules for LLaMA-Factory's model and method keys: stage, finetuning, adapters, preference, reward."""

from __future__ import annotations

from typing import Any

from shardforge.config.lf_tables import PREF_LOSSES, STAGES
from shardforge.config.lf_values import Converted, Rule, cast, names_of, put
from shardforge.errors import ConfigError


def read_stage(value: Any, lf: dict, out: Converted) -> None:
    if value not in STAGES:
        raise ConfigError(f"stage: {value!r} is not one of LLaMA-Factory's {', '.join(STAGES)}")
    put(out.config, "method.stage", STAGES[value])


def read_finetuning(value: Any, lf: dict, out: Converted) -> None:
    if value not in ("lora", "oft", "freeze", "full"):
        raise ConfigError(f"finetuning_type: {value!r} is not one of lora, oft, freeze, full")
    for key in ("use_dora", "use_rslora"):  # LF's own checks
        if value != "lora" and cast(key, bool, lf[key]):
            raise ConfigError(f"{key}: only valid for LoRA training (finetuning_type is {value})")
    put(out.config, "method.finetuning", value)
    if value != "oft":
        return
    rank, block = cast("oft_rank", int, lf["oft_rank"]), cast("oft_block_size", int, lf["oft_block_size"])
    if rank and block:  # peft's OFTConfig takes one of the two
        raise ConfigError(f"oft_rank: {rank} with oft_block_size {block}; set one of them (the other 0)")
    if rank:
        out.unsupported.append(f"oft_rank: {rank} (shardforge's OFT is set by oft_block_size)")
    else:
        put(out.config, "method.oft.block_size", block)
    if float(lf["module_dropout"]):
        out.unsupported.append(f"module_dropout: {lf['module_dropout']} (OFT's multiplicative dropout)")
    names = names_of(lf["lora_target"])  # LF adapts lora_target's modules with OFT too (oft_target is unread)
    put(out.config, "method.oft.targets", "all" if names == ["all"] else names)
    if "oft_target" in lf:
        out.notes.append("oft_target: LLaMA-Factory 0.9.5 reads lora_target for OFT's modules, as here")


def read_quantization(value: Any, lf: dict, out: Converted) -> None:
    if value is None:
        return
    bits, method, kind = (
        cast("quantization_bit", int, value),
        lf["quantization_method"],
        lf["quantization_type"],
    )
    if (bits, method, kind) == (4, "bnb", "nf4"):
        put(out.config, "model.quantize", "nf4")
    else:
        out.unsupported.append(
            f"quantization_bit: {bits} ({method}, {kind}): shardforge quantizes a base to 4-bit NF4 only"
        )


def read_lora_alpha(value: Any, lf: dict, out: Converted) -> None:
    if value is None:
        value = 2 * cast("lora_rank", int, lf["lora_rank"])
        out.notes.append("lora_alpha unset: LLaMA-Factory's default, twice lora_rank")
    put(out.config, "method.lora.alpha", cast("lora_alpha", float, value))


def read_lora_target(value: Any, lf: dict, out: Converted) -> None:
    names = names_of(value)
    put(out.config, "method.lora.targets", "all" if names == ["all"] else names)


def read_freeze_modules(value: Any, lf: dict, out: Converted) -> None:
    if names_of(value) != ["all"]:
        out.unsupported.append(f"freeze_trainable_modules: {value} (only whole layers train under freeze)")


def read_pref(name: str, kind: type) -> Rule:
    """pref_beta / pref_ftx: DPO's, or KTO's under stage kto (LF reads the same keys for both)."""

    def rule(value: Any, lf: dict, out: Converted) -> None:
        key = f"pref_{name}"
        if lf["stage"] == "kto" and name == "ftx":
            if float(value):
                out.unsupported.append(f"{key}: {value} (an SFT term in KTO)")
            return
        section = "kto" if lf["stage"] == "kto" else "pref"
        put(out.config, f"method.{section}.{name}", cast(key, kind, value))

    return rule


def read_pref_loss(value: Any, lf: dict, out: Converted) -> None:
    if float(lf["dpo_label_smoothing"]) and value != "sigmoid":  # LF's own check
        raise ConfigError(f"dpo_label_smoothing: only valid with pref_loss sigmoid (it is {value})")
    if value not in PREF_LOSSES:
        out.unsupported.append(f"pref_loss: {value} (shardforge has {', '.join(PREF_LOSSES)})")
    else:
        put(out.config, "method.pref.loss", PREF_LOSSES[value])


def read_reward_model(value: Any, lf: dict, out: Converted) -> None:
    if value is None:
        if lf["stage"] == "ppo":
            out.unsupported.append("reward_model: unset (LF's PPO needs a reward model)")
        return
    if lf.get("reward_model_type", "lora") != "full":
        out.unsupported.append(
            f"reward_model_type: {lf.get('reward_model_type', 'lora')} (shardforge reads a full reward "
            "model folder: export the rm run merged and set reward_model_type: full)"
        )
    put(out.config, "method.rl.rewards", [{"model": str(value)}])


def read_dft(value: Any, lf: dict, out: Converted) -> None:
    if not cast("use_dft_loss", bool, value):
        return
    if lf["stage"] == "sft":
        put(out.config, "method.sft.loss", "dft")
    else:  # LF's SFT trainer alone reads it
        out.notes.append(f"use_dft_loss: LLaMA-Factory's stage {lf['stage']} ignores it, as shardforge does")


def read_loraplus(value: Any, lf: dict, out: Converted) -> None:
    if value is None:
        return
    if lf["finetuning_type"] != "lora":  # LF's own check
        raise ConfigError("loraplus_lr_ratio: only valid for LoRA training (finetuning_type: lora)")
    put(out.config, "method.lora.plus_lr_ratio", cast("loraplus_lr_ratio", float, value))
    if "loraplus_lr_embedding" in lf:
        out.notes.append("loraplus_lr_embedding: shardforge adapts no embedding, so it changes nothing")


def read_llama_pro(value: Any, lf: dict, out: Converted) -> None:
    if not cast("use_llama_pro", bool, value):
        return
    if lf["finetuning_type"] == "full":  # LF's own check
        raise ConfigError("use_llama_pro: only valid for freeze or LoRA training (finetuning_type)")
    if lf["finetuning_type"] != "freeze":
        out.unsupported.append("use_llama_pro with finetuning_type lora (LoRA on LLaMA Pro's blocks)")
        return
    put(out.config, "method.freeze.llama_pro", True)
    out.notes.append(
        "use_llama_pro: the model must be expanded first (`shardforge expand MODEL --blocks N --to DIR`, "
        "LF's scripts/llama_pro.py); freeze_trainable_layers is the number of blocks added"
    )


def read_pissa(value: Any, lf: dict, out: Converted) -> None:
    if not cast("pissa_init", bool, value):
        return
    if lf["stage"] in ("ppo", "kto") or (lf["stage"] == "dpo" and lf["pref_loss"] not in ("orpo", "simpo")):
        raise ConfigError(
            f"pissa_init: LLaMA-Factory refuses PiSSA for stage {lf['stage']} (a reference model)"
        )
    if lf["finetuning_type"] != "lora":  # LF's own check
        raise ConfigError("pissa_init: only valid for LoRA training (finetuning_type: lora)")
    put(out.config, "method.lora.init", "pissa")
    put(out.config, "method.lora.pissa_iter", cast("pissa_iter", int, lf["pissa_iter"]))
    out.notes.append(
        "pissa_init: the adapter is written as the plain LoRA it amounts to (rank 2r, over the original "
        "base), as LF's pissa_convert: true writes it, whatever pissa_convert says"
    )
