"""Objective `dpo`: preference pairs (a prompt, a chosen and a rejected reply) trained with the DPO family of
losses (sigmoid, ipo, hinge, robust; orpo and simpo without a reference), as `preference_losses.py` defines
them.

A pair is a group of two sequences (chosen first) that share the prompt's tokens; only the replies' tokens
are scored. The loss is per pair: the loop divides the sums by the pairs in the global batch. The reference
model's log-probabilities are computed just before the policy's forward, in `prepare`: with LoRA, by the
same model with its adapters disabled (no second copy); otherwise by a frozen copy of the starting weights.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from shardforge.adapters.lora import LoRALinear, adapters_disabled
from shardforge.config.schema import DataSection, MethodSection
from shardforge.data.batching import IGNORE, Batch
from shardforge.data.examples import Encoder, Sequence_
from shardforge.data.formats import Record
from shardforge.data.templates import encode_pairs, resolve_template
from shardforge.errors import ConfigError
from shardforge.objectives.base import CausalLM, Normalizer, sequence_logprob_sums
from shardforge.objectives.preference_losses import REFERENCE_FREE, Pairs, pair_loss


@dataclass(frozen=True)
class PairEncoder:
    """A preference record -> [chosen sequence, rejected sequence]. A plain object, so encoding worker
    processes can receive it."""

    tokenizer: Any
    template: str

    def encode_batch(self, records: list[Record]) -> list[list[Sequence_]]:
        return encode_pairs(
            self.tokenizer,
            self.template,
            [(list(r.messages or ()), r.rejected or "", r.source) for r in records],
        )

    def __call__(self, record: Record) -> list[Sequence_]:
        return self.encode_batch([record])[0]


class DPOObjective(CausalLM):
    name = "dpo"
    normalizer: Normalizer = "groups"
    group_size = 2
    reader_stage = "pref"
    summed = False  # per-sequence sums, not one sum of token log-probs
    metrics = (
        "loss",
        "rewards/chosen",
        "rewards/rejected",
        "rewards/accuracy",
        "rewards/margin",
        "logps/chosen",
        "logps/rejected",
    )

    def __init__(self, method: MethodSection | None = None) -> None:
        super().__init__(method)
        self.pref = self.method.pref
        self.reference_model: nn.Module | None = None
        self.reference = "none" if self.pref.loss in REFERENCE_FREE or self.pref.ref == "none" else "unbound"

    def encoder(self, tokenizer: Any, data: DataSection) -> Encoder:
        return PairEncoder(tokenizer, resolve_template(tokenizer, data.template))

    def bind_reference(
        self, model: nn.Module, finetuning: str, adapter: str | None, blocker: str | None
    ) -> str:
        """Choose the reference for this run's starting model (before any layout is applied); returns what it
        is, for the run log. `adapter` is the adapter the run starts from, if any; `blocker` names a layout
        the reference cannot follow yet (None: it can)."""
        if self.reference == "none":
            return f"no reference model (the {self.pref.loss} loss needs none)"
        if blocker is not None:
            raise ConfigError(
                f"method.stage dpo with a reference model does not run under {blocker} yet; use data "
                f"parallel (parallel.zero_stage 0-3, LoRA under tensor parallel), or a reference-free loss "
                f"(method.pref.loss: orpo or simpo)"
            )
        if finetuning == "lora" and adapter is None:
            if not any(isinstance(m, LoRALinear) for m in model.modules()):
                raise ConfigError("method.finetuning=lora, but the model has no LoRA layers to disable")
            self.reference = "adapters"
            return "reference model: the policy with its LoRA adapters disabled (no second copy)"
        self.reference_model = copy.deepcopy(model).requires_grad_(False).eval()
        self.reference = "copy"
        why = (
            " (the run starts from an adapter: disabling it would give the base, not the starting policy)"
            if adapter is not None
            else ""
        )
        return f"reference model: a frozen copy of the starting weights{why}"

    def prepare(self, model: nn.Module, batch: Batch) -> Batch:
        """The reference's summed log-probs of each row, into `batch.extras["ref_logps"]`."""
        if self.reference == "none" or "ref_logps" in batch.extras:
            return batch
        if self.reference == "unbound":
            raise RuntimeError("DPOObjective.bind_reference was not called before training")
        with torch.no_grad():
            if self.reference == "adapters":
                with adapters_disabled(model):
                    out = model(batch.input_ids, **self.model_inputs(batch))
            else:
                assert self.reference_model is not None
                out = self.reference_model(batch.input_ids, **self.model_inputs(batch))
        batch.extras["ref_logps"] = sequence_logprob_sums(out.float(), batch)
        return batch

    def loss(self, output: torch.Tensor, batch: Batch) -> dict[str, torch.Tensor]:
        logps = sequence_logprob_sums(output.float(), batch).view(-1, 2)  # a pair's rows are consecutive
        tokens = (batch.targets != IGNORE).sum(dim=1).view(-1, 2).to(logps.dtype)
        policy = Pairs(logps[:, 0], logps[:, 1], tokens[:, 0], tokens[:, 1])
        reference = None
        if "ref_logps" in batch.extras:
            ref = batch.extras["ref_logps"].view(-1, 2)
            reference = Pairs(ref[:, 0], ref[:, 1], tokens[:, 0], tokens[:, 1])
        p = self.pref
        out = pair_loss(p.loss, policy, reference, p.beta, p.label_smoothing, p.simpo_gamma, p.ftx)
        margin = out.chosen_rewards - out.rejected_rewards
        return {
            "loss": out.losses.sum(),
            "rewards/chosen": out.chosen_rewards.sum(),
            "rewards/rejected": out.rejected_rewards.sum(),
            "rewards/accuracy": (margin > 0).float().sum(),
            "rewards/margin": margin.sum(),
            "logps/chosen": policy.chosen.detach().sum(),
            "logps/rejected": policy.rejected.detach().sum(),
        }
