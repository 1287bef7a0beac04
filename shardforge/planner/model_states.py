"""One rank's model states, counted, not estimated: the planner lists the model's parameters (built on the
meta device, with the run's LoRA / freeze transform), and for a layout and a rank applies the same splits the
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

from shardforge.config.optimizers import OptimizerSection
from shardforge.parallel.dims import MESH_ORDER
from shardforge.parallel.pipeline_plan import PipelinePlan
from shardforge.planner.inventory import ParamSpec
from shardforge.planner.layout import Layout
from shardforge.planner.optimizer_states import badam_block_grads, optimizer_state_bytes


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
        mine = stages_of(layout, stages, pp_rank)
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
            grads = badam_block_grads(numel, held)
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


def stages_of(layout: Layout, stages: tuple[tuple[int, ...], ...], pp_rank: int) -> list[int]:
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
