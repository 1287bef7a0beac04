"""Time per optimizer step: compute from the family's FLOPs at the device's achievable rate for the run's GEMM
size, communication from each collective's message size on the link it crosses (ring costs: an all-reduce
moves 2(n-1)/n of the message per device, an all-gather or reduce-scatter (n-1)/n, an all-to-all (n-1)/n),
the overlap each layout allows, the pipeline bubble, and the optimizer's pass over its states.

What overlaps: DDP's all-reduce runs behind backward, FSDP2's gathers and reduce-scatters behind the layers'
compute (prefetch), so only what exceeds the compute they hide behind is exposed; tensor-, context- and
expert-parallel collectives sit on the critical path of each layer and are exposed whole, as is the pipeline's
point-to-point traffic at the ends of the schedule.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shardforge.config.schema import Config
from shardforge.models.spec import CostModel, causal_pairs
from shardforge.planner.hardware import Cluster
from shardforge.planner.layout import Layout
from shardforge.planner.memory import DTYPE_BYTES, StateBytes

MESH_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass
class StepTime:
    """Seconds per optimizer step by part (the exposed part of each collective) and the rates they imply."""

    parts: dict[str, float] = field(default_factory=dict)
    tokens: int = 0  # per step, all ranks
    model_flops: float = 0.0  # per step, all ranks, without recomputation
    world: int = 1
    peak: float = 1.0  # per device, the run's dtype

    @property
    def total(self) -> float:
        return sum(self.parts.values())

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.total

    @property
    def mfu(self) -> float:
        return self.model_flops / (self.total * self.world * self.peak)


def _span(layout: Layout, dims: tuple[str, ...], cluster: Cluster) -> bool:
    """Whether a group over these (adjacent) mesh dimensions crosses nodes: ranks are laid out with tp
    innermost, so a group spans stride x size consecutive ranks."""
    degrees = {"pp": layout.pp, "dp_replicate": layout.dp_replicate, "dp_shard": layout.dp_shard,
               "cp": layout.cp, "tp": layout.tp}  # fmt: skip
    inner = MESH_ORDER[MESH_ORDER.index(dims[-1]) + 1 :]
    stride = 1
    for d in inner:
        stride *= degrees[d]
    size = 1
    for d in dims:
        size *= degrees[d]
    return stride * size > cluster.devices_per_node


def _ring(cluster: Cluster, n: int, nbytes: float, cross: bool, factor: float) -> float:
    """A ring collective over n ranks moving `factor` x (n-1)/n x nbytes per device, plus n-1 latencies."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    bandwidth, latency = cluster.link(n, cross)
    return factor * (n - 1) / n * nbytes / bandwidth + (n - 1) * latency


