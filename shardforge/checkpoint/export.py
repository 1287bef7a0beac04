"""Any training checkpoint (any layout, any world size) -> a Hugging Face folder, in one process."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from shardforge.checkpoint.store import resolve_checkpoint
from shardforge.checkpoint.trainer_state import load_model_weights, read_trainer_state
from shardforge.config import load_config
from shardforge.models import save_model
from shardforge.models.build import build_model, load_tokenizer
from shardforge.parallel.tensor_parallel import pad_vocab, strip_vocab_padding


def export_checkpoint(path: Path, to: Path, warn: Callable[[str], None]) -> tuple[Path, Path]:
    """Write the weights of a checkpoint (+ the run's tokenizer) as an HF folder; returns (the checkpoint
    used, the folder written)."""
    folder = resolve_checkpoint(path, warn)
    config = load_config(folder / "config.yaml")  # the run's resolved config, saved with its checkpoints
    tokenizer = load_tokenizer(config.model)
    model = build_model(config.model, tokenizer, config.train.seed, torch.device("cpu"))
    vocab = model.config.vocab_size
    pad_vocab(model, read_trainer_state(folder)["vocab_rows"])  # as saved: padded for the run's TP degree
    load_model_weights(folder, model)
    weights = strip_vocab_padding(model.state_dict(), vocab)
    return folder, save_model(model, to, tokenizer=tokenizer, state_dict=weights)
