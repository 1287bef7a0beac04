"""Objective `pt`: next-token prediction on plain text documents, every token a target."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from shardforge.config.data_schema import DataSection
from shardforge.data.examples import Encoder, Sequence_
from shardforge.data.formats import Record
from shardforge.data.templates import encode_texts
from shardforge.objectives.base import CausalLM, Traits


@dataclass(frozen=True)
class TextEncoder(Encoder):
    """A document -> BOS + tokens + EOS, every token a target (`blocks`: tokens + EOS, for LLaMA-Factory's
    pretraining blocks). A plain object (not a closure), so encoding worker processes can receive it."""

    tokenizer: Any
    blocks: bool = False

    def encode_batch(self, records: list[Record]) -> list[list[Sequence_]]:
        documents = encode_texts(self.tokenizer, [r.text or "" for r in records], bos=not self.blocks)
        return [[(ids, np.ones(len(ids), dtype=bool))] for ids in documents]

    def __call__(self, record: Record) -> list[Sequence_]:
        return self.encode_batch([record])[0]


class PretrainObjective(CausalLM):
    name = "pt"
    traits = Traits(reader="text")

    def encoder(self, tokenizer: Any, data: DataSection) -> Encoder:
        return TextEncoder(tokenizer, blocks=data.pt_blocks)
