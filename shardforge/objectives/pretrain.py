"""Stage `pt`: next-token prediction on plain text documents, every token a target."""

from __future__ import annotations

from typing import Any

from shardforge.config.schema import DataSection
from shardforge.data.batching import collate
from shardforge.data.examples import Encoder
from shardforge.data.formats import Record
from shardforge.data.templates import encode_text
from shardforge.objectives.base import causal_lm_loss_sum, logits_loss_sum


class PretrainStage:
    name = "pt"
    collate = staticmethod(collate)
    loss_sum = staticmethod(causal_lm_loss_sum)
    logits_loss_sum = staticmethod(logits_loss_sum)

    def encoder(self, tokenizer: Any, data: DataSection) -> Encoder:
        def encode(record: Record) -> tuple[list[int], list[bool]]:
            ids = encode_text(tokenizer, record.text or "")
            return ids, [True] * len(ids)

        return encode
