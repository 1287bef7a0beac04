"""A mixture-of-experts MLP in plain PyTorch: a top-k router and the experts run as one grouped matmul over
the tokens sorted by expert (no Python loop over experts), with the shared expert of Qwen2-MoE.

Parameters keep transformers 5's fused layout and names (`gate.weight` [E, H]; `experts.gate_up_proj`
[E, 2I, H], gate rows first; `experts.down_proj` [E, H, I]; `shared_expert.*`, `shared_expert_gate`), so an HF
checkpoint maps onto it one key to one key. The router is each family's: a softmax in fp32 over all experts,
the top k, renormalized to sum to 1 when the family says so (Mixtral always; Qwen2/3-MoE with
`norm_topk_prob`). No parallel code here: expert parallel is applied from outside.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class MoEShape:
    hidden: int
    intermediate: int  # each expert's MLP width
    experts: int
    top_k: int
    renormalize: bool  # the top-k weights divided by their sum
    shared_intermediate: int = 0  # Qwen2-MoE's shared expert (0: none)


@dataclass
class Routing:
    """What the router chose for n tokens: `logits` [n, E] (for the load-balancing losses), `weights` and
    `experts` [n, k]."""

    logits: torch.Tensor
    weights: torch.Tensor
    experts: torch.Tensor


class Router(nn.Module):
    def __init__(self, shape: MoEShape) -> None:
        super().__init__()
        self.shape = shape
        self.weight = nn.Parameter(torch.empty(shape.experts, shape.hidden))

    def forward(self, x: torch.Tensor) -> Routing:
        logits = F.linear(x, self.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.shape.top_k, dim=-1)
        if self.shape.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return Routing(logits, weights.to(x.dtype), experts)


class Experts(nn.Module):
    """E SwiGLU MLPs. A token's k choices become k rows, sorted by expert (stable, so the order within an
    expert is the token order), run through two grouped matmuls, weighted and summed back per token."""

    def __init__(self, shape: MoEShape) -> None:
        super().__init__()
        e, h, i = shape.experts, shape.hidden, shape.intermediate
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))

    def forward(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        k = routing.experts.shape[-1]
        chosen = routing.experts.reshape(-1)
        order = torch.argsort(chosen, stable=True)
        counts = torch.bincount(chosen, minlength=self.gate_up_proj.shape[0])
        ends = torch.cumsum(counts, 0).to(torch.int32)  # each expert's last row + 1 in the sorted rows
        token = order // k
        gate, up = grouped_linear(x[token], self.gate_up_proj, ends).chunk(2, dim=-1)
        rows = grouped_linear(F.silu(gate) * up, self.down_proj, ends)
        rows = rows * routing.weights.reshape(-1)[order, None]
        return torch.zeros_like(x).index_add_(0, token, rows)


def grouped_linear(rows: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """rows [S, in] sorted by group, weight [E, out, in] (nn.Linear's layout per group), ends [E] int32 the
    cumulative row counts: each group's rows times its weight's transpose, [S, out]."""
    return F.grouped_mm(rows, weight.transpose(-2, -1), offs=ends)


class SwiGLU(nn.Module):
    """The dense MLP of the shared expert (the same as the dense decoder's, under the same names)."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SparseMoE(nn.Module):
    """The MoE MLP of a block: x [..., H] -> [..., H]. The last forward's routing is kept in `routing` for
    the load-balancing losses (None before any forward)."""

    def __init__(self, shape: MoEShape) -> None:
        super().__init__()
        self.shape = shape
        self.gate = Router(shape)
        self.experts = Experts(shape)
        if shape.shared_intermediate:
            self.shared_expert = SwiGLU(shape.hidden, shape.shared_intermediate)
            self.shared_expert_gate = nn.Linear(shape.hidden, 1, bias=False)
        self.routing: Routing | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        self.routing = self.gate(flat)
        out = self.experts(flat, self.routing)
        if self.shape.shared_intermediate:
            out = out + torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return out.reshape(x.shape)


@dataclass
class RoutingStats:
    """What the load-balancing loss is made of, as sums, so that micro-batches and ranks can add theirs
    before the (non-linear) product: top-k picks per expert [E], router probabilities per expert [E] (both
    over the counted tokens of every MoE layer), and the number of those token rows."""

    picks: torch.Tensor
    probs: torch.Tensor
    rows: torch.Tensor

    def __add__(self, other: RoutingStats) -> RoutingStats:
        return RoutingStats(self.picks + other.picks, self.probs + other.probs, self.rows + other.rows)


def routing_stats(routings: list[Routing], mask: torch.Tensor | None = None) -> RoutingStats:
    """The sums over the layers' routings; `mask` [tokens] (1: counted, 0: padding) as transformers'
    attention mask."""
    experts = routings[0].logits.shape[-1]
    device = routings[0].logits.device
    weight = None if mask is None else mask.reshape(-1).to(device=device, dtype=torch.float32)
    picks = torch.zeros(experts, device=device)
    probs = torch.zeros(experts, device=device)
    rows = torch.zeros((), device=device)
    for routing in routings:
        p = torch.softmax(routing.logits.float(), dim=-1)
        k = routing.experts.shape[-1]
        w = torch.ones(p.shape[0], device=device) if weight is None else weight
        picks = picks.scatter_add(0, routing.experts.reshape(-1), w.repeat_interleave(k))
        probs = probs + (p * w[:, None]).sum(dim=0)
        rows = rows + w.sum()
    return RoutingStats(picks, probs, rows)


def load_balancing_loss(stats: RoutingStats) -> torch.Tensor:
    """Switch Transformer's auxiliary loss as transformers defines it: E * sum_e f_e P_e, f_e the picks of
    expert e per token row (they sum to k) and P_e its mean router probability."""
    experts = stats.picks.shape[0]
    return experts * torch.sum((stats.picks / stats.rows) * (stats.probs / stats.rows))
