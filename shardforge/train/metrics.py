"""Metrics sinks: JSONL (one object per logged step), TensorBoard, console lines, and the loss-curve PNG."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rich.console import Console


class MetricsWriter:
    """Writes each logged step to every enabled sink; only constructed on the logging rank."""

    def __init__(self, run_dir: Path, tensorboard: bool, console: Console, resume_step: int = 0) -> None:
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
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            purge = resume_step + 1 if resume_step else None  # TensorBoard hides events past the resume
            self._tb = SummaryWriter(log_dir=str(run_dir / "tensorboard"), purge_step=purge)

    def write(self, record: dict[str, Any]) -> None:
        self.history.append(record)
        self._jsonl.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self._tb.add_scalar(key, value, record["step"])
        shown = {k: v for k, v in record.items() if k in _CONSOLE_KEYS}
        self.console.print(" ".join(_fmt(k, v) for k, v in shown.items()))

    def close(self) -> None:
        self._jsonl.close()
        if self._tb is not None:
            self._tb.close()


_CONSOLE_KEYS = ("step", "loss", "eval_loss", "lr", "grad_norm", "tokens_per_s", "mfu", "epoch")


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
