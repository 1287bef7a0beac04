"""What a run reports about itself: the start-up line, the metrics processor (records, sinks, the plot) and
the result `train()` returns."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from shardforge.train.metrics import MetricsProcessor, MetricsWriter
from shardforge.train.tracking import open_trackers

if TYPE_CHECKING:
    from shardforge.train.setup import Run


@dataclass
class TrainResult:
    """What `train()` returns."""

    run_dir: Path
    steps: int
    final_loss: float
    eval_loss: float | None
    tokens_per_s: float
    final_model: Path | None
    history: list[dict] = field(default_factory=list)  # the logged records (rank 0)


def metrics_for(run: Run, start_step: int) -> MetricsProcessor:
    """The run's metrics processor: JSONL/TensorBoard sinks and the plot on rank 0 only."""
    log = run.config.log
    writer = None
    if run.is_main:
        trackers = open_trackers(log, run.run_dir, start_step)
        writer = MetricsWriter(run.run_dir, trackers, run.console, start_step)
    # The schedule's theoretical idle share, next to the measured step time.
    static = {"pp_bubble": run.plan.bubble_fraction} if run.plan is not None else {}
    plot = run.run_dir / "loss.png" if log.plot else None
    world = run.dims.world_size
    method = run.config.method  # frozen weights need no weight gradients; a frozen tower no backward at all
    tower = method.vision.tower_passes(method.finetuning)
    flops = partial(run.costs.train_flops, trained=run.trained, tower_passes=tower)
    return MetricsProcessor(run.objective, flops, run.peak, world, run.device, writer, plot, static)


def describe_run(run: Run) -> str:
    """The start-up line: model, layout, batch arithmetic and the peak the MFU is measured against."""
    t = run.config.train
    n_params = run.costs.params.total
    peak, source = run.peak
    method = run.config.method.finetuning
    training = f" ({method}: {run.trained:.2%} of them train)" if run.trained < 1 else ""
    moe = f"; {run.moe.describe()}" if run.moe is not None else ""
    family = run.model_config.family
    if family.startswith("hf:"):  # which backend, and why
        why = "model.backend: hf" if run.config.model.backend == "hf" else "no native family"
        family = f"{run.model_config.model_type} on the generic backend (transformers' modules; {why})"
    return (
        f"model: {family}, {n_params / 1e6:.2f}M parameters{training}, {t.precision}; "
        f"layout: {run.dims.describe()}; {run.total_steps} steps of {run.global_batch} rows "
        f"({t.micro_batch} per rank x {run.grad_accum} accumulation x {run.dims.dp} data-parallel); "
        f"peak {peak / 1e9:.1f} GFLOP/s per device on {run.device} ({source}){moe}"
    )
