"""Objective `grpo`: group-relative policy optimization over rollouts, with DAPO's and Dr. GRPO's variants.

Its rows are not read from a data set: its batch source (objectives/rollout.py) samples `group_size`
completions per prompt with the inference engine on the training weights (train/sampler.py), scores them, and
hands the loop micro-batches whose rows are prompt + completion (targets: the completion's tokens), with
per-row advantages, the engine's sampling log-probs (only compared with the training forward's:
`logprob_delta`), and, recomputed by the training forward in `score_rollout`, the rollout policy's per-token
log-probs (`old_logps`, when the rollout trains more than one step) and the reference's (`ref_logps`,
kl_beta > 0). The loss is the clipped surrogate of `rl_losses.py`, aggregated as `method.rl.loss` says; a
group is one prompt's completions, kept on one rank, so advantages need no communication.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shardforge.adapters.lora import adapters_disabled
from shardforge.config.data_schema import DataSection
from shardforge.config.method_schema import MethodSection
from shardforge.data.batch_source import BatchSource
from shardforge.data.batching import IGNORE, Batch
from shardforge.data.examples import Encoder
from shardforge.errors import ConfigError
from shardforge.models import load_model
from shardforge.models.head import Head, PolicyValues, attach_critic, attach_value_head
from shardforge.objectives.base import BindContext, Normalizer, SourceContext, Traits
from shardforge.objectives.preference import ReferencedObjective
from shardforge.objectives.rl_losses import (
    AGGREGATION_NORMALIZER,
    aggregate,
    clipped_surrogate,
    clipped_value_loss,
    gae,
    group_advantages,
)
from shardforge.objectives.rollout import build_rollout_source

# Sums over all data-parallel ranks of a small float64 vector (the rollout source's reduction).
Total = Callable[[torch.Tensor], torch.Tensor]
# The whole model's output for token ids and the forward's keyword inputs: the model called, or under a
# pipeline its stages in turn (the engine's forward_only; None on the ranks without the last stage, which
# alone computes the loss).
Forward = Callable[[nn.Module, torch.Tensor, dict[str, Any]], Any]


def called(net: nn.Module, input_ids: torch.Tensor, inputs: dict[str, Any]) -> Any:
    return net(input_ids, **inputs)


def global_mean_std(values: torch.Tensor, total: Total) -> tuple[float, float]:
    """Mean and unbiased standard deviation of every rank's `values` together."""
    values = values.double()
    moments = torch.stack(
        [torch.tensor(float(values.numel()), dtype=torch.float64), values.sum(), values.square().sum()]
    )
    count, s1, s2 = total(moments).tolist()
    return s1 / count, math.sqrt(max(0.0, (s2 - s1 * s1 / count) / max(1.0, count - 1)))


def at_targets(values: torch.Tensor | None, mask: torch.Tensor) -> torch.Tensor:
    """Per-target values [n] (row-major, as the fused head returns them) placed in a [rows, width] float32
    tensor, zero elsewhere: a per-row field the engines split like any other (all zeros on a pipeline rank
    without the last stage: `values` None, and its stages never read them)."""
    full = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    if values is not None:
        full[mask] = values.float()
    return full


