"""shardforge: train and fine-tune LLMs from one CPU to a cluster, with Hugging Face checkpoints in and
out."""

from __future__ import annotations

from typing import Any

from shardforge.errors import ShardforgeError

__version__ = "0.1.0"
__all__ = ["ShardforgeError", "__version__", "load_model", "save_model"]


def __getattr__(name: str) -> Any:
    """`load_model` / `save_model` import torch and transformers on first use, not when the package is
    imported: the CLI's --help and config errors answer without paying for them."""
    if name in ("load_model", "save_model"):
        from shardforge import models

        return getattr(models, name)
    raise AttributeError(f"module 'shardforge' has no attribute {name!r}")
