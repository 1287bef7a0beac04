"""Heads, the objects a model's forward ends in (logits, a score, target log-probs, PPO's values), and the
LM head fused with the log-probability of each scored position's target, a chunk of positions at a
time, so that full-vocabulary fp32 logits never exist for the batch: at most `chunk` rows of them do.

Training: the gradient of log p(target) with respect to the logits, onehot - softmax, is known in the forward
pass, so each chunk's contribution to the hidden states' gradient is computed there and scaled by its
position's incoming gradient in backward. The weight's gradient is a sum over positions; it is computed in
the forward pass too when the caller says the incoming gradient will be the same for every position (a summed
token loss: SFT, pretraining), which backward checks, and recomputed chunk by chunk from the logits otherwise
(per-sequence losses: DPO, rewards). Either way: the same values as `log_softmax(h @ W.T)[targets]`, and no
[positions, vocab] tensor besides one chunk.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

# fp32 logits held at a time (a chunk of positions x the vocabulary): under glibc's largest mmap threshold
# (32 MiB), so that the chunks reuse heap memory instead of faulting fresh pages in each time
CHUNK_BYTES = 16 << 20
_MIN_CHUNK = 64  # positions: fewer make the head's matmuls too thin to run at speed


@dataclass(frozen=True)
class HeadInput:
    """What a head may read besides the final hidden states: the forward's tokens, their positions and
    documents, and which positions are scored (the hidden states are those positions' already)."""

    tokens: torch.Tensor
    position_ids: torch.Tensor
    doc_ids: torch.Tensor | None
    doc_layout: Any
    output_mask: torch.Tensor | None


HeadOutput = torch.Tensor | tuple[torch.Tensor, torch.Tensor]


class Head(ABC):
    """What a model's forward ends in, named by the caller (an objective's model inputs, the inference
    engine): the final hidden states of the scored positions -> a tensor (PolicyValues: two). A model
    provides `logits` and `target_logprobs` over them (models/protocol.py); heads compose those."""

    @abstractmethod
    def __call__(self, model: Any, hidden: torch.Tensor, inputs: HeadInput) -> HeadOutput: ...


class Logits(Head):
    """The LM head's logits [n, vocab] (or [b, s, vocab] without an output mask): generation."""

    def __call__(self, model: Any, hidden: torch.Tensor, inputs: HeadInput) -> torch.Tensor:
        return model.logits(hidden)


class Hidden(Head):
    """The final (normed) hidden states themselves, for a head the caller applies."""

    def __call__(self, model: Any, hidden: torch.Tensor, inputs: HeadInput) -> torch.Tensor:
        return hidden


class Score(Logits):
    """A reward model's scores [n, labels] at the scored positions: its score head is its `lm_head`."""


@dataclass(frozen=True)
class TargetLogprobs(Head):
    """log p(target) of each scored position [n] (fp32), without the batch's full logits. `summed`: the
    caller sums them with one coefficient (a token loss), so the weight's gradient is made in forward."""

    targets: torch.Tensor
    summed: bool = False

    def __call__(self, model: Any, hidden: torch.Tensor, inputs: HeadInput) -> torch.Tensor:
        return model.target_logprobs(hidden, self.targets, self.summed)


@dataclass(frozen=True)
class PolicyValues(Head):
    """PPO: the targets' log-probs and the critic's value estimates at the same positions, two tensors [n]
    (fp32): the value head on the final hidden states, or the separate critic model run on the same tokens.
    Two outputs, not one stacked tensor: a value loss alone trains the critic alone (the policy's
    parameters keep no gradient from it), while a loss that uses a row with a gradient of exact zeros (every
    value clipped, vf_coef 0) still hands its parameters zeros, so that the optimizer's decay and momentum
    run on them as on any trained parameter."""

    targets: torch.Tensor
    summed: bool = False

    def __call__(
        self, model: Any, hidden: torch.Tensor, inputs: HeadInput
    ) -> tuple[torch.Tensor, torch.Tensor]:
        logps = model.target_logprobs(hidden, self.targets, self.summed)
        return logps.float(), critic_values(model, hidden, inputs)


LOGITS = Logits()


def apply_head(model: Any, h: torch.Tensor, head: Head | None, inputs: HeadInput) -> HeadOutput:
    """The one dispatch both backends end their forward with: final norm, the scored positions, the head
    (None: logits)."""
    return (head or LOGITS)(model, model.final_hidden(h, inputs.output_mask), inputs)


def attach_value_head(model: Any, seed: int = 0) -> None:
    """PPO's critic sharing the policy's body: a value head on its final hidden states (a submodule, so the
    layouts, the optimizer and checkpoints treat it as part of the model; left out of exports). A pipeline
    stage without the LM head gets none."""
    if model.lm_head is not None:
        model.value_head = value_head(model.config.hidden_size, model.lm_head.weight, seed)


def attach_critic(model: Any, critic: nn.Module) -> None:
    """PPO's separate critic: a model of its own with a one-output score head, run on the policy's tokens
    when values are asked for; held as a submodule (its weights are `critic.*`) for the same reasons."""
    model.critic = critic


def value_head(hidden_size: int, like: torch.Tensor, seed: int) -> nn.Linear:
    """A scalar value head on the final hidden states, as TRL's `...WithValueHead` puts on the policy (PPO's
    critic sharing the policy's body): weights N(0, 0.02) drawn from `seed`, bias 0, on `like`'s device and
    in its dtype."""
    head = nn.Linear(hidden_size, 1, device=like.device, dtype=like.dtype)
    with torch.no_grad():
        draw = torch.randn(head.weight.shape, generator=torch.Generator().manual_seed(seed)) * 0.02
        head.weight.copy_(draw)
        head.bias.zero_()
    return head


def critic_values(model: Any, hidden: torch.Tensor, inputs: HeadInput) -> torch.Tensor:
    """PPO's value estimates [n] (fp32) at the positions the policy scores: the value head on the policy's
    final hidden states there [n, hidden], or a separate critic model (`model.critic`: a body of its own
    with a one-output score head, as an `rm` run makes) run on the same tokens, positions and output mask."""
    if model.critic is not None:
        out = model.critic(
            inputs.tokens, inputs.position_ids, inputs.doc_ids, inputs.doc_layout, inputs.output_mask
        )
        return out.squeeze(-1).float()
    assert model.value_head is not None, "PolicyValues needs attach_value_head() or attach_critic()"
    return model.value_head(hidden).squeeze(-1).float()


def chunk_rows(vocab: int) -> int:
    return max(_MIN_CHUNK, CHUNK_BYTES // (4 * vocab))


def target_logprobs(
    head: nn.Linear, hidden: torch.Tensor, targets: torch.Tensor, summed: bool = False
) -> torch.Tensor:
    """log softmax(head(hidden))[i, targets[i]] for hidden [n, h] and targets [n], in fp32, [n]. `summed`:
    the caller sums these with one coefficient (a token loss), so the weight's gradient is computed in the
    forward pass (3 matmuls instead of 4; still exact if the promise is broken). A vocabulary-sharded head
    (tensor parallel) runs as it is and takes torch's `loss_parallel` cross-entropy of its logit shards."""
    if isinstance(head.weight, DTensor):
        out = -F.cross_entropy(head(hidden).float(), targets, reduction="none")
        return out.to_local() if isinstance(out, DTensor) else out
    if not torch.is_grad_enabled():  # evaluation: one matmul a chunk (a Function would still make gradients)
        return _logprobs(hidden, head.weight, targets)
    return _TargetLogprobs.apply(hidden, head.weight, targets, summed)


def _logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
    for part in _chunks(hidden.shape[0], weight.shape[0]):
        out[part] = _chunk_logprobs(hidden[part], weight, targets[part])[0]
    return out


def _chunk_logprobs(h: torch.Tensor, weight: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """One chunk's target log-probs, fp32 logits and their logsumexp."""
    logits = (h @ weight.t()).float()
    lse = torch.logsumexp(logits, dim=-1)
    return logits.gather(1, t[:, None]).squeeze(1) - lse, logits, lse


def _chunks(n: int, vocab: int) -> list[slice]:
    size = chunk_rows(vocab)
    return [slice(s, min(s + size, n)) for s in range(0, n, size)]


def _neg_grad_logits(h: torch.Tensor, weight: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """One chunk: its log-probs and softmax - onehot (the gradient of -log p with respect to its logits),
    the latter in the matmuls' dtype, made in place over the chunk's fp32 logits."""
    logprobs, logits, lse = _chunk_logprobs(h, weight, t)
    rows = torch.arange(t.shape[0], device=t.device)
    probs = logits.sub_(lse[:, None]).exp_()
    probs[rows, t] -= 1.0
    return logprobs, probs.to(h.dtype) if h.dtype != torch.float32 else probs


class _TargetLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, summed):
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        device = hidden.device.type
        ctx.autocast = (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        grad_h = torch.empty_like(hidden) if need_h else None  # -d(log p_i)/d(h_i), row by row
        grad_w = None
        if need_w and summed:  # -sum_i d(log p_i)/dW, in fp32 for a low-precision weight
            grad_w = torch.zeros_like(weight, dtype=torch.float32)
        for part in _chunks(hidden.shape[0], weight.shape[0]):
            h = hidden[part]
            out[part], g = _neg_grad_logits(h, weight, targets[part])
            if grad_h is not None:
                grad_h[part] = g @ weight.to(g.dtype)
            if grad_w is not None:
                _accumulate(grad_w, g.t(), h)
        ctx.grad_w = grad_w  # on ctx, not saved: backward scales it in place and hands it out once
        ctx.save_for_backward(hidden, weight, targets, grad_h)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, targets, grad_h = ctx.saved_tensors
        # The weight's gradient is handed out once, scaled in place: autograd can then keep it as the .grad
        # (a copy of a fresh vocabulary-sized tensor costs as much as the product). If backward runs again
        # (torch's pipeline schedules run it for the inputs, then for the weights), it is recomputed.
        grad_w, ctx.grad_w = ctx.grad_w, None
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dh = (grad_h * -grad_out[:, None].to(grad_h.dtype)) if need_h else None
        if not need_w:
            return dh, None, None, None
        if grad_w is not None and grad_out.numel() == 0:  # nothing scored here (a chunk without targets)
            return dh, grad_w.to(weight.dtype), None, None
        if grad_w is not None and bool((grad_out == grad_out[0]).all()):
            return dh, grad_w.mul_(-grad_out[0]).to(weight.dtype), None, None
        device, enabled, dtype = ctx.autocast
        dw = torch.zeros_like(weight, dtype=torch.float32)
        with torch.no_grad(), torch.autocast(device, dtype=dtype, enabled=enabled):
            for part in _chunks(hidden.shape[0], weight.shape[0]):
                _, g = _neg_grad_logits(hidden[part], weight, targets[part])
                g.mul_(-grad_out[part, None].to(g.dtype))
                _accumulate(dw, g.t(), hidden[part])
        return dh, dw.to(weight.dtype), None, None


def _accumulate(total: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """total += a @ b, in place when the matmul runs in total's dtype (fp32), else through one product."""
    if a.dtype == total.dtype and b.dtype == total.dtype:
        total.addmm_(a, b)
    else:
        total.add_(a @ b.to(a.dtype))
