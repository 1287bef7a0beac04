"""A dry run of a layout at scale: every rank's share of the model built for real, in one process, without
weights, data or compute.

For each rank asked for, torch.distributed starts at that rank and world size on torch's fake process group
(backend `fake`: every collective returns at once and moves nothing), and the run's own code builds the
rank's model as `train/setup.py: build_run` does: `check_layout` (planner/layout.py: degrees, batch
split, shape rules, the pipeline plan), the DeviceMesh, the family's model on the meta device pruned to the
rank's pipeline stages, `apply_finetuning` (LoRA / freeze), then the real `parallelize` (TP/SP -> EP -> CP
-> activation checkpointing -> pipeline stages -> FSDP2/DDP). Each rank's mesh coordinates, stages and the
local shape of every parameter (a DTensor's `to_local()`) come back: a layout of hundreds of ranks is
checked on a laptop.

Covered: the layout checks; the mesh and every sub-group (also the expert (edp, ep) mesh and the pipeline's
tie groups); the TP plan with vocabulary padding and LoRA-aware styles; expert sharding; context parallel's
model hook; activation-checkpoint wrapping; the pipeline engine and its stage modules; FSDP2's sharding of
every unit (experts over edp). Skipped: weights (meta tensors: nothing is allocated, read or initialized; a
rank that allocates is an error), the tokenizer (a preset's vocabulary is its tokenizer's when that folder
loads, else `FALLBACK_VOCAB`; an HF folder needs only config.json), data, the optimizer (so ZeRO-1's
sharded states), checkpoints, autocast and compile (no forward runs), NF4 quantization (the base is shown
unquantized), a preference objective's reference copy, the pipeline schedules (built at the first step:
their shape handshake sends tensors) and DDP's wrapper: building it reads a shape check back to the host
(`.item()`) and broadcasts and buckets parameter memory, none of which meta tensors have; it changes no
parameter, so a stand-in takes its place while `parallelize` runs, and under DDP the recorded shapes are
the model's own.

Measured on a 2-core CPU shared with other work (every rank of a Llama-like model: 8 layers, hidden 256,
pp=2 x tp=8 x dp_shard the rest, ZeRO-3, sequence parallel, selective activation checkpointing;
tests/unit/test_dry_run.py): 64 ranks in 5.1 s, 256 in 15 s, 512 in 33 s, 1024 (the largest tried) in 79 s,
about 60-80 ms a rank, most of it FSDP2's per-parameter set-up and the mesh's sub-groups (which grow with
the world size). A Mixtral-like model (16 experts) on 128 ranks with ep=4: 4.7 s.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from shardforge.adapters.apply import apply_finetuning
from shardforge.config import Config
from shardforge.dtypes import TORCH_DTYPES
from shardforge.errors import ModelError
from shardforge.models.build import planning_shape
from shardforge.models.presets import preset_config
from shardforge.models.spec import spec_for
from shardforge.objectives import build_objective
from shardforge.parallel import data_parallel
from shardforge.parallel.dims import MESH_ORDER, ParallelDims
from shardforge.parallel.expert_parallel import expert_mesh
from shardforge.parallel.parallelize import parallelize
from shardforge.parallel.pipeline_plan import PipelinePlan, split_for_pipeline
from shardforge.planner.layout import check_layout

FALLBACK_VOCAB = 32000  # a preset's vocabulary when its tokenizer folder cannot be read
_CHECKPOINT_WRAPPER = "_checkpoint_wrapped_module."  # activation checkpointing's wrapper, not in checkpoints


@dataclass
class RankBuild:
    rank: int
    coords: dict[str, int]  # index along each mesh dimension that exists (and edp, ep under expert parallel)
    stages: tuple[int, ...]  # the pipeline stages this rank holds (() without pp)
    params: dict[str, tuple[tuple[int, ...], str]]  # parameter FQN -> (local shape, dtype name)
    param_bytes: int  # local bytes of the parameters, each tensor once (a tied weight is one)
    trained: frozenset[str] = frozenset()  # the FQNs that train (what gradients and optimizer states cover)


@dataclass
class DryRun:
    world: int
    mesh_shape: dict[str, int]
    ranks: list[RankBuild]
    seconds: float  # wall time of the whole dry run (model shape, layout checks and every rank's build)


def model_shape(config: Config) -> Any:
    """The model's config (our DecoderConfig) from config.json alone (no weights needed), or a preset's
    shape with its tokenizer's vocabulary (`FALLBACK_VOCAB` when the tokenizer folder cannot be read)."""
    try:
        return planning_shape(config.model)
    except ModelError:
        if config.model.preset is None:
            raise
        return preset_config(config.model.preset, FALLBACK_VOCAB)


