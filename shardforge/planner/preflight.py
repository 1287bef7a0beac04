"""The preflight of a run: every rule that needs only the config, the model's shape and the world size, and
the memory the layout needs against the device's. The launching process runs it before any rank starts, and
each rank again before its first collective. `parallel: auto` is resolved here, by the planner's search."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from shardforge.config import Config
from shardforge.errors import ConfigError
from shardforge.parallel.dims import ParallelDims
from shardforge.parallel.pipeline_plan import PipelinePlan
from shardforge.planner.hardware import cluster_for
from shardforge.planner.layout import check_layout, layout_of
from shardforge.planner.search import Planner, check_memory, choose


def preflight(
    cfg: Config, world: int, shape: Any, measure: bool = True
) -> tuple[Config, ParallelDims, int, PipelinePlan | None, Any]:
    """The run's config with `parallel: auto` resolved, its checked layout, and the planner's estimate of it
    (a `search.Candidate`; None where the device has no preset). A layout that breaks a rule, or needs more
    memory than the device has, is a ConfigError naming the key and what would fit. `measure=False`: on the
    CPU, time with the preset's nominal matmul rate instead of the measured one (no probe)."""
    if world < 1:
        raise ConfigError(f"--nproc {world}: a run needs at least one process")
    cluster = cluster_for(cfg.hardware, world, required=cfg.parallel.auto)
    estimate = None
    if cfg.parallel.auto:  # the chosen layout was estimated (and fits) in the search
        cfg, searched = choose(cfg, shape, cluster, measure)
        estimate = searched.best
    dims, grad_accum, plan = check_layout(cfg, world, shape)
    if cluster is not None and estimate is None:
        layout = layout_of(cfg, world)
        if plan is not None:  # the split the launcher will use
            layout = replace(layout, pp_microbatches=plan.microbatches,
                             pp_layers=",".join(str(len(s)) for s in plan.layers))  # fmt: skip
        estimate = check_memory(layout, Planner(cfg, shape, cluster, measure))
    return cfg, dims, grad_accum, plan, estimate
