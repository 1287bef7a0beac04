"""Training checkpoints: sharded save/load with torch.distributed.checkpoint, atomic commit, discovery,
retention, and export of any checkpoint to a Hugging Face folder."""

from shardforge.checkpoint.store import find_latest, validate
from shardforge.checkpoint.trainer_state import Checkpointer, load_checkpoint

__all__ = ["Checkpointer", "find_latest", "load_checkpoint", "validate"]
