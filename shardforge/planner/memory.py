"""Memory per device: model states counted tensor by tensor (model_states.py), activations from the
family's cost model, and the buffers and margin around them."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from shardforge.config.method_schema import LINEAR_TARGETS
from shardforge.config.schema import Config
from shardforge.dtypes import DTYPE_BYTES
from shardforge.models.spec import ActivationBytes, CostModel, spec_for
from shardforge.planner.inventory import FP32_BYTES, inventory
from shardforge.planner.layout import Layout, critic_shape, sequences_per_group, traits_of
from shardforge.planner.model_states import Coords, StateBytes, StateCounter, stages_of

GIB = 1 << 30
ROLLOUT_BLOCK = 16  # the RL rollout engine's KV block size (train/sampler.py)


def activation_itemsize(cfg: Config) -> int:
    """Bytes of an activation: the autocast / FSDP2 compute dtype under mixed precision, else the weights'."""
    return 2 if cfg.train.precision != "fp32" else DTYPE_BYTES[cfg.model.dtype]


def critic_memory(cfg: Config) -> MemoryModel | None:
    """PPO's separate critic model (method.ppo.critic a folder) as a memory model of its own: the folder's
    shape with a one-output head, trained whole, unquantized, on the same rows."""
    folder = traits_of(cfg).critic
    if folder is None:
        return None
    shape = critic_shape(folder)
    method = cfg.method.model_copy(
        update={"finetuning": "full", "ppo": cfg.method.ppo.model_copy(update={"critic": "head"})}
    )
    critic = cfg.model_copy(
        update={"method": method, "model": cfg.model.model_copy(update={"quantize": "none"})}
    )
    return MemoryModel(critic, shape, spec_for(shape.family).costs(shape))


@dataclass(frozen=True)
class Memory:
    """Per-device bytes of one layout, for its fullest rank."""

    states: StateBytes
    activations: float
    reference: float  # a frozen reference model's parameters (dpo/kto with a full copy)
    buffers: float  # FSDP2's gathered parameters, DDP's buckets, the head's logits chunk
    margin: float  # the allocator's fragmentation and the runtime's context
    rollout: float = 0.0  # RL: the engine's KV cache and gathered weights, before the step's forward

    @property
    def device_bytes(self) -> float:
        """The fuller of the two phases of a step: training (activations and buffers) or an RL rollout."""
        held = sum(self.states.on_device.values())
        return held + self.reference + self.margin + max(self.activations + self.buffers, self.rollout)

    def breakdown(self) -> dict[str, float]:
        """Device bytes by part, and what offload keeps on the host."""
        return {
            **self.states.on_device,
            "activations": self.activations,
            "reference": self.reference,
            "buffers": self.buffers,
            "rollout": self.rollout,
            "margin": self.margin,
            "host": self.states.on_host,
        }


def patches_per_row(cfg: Config, shape: object, from_data: float | None) -> float:
    """The tower's patches in a row: the data's mean where they have been read (`from_data`), else one
    image of data.image_max_pixels."""
    return shape.planned_patches(cfg.data.image_max_pixels) if from_data is None else from_data


def tower_bytes_per_row(cfg: Config, costs: CostModel, dtype_bytes: int, patches: float) -> float:
    """What a vision-language model's tower keeps for backward per row of `patches`, where it gets
    gradients (trained, or adapters in it). A frozen tower keeps nothing."""
    if cfg.method.vision.freeze_tower:
        return 0.0
    return patches * costs.patch_activations * dtype_bytes


