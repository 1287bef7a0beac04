"""Objectives `dpo` and `kto`: a policy trained against a reference model.

`dpo`: preference pairs (a prompt, a chosen and a rejected reply) trained with the DPO family of losses
(sigmoid, ipo, hinge, robust; orpo and simpo without a reference), as `preference_losses.py` defines them. A
pair is a group of two sequences (chosen first) that share the prompt's tokens; only the replies' tokens are
scored. `kto`: single completions labelled desirable or not; each example's group is its own sequence and
its prompt with another example's completion (the mismatched pair KTO's KL estimate is taken over).

The losses are per group: the loop divides the sums by the groups in the global batch. The reference
model's log-probabilities are computed just before the policy's forward, in `prepare`: with LoRA, by the
same model with its adapters disabled (no second copy); otherwise by a frozen copy of the starting weights.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from shardforge.adapters.lora import adapter_layers, adapters_disabled
from shardforge.adapters.merge import merge_adapter
from shardforge.config.data_schema import DataSection
from shardforge.config.method_schema import MethodSection
from shardforge.data.batching import IGNORE, Batch, collate, row_tags
from shardforge.data.examples import Encoder, Example, Sequence_
from shardforge.data.formats import Record
from shardforge.data.templates import ChatTemplate, encode_pairs, resolve_template
from shardforge.errors import ConfigError
from shardforge.models import load_model
from shardforge.objectives.base import BindContext, CausalLM, Normalizer, Traits, sequence_logprob_sums
from shardforge.objectives.preference_losses import REFERENCE_FREE, Pairs, kto_kl, kto_loss, pair_loss


@dataclass(frozen=True)
class PairEncoder(Encoder):
    """A record -> [its conversation's sequence, the same prompt with the reply in `second`]: a preference
    pair (chosen, then rejected), or a KTO example and its mismatched pair for the KL estimate. Both share
    the prompt's tokens. A plain object, so encoding worker processes can receive it."""

    tokenizer: Any
    template: ChatTemplate
    second: str = "rejected"  # the Record field of the second reply ("mismatched" for KTO)

    def encode_batch(self, records: list[Record]) -> list[list[Sequence_]]:
        return encode_pairs(
            self.tokenizer,
            self.template,
            [(list(r.messages or ()), getattr(r, self.second) or "", r.tools, r.source) for r in records],
        )

    def __call__(self, record: Record) -> list[Sequence_]:
        return self.encode_batch([record])[0]


class ReferencedObjective(CausalLM):
    """What DPO and KTO share: groups of two sequences, a loss per group, and the reference model's summed
    log-probs of each row, put in `batch.extras["ref_logps"]` by `prepare` before the policy's forward."""

    normalizer: Normalizer = "groups"
    group_size = 2
    summed = False  # per-sequence sums, not one sum of token log-probs
    traits = Traits(reader="pair", whole_sequences=True, sections=("pref",))

    def __init__(self, method: MethodSection | None = None) -> None:
        super().__init__(method)
        self.pref = self.method.pref
        self.reference_model: nn.Module | None = None
        # How the reference is bound (`bind`): none, unbound, precomputed, adapters or copy.
        self.reference = "none" if not self.needs_reference() else "unbound"
        precomputed = self.pref.ref == "precompute"
        need = "none" if self.reference == "none" else "precomputed" if precomputed else "live"
        self.traits = replace(type(self).traits, reference=need)

    def needs_reference(self) -> bool:
        return True

    def bind(self, ctx: BindContext) -> str | None:
        """Choose the reference for this run's starting model (before any layout is applied; a frozen copy
        is laid out as the policy will be); returns what it is, for the run log. A reference model held
        during training cannot follow a pipeline (its stages run chunks and never `prepare`), unless the
        objective scores it through the stages itself (RL)."""
        blocker = "pipeline parallel" if ctx.pipeline and not self.traits.rollouts else None
        said, reference = self._bind_reference(ctx.model, ctx.adapter, ctx.base, blocker)
        if reference is not None:
            self.reference_model = ctx.lay_out(reference)
        return said

    def _bind_reference(
        self, model: nn.Module, adapter: str | None, base: str | None, blocker: str | None
    ) -> tuple[str, nn.Module | None]:
        """What the reference is (for the run log) and the reference model to hold, if any. `adapter` is the
        adapter the run starts from, if any, `base` the run's model folder (an explicit reference adapter's
        base if it names none); `blocker` names a layout a reference model held during training cannot
        follow (None: it can)."""
        ref, finetuning = self.pref.ref, self.method.finetuning
        if self.reference == "none":
            return f"no reference model (the {self.pref.loss} loss needs none)", None
        if ref == "precompute":
            self.reference = "precomputed"
            said = "reference: the starting policy's log-probs of every sequence, computed once before"
            return f"{said} training (no reference model is held)", None
        if blocker is not None:
            raise ConfigError(
                f"method.stage {self.name} with a reference model held during training does not run under "
                f"{blocker}; set method.pref.ref: precompute (its log-probs computed once, before training), "
                f"or use a reference-free loss (stage dpo, method.pref.loss: orpo or simpo)"
            )
        if ref != "auto":
            self.reference = "copy"
            reference = load_reference(Path(ref), base, model).requires_grad_(False).eval()
            return f"reference model: {ref} (frozen, laid out as the policy is)", reference
        if self.method.adapters and adapter is None:
            if not adapter_layers(model):
                raise ConfigError(f"method.finetuning={finetuning}, but the model has no adapters to disable")
            self.reference = "adapters"
            return "reference model: the policy with its adapters disabled (no second copy)", None
        self.reference = "copy"
        why = (
            " (the run starts from an adapter: disabling it would give the base, not the starting policy)"
            if adapter is not None
            else ""
        )
        said = f"reference model: a frozen copy of the starting weights, laid out as the policy is{why}"
        return said, copy.deepcopy(model).requires_grad_(False).eval()

    def prepare(self, model: nn.Module, batch: Batch) -> Batch:
        """The reference's summed log-probs of each row, into `batch.extras["ref_logps"]` (precomputed ones
        come with the batch)."""
        if self.reference == "none" or "ref_logps" in batch.extras:
            return batch
        if self.reference == "unbound":
            raise RuntimeError(f"{type(self).__name__}.bind was not called before training")
        if self.reference == "precomputed":
            raise RuntimeError("ref: precompute, but this batch's examples have no precomputed log-probs")
        with torch.no_grad():
            if self.reference == "adapters":
                with adapters_disabled(model):
                    out = model(batch.input_ids, **self.model_inputs(batch))
            else:
                assert self.reference_model is not None
                out = self.reference_model(batch.input_ids, **self.model_inputs(batch))
        batch.extras["ref_logps"] = sequence_logprob_sums(out.float(), batch)
        return batch

    @torch.no_grad()
    def reference_logps(
        self, model: nn.Module, examples: Any, rows: list[list[int]], micro_batch: int, pad_id: int
    ) -> np.ndarray:
        """The summed target log-probs of the sequences in `rows` (one each) under `model`, by micro-batches
        of `micro_batch` groups: [len(rows)], in row order (what `ref: precompute` stores)."""
        device = next(model.parameters()).device
        out = np.empty(len(rows), dtype=np.float32)
        step = micro_batch * self.group_size
        for start in range(0, len(rows), step):
            batch = collate(examples, rows[start : start + step], pad_id).to(device)
            logps = model(batch.input_ids, **self.model_inputs(batch))
            out[start : start + step] = sequence_logprob_sums(logps.float(), batch).cpu().numpy()
        return out

    @staticmethod
    def collate(
        examples: Sequence[Example], rows: Sequence[Sequence[int]], pad_id: int, multiple: int = 1
    ) -> Batch:
        """A micro-batch; with `ref: precompute`, each row's reference log-prob (the store's `ref_logps`)."""
        batch = collate(examples, rows, pad_id, multiple)
        precomputed = getattr(examples, "ref_logps", None)
        if precomputed is not None:
            batch.extras["ref_logps"] = torch.from_numpy(precomputed[[row[0] for row in rows]])
        return batch

    @staticmethod
    def group_logps(output: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Policy and (if prepared) reference summed log-probs, [groups, 2] (a group's rows are adjacent)."""
        policy = sequence_logprob_sums(output.float(), batch).view(-1, 2)
        reference = batch.extras.get("ref_logps")
        return policy, None if reference is None else reference.view(-1, 2)


class DPOObjective(ReferencedObjective):
    name = "dpo"
    metrics = (
        "loss",
        "rewards/chosen",
        "rewards/rejected",
        "rewards/accuracy",
        "rewards/margin",
        "logps/chosen",
        "logps/rejected",
    )

    def needs_reference(self) -> bool:
        return self.pref.loss not in REFERENCE_FREE and self.pref.ref != "none"

    def encoder(self, tokenizer: Any, data: DataSection) -> Encoder:
        return PairEncoder(tokenizer, resolve_template(tokenizer, data.template, data.enable_thinking))

    def loss(self, output: torch.Tensor, batch: Batch) -> dict[str, torch.Tensor]:
        logps, ref = self.group_logps(output, batch)
        tokens = (batch.targets != IGNORE).sum(dim=1).view(-1, 2).to(logps.dtype)
        policy = Pairs(logps[:, 0], logps[:, 1], tokens[:, 0], tokens[:, 1])
        reference = None if ref is None else Pairs(ref[:, 0], ref[:, 1], tokens[:, 0], tokens[:, 1])
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


class KTOObjective(ReferencedObjective):
    """Each group: an example's sequence and its mismatched pair; `extras["tags"]` holds each row's label.
    The KL estimate is the mean log-ratio of the micro-batch's mismatched pairs on every data-parallel rank
    (summed over them by the run's `dp_sum`, taken in `bind`)."""

    name = "kto"
    traits = Traits(reader="labelled", whole_sequences=True, sections=("kto", "pref"))
    # Sums divided by the groups; `finish` turns the per-label ones into means over their label's examples.
    metrics = (
        "loss",
        "kl",
        "rewards/chosen",
        "rewards/rejected",
        "logps/chosen",
        "logps/rejected",
        "share/desirable",
    )

    def __init__(self, method: MethodSection | None = None) -> None:
        super().__init__(method)
        self.kto = self.method.kto
        self.all_reduce: Callable[[torch.Tensor], Any] | None = None

    def bind(self, ctx: BindContext) -> str | None:
        self.all_reduce = ctx.dp_sum
        return super().bind(ctx)

    def encoder(self, tokenizer: Any, data: DataSection) -> Encoder:
        template = resolve_template(tokenizer, data.template, data.enable_thinking)
        return PairEncoder(tokenizer, template, second="mismatched")

    @staticmethod
    def collate(
        examples: Sequence[Example], rows: Sequence[Sequence[int]], pad_id: int, multiple: int = 1
    ) -> Batch:
        batch = ReferencedObjective.collate(examples, rows, pad_id, multiple)
        batch.extras["tags"] = row_tags(examples, rows)
        return batch

    def loss(self, output: torch.Tensor, batch: Batch) -> dict[str, torch.Tensor]:
        logps, ref = self.group_logps(output, batch)
        assert ref is not None, "KTO runs with a reference model"
        desirable = batch.extras["tags"].view(-1, 2)[:, 0].bool()
        counted = batch.extras.get("counted")  # evaluation's filler micro-batch counts for nothing
        kl = kto_kl(
            logps[:, 1], ref[:, 1], self.all_reduce, None if counted is None else counted.view(-1, 2)[:, 0]
        )
        k = self.kto
        losses, rewards = kto_loss(
            logps[:, 0], ref[:, 0], desirable, kl, k.beta, k.desirable_weight, k.undesirable_weight
        )
        good = desirable.to(losses.dtype)
        policy = logps[:, 0].detach()
        return {
            "loss": losses.sum(),
            "kl": kl * len(losses),
            "rewards/chosen": (rewards * good).sum(),
            "rewards/rejected": (rewards * (1 - good)).sum(),
            "logps/chosen": (policy * good).sum(),
            "logps/rejected": (policy * (1 - good)).sum(),
            "share/desirable": good.sum(),
        }

    @staticmethod
    def finish(means: dict[str, float]) -> dict[str, float]:
        """Per-label sums over all groups -> means over each label's examples, and the reward margin."""
        share = means["share/desirable"]
        out = dict(means)
        for key in ("rewards", "logps"):
            out[f"{key}/chosen"] = means[f"{key}/chosen"] / share if share > 0 else float("nan")
            out[f"{key}/rejected"] = means[f"{key}/rejected"] / (1 - share) if share < 1 else float("nan")
        out["rewards/margin"] = out["rewards/chosen"] - out["rewards/rejected"]
        return out


def load_reference(folder: Path, base: str | None, policy: nn.Module) -> nn.Module:
    """`method.pref.ref` as a folder: an HF model, or a PEFT adapter merged into its base (the adapter's
    base_model_name_or_path if that is a local folder, else the run's model), in the policy's dtype and on
    its device; its vocabulary must be the policy's."""
    weight = next(policy.parameters())
    where = f"method.pref.ref {str(folder)!r}"
    if (folder / "adapter_config.json").is_file():
        named = json.loads((folder / "adapter_config.json").read_text()).get("base_model_name_or_path")
        base = named if named and Path(named).is_dir() else base
        if base is None:
            raise ConfigError(
                f"{where} is an adapter whose base is not a local folder, and model.path is unset"
            )
        model = load_model(base, dtype=weight.dtype, device=weight.device)
        merge_adapter(model, folder)
    elif (folder / "config.json").is_file():
        model = load_model(folder, dtype=weight.dtype, device=weight.device)
    else:
        raise ConfigError(
            f"{where} is not auto, none, precompute, an HF model folder (config.json) or a PEFT adapter "
            f"folder (adapter_config.json)"
        )
    if model.config.vocab_size != policy.config.vocab_size:
        raise ConfigError(
            f"{where} has a vocabulary of {model.config.vocab_size} tokens, the policy "
            f"{policy.config.vocab_size}: the reference must share the policy's tokenizer"
        )
    return model
