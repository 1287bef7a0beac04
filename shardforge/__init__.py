"""shardforge: train and fine-tune LLMs from one CPU to a cluster, with Hugging Face checkpoints in and
out."""

from __future__ import annotations

import os
import sys
from typing import Any

from shardforge.errors import ShardforgeError

if "torch" not in sys.modules:
    # Host tensors of 2 MiB and more on transparent huge pages: glibc maps every allocation over 32 MiB anew,
    # and a fresh vocabulary-sized gradient then costs one page fault per 4 KiB (steps 4% faster on
    # SmolLM2-135M here). torch reads the switch once, at its first allocation; a user's own value wins.
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

__version__ = "0.1.0"
__all__ = ["ShardforgeError", "__version__", "load_model", "save_model"]


def __getattr__(name: str) -> Any:
    """`load_model` / `save_model` import torch and transformers on first use, not when the package is
    imported: the CLI's --help and config errors answer without paying for them."""
    if name in ("load_model", "save_model"):
        from shardforge import models

        return getattr(models, name)
    raise AttributeError(f"module 'shardforge' has no attribute {name!r}")
