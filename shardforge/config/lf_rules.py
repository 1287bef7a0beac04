"""Every LLaMA-Factory key we map and its rule, in the order they run (a later rule may refine an earlier)."""

from __future__ import annotations

from shardforge.config.lf_data_rules import (
    read_datasets,
    read_mixing,
    read_packing,
    read_template,
    read_val_size,
)
from shardforge.config.lf_method_rules import (
    read_dft,
    read_finetuning,
    read_freeze_modules,
    read_llama_pro,
    read_lora_alpha,
    read_lora_target,
    read_loraplus,
    read_pissa,
    read_pref,
    read_pref_loss,
    read_quantization,
    read_reward_model,
    read_stage,
)
from shardforge.config.lf_train_rules import (
    read_checkpointing,
    read_evaluating,
    read_length,
    read_optimizer,
    read_precision,
    read_report_to,
    read_resuming,
    read_saving,
    read_schedule,
    read_warmup,
    steps_layerwise,
)
from shardforge.config.lf_values import Rule, cast, names_of, put


def _simple(table: dict[str, tuple[str, type | None]]) -> dict[str, Rule]:
    """One-to-one keys: LF key -> (our key, LF's type)."""

    def rule(key: str, dotted: str, kind: type | None) -> Rule:
        return lambda v, lf, out: put(
            out.config, dotted, v if kind is None or v is None else cast(key, kind, v)
        )

    return {key: rule(key, dotted, kind) for key, (dotted, kind) in table.items()}


def _optional(key: str, dotted: str, kind: type) -> Rule:
    """A key whose LF default (None, 0, an empty list) means: leave ours unset."""
    return lambda v, lf, out: put(out.config, dotted, cast(key, kind, v)) if v else None


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
    "quantization_bit": read_quantization,
    "stage": read_stage,
    "finetuning_type": read_finetuning,
    "lora_alpha": read_lora_alpha,
    "lora_target": read_lora_target,
    "freeze_trainable_modules": read_freeze_modules,
    "freeze_extra_modules": lambda v, lf, out: (
        put(out.config, "method.freeze.extra_modules", names_of(v)) if v else None
    ),
    "pref_beta": read_pref("beta", float),
    "pref_loss": read_pref_loss,
    "pref_ftx": read_pref("ftx", float),
    "ref_model": _optional("ref_model", "method.pref.ref", str),
    "reward_model": read_reward_model,
    "dataset": read_datasets("data.train"),
    "eval_dataset": read_datasets("data.eval"),
    "template": read_template,
    "packing": read_packing,
    "val_size": read_val_size,
    "preprocessing_num_workers": _optional("preprocessing_num_workers", "data.workers", int),
    "save_strategy": read_saving,
    "report_to": read_report_to,
    "run_name": _optional("run_name", "log.run_name", str),
    "default_system": _optional("default_system", "data.default_system", str),
    "mix_strategy": read_mixing,
    "num_train_epochs": read_length,
    "lr_scheduler_type": read_schedule,
    "warmup_steps": read_warmup,
    "optim": read_optimizer,
    "max_grad_norm": lambda v, lf, out: put(
        out.config, "train.clip", None if steps_layerwise(lf) else cast("max_grad_norm", float, v) or None
    ),
    "bf16": read_precision,
    "eval_strategy": read_evaluating,
    "overwrite_output_dir": read_resuming,
    "ddp_timeout": lambda v, lf, out: put(
        out.config, "parallel.timeout_minutes", max(1.0, cast("ddp_timeout", int, v) / 60)
    ),
    "disable_gradient_checkpointing": read_checkpointing,
    "use_dft_loss": read_dft,
    "neftune_noise_alpha": _optional("neftune_noise_alpha", "train.neftune_alpha", float),
    "loraplus_lr_ratio": read_loraplus,
    "use_llama_pro": read_llama_pro,
    "pissa_init": read_pissa,
}
# keys read by another key's rule (quantization_bit's, dataset's, ...) or by read_deepspeed
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
