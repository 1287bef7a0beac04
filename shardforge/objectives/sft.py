"""Objective `sft`: supervised fine-tuning on conversations, targets on assistant tokens only by default."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shardforge.config.schema import DataSection
from shardforge.data.examples import Encoder, Sequence_
from shardforge.data.formats import Record
from shardforge.data.templates import ChatTemplate, encode_chats, resolve_template
from shardforge.objectives.base import CausalLM


@dataclass(frozen=True)
class ChatEncoder:
    """A conversation -> its tokens and target flags. A plain object (not a closure), so encoding worker
    processes can receive it."""

    tokenizer: Any
    template: ChatTemplate
    train_on_prompt: bool

    def encode_batch(self, records: list[Record]) -> list[list[Sequence_]]:
        conversations = [(list(r.messages or ()), r.tools, r.source) for r in records]
        encoded = encode_chats(self.tokenizer, self.template, conversations, self.train_on_prompt)
        return [[sequence] for sequence in encoded]

    def __call__(self, record: Record) -> list[Sequence_]:
        return self.encode_batch([record])[0]


class SFTObjective(CausalLM):
    name = "sft"

    def encoder(self, tokenizer: Any, data: DataSection) -> Encoder:
        template = resolve_template(tokenizer, data.template, data.enable_thinking)
        return ChatEncoder(tokenizer, template, data.train_on_prompt)
