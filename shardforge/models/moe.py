"""A mixture-of-experts MLP in plain PyTorch: a top-k router and the experts run as one grouped matmul over
the tokens sorted by expert (no Python loop over experts), with the shared expert of Qwen2-MoE.

Parameters keep transformers 5's fused layout and names (`gate.weight` [E, H]; `experts.gate_up_proj`
[E, 2I, H], gate rows first; `experts.down_proj` [E, H, I]; `shared_expert.*`, `shared_expert_gate`), so an HF
checkpoint maps onto it one key to one key. The router is each family's: a softmax in fp32 over all experts,
the top k, renormalized to sum to 1 when the family says so (Mixtral always; Qwen2/3-MoE with
`norm_topk_prob`). Expert parallel is applied from outside (the experts' `exchange`); the one collective
here sums the balancing statistics over the ranks that split a micro-batch's tokens (`stats_group`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
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


@dataclass(frozen=True)
class Balance:
    """How training keeps the experts' loads even (the config's `method.moe`, as data the model reads):
    Switch Transformer's auxiliary loss and ST-MoE's router z-loss, each averaged over the model's `layers`
    MoE layers; DeepSeek-V3's aux-loss-free bias (`bias_rate` > 0: a per-expert bias added to the scores for
    choosing only, moved after each step towards the mean load); a `capacity_factor` (None: dropless) that
    drops an expert's token choices beyond capacity_factor x tokens x k / E per forward."""

    aux_loss_coef: float = 0.0
    z_loss_coef: float = 0.0
    bias_rate: float = 0.0
    capacity_factor: float | None = None
    layers: int = 1


@dataclass
class Routing:
    """What the router chose for n tokens: `logits` [n, E] (for the load-balancing losses), `weights` and
    `experts` [n, k]."""

    logits: torch.Tensor
    weights: torch.Tensor
    experts: torch.Tensor


class Router(nn.Module):
    """Softmax in fp32 over all experts, the top k chosen with the aux-loss-free `bias` added (zero unless
    that balancing trained it; kept in fp32 whatever the weights' dtype), weighted by the unbiased
    probabilities, renormalized if the family says so."""

    def __init__(self, shape: MoEShape) -> None:
        super().__init__()
        self.shape = shape
        self.weight = nn.Parameter(torch.empty(shape.experts, shape.hidden))
        self.register_buffer("bias", torch.zeros(shape.experts), persistent=True)

    def _apply(self, fn, recurse: bool = True) -> Router:
        out = super()._apply(fn, recurse)
        if self.bias.dtype != torch.float32:  # its updates are ~1e-3 steps: bf16 would stall them
            self.bias = self.bias.float()
        return out

    def forward(self, x: torch.Tensor) -> Routing:
        logits = F.linear(x, local(self.weight))
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        experts = torch.topk(probs + self.bias, self.shape.top_k, dim=-1).indices
        weights = probs.gather(-1, experts)
        if self.shape.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return Routing(logits, weights.to(x.dtype), experts)


@dataclass
class Dispatch:
    """A forward's token choices as rows sorted by expert: `order` [rows] each row's index among the n x k
    choices (token = order // k), `counts` [E] rows per expert and `ends` their cumulative sums (int32),
    `weights` [rows] the router weights, `dropped` (a 0-d tensor) the real tokens' choices past capacity."""

    order: torch.Tensor
    k: int
    counts: torch.Tensor
    ends: torch.Tensor
    weights: torch.Tensor
    dropped: torch.Tensor

    @property
    def token(self) -> torch.Tensor:
        return self.order // self.k


def sort_by_expert(
    routing: Routing, experts: int, capacity: int | None = None, real: torch.Tensor | None = None
) -> Dispatch:
    """Each token's k choices as rows sorted by expert (stable: token order within an expert). With a
    `capacity`, each expert keeps its first `capacity` rows of real tokens (`real` [n], True: not padding)
    and the rest are dropped: those choices add nothing (the token keeps its residual and its other
    experts), and padding takes no capacity. Dropless, padding is computed like any token (no host sync)."""
    k = routing.experts.shape[-1]
    chosen = routing.experts.reshape(-1)
    if capacity is not None and real is not None:  # padding's choices: a group past the last expert
        chosen = torch.where(real.repeat_interleave(k), chosen, experts)
    order = torch.argsort(chosen, stable=True)
    counts = torch.bincount(chosen, minlength=experts + 1)[:experts]
    dropped = chosen.new_zeros((), dtype=torch.float32)
    if capacity is not None:  # each expert's first `capacity` rows; padding's group is cut off too
        sorted_experts = chosen[order]
        starts = torch.cumsum(counts, 0) - counts
        rank_in_expert = (
            torch.arange(order.numel(), device=order.device) - starts[sorted_experts.clamp(max=experts - 1)]
        )
        in_expert = sorted_experts < experts
        keep = in_expert & (rank_in_expert < capacity)
        dropped = (in_expert & ~keep).sum().float()
        order, counts = order[keep], counts.clamp(max=capacity)
    ends = torch.cumsum(counts, 0).to(torch.int32)
    return Dispatch(order, k, counts, ends, routing.weights.reshape(-1)[order], dropped)


