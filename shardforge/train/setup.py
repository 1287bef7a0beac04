"""The composition root of a training run: from a Config to the parts the loop drives, each built by its own
component from its config section (model source, layout, workspace, objective, data, policy, engine,
optimizer, schedule, batch source, checkpoints, peak). It reads like a table of contents: nothing loops,
and it imports only builders and the types it names (tests/unit/test_architecture.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from torch.distributed.device_mesh import DeviceMesh

from shardforge.checkpoint.build import build_checkpoints
from shardforge.checkpoint.manager import CheckpointManager
from shardforge.config import Config
from shardforge.data.batch_source import BatchSource
from shardforge.data.build import BatchSplit, build_data, packing_for
from shardforge.data.loader import RowSet
from shardforge.log import get_logger
from shardforge.models.build import model_source
from shardforge.models.spec import CostModel, costs_for
from shardforge.objectives import Objective, SourceContext, build_objective, reading_of
from shardforge.parallel.dims import ParallelDims
from shardforge.parallel.distributed import (
    local_rank_from_env,
    pick_device,
    rank_from_env,
    world_size_from_env,
)
from shardforge.parallel.engine import Engine
from shardforge.parallel.parallelize import parallelize
from shardforge.parallel.pipeline_plan import PipelinePlan
from shardforge.planner.preflight import resolve_layout, resolve_with_data
from shardforge.train.moe import MoEBalancer
from shardforge.train.optim import build_optimizer, build_scheduler, count_steps
from shardforge.train.policy import build_policy
from shardforge.train.precision import Precision
from shardforge.train.reference import bind_objective
from shardforge.train.runtime import build_peak, build_workspace, start_processes
from shardforge.train.sampler import TrainingSampler

log = get_logger(__name__)


@dataclass(kw_only=True)
class Run:
    """Everything the loop needs, built once."""

    config: Config
    console: Console
    run_dir: Path
    device: torch.device
    dims: ParallelDims
    mesh: DeviceMesh | None
    plan: PipelinePlan | None
    is_main: bool
    owns_process_group: bool
    tokenizer: Any
    objective: Objective
    precision: Precision
    train_rows: RowSet | None  # None: the training data is streamed, or sampled (RL)
    eval_rows: RowSet | None
    model_config: Any
    engine: Engine
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    checkpoints: CheckpointManager
    source: BatchSource
    grad_accum: int
    global_batch: int  # groups per optimizer step (rows, for objectives whose groups are single rows)
    total_steps: int
    seq_multiple: int  # row widths are padded to a multiple of this (sequence parallel, pipeline schedules)
    peak: tuple[float, str]  # FLOP/s per device and where that figure comes from
    costs: CostModel  # the family's cost model of this model (parameters, FLOPs)
    trained: float = 1.0  # the share of the parameters that train (LoRA adapters, unfrozen layers)
    moe: MoEBalancer | None = None  # an MoE model's balancing and routing statistics
    estimate: Any = None  # the planner's estimate of this layout (planner.search.Candidate), where it has one


def build_run(config: Config, console: Console, objective: Objective | None = None) -> Run:
    """Every check that needs no other rank runs first, so a bad value fails alike everywhere."""
    shape, tokenizer = model_source(config.model)
    cfg = packing_for(config, shape)
    device = pick_device(cfg.hardware.device, local_rank_from_env())
    owns = start_processes(cfg, device)
    resolved = resolve_layout(cfg, world_size_from_env(), shape, measure=rank_from_env() == 0)
    cfg, dims, plan = resolved.config, resolved.dims, resolved.plan
    ws = build_workspace(cfg, dims, device, console, owns)
    if config.parallel.auto:
        layout = resolved.estimate.layout
        log.info(f"parallel: auto chose {layout.describe()} ({' '.join(layout.overrides())})")
    objective = objective or build_objective(cfg.method)
    how, precision = reading_of(objective, cfg.data.default_system), Precision(cfg.train.precision, device)
    train_rows, eval_rows = build_data(cfg, tokenizer, objective, how)
    resolved = resolve_with_data(resolved, world_size_from_env(), shape, train_rows, rank_from_env() == 0)
    policy = build_policy(cfg, tokenizer, objective.traits.score_head, dims=dims, mesh=ws.mesh, plan=plan,
                          device=device)  # fmt: skip
    model = policy.model
    bind_objective(cfg, objective, model, tokenizer=tokenizer, dims=dims, mesh=ws.mesh, device=device,
                   precision=precision, rows={"train": train_rows, "eval": eval_rows},
                   run_dir=ws.run_dir)  # fmt: skip
    engine = parallelize(model, dims, ws.mesh, cfg, plan, objective, precision.autocast, device)
    moe = MoEBalancer.build(model, cfg.method.moe, model.config, dims)
    split = BatchSplit(cfg.train.micro_batch, resolved.grad_accum, dims.dp, dims.dp_rank(ws.mesh))
    multiple = dims.row_multiple(cfg.parallel.sequence_parallel, cfg.data.max_length, plan is not None)
    sampler = TrainingSampler(cfg, engine, tokenizer, precision.autocast)
    source = objective.batch_source(SourceContext(
        config=cfg, tokenizer=tokenizer, reading=how, rows=train_rows, split=split, multiple=multiple,
        engine=engine, dims=dims, mesh=ws.mesh, autocast=precision.autocast, sampler=sampler))  # fmt: skip
    total = count_steps(cfg.train, source.groups, split.global_batch)
    optimizer = build_optimizer(engine.model, cfg.train, cfg.parallel, dims.dp_mesh(ws.mesh), cfg.method,
                                model.config, cfg.checkpoint)  # fmt: skip
    scheduler = build_scheduler(optimizer, total, cfg.train)
    checkpoints = build_checkpoints(cfg, run_dir=ws.run_dir, model=model, trained=engine.model,
                                    optimizer=optimizer, scheduler=scheduler, precision=precision,
                                    dims=dims, data_id=source.identity(),
                                    global_batch=split.global_batch)  # fmt: skip
    return Run(
        config=cfg, console=ws.console, run_dir=ws.run_dir, device=device, dims=dims, mesh=ws.mesh, plan=plan,
        is_main=ws.is_main, owns_process_group=owns, tokenizer=tokenizer, objective=objective,
        precision=precision, train_rows=train_rows, eval_rows=eval_rows, model_config=model.config,
        engine=engine, optimizer=optimizer, scheduler=scheduler, checkpoints=checkpoints, source=source,
        grad_accum=resolved.grad_accum, global_batch=split.global_batch, total_steps=total,
        seq_multiple=multiple, peak=build_peak(cfg, model.config, dims, device, precision.dtype, ws.is_main),
        costs=costs_for(model.config), trained=policy.trained, moe=moe, estimate=resolved.estimate,
    )  # fmt: skip
