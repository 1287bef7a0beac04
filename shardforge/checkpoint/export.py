"""Any training checkpoint (any layout, any world size) -> a Hugging Face folder (or, for LoRA, a PEFT adapter
folder, or with `merge` the adapters merged into the base), in one process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from shardforge.adapters.apply import apply_finetuning
from shardforge.adapters.lora import is_adapter_key
from shardforge.adapters.peft_format import merged_state, save_adapter
from shardforge.checkpoint.store import resolve_checkpoint
from shardforge.checkpoint.trainer_state import load_model_weights, read_trainer_state
from shardforge.config import Config, load_config
from shardforge.models import save_model
from shardforge.models.build import build_model, load_tokenizer
from shardforge.models.head import attach_critic
from shardforge.objectives import score_labels
from shardforge.objectives.rl import critic_folder, load_critic
from shardforge.parallel.tensor_parallel import pad_vocab, strip_vocab_padding


def write_model_folder(
    model: nn.Module,
    state: dict[str, torch.Tensor] | None,
    config: Config,
    tokenizer: Any,
    to: Path,
    merge: bool = False,
) -> str:
    """Write a run's full weights (our names, unpadded) as what its method hands back: an HF folder, or for
    LoRA a PEFT adapter folder (the merged HF folder with `merge`). `state` None: the model's own weights.
    Returns what was written."""
    state = model.state_dict() if state is None else state
    # PPO's value head stays behind; its separate critic model is written beside the policy
    state = {k: v for k, v in state.items() if not k.startswith("value_head.")}
    critic = {k.removeprefix("critic."): v for k, v in state.items() if k.startswith("critic.")}
    if critic:  # an HF sequence classifier of its own, in critic/
        state = {k: v for k, v in state.items() if not k.startswith("critic.")}
        save_model(model.critic, to / "critic", tokenizer=tokenizer, state_dict=critic)
    beside = " and its critic (critic/)" if critic else ""
    merge = merge or getattr(model.config, "num_labels", 0) > 0  # a score head trains whole: not an adapter
    if config.method.finetuning == "lora" and not merge:
        adapters = {k: v for k, v in state.items() if is_adapter_key(k)}
        save_adapter(to, model.config.family, adapters, config.method.lora, config.model.path, tokenizer)
        return "LoRA adapter (PEFT format)" + beside
    if config.method.finetuning == "lora":
        state = merged_state(model, state)
    save_model(
        model, to, tokenizer=tokenizer, state_dict=state, expert_layout=config.checkpoint.expert_layout
    )
    merged = ", adapters merged" if config.method.finetuning == "lora" else ""
    return f"model (HF format{merged})" + beside


def export_checkpoint(path: Path, to: Path, merge: bool = False) -> tuple[Path, Path, str]:
    """Write the weights of a checkpoint (+ the run's tokenizer) as an HF folder; returns (the checkpoint
    used, the folder written, what it holds). A LoRA or freeze checkpoint holds only what trained: the base
    is read from the run's model.path."""
    folder = resolve_checkpoint(path)
    config = load_config(folder / "config.yaml")  # the run's resolved config, saved with its checkpoints
    tokenizer = load_tokenizer(config.model)
    num_labels = score_labels(config.method)
    model = build_model(
        config.model, tokenizer, config.train.seed, torch.device("cpu"), num_labels=num_labels
    )
    apply_finetuning(model, config.method, config.train.seed)  # the checkpoint holds the adapters
    critic = critic_folder(config.method)
    if critic is not None:  # PPO's separate critic: the checkpoint holds its trained weights
        attach_critic(model, load_critic(critic, model))
    vocab = model.config.vocab_size
    pad_vocab(model, read_trainer_state(folder)["vocab_rows"])  # as saved: padded for the run's TP degree
    load_model_weights(folder, model)
    weights = strip_vocab_padding(model.state_dict(), vocab)
    return folder, to, write_model_folder(model, weights, config, tokenizer, to, merge)
