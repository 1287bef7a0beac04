"""Objective `sft`: supervised fine-tuning on conversations, targets on assistant tokens only by default."""

from __future__ import annotations

from typing import Any

from shardforge.config.schema import DataSection
from shardforge.data.examples import Encoder
from shardforge.data.formats import Record
from shardforge.data.templates import encode_chat, resolve_template
from shardforge.objectives.base import CausalLM


class SFTObjective(CausalLM):
    name = "sft"

    def encoder(self, tokenizer: Any, data: DataSection) -> Encoder:
        template = resolve_template(tokenizer, data.template)

        def encode(record: Record) -> list[tuple[list[int], list[bool]]]:
            messages = list(record.messages or ())
            return [encode_chat(tokenizer, template, messages, data.train_on_prompt, record.source)]

        return encode
