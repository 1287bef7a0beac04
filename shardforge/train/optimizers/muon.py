"""Muon for the hidden 2-D weights and AdamW for the rest, as one optimizer (one state dict, one LambdaLR).

LLaMA-Factory 0.9.5 ships its own Muon (llamafactory/third_party/muon); torch 2.13 has torch.optim.Muon. They
are the same update with these settings: momentum 0.95, nesterov, 5 Newton-Schulz steps,
`adjust_lr_fn="match_rms_adamw"` (LF's lr x 0.2 sqrt(max(A, B))), decoupled weight decay train.lr x
train.weight_decay on every parameter (LF decays the norms and the embedding too). torch keeps the momentum
as an average (lerp) where LF keeps a sum; the two buffers differ by the factor (1 - momentum), which the
orthogonalization's normalization removes. Both iterate in bfloat16, and torch fuses the iteration's products
(addmm) where LF rounds each: equal to 1e-5 when the iteration runs in fp32, within bfloat16's rounding
(about 1% of the orthogonalized update) as they run (tests/unit/test_optimizers.py checks both).

The rest (embedding, head, norms) is LF's own AdamW step, not torch.optim.AdamW: LF adds eps to sqrt(v)
before the bias correction (torch after), which changes the update of near-zero gradients (the head's rows
of absent tokens) by up to the learning rate.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shardforge.config.optimizers import MuonSection


def muon_split(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """LF's rule: Muon for trainable 2-D parameters whose name holds neither "embed" nor "lm_head"."""
    muon, adamw = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            hidden = p.ndim == 2 and "embed" not in name and "lm_head" not in name
            (muon if hidden else adamw).append(p)
    return muon, adamw


def muon_groups(
    model: nn.Module, section: MuonSection, lr: float, weight_decay: float, betas: tuple, eps: float
) -> list[dict]:
    muon, adamw = muon_split(model)
    groups = [
        {
            "params": muon,
            "use_muon": True,
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": section.momentum,
            "nesterov": section.nesterov,
            "ns_steps": section.ns_steps,
            "adjust_lr_fn": "match_rms_adamw",
        },
        {
            "params": adamw,
            "use_muon": False,
            "lr": lr,
            "weight_decay": weight_decay,
            "betas": betas,
            "eps": eps,
        },
    ]
    return [g for g in groups if g["params"]]


class MuonAdamW(torch.optim.Optimizer):
    """Groups flagged `use_muon` step with torch.optim.Muon (an inner one sharing this one's group dicts and
    state), the others with LF's AdamW step, so the schedule, checkpoints and memory_report see one ordinary
    optimizer (ZeroRedundancyOptimizer can hold it: it takes `(param_groups, **defaults)`)."""

    def __init__(self, params: list[dict], **defaults: Any) -> None:
        super().__init__(params, defaults)
        muon = [g for g in self.param_groups if g["use_muon"]]
        # its constructor fills each group's missing keys with Muon's defaults (in place)
        self._muon = torch.optim.Muon(muon) if muon else None

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._muon is not None:  # load_state_dict replaces groups and state: point the inner one at them
            self._muon.param_groups = [g for g in self.param_groups if g["use_muon"]]
            self._muon.state = self.state
            self._muon.step()
        for group in self.param_groups:
            if not group["use_muon"]:
                self._adamw_step(group)
        return loss

    def _adamw_step(self, group: dict) -> None:
        """LF's third_party/muon AdamW, op for op: eps beside sqrt(v), the bias corrections on the rate."""
        lr, weight_decay, eps = group["lr"], group["weight_decay"], group["eps"]
        beta1, beta2 = group["betas"]
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if "step" not in state:
                state["step"] = torch.zeros((), dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p.grad)
                state["exp_avg_sq"] = torch.zeros_like(p.grad)
            state["step"] += 1
            step = state["step"].item()
            state["exp_avg"].lerp_(p.grad, 1 - beta1)
            state["exp_avg_sq"].lerp_(p.grad.square(), 1 - beta2)
            update = state["exp_avg"] / (eps + state["exp_avg_sq"].sqrt())
            scale = (1 - beta1**step) / (1 - beta2**step) ** 0.5
            p.mul_(1 - lr * weight_decay)
            p.add_(update, alpha=-lr / scale)