class GRPOObjective(ReferencedObjective):
    name = "grpo"
    traits = Traits(
        reader="prompt", whole_sequences=True, rollouts=True, packed_groups=True, sections=("rl", "pref")
    )
    metrics = ("loss", "kl", "clip_fraction", "ratio", "logprob_delta")

    def __init__(self, method: MethodSection | None = None) -> None:
        self.rl = (method or MethodSection()).rl  # needs_reference reads it during the base's __init__
        super().__init__(method)
        self.group_size = self.rl.group_size
        self.normalizer: Normalizer = AGGREGATION_NORMALIZER[self.rl.loss]  # type: ignore[assignment]

    def needs_reference(self) -> bool:
        return self.rl.kl_beta > 0

    def _bind_reference(
        self, model: nn.Module, adapter: str | None, base: str | None, blocker: str | None
    ) -> tuple[str, nn.Module | None]:
        if self.reference != "none" and self.pref.ref in ("precompute", "none"):
            raise ConfigError(
                f"method.pref.ref={self.pref.ref}: stage {self.name} with kl_beta > 0 scores new rollouts "
                f"against a live reference every step; use ref: auto or a folder (or kl_beta: 0)"
            )
        if self.reference == "none":
            return "no reference model (method.rl.kl_beta is 0: no KL term)", None
        return super()._bind_reference(model, adapter, base, blocker)

    def encoder(self, tokenizer: Any, data: DataSection) -> Encoder:
        raise ConfigError(f"stage {self.name} samples its rows; it has no encoder of records")

    @staticmethod
    def collate(*args: Any, **kwargs: Any) -> Batch:
        raise ConfigError("stage grpo's micro-batches come from its rollouts (objectives/rollout.py)")

    def batch_source(self, ctx: SourceContext) -> BatchSource:
        return build_rollout_source(ctx, self)  # each step's rollouts, sampled with the weights of the last

    def prepare(self, model: nn.Module, batch: Batch) -> Batch:
        return batch  # everything the loss compares with was scored once per rollout (score_rollout)

    @torch.no_grad()
    def score_rollout(self, model: nn.Module, batch: Batch, forward: Forward = called) -> Batch:
        """Per target token [rows, width] (zero elsewhere): the policy's log-probs now, before any update
        on this rollout (`old_logps`; only with epochs_per_rollout > 1: a rollout trained once compares
        the training forward with itself, as TRL does), and the reference's when the KL term needs them
        (`ref_logps`)."""
        mask = batch.targets != IGNORE
        if self.rl.epochs_per_rollout > 1:  # the later steps on this rollout need the policy that sampled it
            # (on its first step that is the training forward's)
            batch.extras["old_logps"] = at_targets(
                forward(model, batch.input_ids, self.model_inputs(batch)), mask
            )
        self._score_reference(model, batch, mask, forward)
        return batch

    def _score_reference(self, model: nn.Module, batch: Batch, mask: torch.Tensor, forward: Forward) -> None:
        """The reference's per-token log-probs (`ref_logps`) when there is a KL term: the model with its
        adapters disabled, or the frozen copy."""
        if self.reference == "none":
            return
        net = self.reference_model if self.reference == "copy" else model
        assert net is not None
        disabled = adapters_disabled(model) if self.reference == "adapters" else contextlib.nullcontext()
        with disabled:  # log-probs alone, no values
            logps = forward(net, batch.input_ids, self.scored_inputs(batch, self.logprob_head))
        batch.extras["ref_logps"] = at_targets(logps, mask)

    def assign_advantages(
        self, micro: list[Batch], scores: list[torch.Tensor], total: Total
    ) -> tuple[list[bool], dict[str, float]]:
        """Each sequence's advantage from its reward (`scores`: per micro-batch, in its sequences' order):
        group-relative, scaled as method.rl.scale_rewards says (`batch`: by the global batch's deviation,
        `total` sums over ranks), placed at its target positions (`advantages`, `keep` [rows, width]: a
        row may hold a whole group). `keep` is 0 for the sequences of groups whose rewards are all equal
        when filter_groups is on. Returns each sequence's keep and the groups filtered on this rank."""
        rl, n = self.rl, self.rl.group_size
        flat_scores = torch.cat([s.double().cpu() for s in scores])
        batch_std = global_mean_std(flat_scores, total)[1] if rl.scale_rewards == "batch" else None
        grouped = flat_scores.view(-1, n)
        advantages = group_advantages(grouped, rl.scale_rewards, batch_std).view(-1)
        flat = grouped.max(dim=1).values == grouped.min(dim=1).values
        keep = (~flat if rl.filter_groups else torch.ones_like(flat)).repeat_interleave(n)
        at = 0
        for b, part in zip(micro, scores, strict=True):
            mask, sequence = b.targets != IGNORE, b.sequence_ids()
            count = len(part)
            for key, values in (("advantages", advantages), ("keep", keep)):
                per_sequence = values[at : at + count].float().to(mask.device)
                b.extras[key] = per_sequence[sequence.clamp(max=count - 1)] * mask
            at += count
        return keep.tolist(), {"groups_filtered": float(flat.sum()) if rl.filter_groups else 0.0}

    def loss(self, output: torch.Tensor, batch: Batch) -> dict[str, torch.Tensor]:
        mask = batch.targets != IGNORE
        keep = batch.extras["keep"][mask]  # 0 for the tokens of filtered groups
        ref = batch.extras.get("ref_logps")
        rl = self.rl
        logps = output.float()
        t = clipped_surrogate(
            logps,
            batch.extras["old_logps"][mask] if "old_logps" in batch.extras else logps.detach(),
            batch.extras["advantages"][mask],
            rl.clip,
            rl.kl_beta,
            None if ref is None else ref[mask],
        )
        total = self._totals(batch, mask, keep)
        return {
            "loss": total(t.loss, True),
            "kl": total(t.kl.detach()),
            "clip_fraction": total(t.clipped.float()),
            "ratio": total(t.log_ratio.detach().exp()),
            "logprob_delta": total(sampling_delta(logps, batch, mask)),
        }

    def _totals(
        self, batch: Batch, mask: torch.Tensor, weight: torch.Tensor | float = 1.0
    ) -> Callable[..., torch.Tensor]:
        """Per-token values (at `mask`) -> the sums the loop divides by the normalizer: aggregated over each
        token's sequence as method.rl.loss says for a loss, and for a logged statistic as a mean per token
        (dapo) or of each sequence's token mean (the others), over the same normalizer."""
        rl = self.rl
        sequence = batch.sequence_ids()[mask]
        bound = mask.numel()  # at least the number of sequences, without reading it off the device

        def total(per_token: torch.Tensor, is_loss: bool = False) -> torch.Tensor:
            how = rl.loss if is_loss else "dapo" if rl.loss == "dapo" else "grpo"
            return aggregate(per_token * weight, sequence, bound, how, rl.max_new_tokens)

        return total


