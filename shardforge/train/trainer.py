"""The one training loop. Stages plug in encoding and loss; everything else (batching, accumulation,
clipping, precision, schedule, metrics, export) lives here once."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from shardforge.config import Config, dump_config
from shardforge.data.batching import Batch, GlobalOrder, collate, split_global_batch
from shardforge.data.loader import RowSet, build_datasets
from shardforge.models import save_model
from shardforge.parallel import apply_activation_checkpointing
from shardforge.stages import get_stage
from shardforge.train.build import build_model, load_tokenizer
from shardforge.train.metrics import MetricsWriter, plot_loss
from shardforge.train.optim import build_optimizer, build_scheduler
from shardforge.train.precision import Precision
from shardforge.train.runtime import measure_matmul_peak, memory_bytes, pick_device, seed_everything


@dataclass
class TrainResult:
    run_dir: Path
    steps: int
    final_loss: float
    eval_loss: float | None
    tokens_per_s: float
    final_model: Path | None


@dataclass
class StepCounts:
    """Host-side token counts of one optimizer step (for throughput; known before the step runs)."""

    tokens: int
    targets: int


class Trainer:
    def __init__(self, config: Config, console: Console | None = None) -> None:
        self.config = config
        self.console = console or Console()
        self.run_dir = Path(config.output_dir)

    def setup(self) -> None:
        cfg = self.config
        if cfg.hardware.threads:
            torch.set_num_threads(cfg.hardware.threads)
        seed_everything(cfg.train.seed)
        self.device = pick_device(cfg.hardware.device)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        dump_config(cfg, self.run_dir / "config.yaml")

        self.stage = get_stage(cfg.method.stage)
        self.tokenizer = load_tokenizer(cfg.model)
        encoder = self.stage.encoder(self.tokenizer, cfg.data)
        self.train_rows, self.eval_rows = build_datasets(cfg.data, cfg.method.stage, encoder, cfg.train.seed)
        self._log_data("train", self.train_rows)
        if self.eval_rows is not None:
            self._log_data("eval", self.eval_rows)

        self.model = build_model(cfg.model, self.tokenizer, cfg.train.seed, self.device)
        self.model_config = self.model.config
        apply_activation_checkpointing(self.model, cfg.parallel.activation_checkpoint)
        if cfg.train.compile:
            for block in self.model.layers:
                block.compile()
        self.global_batch = cfg.train.micro_batch * cfg.train.grad_accum
        rows = len(self.train_rows.rows)
        self.total_steps = (
            math.ceil(cfg.train.epochs * rows / self.global_batch) if cfg.train.epochs else cfg.train.steps
        )
        if self.global_batch > rows:
            self.console.print(
                f"[yellow]warning:[/] the global batch ({self.global_batch} rows) is larger than the "
                f"training data ({rows} rows): rows repeat within a step"
            )
        self.optimizer = build_optimizer(self.model, cfg.train)
        self.scheduler = build_scheduler(self.optimizer, self.total_steps, cfg.train)
        self.precision = Precision(cfg.train.precision, self.device)
        self.order = GlobalOrder(rows, cfg.train.seed)
        self.pad_id = self.tokenizer.pad_token_id
        self.peak_flops = cfg.hardware.peak_flops or measure_matmul_peak(self.device, self.precision.dtype)
        n_params = sum(p.numel() for p in self.model.parameters())
        self.console.print(
            f"model: {self.model_config.family}, {n_params / 1e6:.2f}M parameters, {cfg.train.precision}; "
            f"{self.total_steps} steps of {self.global_batch} rows "
            f"({cfg.train.micro_batch} x {cfg.train.grad_accum}"
            f" accumulation); peak {self.peak_flops / 1e9:.1f} GFLOP/s on {self.device}"
        )

    def _log_data(self, what: str, rows: RowSet) -> None:
        fill = rows.num_tokens / (len(rows.rows) * self.config.data.max_length)
        mode = (
            f"packed into {len(rows.rows)} rows ({fill:.0%} full)"
            if self.config.data.packing
            else "one per row"
        )
        self.console.print(
            f"{what} data: {rows.stats.summary()}; {len(rows.examples)} examples, {rows.num_tokens} tokens, "
            f"{rows.num_targets} targets, {mode}"
        )

    def _micro_batches(self) -> list[Batch]:
        t = self.config.train
        ids = self.order.take(self.global_batch)
        groups = split_global_batch(ids, t.micro_batch, t.grad_accum, dp=1, rank=0)
        rows = self.train_rows
        return [collate(rows.examples, [rows.rows[i] for i in g], self.pad_id) for g in groups]

    def train_step(self) -> tuple[torch.Tensor, torch.Tensor, StepCounts]:
        """One optimizer step over the global batch: (loss sum, grad norm) as device tensors, and counts."""
        micro = self._micro_batches()
        num_targets = sum(mb.num_targets for mb in micro)  # known on the host: no sync needed
        loss_sum = torch.zeros((), device=self.device)
        for mb in micro:
            mb = mb.to(self.device)
            with self.precision.autocast():
                loss = self.stage.loss_sum(self.model, mb)
            self.precision.scale(loss / num_targets).backward()
            loss_sum += loss.detach()
        self.precision.unscale(self.optimizer)
        clip = self.config.train.clip or float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip, foreach=True)
        self.precision.step(self.optimizer)
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss_sum, grad_norm, StepCounts(sum(mb.num_tokens for mb in micro), num_targets)

    @torch.no_grad()
    def evaluate(self) -> float | None:
        if self.eval_rows is None:
            return None
        self.model.eval()
        rows, mb = self.eval_rows, self.config.train.micro_batch
        total, count = torch.zeros((), device=self.device), 0
        for start in range(0, len(rows.rows), mb):
            batch = collate(rows.examples, rows.rows[start : start + mb], self.pad_id).to(self.device)
            with self.precision.autocast():
                total += self.stage.loss_sum(self.model, batch)
            count += batch.num_targets
        self.model.train()
        return (total / count).item()

    def _new_window(self) -> dict:
        """Accumulators between two log lines; the loss stays on the device until it is logged."""
        return {"loss": torch.zeros((), device=self.device), "targets": 0, "tokens": 0}

    def train(self) -> TrainResult:
        self.setup()
        cfg = self.config
        writer = MetricsWriter(self.run_dir, cfg.log.tensorboard, self.console)
        self.model.train()
        window = self._new_window()
        last_loss, eval_loss, tokens_per_s = float("nan"), None, 0.0
        seq = cfg.data.max_length
        t0 = time.perf_counter()
        progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeRemainingColumn(),
            TextColumn("{task.fields[info]}"),
            console=self.console,
            disable=not (cfg.log.progress and self.console.is_terminal),
        )
        with progress:
            task = progress.add_task("train", total=self.total_steps, info="")
            for step in range(1, self.total_steps + 1):
                loss_sum, grad_norm, counts = self.train_step()
                window["loss"] += loss_sum
                window["targets"] += counts.targets
                window["tokens"] += counts.tokens
                progress.advance(task)
                is_last = step == self.total_steps
                if step % cfg.train.log_every and not is_last:
                    continue
                elapsed = time.perf_counter() - t0
                last_loss = (window["loss"] / window["targets"]).item()
                tokens_per_s = window["tokens"] / elapsed
                mean_doc = self.train_rows.num_tokens / len(self.train_rows.examples)
                flops = self.model_config.flops_per_token(int(min(seq, mean_doc)))
                record = {
                    "step": step,
                    "loss": last_loss,
                    "lr": self.scheduler.get_last_lr()[0],
                    "grad_norm": grad_norm.item(),
                    "tokens_per_s": tokens_per_s,
                    "target_tokens_per_s": window["targets"] / elapsed,
                    "mfu": flops * tokens_per_s / self.peak_flops,
                    "epoch": round(self.order.epoch, 4),
                    **memory_bytes(self.device),
                }
                if self.precision.loss_scale is not None:
                    record["loss_scale"] = self.precision.loss_scale
                if self.eval_rows is not None and (
                    is_last or (cfg.train.eval_every and step % cfg.train.eval_every == 0)
                ):
                    record["eval_loss"] = eval_loss = self.evaluate()
                writer.write(record)
                progress.update(task, info=f"loss {last_loss:.4f}")
                window = self._new_window()
                t0 = time.perf_counter()
        writer.close()
        if cfg.log.plot:
            plot_loss(writer.history, self.run_dir / "loss.png")
        final = None
        if cfg.checkpoint.save_final:
            final = save_model(self.model, self.run_dir / "final", tokenizer=self.tokenizer)
            self.console.print(f"saved the final model (HF format) to {final}")
        return TrainResult(self.run_dir, self.total_steps, last_loss, eval_loss, tokens_per_s, final)


def train(config: Config, console: Console | None = None) -> TrainResult:
    """Run a whole training job described by `config`; the library entry point behind `shardforge train`."""
    return Trainer(config, console).train()
