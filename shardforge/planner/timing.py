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

import math
from dataclasses import dataclass, field

from shardforge.config.schema import Config
from shardforge.dtypes import DTYPE_BYTES
from shardforge.models.spec import CostModel, causal_pairs
from shardforge.parallel.dims import MESH_ORDER
from shardforge.parallel.pipeline_plan import bubble_fraction
from shardforge.planner.hardware import Cluster
from shardforge.planner.layout import Layout
from shardforge.planner.memory import activation_itemsize, patches_per_row
from shardforge.planner.model_states import StateBytes

DDP_BUCKET = 25 << 20  # DDP's default bucket_cap_mb


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
    degrees = layout.degrees()
    inner = MESH_ORDER[MESH_ORDER.index(dims[-1]) + 1 :]
    spanned = math.prod(degrees[d] for d in inner) * math.prod(degrees[d] for d in dims)
    return spanned > cluster.devices_per_node


def _ring(cluster: Cluster, n: int, nbytes: float, cross: bool, factor: float, count: float = 1) -> float:
    """`count` ring collectives over n ranks moving `factor` x (n-1)/n x nbytes per device in all, each
    paying n-1 latencies."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    bandwidth, latency = cluster.link(n, cross)
    return factor * (n - 1) / n * nbytes / bandwidth + count * (n - 1) * latency


OPS_PER_LAYER = (
    28  # kernels one decoder layer launches per pass (norms, projections, RoPE, attention, SwiGLU)
)
OPS_PER_ADAPTER = 5  # a LoRA adapter's: dropout, A, B, scale, add
OPS_PER_MOE = 25  # an MoE layer's routing, sort, gather, grouped matmuls and scatter beyond a dense MLP's


class TimeModel:
    """Step time of any layout for one model, method and batch shape on one cluster."""

    def __init__(
        self,
        cfg: Config,
        shape: object,
        costs: CostModel,
        cluster: Cluster,
        trained: float,
        patches: float | None = None,
    ) -> None:
        """`trained`: the share of the parameters that train (their weight gradients are computed);
        `patches`: the tower's patches per row the data hold (None: not read yet)."""
        self.cfg, self.shape, self.costs, self.cluster = cfg, shape, costs, cluster
        self.row_patches = patches_per_row(cfg, shape, patches)
        self.dtype = cfg.train.precision
        self.act = activation_itemsize(cfg)
        self.trained = trained
        layer = costs.layer_flops
        moe = [i for i in range(len(layer)) if shape.is_moe(i)]
        self.moe_share = sum(layer[i] for i in moe) / max(sum(layer), 1.0)
        adapted = self._adapter_widths()
        self.ops = (
            OPS_PER_LAYER + OPS_PER_ADAPTER * len(adapted) + OPS_PER_MOE * len(moe) / max(len(layer), 1)
        )
        # an adapter's output is added to its base's: per token and layer
        self.adapter_bytes = sum(adapted) * self.act

    def tower_flops(self, batch: int) -> float:
        """A vision-language model's tower and projector over `batch` rows (`patches_per_row`), forward and
        backward as the method trains it."""
        vision, method = self.cfg.method.vision, self.cfg.method
        return batch * self.row_patches * self.costs.patch_flops * vision.tower_passes(method.finetuning)

    def _adapter_widths(self) -> list[int]:
        """Output features of each linear of a layer that carries a LoRA adapter."""
        if self.cfg.method.finetuning != "lora":
            return []
        s = self.shape
        h, q, kv = s.hidden_size, s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        widths = {"q_proj": q, "k_proj": kv, "v_proj": kv, "o_proj": h, "gate_proj": s.intermediate_size}
        widths |= {"up_proj": s.intermediate_size, "down_proj": h}
        targets = self.cfg.method.lora.targets  # the fused experts' adapters run per layer, not per token
        return [widths[t] for t in (widths if targets == "all" else targets) if t in widths]

    def estimate(self, layout: Layout, states: StateBytes, batch: int) -> StepTime:
        """`states`: the fullest rank's model states (the memory model's); `batch`: rows per step."""
        cfg, c, cl, d = self.cfg, self.costs, self.cluster, self.cluster.device
        seq = cfg.data.max_length
        tokens, pairs = batch * seq, batch * causal_pairs([seq])
        body = tokens * sum(c.layer_flops) + pairs * sum(c.pair_flops)
        recompute = {"none": 0.0, "full": body, "selective": pairs * sum(c.pair_flops)}
        s = self.shape
        if layout.sequence_parallel and layout.tp > 1:  # selective recomputes the row-parallel partial sums
            o_proj = s.num_heads * s.head_dim * s.hidden_size * s.num_layers
            down = s.intermediate_size * s.hidden_size * (s.num_layers - len(s.moe_layers))
            recompute["selective"] += 2 * tokens * (o_proj + down)
        # MoE layers run whole on every tp rank (their experts are split by ep, not tp)
        split = layout.world / (1 + self.moe_share * (layout.tp - 1))
        flops = (
            c.train_flops(tokens, tokens, pairs, self.trained) + recompute[layout.activation_checkpoint]
        ) / split
        # the tower: whole on every tensor-parallel rank, on the first pipeline stage (its critical path)
        flops += self.tower_flops(batch) / layout.dp
        if layout.tp > s.num_kv_heads:  # replicated kv heads: each tp rank projects all of them
            runs = 4 if layout.activation_checkpoint == "full" else 3  # forward (again), two in backward
            kv_total = runs * 2 * tokens * s.hidden_size * 2 * s.num_kv_heads * s.head_dim * s.num_layers
            flops += kv_total * (layout.tp - 1) / layout.world
        m = layout.pipeline_microbatches if layout.pp > 1 else 1
        mb_tokens = batch / layout.dp / layout.grad_accum / m * seq / layout.cp  # tokens a forward pass runs
        width = self.shape.moe_intermediate_size if self.moe_share else self.shape.intermediate_size
        gemm = 2 * mb_tokens * self.shape.hidden_size * max(1, width // layout.tp)
        passes = {"none": 3, "selective": 3.5, "full": 4}[layout.activation_checkpoint]
        forwards = layout.grad_accum * m  # forward passes of each layer a rank runs per step
        layers = self.shape.num_layers / layout.pp
        kept = self.costs.activation_bytes("none", self.act, layout.tp, layout.sequence_parallel).per_token
        kept += self.adapter_bytes * layers / layout.tp
        mode = layout.activation_checkpoint  # recomputation streams again what it did not keep
        again = (
            kept - self.costs.activation_bytes(mode, self.act, layout.tp, layout.sequence_parallel).per_token
        )
        parts = {
            "compute": flops / d.achievable(self.dtype, gemm),
            # element-wise work streams what the forward keeps: written, read back and its gradient written
            "elementwise": (3 * kept + again) / layout.pp * mb_tokens * forwards / (d.memory_gbps * 1e9),
            "overhead": d.op_us * 1e-6 * self.ops * layers * passes * forwards,
        }
        if layout.pp > 1:
            busy = parts["compute"] + parts["elementwise"] + parts["overhead"]
            parts["pp_bubble"] = busy * bubble_fraction(layout.pp_schedule, layout.pp, layout.pp_virtual, m)
            msg = (
                mb_tokens * self.shape.hidden_size * self.act / (layout.tp if layout.sequence_parallel else 1)
            )
            hops = 2 * (m * layout.pp_virtual + layout.pp - 1) * layout.grad_accum
            parts["pp_p2p"] = hops * _ring(cl, 2, msg, _span(layout, ("pp",), cl), 2.0)
        parts.update(self._layer_collectives(layout, mb_tokens, forwards))
        parts.update(self._data_parallel(layout, states.params, states.grads, parts["compute"]))
        if layout.offload == "none":  # AdamW reads weights, gradients, both moments and writes three back
            parts["optimizer"] = 7 * states.grads / (d.memory_gbps * 1e9)
        else:
            parts["offload"] = self._offload(layout, states)
        model_flops = c.train_flops(tokens, tokens, pairs, self.trained) + self.tower_flops(batch)
        return StepTime(parts, tokens, model_flops, layout.world, d.peak.get(self.dtype, d.peak["fp32"]))

    def _offload(self, layout: Layout, states: StateBytes) -> float:
        """Host traffic and the host's optimizer step: gradients down and updated weights up once a step
        (offload=optimizer); with offload=params the sharded weights also cross before every gather."""
        d = self.cluster.device
        host = d.host_gbps * 1e9
        elems = states.grads / DTYPE_BYTES[self.cfg.model.dtype]
        seconds = 2 * states.grads / host + 28 * elems / (d.host_adam_gbps * 1e9)  # fp32 AdamW on the host
        if layout.offload == "params":
            gathers = (2 if layout.zero_stage == 3 else 1) * layout.grad_accum
            seconds += gathers * states.params / host
        return seconds

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
            # two reductions per layer per pass: reduce-scatter + all-gather under SP, all-reduce without;
            # and the DTensor dispatch of the layer's sharded ops
            collectives = 2 * _ring(cl, layout.tp, msg, cross, 2.0, 2 if layout.sequence_parallel else 1)
            dispatch = cl.device.dtensor_us * 1e-6
            # sequence parallel gathers the attention and MLP inputs again in backward (no checkpointing keeps
            # them sharded, selective recomputes them): half a pass more
            again = 0.5 if layout.sequence_parallel and layout.activation_checkpoint != "full" else 0.0
            out["tp_comm"] = (collectives * (repeat + again) + dispatch * repeat) * layers * passes
        if layout.cp > 1:
            cross = _span(layout, ("cp",), cl)
            kv = s.kv_heads_per_rank(layout.tp) * s.head_dim
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

    def _data_parallel(self, layout: Layout, param_bytes: float, grads: float, compute: float) -> dict:
        """Gradient reduction (and FSDP2's parameter gathers), exposed beyond the compute they overlap.
        `param_bytes`, `grads`: the fullest rank's local parameter and gradient bytes. DDP reduces 25 MiB
        buckets; FSDP2 gathers and reduce-scatters each decoder layer (and the root) on its own."""
        cl = self.cluster
        if layout.dp * layout.cp == 1:
            return {}
        itemsize = DTYPE_BYTES[self.cfg.model.dtype]
        reduce = 4 if self.cfg.parallel.reduce_dtype == "fp32" else 2
        if layout.zero_stage < 2:
            n = layout.dp_replicate * layout.cp
            cross = _span(layout, ("dp_replicate",), cl)
            buckets = max(1, math.ceil(grads / DDP_BUCKET))
            comm = _ring(cl, n, grads, cross, 2.0, buckets)
            if layout.zero_stage == 1:  # the updated shards broadcast back
                comm += _ring(cl, n, param_bytes, cross, 1.0, buckets)
            # DDP's buckets reduce while backward (two thirds of the compute) still runs
            return {"dp_comm": max(comm - cl.device.overlap * 2 / 3 * compute, 0.0)}
        n = layout.dp_shard * layout.cp
        cross = _span(layout, ("dp_shard", "cp") if layout.cp > 1 else ("dp_shard",), cl)
        units = self.shape.num_layers / layout.pp + 1  # FSDP2 wraps each layer and the root
        gathers = (2 if layout.zero_stage == 3 else 1) * layout.grad_accum
        whole = param_bytes / itemsize * n  # the stage's elements: the shards held here are 1/n of them
        comm = _ring(cl, n, whole * self.act, cross, 1.0, units) * gathers
        comm += _ring(cl, n, grads / itemsize * n * reduce, cross, 1.0, units)
        if layout.dp_replicate > 1:
            comm += _ring(cl, layout.dp_replicate, grads, _span(layout, ("dp_replicate",), cl), 2.0, units)
        return {"dp_comm": max(comm - cl.device.overlap * compute, 0.0)}
