"""Objective `sft`: supervised fine-tuning on conversations, targets on assistant tokens only by default."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from shardforge.config.data_schema import DataSection
from shardforge.config.method_schema import MethodSection
from shardforge.data.batching import Batch
from shardforge.data.examples import Encoder, Sequence_
from shardforge.data.formats import Record
from shardforge.data.templates import ChatTemplate, encode_chats, resolve_template
from shardforge.objectives.base import CausalLM, Traits


@dataclass(frozen=True)
class ChatEncoder(Encoder):
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
    traits = Traits(sections=("sft",))

    def encoder(self, tokenizer: Any, data: DataSection) -> Encoder:
        template = resolve_template(tokenizer, data.template, data.enable_thinking)
        return ChatEncoder(tokenizer, template, data.train_on_prompt)

    def __init__(self, method: MethodSection | None = None) -> None:
        super().__init__(method)
        # DFT weighs each token by its probability, so the loss is no plain sum of log-probs: the head
        # returns them for the loss to weigh instead of making the weight's gradient in forward
        self.dft = self.method.sft.loss == "dft"
        self.summed = not self.dft

    def loss(self, output: torch.Tensor, batch: Batch) -> dict[str, torch.Tensor]:
        """Cross-entropy, or DFT's: -sum p log p over the target tokens, p detached (divided, like
        cross-entropy, by the global batch's target count: LLaMA-Factory's num_items_in_batch)."""
        if not self.dft:
            return {"loss": -output.sum()}
        return {"loss": -(output * output.detach().exp()).sum()}
