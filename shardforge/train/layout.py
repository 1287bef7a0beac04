"""The layout checks of a run: every rule that needs only the config, the model's shape and the world size.
The launching process runs them before any rank starts, and each rank again before its first collective."""

from __future__ import annotations

from typing import Any

from shardforge.config import Config
from shardforge.errors import ConfigError
from shardforge.parallel.context_parallel import check_context_parallel
from shardforge.parallel.dims import ParallelDims
from shardforge.parallel.expert_parallel import check_expert_parallel
from shardforge.parallel.pipeline_plan import PipelinePlan, plan_pipeline
from shardforge.parallel.tensor_parallel import check_tensor_parallel


def resolve_grad_accum(cfg: Config, dp: int) -> int:
    """grad_accum, or the one implied by train.global_batch = micro_batch x grad_accum x dp."""
    t = cfg.train
    if t.global_batch is None:
        return t.grad_accum
    per_step = t.micro_batch * dp
    if t.global_batch % per_step:
        raise ConfigError(
            f"train.global_batch={t.global_batch} is not divisible by train.micro_batch ({t.micro_batch}) x "
            f"data-parallel size ({dp}) = {per_step}"
        )
    return t.global_batch // per_step


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
