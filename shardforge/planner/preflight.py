"""The preflight of a run: every rule that needs only the config, the model's shape and the world size, and
the memory the layout needs against the device's. The launching process runs it before any rank starts, and
each rank again before its first collective. `parallel: auto` is resolved here, by the planner's search."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from shardforge.config import Config
from shardforge.errors import ConfigError
from shardforge.parallel.context_parallel import check_context_parallel
from shardforge.parallel.dims import ParallelDims
from shardforge.parallel.expert_parallel import check_expert_parallel
from shardforge.parallel.pipeline_plan import PipelinePlan, plan_pipeline
from shardforge.parallel.tensor_parallel import check_tensor_parallel
from shardforge.planner.hardware import cluster_for
from shardforge.planner.layout import resolve_grad_accum


def check_layout(cfg: Config, world: int, shape: Any) -> tuple[ParallelDims, int, PipelinePlan | None]:
    """Degrees against the world size, the batch split, the model's TP shape rules (`shape`: the model's
    config, from `model_source`) and the pipeline plan. Returns (dims, grad_accum, pipeline plan)."""
    if world < 1:
        raise ConfigError(f"--nproc {world}: a run needs at least one process")
    if world == 1 and cfg.parallel.offload != "none":
        raise ConfigError(
            f"parallel.offload={cfg.parallel.offload} offloads sharded states: it needs several processes "
            f"(--nproc N); a single process shards nothing"
        )
    dims = ParallelDims.from_config(cfg.parallel, world)
    grad_accum = resolve_grad_accum(cfg, dims.dp)
    check_tensor_parallel(shape, cfg.parallel)
    check_expert_parallel(shape, dims)
    check_context_parallel(shape, dims, cfg.parallel, cfg.method.stage, cfg.data.max_length)
    plan = plan_pipeline(shape, cfg.parallel, cfg.train.micro_batch, cfg.data.max_length)
    return dims, grad_accum, plan


def preflight(
    cfg: Config, world: int, shape: Any, measure: bool = True
) -> tuple[Config, ParallelDims, int, PipelinePlan | None, Any]:
    """The run's config with `parallel: auto` resolved, its checked layout, and the planner's estimate of it
    (a `search.Candidate`; None where the device has no preset). A layout that breaks a rule, or needs more
    memory than the device has, is a ConfigError naming the key and what would fit. `measure=False`: on the
    CPU, time with the preset's nominal matmul rate instead of the measured one (no probe)."""
    from shardforge.planner.layout import layout_of
    from shardforge.planner.search import Planner, check_memory, choose

    if world < 1:
        raise ConfigError(f"--nproc {world}: a run needs at least one process")
    cluster = cluster_for(cfg.hardware, world, required=cfg.parallel.auto)
    if cfg.parallel.auto:
        cfg, _ = choose(cfg, shape, cluster, measure)
    dims, grad_accum, plan = check_layout(cfg, world, shape)
    estimate = None
    if cluster is not None:
        layout = layout_of(cfg, world)
        if plan is not None:  # the split the launcher will use
            layout = replace(layout, pp_microbatches=plan.microbatches,
                             pp_layers=",".join(str(len(s)) for s in plan.layers))  # fmt: skip
        estimate = check_memory(cfg, layout, Planner(cfg, shape, cluster, measure))
    return cfg, dims, grad_accum, plan, estimate
