"""What a training objective plugs into the one loop.

An objective says how records become examples (one or several sequences per record: a *group*, such as a
chosen/rejected pair, stays together on one rank and in one micro-batch), how rows are collated, what the
model is called with, and the loss as a dict of *sums* over a micro-batch. The loop divides those sums by the
objective's `normalizer` counted over the whole global batch (target tokens, sequences or groups), so a
per-token SFT loss and a per-pair preference loss share one loop and one global-batch semantics: the update
never depends on how the global batch is split over ranks and micro-steps.

`loss` receives the model's output (logits of the scored positions) and the micro-batch (or, under pipeline
parallel, the last stage's chunk of it: a Batch rebuilt from its per-row tensors), so it can form per-token
or per-sequence quantities alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from shardforge.config.schema import DataSection, MethodSection
from shardforge.data.batching import IGNORE, Batch, collate
from shardforge.data.examples import Encoder, Example

Normalizer = Literal["targets", "sequences", "groups"]


class Objective(Protocol):
    name: str
    normalizer: Normalizer  # the global-batch count the loss sums are divided by
    group_size: int  # sequences per group (1: every sequence stands alone)
    metrics: tuple[str, ...]  # the keys `loss` returns, "loss" first (the differentiated sum)
    reads_text: bool  # records as plain text (pretraining) rather than conversations

    def encoder(self, tokenizer: Any, data: DataSection) -> Encoder:
        """Record -> its group's sequences, each (token ids, per-token target flags)."""
        ...

    def collate(
        self, examples: Sequence[Example], rows: Sequence[Sequence[int]], pad_id: int, multiple: int = 1
    ) -> Batch:
        """Rows of examples (a group's rows consecutive) -> one micro-batch, its width a multiple of
        `multiple`."""
        ...

    def model_inputs(self, batch: Batch) -> dict[str, Any]:
        """Keyword arguments of the model's forward besides the token ids."""
        ...

    def loss(self, output: torch.Tensor, batch: Batch) -> dict[str, torch.Tensor]:
        """Sums over the micro-batch, keyed by `metrics`; "loss" is what is differentiated."""
        ...


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy summed over the scored positions: logits [n, vocab], targets [n]."""
    loss = F.cross_entropy(logits.float(), targets, reduction="sum")
    # Under tensor parallel the logits are vocabulary shards and `loss_parallel` returns a replicated DTensor.
    return loss.to_local() if isinstance(loss, DTensor) else loss


def sequence_logprob_sums(logits: torch.Tensor, batch: Batch) -> torch.Tensor:
    """Summed log-probability of each row's target tokens, [rows]: what per-sequence objectives (preference
    pairs, rewards of completions) compare. `logits` are those of the scored positions, in row order."""
    scored = batch.targets != IGNORE
    logprobs = -F.cross_entropy(logits.float(), batch.targets[scored], reduction="none")
    rows = scored.nonzero()[:, 0]
    return torch.zeros(batch.targets.shape[0], device=logprobs.device).index_add(0, rows, logprobs)


class CausalLM:
    """Next-token prediction: cross-entropy summed over target tokens, divided by the global batch's target
    count. The LM head runs only on target positions: prompts and padding never pay for the vocabulary
    projection."""

    name = "causal_lm"
    normalizer: Normalizer = "targets"
    group_size = 1
    metrics = ("loss",)
    reads_text = False
    collate = staticmethod(collate)

    def __init__(self, method: MethodSection | None = None) -> None:
        self.method = method or MethodSection()  # where an objective's hyper-parameters come from

    @staticmethod
    def model_inputs(batch: Batch) -> dict[str, Any]:
        return {
            "position_ids": batch.position_ids,
            "doc_ids": batch.doc_ids,
            "doc_layout": batch.doc_layout,
            "output_mask": batch.targets != IGNORE,
        }

    @staticmethod
    def loss(output: torch.Tensor, batch: Batch) -> dict[str, torch.Tensor]:
        return {"loss": token_loss_sum(output, batch.targets[batch.targets != IGNORE])}


def causal_lm_forward(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Logits [targets, vocab] of the target positions only."""
    return model(batch.input_ids, **CausalLM.model_inputs(batch))


def causal_lm_loss_sum(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Next-token cross-entropy summed over the target tokens of a micro-batch."""
    return CausalLM.loss(causal_lm_forward(model, batch), batch)["loss"]