def sampling_delta(logps: torch.Tensor, batch: Batch, mask: torch.Tensor) -> torch.Tensor:
    """|training forward's log-prob - the engine's sampling log-prob| per completion token: ~1e-7 in fp32
    on a rollout's first step (the same weights), the policy's movement on later ones."""
    return (logps.detach() - batch.extras["sampled_logps"][mask]).abs()


def critic_folder(method: MethodSection) -> Path | None:
    """PPO's separate critic model's folder (method.ppo.critic), None for a value head on the policy."""
    folder = method.ppo.critic_folder
    return Path(folder) if method.stage == "ppo" and folder is not None else None


def load_critic(folder: Path, policy: nn.Module) -> nn.Module:
    """method.ppo.critic as a folder: an HF model (an `rm` run's sequence classifier keeps its score head;
    any other gets a fresh one-output head, N(0, 0.02) from seed 0, on its body), in the policy's dtype and
    on its device, trained whole whatever the policy's method; it reads the policy's token ids, so its
    vocabulary must be the policy's."""
    weight = next(policy.parameters())
    critic = load_model(folder, dtype=weight.dtype, device=weight.device, num_labels=1, seed=0)
    if critic.config.vocab_size != policy.config.vocab_size:
        raise ConfigError(
            f"method.ppo.critic {str(folder)!r} has a vocabulary of {critic.config.vocab_size} tokens, the "
            f"policy {policy.config.vocab_size}: the critic must share the policy's tokenizer"
        )
    return critic.requires_grad_(True).train()


