"""Memory per device: model states counted tensor by tensor, activations from the family's cost model, and
the buffers and margin around them.

Model states are counted, not estimated: the planner lists the model's parameters (built on the meta
device, with the run's LoRA / freeze transform), and for a layout and a rank applies the same splits the
engine applies: the tensor-parallel plan's dimension (the vocabulary padded to a multiple of tp), expert
parallel's dimension 0 over ep, FSDP2's dimension-0 chunks over the sharding ranks (torch.chunk sizes, so
uneven on the last ranks), ZeroRedundancyOptimizer's greedy partition for ZeRO-1, and AdamW's two moments
plus a 4-byte step per trained tensor. So the estimate equals `parallel.memory_report` exactly on CPU
(tests/dist/test_planner_memory.py). The ZeRO paper's per-parameter accounting is tests/oracles.py's
`zero_model_states`.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from dataclasses import dataclass

import torch

from shardforge.adapters.apply import apply_finetuning
from shardforge.config.optimizers import OptimizerSection
from shardforge.config.schema import LINEAR_TARGETS, Config
from shardforge.dtypes import DTYPE_BYTES
from shardforge.models.quantize import nf4_storage_bytes, quantized_names
from shardforge.models.spec import ActivationBytes, CostModel, spec_for
from shardforge.parallel.dims import MESH_ORDER
from shardforge.parallel.pipeline_plan import PipelinePlan
from shardforge.parallel.tensor_parallel import matches_plan_key
from shardforge.planner.layout import Layout, critic_shape, sequences_per_group, traits_of
from shardforge.sharding.lora_styles import ADAPTER, COLWISE, ROWWISE
from shardforge.sharding.styles import KVColwiseParallel

GIB = 1 << 30
STEP_BYTES = 4  # AdamW's per-tensor step counter (fp32)
FP32_BYTES = 4
ROLLOUT_BLOCK = 16  # the RL rollout engine's KV block size (train/sampler.py)


def activation_itemsize(cfg: Config) -> int:
    """Bytes of an activation: the autocast / FSDP2 compute dtype under mixed precision, else the weights'."""
    return 2 if cfg.train.precision != "fp32" else DTYPE_BYTES[cfg.model.dtype]


@dataclass(frozen=True)
class ParamSpec:
    """One parameter tensor as the engine will split it."""

    name: str
    shape: tuple[int, ...]
    itemsize: float  # bytes per element (an NF4 weight: its codes and scales per element)
    trained: bool
    tp_dim: int | None  # the dimension tensor parallel splits; None: whole on every tp rank
    kv_heads: int | None  # a key / value projection's: whole on every rank when tp exceeds them
    expert: bool  # dimension 0 split over ep
    vocab: bool  # dimension 0 padded to a multiple of tp
    layer: int | None  # its decoder layer; None: embedding (first stage) or final norm / head (last)
    first: bool  # on the first pipeline stage (embedding) rather than the last (final norm, head)