class Experts(nn.Module):
    """E SwiGLU MLPs run as two grouped matmuls over rows sorted by expert. Expert parallel (applied from
    outside, parallel/expert_parallel.py) sets `exchange`: the rows then travel to the rank holding their
    expert and back, and this module holds only that rank's experts."""

    def __init__(self, shape: MoEShape) -> None:
        super().__init__()
        e, h, i = shape.experts, shape.hidden, shape.intermediate
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h))
        self.down_proj = nn.Parameter(torch.empty(e, h, i))
        self.exchange: Callable[[Experts, torch.Tensor, Dispatch], torch.Tensor] | None = None
        self.grad_scale = 1.0  # on the weights' gradients (expert parallel: 1 / ep, see expert_parallel.py)

    def run(self, rows: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        """rows [S, H] sorted by (this rank's) expert, ends [E_local] int32 -> [S, H]. Under autocast in the
        autocast dtype (grouped_mm is on none of autocast's lists)."""
        w1, w2 = local(self.gate_up_proj), local(self.down_proj)
        if self.grad_scale != 1.0:
            w1, w2 = _ScaleGrad.apply(w1, self.grad_scale), _ScaleGrad.apply(w2, self.grad_scale)
        device = rows.device.type
        if torch.is_autocast_enabled(device):
            dtype = torch.get_autocast_dtype(device)
            rows, w1, w2 = rows.to(dtype), w1.to(dtype), w2.to(dtype)
        gate, up = grouped_linear(rows, w1, ends).chunk(2, dim=-1)
        return grouped_linear(F.silu(gate) * up, w2, ends)

    def forward(self, x: torch.Tensor, dispatch: Dispatch) -> torch.Tensor:
        rows = x[dispatch.token]
        rows = self.run(rows, dispatch.ends) if self.exchange is None else self.exchange(self, rows, dispatch)
        rows = rows * dispatch.weights[:, None]
        # Each token's k results summed in choice order (a deterministic sum, unlike atomic index_add).
        n, k = x.shape[0], dispatch.k
        choices = rows.new_zeros(n * k, x.shape[-1]).index_copy(0, dispatch.order, rows)
        return choices.view(n, k, -1).sum(dim=1).to(x.dtype)


def grouped_linear(rows: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """rows [S, in] sorted by group, weight [E, out, in] (nn.Linear's layout per group), ends [E] int32 the
    cumulative row counts: each group's rows times its weight's transpose, [S, out]."""
    return F.grouped_mm(rows, weight.transpose(-2, -1), offs=ends)


def local(param: torch.Tensor) -> torch.Tensor:
    """A parameter's local tensor: tensor parallel makes the router and the experts DTensors replicated over
    the tp ranks (one optimizer / clipping path for all parameters), while the MoE computes on plain tensors
    (each tp rank runs the layer on the whole sequence, so their gradients agree)."""
    to_local = getattr(param, "to_local", None)
    return to_local() if to_local is not None else param


class SwiGLU(nn.Module):
    """The dense MLP of the shared expert (the same as the dense decoder's, under the same names)."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


# What a layer's statistics vector holds after the per-expert picks (see `SparseMoE.window`).
STAT_FIELDS = ("aux_loss", "z_loss", "tokens", "dropped")


class SparseMoE(nn.Module):
    """The MoE MLP of a block: x [..., H] -> [..., H]; `token_mask` [...] (True: a real token) keeps padding
    out of the balancing losses and statistics.

    In training with `balance` set, the layer's balancing losses are attached to its output
    (`_AttachLoss`: the forward value is unchanged, the backward adds their gradient scaled by
    `loss_weight`, which the loop sets per step), so they reach the router from any pipeline stage without a
    second loss path. The backward also adds the forward's statistics (detached) to `window` (per expert
    picks, then STAT_FIELDS) and `step_picks`: once per real forward, never for a recomputation."""

    def __init__(self, shape: MoEShape) -> None:
        super().__init__()
        self.shape = shape
        self.gate = Router(shape)
        self.experts = Experts(shape)
        if shape.shared_intermediate:
            self.shared_expert = SwiGLU(shape.hidden, shape.shared_intermediate)
            self.shared_expert_gate = nn.Linear(shape.hidden, 1, bias=False)
        self.balance: Balance | None = None
        self.loss_weight = 0.0  # per token: dp x cp / global tokens x the loss scale (set by the loop)
        self.stats_group: Any = None  # ranks that split this forward's tokens (context parallel)
        self.window: torch.Tensor | None = None
        self.step_picks: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, token_mask: torch.Tensor | None = None) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        mask = None if token_mask is None else token_mask.reshape(-1)
        balance = self.balance
        routing = self.gate(flat)
        capacity = None
        if balance is not None and balance.capacity_factor is not None:
            n, k, e = flat.shape[0], self.shape.top_k, self.shape.experts
            capacity = max(1, math.ceil(balance.capacity_factor * n * k / e))
        dispatch = sort_by_expert(routing, self.shape.experts, capacity, mask)
        out = self.experts(flat, dispatch)
        if self.shape.shared_intermediate:
            out = out + torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        if balance is not None and self.training and torch.is_grad_enabled():
            loss, stats = self._balance_loss(routing, mask, dispatch.dropped)
            out = _AttachLoss.apply(out, loss, self, stats)
        return out.reshape(x.shape)

    def _balance_loss(
        self, routing: Routing, mask: torch.Tensor | None, dropped: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This forward's balancing losses as sums over its tokens (aux x tokens, and the z-loss's sum of
        squared log-sum-exps), and its statistics. The aux loss's expert fractions (no gradient) and token
        count are those of the whole micro-batch: summed over `stats_group` (one all-reduce) when ranks
        split its tokens, so each rank's term is its part of the one-process value."""
        balance, e = self.balance, self.shape.experts
        stats = routing_stats([routing], mask)
        lse = torch.logsumexp(routing.logits.float(), dim=-1)
        z_sum = (lse.pow(2) * (1.0 if mask is None else mask.float())).sum()
        extra = torch.stack([stats.rows, dropped, z_sum.detach()])
        totals = torch.cat([stats.picks, stats.probs.detach(), extra])
        if self.stats_group is not None:
            totals = _all_reduce(totals, self.stats_group)
        picks, probs, (n, dropped_all, z_all) = totals[:e], totals[e : 2 * e], totals[2 * e :]
        n = n.clamp(min=1.0)
        aux_sum = e * torch.sum(picks / n * stats.probs)  # = aux x tokens, summed over the group's ranks
        loss = (balance.aux_loss_coef * aux_sum + balance.z_loss_coef * z_sum) / balance.layers
        aux = load_balancing_loss(RoutingStats(picks, probs, n))
        return loss, torch.cat([picks, torch.stack([aux * n, z_all, n, dropped_all])])

    def record(self, stats: torch.Tensor) -> None:
        self.window = stats if self.window is None else self.window + stats
        if self.balance.bias_rate:  # the step's loads, for the expert bias's update
            picks = stats[: self.shape.experts]
            self.step_picks = picks if self.step_picks is None else self.step_picks + picks


def _all_reduce(t: torch.Tensor, group: Any) -> torch.Tensor:
    t = t.clone()
    dist.all_reduce(t, group=group)
    return t


class _ScaleGrad(torch.autograd.Function):
    """Identity whose backward scales the gradient."""

    @staticmethod
    def forward(ctx, t: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return t.view_as(t)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


class _AttachLoss(torch.autograd.Function):
    """Identity on `out`; the backward gives `loss` the gradient `layer.loss_weight` and records `stats`."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, loss: torch.Tensor, layer: SparseMoE, stats: torch.Tensor):
        ctx.layer, ctx.stats, ctx.loss_shape = layer, stats, loss.shape
        ctx.loss_dtype, ctx.loss_device = loss.dtype, loss.device
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.layer.record(ctx.stats)
        weight = torch.full(
            ctx.loss_shape, ctx.layer.loss_weight, dtype=ctx.loss_dtype, device=ctx.loss_device
        )
        return grad, weight, None, None


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


def moe_layers(model: nn.Module) -> list[SparseMoE]:
    """The MoE layers a model (or a pipeline rank's part of it) holds, in order."""
    return [m for m in model.modules() if isinstance(m, SparseMoE)]
