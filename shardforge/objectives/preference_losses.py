"""The preference, KTO and reward-model losses, per pair (or per KTO example), as TRL defines them.

Inputs are per-sequence quantities: the summed log-probability of each completion's tokens under the policy
(and the reference), and each completion's token count. The objectives sum what these return over a
micro-batch and the loop divides by the global batch's pair count, so the update does not depend on how the
batch is split over ranks and micro-steps.

- `sigmoid` (DPO), `hinge`, `robust`: on the summed log-ratios h = (log pi_c - log ref_c) - (log pi_r - log
  ref_r). `sigmoid` with `label_smoothing` e is cDPO: -(1-e) log s(b h) - e log s(-b h); `robust` is
  (-(1-e) log s(b h) + e log s(-b h)) / (1 - 2e).
- `ipo`: (h_avg - 1/(2b))^2 on the log-ratios divided by each completion's length (TRL's normalized form).
- `simpo`: no reference; length-averaged log-probs, -(1-e) log s(b (avg_c - avg_r) - gamma) - e log s(...).
- `orpo`: no reference; the chosen completion's length-averaged NLL minus b log s(log-odds ratio) on
  length-averaged log-probs. (TRL takes the NLL as a token mean over the batch; here it is each pair's chosen
  token mean, LLaMA-Factory's form, which keeps the loss a per-pair sum. They agree when the chosen
  completions have one length.)
- `ftx` > 0 adds ftx times the chosen completion's length-averaged NLL (LLaMA-Factory's `pref_ftx`).
- KTO: 1 - s(b (r - KL)) for desirable, 1 - s(b (KL - r)) for undesirable examples, weighted, with r the
  log-ratio and KL the detached, clamped mean log-ratio of mismatched (prompt, other completion) pairs.
- Reward model: -log s(r_c - r_r).
Rewards (for the metrics) are b times the detached log-ratios (the length-averaged log-probs where no
reference is used), as TRL logs them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

PAIR_LOSSES = ("sigmoid", "ipo", "hinge", "robust", "orpo", "simpo")
REFERENCE_FREE = ("orpo", "simpo")


@dataclass(frozen=True)
class Pairs:
    """Per pair [pairs]: summed completion log-probs of the chosen and rejected completions, and their
    completion token counts."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    chosen_tokens: torch.Tensor
    rejected_tokens: torch.Tensor

    def per_token(self, chosen: torch.Tensor, rejected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-pair quantities divided by their completion's length."""
        return chosen / self.chosen_tokens.clamp(min=1), rejected / self.rejected_tokens.clamp(min=1)

    def averaged(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.per_token(self.chosen, self.rejected)


@dataclass(frozen=True)
class PairLoss:
    losses: torch.Tensor  # [pairs], differentiable
    chosen_rewards: torch.Tensor  # [pairs], detached
    rejected_rewards: torch.Tensor


def pair_loss(
    kind: str,
    policy: Pairs,
    reference: Pairs | None,
    beta: float,
    label_smoothing: float = 0.0,
    simpo_gamma: float = 0.5,
    ftx: float = 0.0,
) -> PairLoss:
    if kind not in PAIR_LOSSES:
        raise ValueError(f"unknown preference loss {kind!r}; valid: {', '.join(PAIR_LOSSES)}")
    if kind == "robust" and not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"the robust loss needs label_smoothing in [0, 0.5), got {label_smoothing}")
    if reference is None and kind not in REFERENCE_FREE:
        free = ", ".join(REFERENCE_FREE)
        raise ValueError(f"the {kind!r} loss needs a reference model (only {free} do not)")
    eps = label_smoothing
    if kind in REFERENCE_FREE:
        chosen, rejected = policy.averaged()
        rewards = beta * chosen.detach(), beta * rejected.detach()
        if kind == "simpo":
            z = beta * (chosen - rejected) - simpo_gamma
            losses = -(1 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)
        else:
            log_odds = (chosen - rejected) - (_log1mexp(chosen) - _log1mexp(rejected))
            losses = -chosen - beta * F.logsigmoid(log_odds)
    else:
        chosen = policy.chosen - reference.chosen
        rejected = policy.rejected - reference.rejected
        rewards = beta * chosen.detach(), beta * rejected.detach()
        z = beta * (chosen - rejected)
        if kind == "sigmoid":
            losses = -(1 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)
        elif kind == "robust":
            losses = (-(1 - eps) * F.logsigmoid(z) + eps * F.logsigmoid(-z)) / (1 - 2 * eps)
        elif kind == "hinge":
            losses = torch.relu(1 - z)
        else:  # ipo
            chosen_avg, rejected_avg = policy.per_token(chosen, rejected)
            losses = (chosen_avg - rejected_avg - 1 / (2 * beta)) ** 2
    if ftx:
        losses = losses - ftx * policy.averaged()[0]
    return PairLoss(losses, *rewards)


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, without cancellation on either side of -log 2."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def kto_kl(
    policy: torch.Tensor,
    reference: torch.Tensor,
    all_reduce: Callable[[torch.Tensor], None] | None = None,
    counted: torch.Tensor | None = None,
) -> torch.Tensor:
    """KTO's reference point: the mean log-ratio of the mismatched pairs over every rank's examples
    (`all_reduce` sums a tensor in place across ranks), detached and clamped at 0. `counted` (1 or 0 per
    pair) leaves out pairs that only keep a collective company (evaluation's filler micro-batches)."""
    ratio = (policy - reference).detach()
    weight = torch.ones_like(ratio) if counted is None else counted.to(ratio.dtype)
    total = torch.stack([(ratio * weight).sum(), weight.sum()])
    if all_reduce is not None:
        all_reduce(total)
    return (total[0] / total[1].clamp(min=1)).clamp(min=0)


def kto_loss(
    policy: torch.Tensor,
    reference: torch.Tensor,
    desirable: torch.Tensor,
    kl: torch.Tensor,
    beta: float,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(losses, rewards) per example [n]: `desirable` is the example's label (True = desirable)."""
    ratio = policy - reference
    losses = torch.where(
        desirable,
        desirable_weight * (1 - torch.sigmoid(beta * (ratio - kl))),
        undesirable_weight * (1 - torch.sigmoid(beta * (kl - ratio))),
    )
    return losses, beta * ratio.detach()


def reward_pair_loss(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """The pairwise reward-model loss per pair: -log sigmoid(r_chosen - r_rejected)."""
    return -F.logsigmoid(chosen - rejected)
