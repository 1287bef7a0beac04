"""What a training stage plugs into the one trainer loop: how records become tokens, and the loss."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from shardforge.config.schema import DataSection
from shardforge.data.batching import IGNORE, Batch
from shardforge.data.examples import Encoder, Example


class Stage(Protocol):
    name: str

    def encoder(self, tokenizer: Any, data: DataSection) -> Encoder:
        """Record -> (token ids, per-token target flags)."""
        ...

    def collate(self, examples: Sequence[Example], rows: Sequence[Sequence[int]], pad_id: int) -> Batch:
        """Rows of examples -> one micro-batch of tensors."""
        ...

    def loss_sum(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        """Sum (not mean) of the per-target losses of a micro-batch; the loop divides by the global count."""
        ...


def causal_lm_loss_sum(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Next-token cross-entropy summed over target tokens (targets are pre-shifted per document). The LM head
    runs only on target positions: prompts and padding never pay for the vocabulary projection."""
    scored = batch.targets != IGNORE
    logits = model(
        batch.input_ids,
        position_ids=batch.position_ids,
        doc_ids=batch.doc_ids,
        doc_layout=batch.doc_layout,
        output_mask=scored,
    )
    return F.cross_entropy(logits.float(), batch.targets[scored], reduction="sum")
