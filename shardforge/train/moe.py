"""The loop's side of mixture-of-experts balancing: the balancing losses' weight per step, the aux-loss-free
bias update after each step, and the logged routing statistics.

The layers attach their losses to their outputs (models/moe.py); this module tells them the weight of a
token's share, dp x cp / global tokens (x the fp16 loss scale), as the loop scales the main loss by
dp x cp / its normalizer: the losses then add coef x the token-weighted mean over micro-batches, averaged
over the MoE layers, to the loss whatever the data-parallel split. Statistics are reduced over all ranks:
data-parallel ranks saw other tokens and pipeline ranks hold other layers, while tensor- and
context-parallel peers hold the same (whole-sequence) numbers and are divided out.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

from shardforge.config.method_schema import MoESection
from shardforge.errors import ConfigError
from shardforge.models.moe import STAT_FIELDS, Balance, moe_layers
from shardforge.parallel.dims import ParallelDims


class MoEBalancer:
    def __init__(self, model: nn.Module, section: MoESection, model_config, dims: ParallelDims) -> None:
        self.layers, self.dims = moe_layers(model), dims
        self.experts, self.k = model_config.num_experts, model_config.experts_per_token
        coef = model_config.router_aux_loss_coef if section.aux_loss_coef is None else section.aux_loss_coef
        self.balance = Balance(
            aux_loss_coef=coef if section.balance == "aux_loss" else 0.0,
            z_loss_coef=section.z_loss_coef,
            bias_rate=section.bias_rate if section.balance == "bias" else 0.0,
            capacity_factor=section.capacity_factor,
            layers=len(model_config.moe_layers),
        )
        for layer in self.layers:
            layer.balance = self.balance
        # LoRA (linear layers only) and freeze tuning can leave the experts and routers untouched.
        self.frozen = bool(self.layers) and not any(
            p.requires_grad for p in self.layers[0].experts.parameters()
        )

    @classmethod
    def build(cls, model: nn.Module, section: MoESection, model_config, dims: ParallelDims):
        """A balancer for an MoE model; None for a dense one (where setting method.moe is an error)."""
        if model_config.num_experts:
            return cls(model, section, model_config, dims)
        if section != MoESection():
            raise ConfigError(
                f"method.moe is set, but the model ({model_config.family}) has no experts: remove it, or use "
                f"a mixture-of-experts model (mixtral, qwen2_moe, qwen3_moe)"
            )
        return None

    def describe(self) -> str:
        b = self.balance
        how = (
            f"aux loss x {b.aux_loss_coef:g}"
            if b.aux_loss_coef
            else f"expert bias (rate {b.bias_rate:g})"
            if b.bias_rate
            else "no balancing loss"
        )
        capacity = f"capacity factor {b.capacity_factor:g}" if b.capacity_factor else "dropless"
        z = f", z-loss x {b.z_loss_coef:g}" if b.z_loss_coef else ""
        frozen = "; experts and routers frozen (the method trains other weights)" if self.frozen else ""
        return (
            f"MoE: {self.experts} experts, top {self.k}, {b.layers} MoE layers; {how}{z}; {capacity}{frozen}"
        )

    def begin_step(self, global_tokens: int, loss_scale: float | None) -> None:
        weight = self.dims.averaged / max(1, global_tokens) * (loss_scale or 1.0)
        for layer in self.layers:
            layer.loss_weight = weight

    @torch.no_grad()
    def end_step(self, dp_sum: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Aux-loss-free balancing: each layer's bias moves by the rate towards under-loaded experts, from
        the step's loads over all data-parallel ranks (the same on every rank)."""
        if not self.balance.bias_rate or not self.layers:
            return
        picks = [layer.step_picks for layer in self.layers]
        for layer in self.layers:
            layer.step_picks = None
        if any(p is None for p in picks):  # no training forward this step
            return
        loads = dp_sum(torch.stack(picks))
        for layer, load in zip(self.layers, loads, strict=True):
            layer.gate.bias += self.balance.bias_rate * torch.sign(load.mean() - load)

    @torch.no_grad()
    def fields(self, device: torch.device) -> dict[str, float]:
        """The window's routing statistics (a collective on every rank), then a fresh window: the balancing
        losses' means, each expert's load relative to an even split (max and min over experts), and the
        share of token choices dropped for capacity."""
        width = self.experts + len(STAT_FIELDS)
        total = torch.zeros(width, device=device)
        for layer in self.layers:
            if layer.window is not None:
                total += layer.window
            layer.window = None
        if dist.is_initialized():
            dist.all_reduce(total)
            total /= self.dims.tp * self.dims.cp
        picks, (aux, z, tokens, dropped) = total[: self.experts], total[self.experts :].tolist()
        if tokens == 0:
            return {}
        load = picks * self.experts / picks.sum().clamp(min=1.0)
        return {
            "moe_aux_loss": aux / tokens,
            "moe_z_loss": z / tokens,
            "moe_load_max": load.max().item(),
            "moe_load_min": load.min().item(),
            "moe_dropped": dropped / (tokens * self.k),
        }
