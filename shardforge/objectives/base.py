"""What a training objective plugs into the one loop.

An objective says how records become examples (one or several sequences per record: a *group*, such as a
chosen/rejected pair, stays together on one rank and in one micro-batch), how rows are collated, what the
model is called with, and the loss as a dict of *sums* over a micro-batch. The loop divides those sums by the
objective's `normalizer` counted over the whole global batch (target tokens, sequences or groups), so a
per-token SFT loss and a per-pair preference loss share one loop and one global-batch semantics: the update
never depends on how the global batch is split over ranks and micro-steps.

`loss` receives the model's output (the log-probabilities of the scored positions' targets, from the fused
head: no full-vocabulary logits) and the micro-batch (or, under pipeline parallel, the last stage's chunk of
it: a Batch rebuilt from its per-row tensors), so it can form per-token or per-sequence quantities alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, Protocol

import torch
from torch import nn

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


def finish_means(objective: Objective, means: dict[str, float]) -> dict[str, float]:
    """The logged means: each metric's sum over the global batch divided by the normalizer, then whatever
    the objective's optional `finish` makes of them (e.g. means over a subset of the groups)."""
    finish = getattr(objective, "finish", None)
    return finish(means) if finish is not None else means


def sequence_logprob_sums(logprobs: torch.Tensor, batch: Batch) -> torch.Tensor:
    """Summed log-probability of each row's target tokens, [rows]: what per-sequence objectives (preference
    pairs, rewards of completions) compare. `logprobs` are those of the scored positions, in row order."""
    rows = (batch.targets != IGNORE).nonzero()[:, 0]
    return torch.zeros(batch.targets.shape[0], device=logprobs.device).index_add(0, rows, logprobs)


class CausalLM:
    """Next-token prediction: cross-entropy summed over target tokens, divided by the global batch's target
    count. The LM head runs only on target positions, fused with the log-probabilities: prompts and padding
    never pay for the vocabulary projection, and no full-vocabulary logits are held."""

    name = "causal_lm"
    normalizer: Normalizer = "targets"
    group_size = 1
    metrics = ("loss",)
    reads_text = False
    collate = staticmethod(collate)
    summed = True  # the loss is a plain sum of the token log-probs (the fused head's fast gradient)

    def __init__(self, method: MethodSection | None = None) -> None:
        self.method = method or MethodSection()  # where an objective's hyper-parameters come from

    def model_inputs(self, batch: Batch) -> dict[str, Any]:
        scored = batch.targets != IGNORE
        return {
            "position_ids": batch.position_ids,
            "doc_ids": batch.doc_ids,
            "doc_layout": batch.doc_layout,
            "output_mask": scored,
            "targets": batch.targets[scored],
            "summed": self.summed,
        }

    @staticmethod
    def loss(output: torch.Tensor, batch: Batch) -> dict[str, torch.Tensor]:
        return {"loss": -output.sum()}


def causal_lm_forward(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Log-probabilities [targets] of the target positions' next tokens."""
    return model(batch.input_ids, **CausalLM().model_inputs(batch))


def causal_lm_loss_sum(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Next-token cross-entropy summed over the target tokens of a micro-batch."""
    return CausalLM.loss(causal_lm_forward(model, batch), batch)["loss"]
