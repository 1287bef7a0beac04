"""The preflight of a run: every rule that needs only the config, the model's shape and the world size, and
the memory the layout needs against the device's. The launching process runs it before any rank starts, and
each rank again before its first collective. `parallel: auto` is resolved here, by the planner's search, and
only here (`resolve_layout`)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch.distributed as dist

from shardforge.config import Config
from shardforge.errors import ConfigError, ShardforgeError
from shardforge.log import get_logger
from shardforge.parallel.dims import ParallelDims
from shardforge.parallel.pipeline_plan import PipelinePlan
from shardforge.planner.hardware import cluster_for
from shardforge.planner.layout import check_layout, layout_of
from shardforge.planner.search import Planner, check_memory, choose

log = get_logger(__name__)


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
    try:
        dims, grad_accum, plan = check_layout(cfg, world, shape)
    except ConfigError as exc:  # the rules, and the memory the layout would need besides
        raise ConfigError(f"{exc}{_memory_figure(cfg, world, shape, cluster, measure)}") from None
    if cluster is not None and estimate is None:
        layout = layout_of(cfg, world)
        if plan is not None:  # the split the launcher will use
            layout = replace(layout, pp_microbatches=plan.microbatches,
                             pp_layers=",".join(str(len(s)) for s in plan.layers))  # fmt: skip
        estimate = check_memory(layout, Planner(cfg, shape, cluster, measure))
    return cfg, dims, grad_accum, plan, estimate


def resolve_with_data(resolved: Resolved, world: int, shape: Any, rows: Any, measure: bool) -> Resolved:
    """A vision-language run's layout checked again once its data are read (`rows`; None where the
    objective samples its own): a family that packs no rows with images refuses packed data that hold
    some, before the first step, and the estimate is made again with the tower patches per row the data
    hold (their mean; the layout was checked with one image of data.image_max_pixels a row)."""
    cfg = resolved.config
    if not shape.takes_images or rows is None:
        return resolved
    if cfg.data.packing and not shape.packs_images and rows.examples.has_images:
        raise ConfigError(
            f"data.packing: true with images: {shape.family} does not pack rows that hold images "
            f"(transformers' image masks over packed documents are not verified on the generic backend); "
            f"set data.packing: false"
        )
    patches = float(rows.examples.patches.sum()) / max(1, len(rows.rows))
    log.info(
        f"planner: the data hold {patches:.0f} tower patches per row (planned before they were read: "
        f"{shape.planned_patches(cfg.data.image_max_pixels)}, one image of data.image_max_pixels); "
        f"estimated again with theirs"
    )
    return with_data(resolved, world, shape, patches, measure)


def with_data(resolved: Resolved, world: int, shape: Any, patches: float, measure: bool) -> Resolved:
    """The estimate again with the data's tower patches per row: its memory must still fit, else the run
    stops here, before training, saying what would."""
    if resolved.estimate is None:
        return resolved
    cfg = resolved.config
    planner = Planner(cfg, shape, cluster_for(cfg.hardware, world, required=False), measure, patches)
    return replace(resolved, estimate=check_memory(resolved.estimate.layout, planner))


def _memory_figure(cfg: Config, world: int, shape: Any, cluster: Any, measure: bool) -> str:
    """What a layout that breaks a rule would need per device, where it can be estimated (its degrees and
    batch split hold; a pipeline split by cost)."""
    if cluster is None:
        return ""
    try:
        planner = Planner(cfg, shape, cluster, measure)
        memory = planner.memory.estimate(layout_of(cfg, world), None, cluster.device.name != "cpu")
    except ShardforgeError:
        return ""
    return (
        f" (and its memory: it would need {memory.device_bytes / 2**30:.1f} GiB per device of "
        f"{cluster.device.memory_gib:.1f})"
    )


@dataclass(frozen=True)
class Resolved:
    """A run's checked layout: the config with `parallel: auto` resolved, its degrees, the gradient
    accumulation, the pipeline plan and the planner's estimate (None where the device has no preset)."""

    config: Config
    dims: ParallelDims
    grad_accum: int
    plan: PipelinePlan | None
    estimate: Any


def resolve_layout(cfg: Config, world: int, shape: Any, measure: bool = True) -> Resolved:
    """The preflight, once per process. With `parallel: auto` on ranks already in a process group (started
    by torchrun or srun; the shardforge launcher passes its own choice to the ranks), rank 0 searches and
    every other rank checks the layout it chose (searches on different machines, or with differently
    measured peaks, could choose differently); rank 0's error, when nothing fits, is every rank's."""
    if not (cfg.parallel.auto and dist.is_initialized() and dist.get_world_size() > 1):
        return Resolved(*preflight(cfg, world, shape, measure))
    message: list[Any] = [None]
    resolved = None
    if dist.get_rank() == 0:
        try:
            resolved = Resolved(*preflight(cfg, world, shape, measure))
            message[0] = resolved.config.model_dump()
        except ConfigError as exc:
            message[0] = str(exc)
    dist.broadcast_object_list(message, src=0)
    if isinstance(message[0], str):
        raise ConfigError(message[0])
    return resolved or Resolved(*preflight(Config.model_validate(message[0]), world, shape, measure=False))
