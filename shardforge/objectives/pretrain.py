"""Objective `pt`: next-token prediction on plain text documents, every token a target."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shardforge.config.schema import DataSection
from shardforge.data.examples import Encoder
from shardforge.data.formats import Record
from shardforge.data.templates import encode_text
from shardforge.objectives.base import CausalLM


@dataclass(frozen=True)
class TextEncoder:
    """A document -> BOS + tokens + EOS, every token a target. A plain object (not a closure), so encoding
    worker processes can receive it."""

    tokenizer: Any

    def __call__(self, record: Record) -> list[tuple[list[int], list[bool]]]:
        ids = encode_text(self.tokenizer, record.text or "")
        return [(ids, [True] * len(ids))]


class PretrainObjective(CausalLM):
    name = "pt"
    reads_text = True

    def encoder(self, tokenizer: Any, data: DataSection) -> Encoder:
        return TextEncoder(tokenizer)
