"""LLaMA-Factory's defaults and the tables its keys are read by: what each key means to LF, kept as data."""

from __future__ import annotations

from typing import Any, get_args

from shardforge.config.schema import Tracker

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