def _tp_dims(model: torch.nn.Module, plan: dict) -> tuple[dict[str, int | None], set[str]]:
    """Parameter name -> the dimension its module's TP style splits (the styles the family plans use), and
    the key / value projections' parameters (split by kv heads)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    dims: dict[str, int | None] = {}
    kv: set[str] = set()
    for mod_name, module in model.named_modules():
        style = next((s for k, s in plan.items() if matches_plan_key(k, mod_name)), None)
        if not isinstance(style, ColwiseParallel | RowwiseParallel):
            continue
        if isinstance(style, KVColwiseParallel):
            kv |= {f"{mod_name}.{pname}" for pname, _ in module.named_parameters(recurse=False)}
        colwise = isinstance(style, ColwiseParallel)
        if hasattr(module, ADAPTER):
            table = {
                k: (p.dim if hasattr(p, "dim") else None)
                for k, p in (COLWISE if colwise else ROWWISE).items()
            }
        elif isinstance(module, torch.nn.Embedding):
            table = {"weight": 1 if colwise else 0}
        else:
            table = {"weight": 0 if colwise else 1, "bias": 0 if colwise else None}
        for pname, _ in module.named_parameters(recurse=False):
            dims[f"{mod_name}.{pname}"] = table.get(pname)
    return dims, kv


def inventory(shape: object, cfg: Config) -> list[ParamSpec]:
    """The run's parameters in `model.parameters()` order, with how the engine splits each."""
    spec = spec_for(shape.family)
    score_head = traits_of(cfg).score_head
    if score_head and not shape.num_labels:
        shape = shape.with_score_head(score_head)
    with torch.device("meta"):
        model = spec.build(shape)
        apply_finetuning(model, cfg.method, cfg.train.seed, None)
    plan = spec.tp_plan(shape, 1, True) if spec.tp_plan is not None else {}
    tp_dims, kv_params = _tp_dims(model, plan)
    itemsize = DTYPE_BYTES[cfg.model.dtype]
    nf4 = cfg.model.quantize == "nf4"
    out = []
    quantized = quantized_names(model) if cfg.model.quantize == "nf4" else set()
    for name, p in model.named_parameters():
        parts = model.canonical_name(name).split(".")  # the generic backend's names, as ours are spelled
        layer = int(parts[1]) if parts[0] == "layers" else None
        size = itemsize
        if nf4 and not p.requires_grad and name in quantized:
            size = nf4_storage_bytes(p.numel(), itemsize) / p.numel()
        vocab = parts[0] in ("embed_tokens", "lm_head") and not shape.num_labels
        split = tp_dims.get(name)
        # the embedding, and a vision-language model's tower, on the first pipeline stage
        first = parts[0] == "embed_tokens" or shape.part_of(model.canonical_name(name)) != "language"
        out.append(
            ParamSpec(
                name,
                tuple(p.shape),
                size,
                p.requires_grad,
                split,
                shape.num_kv_heads if name in kv_params else None,
                "experts" in parts,
                vocab,
                layer,
                first,
            )
        )
    if shape.tie_embeddings:  # a pipeline's last stage holds its own copy of the head
        embed = next(p for p in out if p.first)
        out.append(dataclasses.replace(embed, name="lm_head.weight", first=False))
    return out


@dataclass(frozen=True)
class Coords:
    """Where one rank sits: its pipeline rank, its index among the FSDP2 sharding ranks (dp_shard x cp) and,
    for experts, among the expert-sharding ranks (edp), and its data-parallel index (ZeRO-1)."""

    pp: int = 0
    shard: int = 0
    expert_shard: int = 0
    dp: int = 0


