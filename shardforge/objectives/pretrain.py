"""Objective `pt`: next-token prediction on plain text documents, every token a target."""

from __future__ import annotations

from typing import Any

from shardforge.config.schema import DataSection
from shardforge.data.examples import Encoder
from shardforge.data.formats import Record
from shardforge.data.templates import encode_text
from shardforge.objectives.base import CausalLM


class PretrainObjective(CausalLM):
    name = "pt"
    reads_text = True

    def encoder(self, tokenizer: Any, data: DataSection) -> Encoder:
        def encode(record: Record) -> list[tuple[list[int], list[bool]]]:
            ids = encode_text(tokenizer, record.text or "")
            return [(ids, [True] * len(ids))]

        return encode