class TimeModel:
    def __init__(self, cfg: Config, shape: object, costs: CostModel, cluster: Cluster) -> None:
        self.cfg, self.shape, self.costs, self.cluster = cfg, shape, costs, cluster
        self.dtype = {"fp32": "fp32", "bf16": "bf16", "fp16": "fp16"}[cfg.train.precision]
        self.act = 2 if cfg.train.precision != "fp32" else DTYPE_BYTES[cfg.model.dtype]
        self.trained = 1.0 if cfg.method.finetuning == "full" else 0.0
        layer = costs.layer_flops
        moe = [i for i in range(len(layer)) if getattr(shape, "is_moe", lambda _: False)(i)]
        self.moe_share = sum(layer[i] for i in moe) / max(sum(layer), 1.0)

    def estimate(self, layout: Layout, states: StateBytes, batch: int) -> StepTime:
        """`states`: the fullest rank's model states (the memory model's); `batch`: rows per step."""
        cfg, c, cl = self.cfg, self.costs, self.cluster
        seq = cfg.data.max_length
        tokens = batch * seq
        pairs = batch * causal_pairs([seq])
        trained = self.trained if cfg.method.finetuning != "freeze" else 0.5
        work = c.train_flops(tokens, tokens, pairs, trained)
        body = tokens * sum(c.layer_flops) + pairs * sum(c.pair_flops)
        recompute = {"none": 0.0, "full": body, "selective": pairs * sum(c.pair_flops)}[
            layout.activation_checkpoint
        ]
        # MoE layers run whole on every tp rank (their experts are split by ep, not tp)
        split = layout.world / (1 + self.moe_share * (layout.tp - 1))
        flops = (work + recompute) / split
        m = layout.pipeline_microbatches if layout.pp > 1 else 1
        rows = layout.micro_batch / m  # rows per forward pass
        mb_tokens = rows * seq / layout.cp
        width = self.shape.intermediate_size if not self.moe_share else self.shape.moe_intermediate_size
        gemm = 2 * mb_tokens * self.shape.hidden_size * max(1, width // layout.tp)
        rate = cl.device.achievable(self.dtype, gemm)
        passes = {"none": 3, "selective": 3.5, "full": 4}[layout.activation_checkpoint]
        layers_here = self.shape.num_layers / layout.pp
        overhead = cl.device.overhead_us * 1e-6 * layers_here * passes * layout.grad_accum * m
        parts = {"compute": flops / rate + overhead}
        if layout.pp > 1:
            parts["pp_bubble"] = (
                parts["compute"]
                * (layout.pp - 1)
                / (layout.pp_virtual * m)
                * (1 / 3 if layout.pp_schedule in ("zero_bubble", "zbv", "dualpipev") else 1)
            )
            msg = (
                mb_tokens * self.shape.hidden_size * self.act / (layout.tp if layout.sequence_parallel else 1)
            )
            hops = 2 * (m * layout.pp_virtual + layout.pp - 1) * layout.grad_accum
            parts["pp_p2p"] = hops * _ring(cl, 2, msg, _span(layout, ("pp",), cl), 2.0)
        parts.update(self._layer_collectives(layout, mb_tokens, layout.grad_accum * m))
        parts.update(self._data_parallel(layout, states.params, states.grads, parts["compute"]))
        # AdamW reads weights, gradients and both moments and writes weights and moments
        parts["optimizer"] = 7 * states.grads / (cl.device.memory_gbps * 1e9)
        model_flops = c.train_flops(tokens, tokens, pairs, trained)
        peak = cl.device.peak.get(self.dtype, cl.device.peak["fp32"])
        return StepTime(parts, tokens, model_flops, layout.world, peak)

    def _layer_collectives(self, layout: Layout, mb_tokens: float, passes: int) -> dict[str, float]:
        """TP/SP, CP and EP collectives of every layer, forward and backward (full recomputation repeats the
        forward's), for `passes` forward passes of `mb_tokens` tokens per rank."""
        cl, s = self.cluster, self.shape
        layers = s.num_layers / layout.pp
        repeat = 3 if layout.activation_checkpoint == "full" else 2  # forward, backward (and the recompute)
        out = {}
        if layout.tp > 1:
            msg = mb_tokens * s.hidden_size * self.act
            cross = _span(layout, ("tp",), cl)
            # two reductions per layer per pass: reduce-scatter + all-gather under SP, all-reduce without
            per = 2 * _ring(cl, layout.tp, msg, cross, 2.0)
            out["tp_comm"] = per * layers * repeat * passes
        if layout.cp > 1:
            cross = _span(layout, ("cp",), cl)
            kv = s.num_kv_heads * s.head_dim / layout.tp
            if self.cfg.parallel.cp_mode == "allgather":  # K and V gathered, their gradients reduce-scattered
                per = _ring(cl, layout.cp, 2 * kv * mb_tokens * layout.cp * self.act, cross, 1.0)
            else:  # q, k, v to heads and the output back: four all-to-alls
                q = s.num_heads * s.head_dim / layout.tp
                per = _ring(cl, layout.cp, (2 * q + 2 * kv) * mb_tokens * self.act, cross, 1.0)
            out["cp_comm"] = per * layers * repeat * passes
        if layout.ep > 1:
            cross = (
                _span(layout, ("dp_shard", "cp"), cl)
                if layout.ep * layout.tp > cl.devices_per_node
                else False
            )
            k = s.experts_per_token
            moe_layers = len(s.moe_layers) / layout.pp
            per = 2 * _ring(
                cl, layout.ep, mb_tokens * k * s.hidden_size * self.act, cross, 1.0
            )  # there, back
            out["ep_comm"] = per * moe_layers * repeat * passes
        return out

    def _data_parallel(self, layout: Layout, param_bytes: float, state_bytes: float, compute: float) -> dict:
        """Gradient reduction (and FSDP2's parameter gathers), exposed beyond the compute they overlap."""
        cl = self.cluster
        if layout.dp * layout.cp == 1:
            return {}
        reduce = 4 if self.cfg.parallel.reduce_dtype == "fp32" else 2
        param_elems = param_bytes / DTYPE_BYTES[self.cfg.model.dtype]
        compute_bytes = 2 if self.cfg.train.precision != "fp32" else DTYPE_BYTES[self.cfg.model.dtype]
        grads = state_bytes  # the fullest rank's trained elements' gradient bytes
        if layout.zero_stage < 2:
            n = layout.dp_replicate * layout.cp
            cross = _span(layout, ("dp_replicate",), cl)
            comm = _ring(cl, n, grads, cross, 2.0)
            if layout.zero_stage == 1:  # the updated shards broadcast back
                comm += _ring(cl, n, param_bytes, cross, 1.0)
            # DDP's buckets reduce while backward (two thirds of the compute) still runs
            return {"dp_comm": max(comm - cl.device.overlap * 2 / 3 * compute, 0.0)}
        n = layout.dp_shard * layout.cp
        cross = _span(layout, ("dp_shard", "cp") if layout.cp > 1 else ("dp_shard",), cl)
        full = param_elems * n  # the stage's whole parameters: the shards held here are 1/n of them
        gathers = (2 if layout.zero_stage == 3 else 1) * layout.grad_accum
        comm = gathers * _ring(cl, n, full * compute_bytes, cross, 1.0)
        comm += _ring(cl, n, grads / DTYPE_BYTES[self.cfg.model.dtype] * n * reduce, cross, 1.0)
        if layout.dp_replicate > 1:
            comm += _ring(cl, layout.dp_replicate, grads, _span(layout, ("dp_replicate",), cl), 2.0)
        return {"dp_comm": max(comm - cl.device.overlap * compute, 0.0)}