class PPOObjective(GRPOObjective):
    """Stage `ppo`: the policy and its critic, either a value head on its final hidden states (the critic
    shares the body, as TRL's `...WithValueHead`; `attach_value_head`, made before any layout so it is
    sharded, trained and checkpointed with the policy, and left out of exports) or a separate critic model
    (method.ppo.critic a folder, as TRL's `value_model`: `attach_critic`, attached after the reference
    copy is taken, laid out, trained and checkpointed as part of the model, exported beside the policy as
    `critic/`). Per completion token the reward is
    -kl_beta x (log pi_old - log pi_ref) (TRL's k1 penalty in the reward), plus the sequence's score at its
    last token; GAE (method.ppo gamma, lam) over the rollout's values gives advantages (whitened over the
    global batch) and returns; the loss is the clipped surrogate plus vf_coef x the clipped value loss, both
    aggregated as method.rl.loss says (TRL's PPO: a token mean, `dapo`)."""

    name = "ppo"
    traits = replace(GRPOObjective.traits, sections=("rl", "ppo", "pref"))
    metrics = ("loss", "policy_loss", "value_loss", "kl", "clip_fraction", "value_clip_fraction", "ratio")
    metrics += ("logprob_delta",)

    def __init__(self, method: MethodSection | None = None) -> None:
        super().__init__(method)
        self.ppo = self.method.ppo
        # GAE runs along rows: one sequence per row
        self.traits = replace(self.traits, critic=self.ppo.critic_folder, packed_groups=False)

    def bind(self, ctx: BindContext) -> str | None:
        folder, model = critic_folder(self.method), ctx.model
        if folder is None:
            attach_value_head(model, seed=0)  # before the reference copy: the copy never uses it
            return super().bind(ctx)
        said = super().bind(ctx)  # the copy has no critic
        attach_critic(model, load_critic(folder, model))
        return f"{said}; critic: the model in {folder} (trained beside the policy, exported as critic/)"

    def head(self, targets: torch.Tensor) -> Head:
        return PolicyValues(targets, self.summed)  # and the critic's values at the same positions

    @torch.no_grad()
    def score_rollout(self, model: nn.Module, batch: Batch, forward: Forward = called) -> Batch:
        mask = batch.targets != IGNORE
        out = forward(model, batch.input_ids, self.model_inputs(batch))
        logps, values = out if out is not None else (None, None)  # None: a pipeline rank before the last
        batch.extras["old_logps"], batch.extras["old_values"] = (
            at_targets(logps, mask),
            at_targets(values, mask),
        )
        self._score_reference(model, batch, mask, forward)
        return batch

    def assign_advantages(
        self, micro: list[Batch], scores: list[torch.Tensor], total: Total
    ) -> tuple[list[bool], dict[str, float]]:
        """GAE over each row's completion tokens (one sequence per row; `scores` its reward, per micro-batch),
        then whitening with the global batch's mean and deviation; returns every sequence kept and this
        rank's sum of the KL penalty's k1 terms (the log divides by the tokens)."""
        ppo, kl_sum = self.ppo, 0.0
        for b, score in zip(micro, scores, strict=True):
            mask = b.targets != IGNORE
            kl = (b.extras["old_logps"] - b.extras["ref_logps"]) * mask if "ref_logps" in b.extras else None
            rewards = -self.rl.kl_beta * kl if kl is not None else torch.zeros(mask.shape, device=mask.device)
            last = mask.shape[1] - 1 - mask.flip(1).float().argmax(dim=1)  # each row's last target column
            rewards[torch.arange(mask.shape[0], device=mask.device), last] += score.float().to(mask.device)
            advantages, returns = gae(rewards, b.extras["old_values"], mask, ppo.gamma, ppo.lam)
            b.extras["advantages"], b.extras["returns"] = advantages, returns
            kl_sum += float(kl.sum()) if kl is not None else 0.0
        flat = torch.cat([b.extras["advantages"][b.targets != IGNORE].cpu() for b in micro])
        mean, std = global_mean_std(flat, total)
        for b in micro:  # whitened, as TRL's PPO does (over its batch; here the global batch)
            b.extras["advantages"] = (b.extras["advantages"] - mean) / (std + 1e-8) * (b.targets != IGNORE)
        return [True] * sum(len(s) for s in scores), {"kl_penalty_sum": kl_sum}

    def loss(self, output: Any, batch: Batch) -> dict[str, torch.Tensor]:
        logps, values = output
        mask = batch.targets != IGNORE
        rl, ppo = self.rl, self.ppo
        policy = clipped_surrogate(
            logps.float(), batch.extras["old_logps"][mask], batch.extras["advantages"][mask], rl.clip
        )
        value_loss, value_clipped = clipped_value_loss(
            values.float(), batch.extras["old_values"][mask], batch.extras["returns"][mask], ppo.value_clip
        )
        total = self._totals(batch, mask)
        ref = batch.extras.get("ref_logps")
        kl = (logps.detach().float() - ref[mask]) if ref is not None else torch.zeros_like(policy.loss)
        policy_sum, value_sum = total(policy.loss, True), total(value_loss, True)
        return {
            "loss": policy_sum + ppo.vf_coef * value_sum,
            "policy_loss": policy_sum.detach(),
            "value_loss": value_sum.detach(),
            "kl": total(kl),
            "clip_fraction": total(policy.clipped.float()),
            "value_clip_fraction": total(value_clipped.float()),
            "ratio": total(policy.log_ratio.detach().exp()),
            "logprob_delta": total(sampling_delta(logps.float(), batch, mask)),
        }
