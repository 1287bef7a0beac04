"""The reinforcement-learning losses as pure functions of tensors: group-relative advantages (GRPO), the
clipped surrogate with DAPO's decoupled clip range and the k3 KL estimator, the three token aggregations
(grpo, dapo, dr_grpo as TRL defines them), and PPO's GAE and clipped value loss. Each is tested against the
published formula written independently in the tests.

Aggregations are *sums* the loop divides by a global count (objectives/base.py): `grpo` sums each sequence's
token mean (divided by the sequences), `dapo` sums tokens (divided by the completion tokens), `dr_grpo` sums
each sequence's tokens over the fixed `max_new_tokens` (divided by the sequences)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

STD_EPS = 1e-4  # TRL's: added to the standard deviation before dividing
AGGREGATION_NORMALIZER = {"grpo": "sequences", "dapo": "targets", "dr_grpo": "sequences"}


def group_advantages(
    rewards: torch.Tensor, scale: str, batch_std: torch.Tensor | float | None = None
) -> torch.Tensor:
    """rewards [groups, group_size] -> advantages of the same shape: the reward minus its group's mean,
    divided by the group's (unbiased) standard deviation (`group`), the whole batch's (`batch`: pass the
    global batch's std as `batch_std`, or it is this tensor's) or not at all (`none`, Dr. GRPO)."""
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if scale == "none":
        return centred
    if scale == "group":
        std = rewards.std(dim=1, keepdim=True) if rewards.shape[1] > 1 else torch.zeros_like(centred)
    elif scale == "batch":
        std = rewards.std() if batch_std is None else torch.as_tensor(batch_std, dtype=rewards.dtype)
    else:
        raise ValueError(f"scale_rewards={scale!r}; expected group, batch or none")
    return centred / (std + STD_EPS)


@dataclass
class TokenLosses:
    """Per completion token: the loss, the log-ratio to the rollout policy, whether the ratio was clipped,
    and the KL estimate to the reference (zeros without one)."""

    loss: torch.Tensor
    log_ratio: torch.Tensor
    clipped: torch.Tensor
    kl: torch.Tensor


def clipped_surrogate(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    clip: tuple[float, float],
    kl_beta: float = 0.0,
    ref_logps: torch.Tensor | None = None,
) -> TokenLosses:
    """PPO's clipped objective per token, -min(r A, clip(r, 1 - low, 1 + high) A) with r = pi / pi_old
    (DAPO's clip-higher when high > low), plus kl_beta times the k3 estimator of KL(pi || pi_ref),
    exp(ref - logp) - (ref - logp) - 1 (Schulman's; GRPO's). All tensors are [tokens]."""
    low, high = clip
    log_ratio = logps - old_logps
    ratio = log_ratio.exp()
    clipped_ratio = ratio.clamp(1 - low, 1 + high)
    loss = -torch.minimum(ratio * advantages, clipped_ratio * advantages)
    clipped = ((ratio < 1 - low) & (advantages < 0)) | ((ratio > 1 + high) & (advantages > 0))
    kl = torch.zeros_like(logps)
    if ref_logps is not None:
        delta = ref_logps - logps
        kl = delta.exp() - delta - 1
        loss = loss + kl_beta * kl
    return TokenLosses(loss, log_ratio, clipped, kl)


def aggregate(
    per_token: torch.Tensor, sequence_of_token: torch.Tensor, sequences: int, how: str, max_new_tokens: int
) -> torch.Tensor:
    """The sum the loop divides by its normalizer (AGGREGATION_NORMALIZER[how]): per-token values of
    completion tokens [tokens], each token's sequence index, and a bound on the sequences' number (one
    with no tokens adds nothing)."""
    if how == "dapo":
        return per_token.sum()
    per_sequence = torch.zeros(sequences, dtype=per_token.dtype, device=per_token.device).index_add(
        0, sequence_of_token, per_token
    )
    if how == "dr_grpo":
        return per_sequence.sum() / max_new_tokens
    if how == "grpo":
        lengths = torch.zeros(sequences, dtype=per_token.dtype, device=per_token.device).index_add(
            0, sequence_of_token, torch.ones_like(per_token)
        )
        return (per_sequence / lengths.clamp(min=1)).sum()
    raise ValueError(f"loss={how!r}; expected grpo, dapo or dr_grpo")


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation over completion tokens [rows, T] (`mask` marks them; they are
    contiguous in a row, the value after the last one is 0): advantages and returns (= advantages + values).
    delta_t = r_t + gamma V_{t+1} - V_t, A_t = delta_t + gamma lam A_{t+1}."""
    rewards, values = rewards * mask, values * mask
    advantages = torch.zeros_like(values)
    running = torch.zeros_like(values[:, 0])
    next_value = torch.zeros_like(values[:, 0])
    for t in reversed(range(values.shape[1])):
        live = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = torch.where(live, delta + gamma * lam * running, running)
        advantages[:, t] = torch.where(live, running, torch.zeros_like(running))
        next_value = torch.where(live, values[:, t], next_value)
    return advantages, advantages + values


def clipped_value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's value loss per token, 0.5 max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2), and whether
    the clipped term was the larger (the value clip fraction)."""
    clipped_values = old_values + (values - old_values).clamp(-clip, clip)
    plain, clipped = (values - returns) ** 2, (clipped_values - returns) ** 2
    return 0.5 * torch.maximum(plain, clipped), clipped > plain
