"""Stage `sft`: supervised fine-tuning on conversations, targets on assistant tokens only by default."""

from __future__ import annotations

from typing import Any

from shardforge.config.schema import DataSection
from shardforge.data.batching import collate
from shardforge.data.examples import Encoder
from shardforge.data.formats import Record
from shardforge.data.templates import encode_chat, resolve_template
from shardforge.objectives.base import causal_lm_loss_sum, logits_loss_sum


class SFTStage:
    name = "sft"
    collate = staticmethod(collate)
    loss_sum = staticmethod(causal_lm_loss_sum)
    logits_loss_sum = staticmethod(logits_loss_sum)

    def encoder(self, tokenizer: Any, data: DataSection) -> Encoder:
        template = resolve_template(tokenizer, data.template)

        def encode(record: Record) -> tuple[list[int], list[bool]]:
            return encode_chat(
                tokenizer, template, list(record.messages or ()), data.train_on_prompt, record.source
            )

        return encode
