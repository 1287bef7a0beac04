"""The one training loop, with hooks. What it runs is composed elsewhere (train/setup.py): the objective gives
batching and the loss, the engine hides the layout, the checkpoint manager resumes and saves, the loader
draws global batches ahead, and the metrics processor turns windows of steps into records."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from rich.console import Console

from shardforge.checkpoint.export import write_model_folder
from shardforge.config import Config
from shardforge.data.batch_source import GlobalBatchLoader
from shardforge.log import get_logger, log_to_console
from shardforge.objectives import Objective
from shardforge.parallel.distributed import shutdown
from shardforge.parallel.memory import memory_report
from shardforge.planner.compare import planned_vs_measured
from shardforge.train.evaluation import evaluate
from shardforge.train.guard import NonFiniteGuard
from shardforge.train.metrics import progress_bar
from shardforge.train.neftune import NEFTune
from shardforge.train.profiling import StepProfiler
from shardforge.train.report import TrainResult, describe_run, metrics_for
from shardforge.train.runtime import console_for
from shardforge.train.setup import build_run
from shardforge.train.watchdog import Watchdog, dump, is_timeout

log = get_logger(__name__)
HOOKS = ("phase", "step_end", "log", "eval", "save")  # each hook is called as fn(trainer, step, payload)


class Trainer:
    def __init__(self, config: Config, console: Console | None = None, objective: Objective | None = None):
        self.config, self.objective_override = config, objective
        self.console = console or console_for()
        log_to_console(self.console, config.log.all_ranks)  # the library's records, on this run's console
        self.run_dir = Path(config.output_dir)
        self.memory: dict[str, int] = {}
        self.hooks: dict[str, list[Callable]] = defaultdict(list)
        self.watchdog: Watchdog | None = None  # started by train(); train_step also runs without it
        self.step = self.start_step = self.samples_seen = 0

    def add_hook(self, event: str, fn: Callable) -> None:
        if event not in HOOKS:
            raise ValueError(f"unknown hook {event!r}; expected one of {', '.join(HOOKS)}")
        self.hooks[event].append(fn)

    def _fire(self, event: str, payload: object) -> None:
        for fn in self.hooks[event]:
            fn(self, self.step, payload)

    def setup(self) -> None:
        self.run = run = build_run(self.config, self.console, self.objective_override)
        self.console, self.dims, self.objective = run.console, run.dims, run.objective
        self.engine, self.model, self.optimizer = run.engine, run.engine.model, run.optimizer
        self.total_steps, self.is_main = run.total_steps, run.is_main
        self.guard = NonFiniteGuard(self.config.train.max_bad_steps, str(run.checkpoints.root))
        state = run.checkpoints.resume()
        data_state = {"samples": 0}
        if state is not None:
            data_state = state.get("data") or {"samples": state["samples_seen"]}  # older: the count alone
            self.start_step, self.samples_seen = state["step"], state["samples_seen"]
            self.guard.bad_steps = state["bad_steps"]
            if self.start_step >= self.total_steps:
                at = f"the checkpoint is at step {self.start_step} and this run has {self.total_steps} steps"
                log.warning(f"{at}: nothing is left to train (raise train.steps or train.epochs to continue)")
        self.loader = GlobalBatchLoader(run.source, self.total_steps - self.start_step)
        self.loader.load_state_dict(data_state)
        if run.plan:
            log.info(run.plan.describe())
        log.info(describe_run(run))
        StepProfiler.attach(self)  # when train.profile asks for it
        self.neftune = NEFTune.attach(self)  # when train.neftune_alpha asks for it

    def _phase(self, what: str, tag: str | None = None) -> None:
        """Mark progress for the watchdog (named in a hang report) and, tagged, for the "phase" hooks."""
        if self.watchdog is not None:
            self.watchdog.beat(f"step {self.step}: {what}")
        self._fire("phase", tag)

    # ---- one step ----------------------------------------------------------------------------------------
    def train_step(self) -> tuple[dict[str, torch.Tensor], torch.Tensor, dict[str, int]]:
        """One optimizer step: (this rank's sums, global grad norm) as device tensors, and global counts.

        Each micro-batch's loss sum is divided by the objective's normalizer counted over the *global* batch
        (target tokens, sequences or groups); data-parallel gradient averaging divides by dp, so the loss is
        multiplied back by dp. The update is the gradient of the mean over the whole global batch, however it
        is split across ranks and micro-steps."""
        batch = self.loader.next()
        precision, counts = self.run.precision, batch.counts
        scale = self.dims.averaged / counts[self.objective.normalizer]
        differentiate = lambda loss: precision.scale(loss * scale)  # noqa: E731
        if self.run.moe is not None:  # the MoE layers' balancing losses: their weight in this step
            self.run.moe.begin_step(counts["tokens"], precision.loss_scale)
        totals: dict[str, torch.Tensor] = {}
        for j, mb in enumerate(batch.micro):
            last = j == len(batch.micro) - 1
            self._phase(f"forward/backward of micro-step {j + 1}/{len(batch.micro)} (collectives)", "fwd_bwd")
            sums = self.engine.forward_backward(mb.to(self.run.device), differentiate, last)
            totals = {k: totals.get(k, 0) + v for k, v in sums.items()}
        self._phase("gradient norm (all-reduce) and the optimizer step", "optimizer")
        self.engine.reduce_tied_grads()
        overflow = precision.unscale(self.engine.params)
        grad_norm = self.engine.clip(self.config.train.clip)
        first = not self.memory
        grads = memory_report(self.engine.inner)["grad_bytes"] if first else 0
        # The norm is global (the same on every rank), so every rank skips the same steps. fp16 overflow is
        # the loss scaler's business (it lowers the scale); anything else non-finite is a bad step.
        if self.guard.allow(overflow or math.isfinite(grad_norm.item())):  # overflow: the scaler skips
            precision.step(self.optimizer, overflow)
        if self.run.moe is not None:  # the expert biases' update (also resets the step's loads)
            self.run.moe.end_step(self.engine.dp_sum)
        if first:  # gradients exist before the step, optimizer states only after it
            self.memory = memory_report(self.engine.inner, self.optimizer) | {"grad_bytes": grads}
        self.step_lr = self.run.scheduler.get_last_lr()[0]  # the rate this step used
        self.run.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.samples_seen = self.loader.state_dict()["samples"]
        return totals, grad_norm, counts

    # ---- evaluation, checkpoints, export -----------------------------------------------------------------
    def evaluate(self) -> dict[str, float] | None:
        """The objective's means over the eval rows (sharded over data-parallel ranks)."""
        run = self.run
        if run.eval_rows is None:
            return None
        dp, args = (self.dims.dp, self.dims.dp_rank(run.mesh)), (run.tokenizer.pad_token_id, run.seq_multiple)
        mb = self.config.train.micro_batch
        return evaluate(self.engine, self.objective, run.eval_rows, mb, dp, args, run.device, self._phase)

    def save_checkpoint(self, step: int) -> Path:
        """Sharded checkpoint of the whole training state at `step` (collective)."""
        state = {
            "samples_seen": self.samples_seen,
            "data": self.loader.state_dict(),
            "bad_steps": self.guard.bad_steps,
        }
        extra = {"config.yaml": (self.run_dir / "config.yaml").read_text()} if self.is_main else None
        folder = self.run.checkpoints.save(step, state, extra, self._phase)
        log.info(f"{'writing' if self.run.checkpoints.async_save else 'saved'} checkpoint {folder}")
        self._fire("save", folder)
        return folder

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full (unsharded) weights on the host, without TP vocabulary padding; complete on rank 0."""
        return self.engine.full_state_dict()

    # ---- the loop ----------------------------------------------------------------------------------------
    def train(self) -> TrainResult:
        """Set up, then run the loop under a watchdog: a rank that hangs, or a collective that times out,
        reports which rank was doing what and dumps its Python stacks before the job ends."""
        self.setup()
        timeout_s = self.config.parallel.timeout_minutes * 60
        self.watchdog = Watchdog(dist.get_rank(), timeout_s) if dist.is_initialized() else None
        try:
            return self._loop()
        except RuntimeError as exc:
            if self.watchdog is not None and is_timeout(exc):
                dump(f"shardforge: a collective timed out; {self.watchdog.describe()}")
            raise
        finally:
            if hasattr(self, "loader"):
                self.loader.close()
            if self.watchdog is not None:
                self.watchdog.stop()

    def _loop(self) -> TrainResult:
        cfg, run = self.config, self.run
        metrics = metrics_for(run, self.start_step)
        last_loss, eval_loss, tokens_per_s = float("nan"), None, 0.0
        self.model.train()
        with progress_bar(self.console, cfg.log, self.is_main) as progress:
            task = progress.add_task("train", total=self.total_steps, completed=self.start_step, info="")
            for step in range(self.start_step + 1, self.total_steps + 1):
                self.step, is_last = step, step == self.total_steps
                self._phase("waiting for this step's batch (data preparation)", "data")
                sums, grad_norm, counts = self.train_step()
                if step == self.start_step + 1:  # measured in the first step, next to the planner's estimate
                    metrics.first_record.update(planned_vs_measured(run.estimate, self.memory))
                metrics.add(sums, counts)
                self._fire("step_end", sums)
                progress.advance(task)
                if is_last or step % cfg.train.log_every == 0:
                    self._phase("logging (all-reduce of the window's sums) and evaluation")
                    record = metrics.record(step, self.engine.dp_sum, **self._step_fields(grad_norm))
                    every = cfg.train.eval_every
                    if run.eval_rows is not None and (is_last or (every and step % every == 0)):
                        evaluated = self.evaluate() or {}
                        record.update({f"eval_{k}": v for k, v in evaluated.items()})
                        self._fire("eval", evaluated)
                    last_loss, tokens_per_s = record["loss"], record["tokens_per_s"]
                    eval_loss = record.get("eval_loss", eval_loss)
                    metrics.write(record)
                    self._fire("log", record)
                    progress.update(task, info=f"loss {last_loss:.4f}")
                    metrics.restart_clock()  # logging and evaluation stay out of the next window's rates
                if cfg.checkpoint.every and (step % cfg.checkpoint.every == 0 or is_last):
                    self._phase("saving a checkpoint (torch.distributed.checkpoint collectives)")
                    self.save_checkpoint(step)
                    metrics.restart_clock()
        if self.watchdog is not None:  # what follows is I/O of unbounded length (final export), not steps
            self.watchdog.stop()
        run.checkpoints.wait()  # an async save still in flight is completed and committed
        final = self._save_final() if cfg.checkpoint.save_final else None
        history = metrics.close(final)  # the trackers are told where the final model is
        if self.start_step >= self.total_steps and history:  # resumed at the end: nothing ran this time
            last_loss, eval_loss = history[-1]["loss"], history[-1].get("eval_loss")
        return TrainResult(self.run_dir, self.total_steps, last_loss, eval_loss, tokens_per_s, final, history)

    def _step_fields(self, grad_norm: torch.Tensor) -> dict:
        """What the loop adds to a record besides the window's means and rates."""
        # The epoch of the batches handed out, not the source's: the loader has already drawn the next one.
        epoch = round(self.loader.epoch, 4)
        fields = {"lr": self.step_lr, "grad_norm": grad_norm.item(), "epoch": epoch}
        fields.update(self.loader.take_stats())  # the source's own figures (an RL step's rewards, times)
        if self.guard.bad_steps:
            fields["bad_steps"] = self.guard.bad_steps
        if self.run.moe is not None:
            fields.update(self.run.moe.fields(self.run.device))
        precision = self.run.precision
        if precision.loss_scale is not None:
            fields.update(loss_scale=precision.loss_scale, skipped_steps=precision.skipped_steps)
        return fields

    def _save_final(self) -> Path:
        """Gather full weights (a collective) and write, from rank 0, the HF folder (or for LoRA the PEFT
        adapter folder, which peft loads over the base model)."""
        adapters = self.config.method.adapters
        state = (
            self.full_state_dict() if dist.is_initialized() or adapters else None
        )  # else: the live weights
        final = self.run_dir / "final"
        if self.is_main:
            what = write_model_folder(self.engine.inner, state, self.config, self.run.tokenizer, final)
            log.info(f"saved the final {what} to {final}")
        if dist.is_initialized():
            dist.barrier()
        return final


def train(config: Config, console: Console | None = None) -> TrainResult:
    """Run a whole training job described by `config`; the library entry point behind `shardforge train`."""
    trainer = Trainer(config, console)
    try:
        return trainer.train()
    finally:
        run = getattr(trainer, "run", None)
        if run is not None and run.owns_process_group:
            shutdown()
