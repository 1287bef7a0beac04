"""Objective `rm`: a reward model trained on preference pairs (the same data as `dpo`), with a scalar score
head on the final hidden state of each sequence's last non-padding token and the pairwise loss
-log sigmoid(r_chosen - r_rejected).

The model is the family's decoder with `num_labels: 1` (models/common/config.py): the score head replaces the
LM head (HF's `score`), so it exports as a `...ForSequenceClassification` folder. The scored position is
chosen as transformers chooses it (the rightmost token whose id is not the pad id), so the exported model
gives the same scores there.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from shardforge.data.batching import Batch, collate
from shardforge.data.examples import Encoder, Example
from shardforge.data.templates import resolve_template
from shardforge.models.head import Score
from shardforge.objectives.base import CausalLM, Normalizer, Traits
from shardforge.objectives.preference import PairEncoder
from shardforge.objectives.preference_losses import reward_pair_loss


def last_non_pad(input_ids: torch.Tensor, pad_id: int) -> torch.Tensor:
    """Per row, the index of the rightmost token that is not padding (transformers' rule) [rows]."""
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)
    return (positions * (input_ids != pad_id)).argmax(dim=1)


class RewardObjective(CausalLM):
    name = "rm"
    normalizer: Normalizer = "groups"
    group_size = 2
    traits = Traits(reader="pair", whole_sequences=True, score_head=1)  # a one-output score head
    metrics = ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracy", "rewards/margin")

    def encoder(self, tokenizer: Any, data: Any) -> Encoder:
        return PairEncoder(tokenizer, resolve_template(tokenizer, data.template, data.enable_thinking))

    @staticmethod
    def collate(
        examples: Sequence[Example], rows: Sequence[Sequence[int]], pad_id: int, multiple: int = 1
    ) -> Batch:
        batch = collate(examples, rows, pad_id, multiple)
        batch.extras["scored"] = last_non_pad(batch.input_ids, pad_id)
        return batch

    def model_inputs(self, batch: Batch) -> dict[str, Any]:
        scored = batch.extras["scored"]
        mask = torch.zeros(batch.targets.shape, dtype=torch.bool, device=scored.device)
        mask[torch.arange(len(scored), device=scored.device), scored] = True
        return {
            "position_ids": batch.position_ids,
            "doc_ids": batch.doc_ids,
            "doc_layout": batch.doc_layout,
            "output_mask": mask,
            "head": Score(),
            "images": batch.images,
        }

    def loss(self, output: torch.Tensor, batch: Batch) -> dict[str, torch.Tensor]:
        scores = output.float().view(-1, 2)  # a pair's rows are consecutive, chosen first
        chosen, rejected = scores[:, 0], scores[:, 1]
        margin = (chosen - rejected).detach()
        return {
            "loss": reward_pair_loss(chosen, rejected).sum(),
            "rewards/chosen": chosen.detach().sum(),
            "rewards/rejected": rejected.detach().sum(),
            "rewards/accuracy": (margin > 0).float().sum(),
            "rewards/margin": margin.sum(),
        }
