"""shardforge: train and fine-tune LLMs from one CPU to a cluster, with Hugging Face checkpoints in and
out."""

from shardforge.errors import ShardforgeError
from shardforge.models import load_model, save_model

__version__ = "0.1.0"
__all__ = ["ShardforgeError", "__version__", "load_model", "save_model"]
