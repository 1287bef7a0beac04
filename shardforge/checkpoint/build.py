"""A run's checkpoint manager, built from its config: the signature a continuation is checked against (the
model, the padded vocabulary, the global batch, the data, the seed, what a parameter-efficient run trains
over, PPO's separate critic) and the parts it saves."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shardforge.checkpoint.manager import CheckpointManager, signature
from shardforge.config.schema import Config
from shardforge.data.cache import file_fingerprint
from shardforge.log import get_logger
from shardforge.parallel.dims import ParallelDims
from shardforge.parallel.tensor_parallel import padded_vocab

log = get_logger(__name__)


def finetuning_identity(cfg: Config) -> dict | None:
    """What a parameter-efficient run's checkpoint depends on besides itself: the method's settings and the
    base it does not hold (re-read from model.path on resume). None for full fine-tuning."""
    method = cfg.method
    if method.finetuning == "full":
        return None
    settings = {"lora": method.lora, "oft": method.oft}.get(method.finetuning, method.freeze)
    weights = sorted(Path(cfg.model.path).glob("*.safetensors")) if cfg.model.path else []
    base = file_fingerprint(weights) if weights else f"preset {cfg.model.preset}"
    identity = {"method": method.finetuning, "settings": settings.model_dump(), "base": base}
    return json.loads(json.dumps(identity))  # as the checkpoint stores it (lists, not tuples)


def build_checkpoints(
    cfg: Config,
    *,
    run_dir: Path,
    model: nn.Module,
    trained: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    precision: Any,
    dims: ParallelDims,
    data_id: Any,
    global_batch: int,
) -> CheckpointManager:
    """`model`: the rank's model (its config, and PPO's critic model, `model.critic`, checkpointed with it);
    `trained`: what runs forward (the engine's model: a wrapper's state dict is the model's)."""
    config = model.config
    critic = model.critic.config if model.critic is not None else None
    vocab_rows = padded_vocab(config.vocab_size, dims.tp)
    finetuning = finetuning_identity(cfg)
    seed, optimizer_name = cfg.train.seed, cfg.train.optimizer.name
    sig = signature(config, vocab_rows, global_batch, data_id, seed, finetuning, critic, optimizer_name)
    parts = (trained, optimizer, scheduler, precision)
    layout = (dims.world_size, dims.describe())
    return CheckpointManager(run_dir / "checkpoints", cfg.checkpoint, sig, parts, layout)