class MemoryModel:
    """Memory of any layout for one model, method and batch shape."""

    def __init__(self, cfg: Config, shape: object, costs: CostModel, patches: float | None = None) -> None:
        """`patches`: the tower's patches per row the data hold (None: not read yet)."""
        self.cfg, self.shape, self.costs = cfg, shape, costs
        params = inventory(shape, cfg)
        self.counter = StateCounter(params, shape.tie_embeddings, cfg.train.optimizer, shape)
        self._states: dict[tuple, tuple[StateBytes, float]] = {}
        self._per_token_cache: dict[tuple, ActivationBytes] = {}
        self.act_dtype_bytes = activation_itemsize(cfg)
        self.group = sequences_per_group(cfg)  # rows per micro-batch group
        self.critic = critic_memory(cfg)
        row = patches_per_row(cfg, shape, patches)
        self.row_tower = tower_bytes_per_row(cfg, costs, self.act_dtype_bytes, row)

    def activations(
        self, layout: Layout, stages: tuple[tuple[int, ...], ...] | None, scored: float = 1.0
    ) -> float:
        """The fullest pipeline rank's activations: each in-flight micro-batch of each of its stages. Rows are
        full (packed) and a share `scored` of their positions reach the LM head: all of them for pretraining,
        an upper bound for SFT, whose targets are the responses only."""
        per = self._per_token(layout)
        seq = self.cfg.data.max_length
        if layout.pp == 1 or stages is None:
            rows = layout.micro_batch * self.group
            tokens = rows * seq // layout.cp
            masks = self._mask(layout, rows, self.shape.num_layers)
            tower = rows * self.row_tower
            return per.total(tokens, tokens * scored) + self._cp_extra(layout, rows) + masks + tower
        m = layout.pipeline_microbatches
        rows = layout.micro_batch * self.group / m
        tokens = rows * seq / layout.cp
        worst = 0.0
        for r in range(layout.pp):
            total = 0.0
            for s in stages_of(layout, stages, r):
                stage = per.stage(stages[s], s == len(stages) - 1)
                held = stage.total(tokens, tokens * scored) + self._mask(layout, rows, len(stages[s]))
                held += rows * self.row_tower if s == 0 else 0.0  # the tower runs on the first stage
                total += held * in_flight(layout, r, m)
            worst = max(worst, total)
        return worst

    def _mask(self, layout: Layout, rows: float, layers: int) -> float:
        """Packed rows shorter than 512 tokens attend through a block-diagonal mask (data/batching.py:
        use_per_document): the boolean mask [rows, s, s], and, without checkpointing, each layer's copy of it
        in the activation dtype that SDPA keeps for backward. Longer rows attend per document (no mask)."""
        seq = self.cfg.data.max_length
        if not self.cfg.data.packing or seq >= 512 or layout.cp > 1:
            return 0.0
        square = rows * seq * seq
        return square + (
            layers * square * self.act_dtype_bytes if layout.activation_checkpoint == "none" else 0
        )

    def _cp_extra(self, layout: Layout, rows: int) -> float:
        """All-gather context parallel keeps each layer's gathered keys and values (the whole sequence)."""
        if (
            layout.cp == 1
            or self.cfg.parallel.cp_mode != "allgather"
            or layout.activation_checkpoint == "full"
        ):
            return 0.0
        s = self.shape
        kv = s.kv_heads_per_rank(layout.tp) * s.head_dim
        tokens = rows * self.cfg.data.max_length
        return s.num_layers * 2 * kv * self.act_dtype_bytes * tokens * (1 - 1 / layout.cp)

    def states(self, layout: Layout, stages: tuple[tuple[int, ...], ...] | None) -> tuple[StateBytes, float]:
        """The fullest rank's model states and buffers (cached: they depend on neither checkpointing nor the
        micro-batch)."""
        key = (layout.tp, layout.pp, layout.pp_virtual, layout.pp_schedule, layout.cp, layout.ep,
               layout.zero_stage, layout.dp_shard, layout.dp_replicate, layout.offload, stages)  # fmt: skip
        if key not in self._states:
            states = max(
                (self.counter.count(layout, Coords(pp=r), stages) for r in range(layout.pp)),
                key=lambda s: s.total - s.on_host,
            )
            if self.critic is not None:  # PPO's separate critic: states of its own, sharded as the policy's
                states = states.plus(self.critic.states(layout, None)[0])
            self._states[key] = states, self._buffers(layout, stages)
        return self._states[key]

    def _per_token(self, layout: Layout) -> ActivationBytes:
        key = (layout.activation_checkpoint, layout.tp, layout.sequence_parallel)
        if key not in self._per_token_cache:
            per = self.costs.activation_bytes(
                layout.activation_checkpoint, self.act_dtype_bytes, layout.tp, layout.sequence_parallel
            )
            self._per_token_cache[key] = self._adapted(per, layout)
        return self._per_token_cache[key]

    def _adapted(self, per: ActivationBytes, layout: Layout) -> ActivationBytes:
        """LoRA freezes the norms and the head: a frozen RMSNorm keeps its input only (not the normalized
        copy its weight's gradient needs, nor the per-row rsqrt), the head makes no weight gradient; each
        adapter keeps its rank-r product (measured: benchmarks/planner_accuracy.py)."""
        if self.cfg.method.finetuning != "lora":
            return per
        b, h, lora = self.act_dtype_bytes, self.shape.hidden_size, self.cfg.method.lora
        split = layout.tp if layout.sequence_parallel and layout.tp > 1 else 1
        frozen_norm = (b * h + FP32_BYTES) / split
        # the linears' adapters (not the fused experts': W + delta is per layer, not per token)
        named = LINEAR_TARGETS if lora.targets == "all" else set(lora.targets) & set(LINEAR_TARGETS)
        targets = len(named)
        layer = targets * lora.rank * b - 2 * frozen_norm if layout.activation_checkpoint == "none" else 0.0
        tail = b * h + FP32_BYTES  # the final norm runs on the whole (gathered) stream
        layers = tuple(x + layer for x in per.layers)
        per_token = per.per_token + layer * len(layers) - tail
        return ActivationBytes(per_token, per.per_scored, 0.0, layers, per.tail - tail)

    def estimate(self, layout: Layout, stages: tuple[tuple[int, ...], ...] | None, on_gpu: bool) -> Memory:
        worst, buffers = self.states(layout, stages)
        reference = 0.0
        method = self.cfg.method
        held = traits_of(self.cfg).reference == "live"
        if held and not method.adapters and method.pref.ref == "auto":
            reference = worst.params  # a frozen copy of the starting weights, sharded as the policy is
            if self.critic is not None:  # (without PPO's critic model, attached after the copy is taken)
                reference -= self.critic.states(layout, None)[0].params
        activations = self.activations(layout, stages)
        if self.critic is not None:  # PPO's critic model runs on the same rows, its activations held too
            activations += self.critic.activations(layout, None)
        memory = Memory(worst, activations, reference, buffers, 0.0, self.rollout(layout, stages))
        if on_gpu:  # the CUDA context and NCCL's buffers, and the caching allocator's fragmentation (a tenth)
            memory = dataclasses.replace(memory, margin=GIB + 0.1 * memory.device_bytes)
        return memory

    def rollout(self, layout: Layout, stages: tuple[tuple[int, ...], ...] | None) -> float:
        """RL's rollout, which runs before each step's forward (so beside the model states, not the
        activations), on the fullest pipeline rank: the engine's paged KV cache for every completion of the
        rank's prompts in the step (at most data.max_length tokens each, in blocks of 16, the stage's layers
        and the rank's kv heads, in the compute dtype), the sampled rows' fp32 logits (and their copy), and
        under FSDP2 the stage's parameters gathered whole for the rollout (objectives/rollout.py:
        `kept_unsharded`)."""
        if not traits_of(self.cfg).rollouts:
            return 0.0
        s = self.shape
        sequences = layout.micro_batch * layout.grad_accum * self.cfg.method.rl.group_size
        slots = (
            sequences * math.ceil(self.cfg.data.max_length / ROLLOUT_BLOCK) * ROLLOUT_BLOCK + ROLLOUT_BLOCK
        )
        kv_heads = int(s.kv_heads_per_rank(layout.tp))
        sharded = layout.zero_stage >= 2 and layout.dp_shard * layout.cp > 1
        whole = dataclasses.replace(layout, zero_stage=0)
        worst = 0.0
        for r in range(layout.pp if stages is not None else 1):
            held = self.counter.stage_params(layout, stages, r)
            layers = len({p.layer for p in held if p.layer is not None})
            kv = 2 * layers * slots * kv_heads * s.head_dim * self.act_dtype_bytes
            gathered = sum(self.counter.local_numel(p, whole, Coords()) for p in held) if sharded else 0
            worst = max(worst, kv + gathered * self.act_dtype_bytes)
        return worst + 2 * sequences * s.vocab_size * FP32_BYTES

    def _buffers(self, layout: Layout, stages: tuple[tuple[int, ...], ...] | None) -> float:
        """Transient memory at the peak: gathered FSDP2 parameters (ZeRO-3: the layer in use and the next
        one prefetched; ZeRO-2: every layer of the stage, kept from forward to backward), DDP's gradient
        buckets (a copy of the gradients), the fused head's logits chunk (16 MiB) and its gradient."""
        held = self.counter.stage_params(layout, stages, 0)
        compute = self.act_dtype_bytes  # FSDP2 gathers in the compute dtype
        whole = Coords()
        unsharded = dataclasses.replace(layout, zero_stage=0)
        layer_elems = sum(self.counter.local_numel(p, unsharded, whole) for p in held if p.layer is not None)
        n_layers = max(1, len({p.layer for p in held if p.layer is not None}))
        head = 2 * (16 << 20)
        if layout.zero_stage == 3:
            return 2 * layer_elems / n_layers * compute + head
        if layout.zero_stage == 2:
            return layer_elems * compute + head
        if layout.dp > 1:
            grads = sum(self.counter.local_numel(p, unsharded, whole) * p.itemsize for p in held if p.trained)
            return grads + head
        return head


def in_flight(layout: Layout, pp_rank: int, m: int) -> float:
    """Micro-batches whose activations a pipeline rank's stage holds at its peak: GPipe all m; 1F1B pp - r
    (the warm-up depth); interleaved schedules their warm-up depth spread over the rank's v stages."""
    pp, v = layout.pp, layout.pp_virtual
    if layout.pp_schedule == "gpipe":
        return m
    if v == 1:
        return min(m, pp - pp_rank)
    warmup = (pp - pp_rank - 1) * 2 + (v - 1) * pp + 1
    return min(m * v, warmup) / v