def dry_run(config: Config, world: int, ranks: Iterable[int] | None = None) -> DryRun:
    """Build each requested rank of `world` (default: all) on the fake process group and record its
    parameters. A bad layout fails with the ConfigError a real run would raise, before anything is built."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    start = time.perf_counter()
    shape = model_shape(config)
    dims, _, plan = check_layout(config, world, shape)
    if dist.is_initialized():
        raise RuntimeError("dry_run starts its own (fake) process groups: call it outside a distributed job")
    wanted = list(range(world) if ranks is None else ranks)
    if any(not 0 <= r < world for r in wanted):
        raise ValueError(f"ranks {wanted} are not all in 0..{world - 1}")
    builds = []
    for rank in wanted:
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        try:
            builds.append(_build_rank(config, shape, dims, plan, rank))
        finally:
            dist.destroy_process_group()
    degrees = dims.degrees()
    mesh_shape = {name: degrees[name] for name in MESH_ORDER if degrees[name] > 1}
    return DryRun(world, mesh_shape, builds, time.perf_counter() - start)


def _build_rank(
    config: Config, shape: Any, dims: ParallelDims, plan: PipelinePlan | None, rank: int
) -> RankBuild:
    """One rank's model as `build_run` makes it, on the meta device, laid out by the real `parallelize`."""
    device = torch.device("cpu")
    mesh = dims.build_mesh(device.type)
    stages = tuple(plan.stages_of(dims.pp_rank(mesh))) if plan is not None else ()
    objective = build_objective(config.method)
    num_labels = objective.traits.score_head  # a reward model's score head
    model_cfg = shape.with_score_head(num_labels) if num_labels else shape
    with torch.device("meta"):
        model = spec_for(model_cfg.family).build(model_cfg)
    if plan is not None:
        split_for_pipeline(model, plan, list(stages))
    model.to(TORCH_DTYPES[config.model.dtype])
    apply_finetuning(model, config.method, config.train.seed, None)
    if num_labels and model.lm_head is not None:
        model.lm_head.requires_grad_(True)
    with mock.patch.object(data_parallel, "DistributedDataParallel", _NoDDP):  # no forward: no autocast
        engine = parallelize(model, dims, mesh, config, plan, objective, contextlib.nullcontext, device)
    coords = {name: mesh.get_local_rank(name) for name in mesh.mesh_dim_names} if mesh is not None else {}
    experts = expert_mesh(dims, mesh)  # the (edp, ep) view expert parallel made of the data ranks
    if experts is not None:
        coords |= {name: experts.get_local_rank(name) for name in ("edp", "ep")}
    params, trained, total = {}, set(), 0
    for name, param in engine.inner.named_parameters():  # each tensor once: a tied weight is counted once
        local = param.to_local() if isinstance(param, DTensor) else param
        if not local.is_meta:
            raise RuntimeError(
                f"the dry run allocated {name} on {local.device}: a layout step materialized it"
            )
        name = name.replace(_CHECKPOINT_WRAPPER, "")
        params[name] = (tuple(local.shape), str(local.dtype).removeprefix("torch."))
        if param.requires_grad:
            trained.add(name)
        # Not memory_report: it tells storages apart by address, and every meta tensor's address is 0.
        total += local.numel() * local.element_size()
    return RankBuild(rank, coords, stages, params, total, frozenset(trained))


class _NoDDP(nn.Module):
    """Stands in for DistributedDataParallel during a dry run: DDP changes no parameter, and building it
    checks shapes across ranks with a host read (`.item()`), then broadcasts and buckets parameter memory,
    none of which meta tensors have."""

    def __init__(self, module: nn.Module, **_: object) -> None:
        super().__init__()
        self.module = module

    def register_comm_hook(self, *_: object) -> None:
        """Gradient compression hooks change no parameter either."""
