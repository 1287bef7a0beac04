"""Metrics: the window between two log lines (sums on the device, counts on the host), throughput, MFU,
memory and progress (`MetricsProcessor`), and the sinks (`MetricsWriter`: JSONL, TensorBoard, console
lines; `plot_loss`: the loss-curve PNG)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from shardforge.config.schema import LogSection
from shardforge.log import get_logger
from shardforge.objectives.base import Objective
from shardforge.planner import peak as peaks
from shardforge.train.runtime import memory_bytes
from shardforge.train.tracking import Trackers

log = get_logger(__name__)

# (tokens, scored tokens, attention pairs, patches=image patches) -> training FLOPs (CostModel.train_flops)
Flops = Callable[..., float]


class MetricsWriter:
    """Writes each logged step to every enabled sink (metrics.jsonl, the console, the trackers of
    log.report_to); only constructed on the logging rank."""

    def __init__(self, run_dir: Path, trackers: Trackers, console: Console, resume_step: int = 0) -> None:
        """A resumed run keeps the records up to `resume_step` and drops later ones (logged after the
        checkpoint it resumes from, before the interruption): they are computed again."""
        self.run_dir = run_dir
        self.console = console
        path = run_dir / "metrics.jsonl"
        self.history: list[dict[str, Any]] = []
        if resume_step and path.is_file():
            records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            self.history = [r for r in records if r.get("step", 0) <= resume_step]
        self._jsonl = open(path, "w", buffering=1)  # noqa: SIM115 - closed in close()
        for record in self.history:
            self._jsonl.write(json.dumps(record) + "\n")
        self.trackers = trackers

    def write(self, record: dict[str, Any]) -> None:
        self.history.append(record)
        self._jsonl.write(json.dumps(record) + "\n")
        self.trackers.log(record)
        shown = {k: v for k, v in record.items() if k in _CONSOLE_KEYS}
        self.console.print(" ".join(_fmt(k, v) for k, v in shown.items()))

    def close(self, artifacts: dict[str, str]) -> None:
        self._jsonl.close()
        self.trackers.finish(artifacts)


_CONSOLE_KEYS = (
    "step",
    "loss",
    "eval_loss",
    "lr",
    "grad_norm",
    "tokens_per_s",
    "mfu",
    "epoch",
    "moe_aux_loss",
    "moe_load_max",
    "reward_mean",
    "kl",
    "response_length_mean",
    "rollout_tokens_per_s",
)


class MetricsProcessor:
    """Accumulates each step's sums and counts, turns a window of steps into one record, and sends records
    to the sinks (rank 0) and, at the end, the loss plot.

    The loss sums stay on the device until a record is due (one host sync per log line); the global batch's
    counts are known on the host. MFU divides the FLOPs the steps really needed (the cost model's: body on
    every token, LM head on scored positions, causal attention pairs) by the peak of every device; the peak
    and where it comes from are in the run's first record (`peak_flops`, `peak_source`), and the peak each
    record's MFU divides by in every record (`mfu_peak_flops`, `mfu_peak_source`). A measured peak (the CPU's,
    planner/peak.py) that a window's steps beat is raised to their rate (and kept in the machine's cache on
    the CPU), with a warning, so MFU stays at most 1; above any other peak (hardware.peak_flops, a datasheet)
    a ratio above 1 is reported as a measurement problem instead of being logged silently."""

    def __init__(
        self,
        objective: Objective,
        flops: Flops,
        peak: tuple[float, str],
        world: int,
        device: torch.device,
        writer: MetricsWriter | None,
        plot: Path | None,
        static: dict[str, Any],
    ) -> None:
        self.objective, self.metrics, self.normalizer = objective, objective.metrics, objective.normalizer
        self.flops, self.world, self.device = flops, world, device
        self.peak, self.peak_source = peak
        self.measured_source = peak[1] if peaks.raisable(peak[1]) else None  # None: not raised
        self.writer, self.plot, self.static = writer, plot, static  # static: logged in every record
        self.first_record: dict[str, Any] = {"peak_flops": self.peak, "peak_source": self.peak_source}
        self._reset()

    def _reset(self) -> None:
        self.sums = torch.zeros(len(self.metrics), device=self.device)
        self.counts: dict[str, int] = {}
        self.steps, self.step_flops = 0, 0.0
        self.restart_clock()

    def restart_clock(self) -> None:
        """Leave time spent outside the steps (evaluation, checkpoints) out of the window's rates."""
        self.t0 = time.perf_counter()

    def add(self, sums: dict[str, torch.Tensor], counts: dict[str, int]) -> None:
        self.sums += torch.stack([sums[k].float() for k in self.metrics])
        for key, value in counts.items():
            self.counts[key] = self.counts.get(key, 0) + value
        self.steps += 1
        patches = counts.get("patches", 0)  # a vision-language model's image patches (rollouts have none)
        self.step_flops += self.flops(
            counts["tokens"], counts["targets"], counts["attention_pairs"], patches=patches
        )

    def record(self, step: int, reduce: Callable[[torch.Tensor], torch.Tensor], **extra: Any) -> dict:
        """The window's record; `reduce` sums the loss sums over data-parallel ranks (a collective)."""
        elapsed = time.perf_counter() - self.t0
        means = (reduce(self.sums) / self.counts[self.normalizer]).tolist()
        means = self.objective.finish(dict(zip(self.metrics, means, strict=True)))
        record: dict[str, Any] = {"step": step, **means, **extra}
        achieved = self.step_flops / elapsed / self.world  # per device
        if self.measured_source is not None and achieved > self.peak:
            self._raise_peak(step, achieved)
        mfu = achieved / self.peak
        record.update(
            tokens_per_s=self.counts["tokens"] / elapsed,
            target_tokens_per_s=self.counts["targets"] / elapsed,
            mfu=mfu,
            mfu_peak_flops=self.peak,
            mfu_peak_source=self.peak_source,
            step_time_s=elapsed / self.steps,
            **self.static,
            **memory_bytes(self.device),
            **self.first_record,
        )
        if "time/rollout_s" in record:  # an RL step: the rest of the step trained
            record["time/training_s"] = (
                record["step_time_s"] - record["time/rollout_s"] - record["time/scoring_s"]
            )
        if "planned_step_time_s" in self.first_record:
            record["step_time_ratio"] = record["step_time_s"] / self.first_record["planned_step_time_s"]
        self.first_record = {}
        if mfu > 1:
            log.warning(
                f"MFU {mfu:.2f} > 1 at step {step}: the peak ({self.peak / 1e9:.1f} GFLOP/s, "
                f"{self.peak_source}) is too low for this device; set hardware.peak_flops"
            )
        self._reset()
        return record

    def _raise_peak(self, step: int, achieved: float) -> None:
        """A measured peak that the steps beat was too low: the achieved rate is the peak from now on (and,
        on the CPU, in the machine's cache)."""
        before = self.peak
        self.peak = achieved
        self.peak_source = f"raised to the achieved rate at step {step} (from {self.measured_source})"
        kept = peaks.raise_peak(self.measured_source, achieved)
        log.warning(
            f"peak raised to the achieved rate at step {step}: {achieved / 1e9:.1f} GFLOP/s per device "
            f"(was {before / 1e9:.1f})" + ("; kept in the machine's peak cache" if kept else "")
        )

    def write(self, record: dict) -> None:
        if self.writer is not None:
            self.writer.write(record)

    def close(self, final: Path | None) -> list[dict]:
        """Draw the loss curve, close the sinks (the trackers get the paths of what the run wrote); returns
        the run's records (rank 0's; empty elsewhere)."""
        if self.writer is None:
            return []
        plot = plot_loss(self.writer.history, self.plot) if self.plot is not None else None
        run_dir = self.writer.run_dir
        written = {"final": final, "metrics": run_dir / "metrics.jsonl", "loss_plot": plot}
        written |= {name: run_dir / name for name in ("checkpoints", "profile")}
        self.writer.close({k: str(v) for k, v in written.items() if v is not None and v.exists()})
        return self.writer.history


def progress_bar(console: Console, log: LogSection, enabled: bool) -> Progress:
    return Progress(
        TextColumn("[bold]train"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeRemainingColumn(),
        TextColumn("{task.fields[info]}"),
        console=console,
        disable=not (log.progress and enabled and console.is_terminal),
    )


def _fmt(key: str, value: Any) -> str:
    if isinstance(value, float):
        return f"{key}={value:.4g}"
    return f"{key}={value}"


def plot_loss(history: list[dict[str, Any]], path: Path) -> Path | None:
    """Loss (and eval loss) against step, as a PNG next to the metrics."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [(r["step"], r["loss"]) for r in history if "loss" in r]
    evals = [(r["step"], r["eval_loss"]) for r in history if "eval_loss" in r]
    if not train and not evals:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train, strict=True), label="train loss")
    if evals:
        ax.plot(*zip(*evals, strict=True), "o-", label="eval loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (mean over target tokens)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
