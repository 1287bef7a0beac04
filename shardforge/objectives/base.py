"""What a training stage plugs into the one trainer loop: how records become tokens, and the loss."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from shardforge.config.schema import DataSection
from shardforge.data.batching import IGNORE, Batch
from shardforge.data.examples import Encoder, Example


class Stage(Protocol):
    name: str

    def encoder(self, tokenizer: Any, data: DataSection) -> Encoder:
        """Record -> (token ids, per-token target flags)."""
        ...

    def collate(
        self, examples: Sequence[Example], rows: Sequence[Sequence[int]], pad_id: int, multiple: int = 1
    ) -> Batch:
        """Rows of examples -> one micro-batch of tensors, its length a multiple of `multiple`."""
        ...

    def loss_sum(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        """Sum (not mean) of the per-target losses of a micro-batch; the loop divides by the global count."""
        ...

    def logits_loss_sum(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The same sum from the LM head's output at the scored positions (the last pipeline stage's loss)."""
        ...


def causal_lm_forward(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Logits [targets, vocab] of the target positions only (the LM head skips prompts and padding)."""
    return model(
        batch.input_ids,
        position_ids=batch.position_ids,
        doc_ids=batch.doc_ids,
        doc_layout=batch.doc_layout,
        output_mask=batch.targets != IGNORE,
    )


def causal_lm_loss_sum(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Next-token cross-entropy summed over target tokens (targets are pre-shifted per document). The LM head
    runs only on target positions: prompts and padding never pay for the vocabulary projection."""
    return logits_loss_sum(causal_lm_forward(model, batch), batch.targets[batch.targets != IGNORE])


def logits_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy summed over the scored positions: logits [n, vocab], targets [n] (also what the last
    pipeline stage computes)."""
    loss = F.cross_entropy(logits.float(), targets, reduction="sum")
    # Under tensor parallel the logits are vocabulary shards and `loss_parallel` returns a replicated DTensor.
    return loss.to_local() if isinstance(loss, DTensor) else loss