def coords_of(layout: Layout, rank: int) -> Coords:
    """A global rank's coordinates on the mesh (order pp, dp_replicate, dp_shard, cp, tp, innermost last)."""
    index = {}
    for name in reversed(MESH_ORDER):  # the tp index does not change what a rank holds
        rank, index[name] = divmod(rank, layout.degrees()[name])
    pp_i, rep_i, shard_i, cp_i = (index[n] for n in ("pp", "dp_replicate", "dp_shard", "cp"))
    flat = shard_i * layout.cp + cp_i  # FSDP2 over (dp_shard, cp) flattened
    return Coords(pp_i, flat, flat // layout.ep, rep_i * layout.dp_shard + shard_i)


@dataclass(frozen=True)
class StateBytes:
    """One rank's model states (what memory_report measures), and where they live."""

    params: int
    frozen: int
    grads: int
    optimizer: int
    offload: str = "none"  # parallel.offload: optimizer states (and masters), or everything, on the host

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def on_device(self) -> dict[str, int]:
        return {
            "params": self.params * (self.offload != "params"),
            "grads": self.grads * (self.offload != "params"),
            "optimizer": self.optimizer * (self.offload == "none"),
        }

    @property
    def on_host(self) -> int:
        return self.total - sum(self.on_device.values())

    def plus(self, other: StateBytes) -> StateBytes:
        """The states of two models held together, laid out alike (the policy and PPO's critic model)."""
        return dataclasses.replace(
            self,
            params=self.params + other.params,
            frozen=self.frozen + other.frozen,
            grads=self.grads + other.grads,
            optimizer=self.optimizer + other.optimizer,
        )


class StateCounter:
    """Counts the model states of any rank of any layout over one model's parameter list."""

    def __init__(
        self,
        params: list[ParamSpec],
        tied: bool,
        optimizer: OptimizerSection | None = None,
        model_shape: object = None,
    ) -> None:
        self.params = params
        self.tied = tied  # the head is the embedding (one tensor) unless a pipeline splits them
        self.optimizer = optimizer or OptimizerSection()  # train.optimizer: what its states hold
        self.model_shape = model_shape  # Adam-mini's heads
        # without a pipeline, a tied head is the embedding itself
        self.whole_model = [p for p in params if not (tied and p.name == "lm_head.weight")]
        self._held: dict[tuple, list[ParamSpec]] = {}  # a search asks for the same few pipeline splits

    def stage_params(
        self, layout: Layout, stages: tuple[tuple[int, ...], ...] | None, pp_rank: int
    ) -> list[ParamSpec]:
        """The parameters a pipeline rank holds (all of them without a pipeline)."""
        if layout.pp == 1 or stages is None:
            return self.whole_model
        key = (layout.pp, layout.pp_virtual, layout.pp_schedule, stages, pp_rank)
        if key not in self._held:
            self._held[key] = self._stage_params(layout, stages, pp_rank)
        return self._held[key]

    def _stage_params(
        self, layout: Layout, stages: tuple[tuple[int, ...], ...], pp_rank: int
    ) -> list[ParamSpec]:
        mine = _stages_of(layout, stages, pp_rank)
        layers = {i for s in mine for i in stages[s]}
        first, last = 0 in mine, len(stages) - 1 in mine
        keep = []
        for p in self.params:
            if p.layer is not None:
                if p.layer in layers:
                    keep.append(p)
            elif (p.first and first) or (not p.first and last):
                keep.append(p)
        return keep

    @staticmethod
    def local_numel(p: ParamSpec, layout: Layout, coords: Coords) -> int:
        shape = list(p.shape)
        if p.vocab and layout.tp > 1:
            shape[0] = math.ceil(shape[0] / layout.tp) * layout.tp
        if p.tp_dim is not None and layout.tp > 1 and not (p.kv_heads and layout.tp > p.kv_heads):
            shape[p.tp_dim] //= layout.tp
        if p.expert and layout.ep > 1:
            shape[0] //= layout.ep
        if layout.zero_stage >= 2:
            n = layout.dp_shard * layout.cp // (layout.ep if p.expert else 1)
            index = coords.expert_shard if p.expert else coords.shard
            chunk = math.ceil(shape[0] / n)
            shape[0] = max(0, min(chunk, shape[0] - index * chunk))
        return math.prod(shape)

    def count(self, layout: Layout, coords: Coords, stages: tuple[tuple[int, ...], ...] | None) -> StateBytes:
        held = self.stage_params(layout, stages, coords.pp)
        split: dict[tuple, int] = {}  # every layer's tensors repeat the same few shapes
        numel = []
        for p in held:
            kind = (p.shape, p.tp_dim, p.kv_heads, p.expert, p.vocab)
            if kind not in split:
                split[kind] = self.local_numel(p, layout, coords)
            numel.append(split[kind])
        sizes = [n * p.itemsize for n, p in zip(numel, held, strict=True)]
        params = int(sum(sizes))
        frozen = int(sum(s for s, p in zip(sizes, held, strict=True) if not p.trained))
        grads = params - frozen
        if self.optimizer.name == "badam" and self.optimizer.badam.mode == "layer":
            grads = _badam_block_grads(numel, held)
        if not self.tied and layout.tp > 1 and layout.zero_stage < 2:
            # An untied embedding's gradient comes back from DTensor's embedding backward replicated over tp:
            # the whole padded vocabulary on every rank, tp times its shard (measured; a tied one is summed
            # with the head's sharded gradient and stays sharded).
            for n, p in zip(numel, held, strict=True):
                if p.first and p.trained:
                    grads += int(n * p.itemsize) * (layout.tp - 1)
        trained = [(n, p) for n, p in zip(numel, held, strict=True) if p.trained]
        if layout.zero_stage == 1 and layout.dp > 1:
            trained = _zero1_share(trained, layout.dp, coords.dp)
        optimizer = optimizer_state_bytes(self.optimizer, trained, self.model_shape, layout.offload)
        return StateBytes(params, frozen, grads, optimizer, layout.offload)


BNB_MIN_8BIT = 4096  # bitsandbytes keeps 32-bit states for smaller tensors (its min_8bit_size)
BNB_BLOCK = 256  # elements per absmax scale of its blockwise 8-bit states
BNB_QMAPS = 2 * 256 * FP32_BYTES  # the two 256-entry code books, one tensor each shared by every parameter


def optimizer_state_bytes(
    optimizer: OptimizerSection, trained: list[tuple[int, ParamSpec]], model_shape: object, offload: str
) -> int:
    """The bytes of a rank's optimizer states for its `trained` (local numel, parameter) pairs: what each
    choice of train.optimizer.name keeps after its first step (tests/unit/test_optimizers.py measures them).
    AdamW: two moments and a 4-byte step per tensor (offload: fp32 masters and moments on the host). The
    whole-tensor choices only run on unsharded layouts, so local numel is the whole tensor."""
    name = optimizer.name
    if name == "adamw":
        if offload == "optimizer":  # fp32 masters and both moments on the host
            return sum(12 * n + STEP_BYTES for n, _ in trained)
        return int(sum(2 * n * p.itemsize + STEP_BYTES for n, p in trained))
    if name == "adamw_8bit":
        return _bnb_8bit(trained)
    if name == "muon":  # one momentum for the hidden matrices, AdamW's two moments and step for the rest
        hidden = [(n, p) for n, p in trained if _muon_matrix(p)]
        rest = [(n, p) for n, p in trained if not _muon_matrix(p)]
        return int(
            sum(n * p.itemsize for n, p in hidden) + sum(2 * n * p.itemsize + STEP_BYTES for n, p in rest)
        )
    if name in ("galore", "apollo"):
        return _projected(getattr(optimizer, name), name, trained)
    if name == "badam":
        return _badam(optimizer, trained)
    return _adam_mini(trained, model_shape)


def _bnb_8bit(trained: list[tuple[int, ParamSpec]]) -> int:
    """Two uint8 moments plus an fp32 scale per 256 elements each; fp32 moments for small tensors and the
    embedding (transformers' override); the step is a Python int."""
    total, eight = 0, False
    for n, p in trained:
        if n >= BNB_MIN_8BIT and not (p.first and p.vocab):
            total += 2 * n + 2 * math.ceil(n / BNB_BLOCK) * FP32_BYTES
            eight = True
        else:
            total += 2 * n * FP32_BYTES
    return total + BNB_QMAPS * eight


def _muon_matrix(p: ParamSpec) -> bool:
    return len(p.shape) == 2 and "embed" not in p.name and "lm_head" not in p.name


def _projected(section: object, name: str, trained: list[tuple[int, ParamSpec]]) -> int:
    """GaLore / APOLLO: the projected weights keep both moments of a rank x side projection and the projector
    (rank x the other side; `full`: both); APOLLO adds a scalar scale; the rest keep AdamW's moments."""
    total = 0
    for n, p in trained:
        if not _projected_target(p, section.targets):
            total += int(2 * n * p.itemsize)
            continue
        rows, cols = p.shape
        k = min(section.rank, rows, cols)
        kind = section.proj_type
        if kind in ("std", "reverse_std"):
            right = (rows >= cols) == (kind == "std")
            kind = "right" if right else "left"
        states, projector = {
            "right": (rows * k, k * cols),
            "left": (k * cols, rows * k),
            "full": (k * k, rows * k + k * cols),
        }[kind]
        total += int((2 * states + projector) * p.itemsize) + int(p.itemsize) * (name == "apollo")
    return total


def _projected_target(p: ParamSpec, targets: str | list[str]) -> bool:
    """LF's selection over the parameter list: the 2-D weights of the decoder's linears ("all": any but the
    embedding and the head), or of the modules whose name holds a target."""
    if len(p.shape) != 2 or not p.name.endswith(".weight"):
        return False
    if targets == "all":
        return not p.vocab
    module = p.name.rsplit(".", 1)[0]
    return any(t in module for t in targets)


def _badam(optimizer: OptimizerSection, trained: list[tuple[int, ParamSpec]]) -> int:
    """layer: the active block's fp32 working copies, both fp32 moments and a step each, for the largest
    decoder block (the embedding and head never train); ratio: both moments of each tensor's trained share."""
    section = optimizer.badam
    if section.mode == "ratio":
        return int(sum(2 * int(n * section.update_ratio) * p.itemsize for n, p in trained if not p.vocab))
    blocks: dict[int, int] = {}
    for n, p in trained:
        if p.layer is not None:
            blocks[p.layer] = blocks.get(p.layer, 0) + 3 * n * FP32_BYTES + STEP_BYTES
    return max(blocks.values(), default=0)


def _badam_block_grads(numel: list[int], held: list[ParamSpec]) -> int:
    """BAdam's layer mode: only the active decoder block has requires_grad (the largest block's gradients)."""
    blocks: dict[int, int] = {}
    for n, p in zip(numel, held, strict=True):
        if p.trained and p.layer is not None:
            blocks[p.layer] = blocks.get(p.layer, 0) + n * p.itemsize
    return max(blocks.values(), default=0)


def _adam_mini(trained: list[tuple[int, ParamSpec]], shape: object) -> int:
    """Adam-mini: the first moment whole, one second moment per block: per head of the query and key
    projections (hidden_size^2 / heads elements each, as LF passes it), per row of the embedding, head,
    value, output and MLP matrices, one per other tensor (norms); biases keep Adam's."""
    head_numel = shape.hidden_size * shape.hidden_size // shape.num_heads
    total = 0
    for n, p in trained:
        name = p.name.lower()
        if "bias" in name:
            second = n
        elif any(k in name for k in ("k_proj", "q_proj", "wq", "wk", "query", "key")):
            second = n // head_numel
        elif any(
            k in name
            for k in (
                "embed",
                "embd",
                "wte",
                "lm_head",
                "output",
                "final_layer",
                "v_proj",
                "wv",
                "value",
                "feed_forward",
                "linear",
                "mlp",
                "o_proj",
                "wo",
                "attn.proj",
            )
        ):
            second = p.shape[0]  # fmt: skip
        else:
            second = 1
        total += int((n + second) * p.itemsize)
    return total


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


def _stages_of(layout: Layout, stages: tuple[tuple[int, ...], ...], pp_rank: int) -> list[int]:
    """The stages a pipeline rank runs, as the pipeline plan places them (round robin, or V-shaped)."""
    plan = PipelinePlan(
        layout.pp_schedule, layout.pp, layout.pp_virtual, layout.pipeline_microbatches, stages
    )
    return plan.stages_of(pp_rank)


def _zero1_share(trained: list[tuple[int, ParamSpec]], dp: int, rank: int) -> list[tuple[int, ParamSpec]]:
    """The tensors ZeroRedundancyOptimizer gives `rank`: per parameter group (matrices, then vectors), the
    largest first, each to the rank with the fewest elements so far (ties: the lowest rank)."""
    sizes = [(0, r) for r in range(dp)]  # a heap of (elements, rank)
    mine = []
    for group in ([t for t in trained if len(t[1].shape) >= 2], [t for t in trained if len(t[1].shape) < 2]):
        for n, p in sorted(group, key=lambda t: t[0], reverse=True):
            size, r = heapq.heappop(sizes)
            if r == rank:
                mine.append((n, p))
            heapq.heappush(sizes, (size + n, r))
    return mine


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
            for s in _stages_of(layout, stages, r):
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
