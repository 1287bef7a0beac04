"""The one training loop. Stages plug in encoding and loss; everything else (layout, batching, accumulation,
clipping, precision, schedule, metrics, export) lives here once."""

from __future__ import annotations

import datetime
import math
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

from shardforge.checkpoint import Checkpointer, find_latest, load_checkpoint
from shardforge.checkpoint.compat import check_compatible
from shardforge.checkpoint.store import resolve_checkpoint
from shardforge.checkpoint.optim_state import FORMAT as OPTIMIZER_FORMAT
from shardforge.checkpoint.trainer_state import read_trainer_state
from shardforge.config import Config, dump_config
from shardforge.data.batching import Batch, GlobalOrder, split_global_batch
from shardforge.data.loader import RowSet, build_datasets
from shardforge.errors import CheckpointError, ConfigError, TrainingError
from shardforge.models import save_model
from shardforge.models.build import build_model
from shardforge.objectives import get_stage
from shardforge.parallel import apply_activation_checkpointing
from shardforge.parallel.data_parallel import apply_data_parallel, gradient_sync, unwrap
from shardforge.parallel.distributed import (
    init_distributed,
    local_rank_from_env,
    pick_backend,
    shutdown,
    world_size_from_env,
)
from shardforge.parallel.memory import memory_report
from shardforge.parallel.pipeline import PipelineRunner, pipeline_stages, split_for_pipeline
from shardforge.parallel.tensor_parallel import (
    apply_tensor_parallel,
    loss_context,
    padded_vocab,
    strip_vocab_padding,
)
from shardforge.train.layout import check_layout
from shardforge.train.metrics import MetricsWriter, plot_loss
from shardforge.train.optim import build_optimizer, build_scheduler, clip_grad_norm
from shardforge.train.precision import Precision
from shardforge.train.runtime import measure_matmul_peak, memory_bytes, pick_device, seed_everything
from shardforge.train.watchdog import Watchdog, dump, is_timeout


@dataclass
class TrainResult:
    run_dir: Path
    steps: int
    final_loss: float
    eval_loss: float | None
    tokens_per_s: float
    final_model: Path | None
    history: list[dict] = field(default_factory=list)  # the logged records (rank 0)


@dataclass
class StepCounts:
    """Token counts of one optimizer step over the whole global batch (all ranks), known before it runs."""

    tokens: int
    targets: int


class Trainer:
    def __init__(self, config: Config, console: Console | None = None) -> None:
        self.config = config
        self.console = console or Console()
        self.run_dir = Path(config.output_dir)
        self.memory: dict[str, int] = {}

    # ---- setup -------------------------------------------------------------------------------------------
    def setup(self) -> None:
        cfg = self.config
        # Everything that can be checked without talking to other ranks is checked first.
        world = world_size_from_env()
        self.dims, self.grad_accum, self.tokenizer, self.plan = check_layout(cfg, world)
        self.device = pick_device(cfg.hardware.device, local_rank_from_env())
        backend = pick_backend(cfg.parallel.backend, self.device)
        if cfg.hardware.threads:
            torch.set_num_threads(cfg.hardware.threads)

        if world == 1 and cfg.parallel.offload != "none":
            raise ConfigError(
                f"parallel.offload={cfg.parallel.offload} offloads sharded states: it needs several "
                f"processes (--nproc N); a single process shards nothing"
            )
        try:  # every rank checks before any collective, so a bad path fails alike everywhere
            self.run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"output_dir {str(self.run_dir)!r} cannot be created: {exc.strerror}") from None

        self.owns_process_group = init_distributed(backend, cfg.parallel.timeout_minutes)
        timeout = datetime.timedelta(minutes=cfg.parallel.timeout_minutes)
        self.mesh = self.dims.build_mesh(self.device.type, timeout)
        self.dp_rank = self.dims.dp_rank(self.mesh)
        self.is_main = not dist.is_initialized() or dist.get_rank() == 0
        if not self.is_main:
            self.console = Console(quiet=True)
        seed_everything(cfg.train.seed)
        if self.is_main:
            dump_config(cfg, self.run_dir / "config.yaml")

        self.stage = get_stage(cfg.method.stage)
        self.precision = Precision(cfg.train.precision, self.device)
        encoder = self.stage.encoder(self.tokenizer, cfg.data)
        self.train_rows, self.eval_rows = build_datasets(cfg.data, cfg.method.stage, encoder, cfg.train.seed)
        self._log_data("train", self.train_rows)
        if self.eval_rows is not None:
            self._log_data("eval", self.eval_rows)

        # A pipeline rank builds only its stages' part of the model (pruned on the meta device).
        pp_rank = self.dims.pp_rank(self.mesh)
        prune = (
            partial(split_for_pipeline, plan=self.plan, stages=self.plan.stages_of(pp_rank))
            if self.plan
            else None
        )
        model = build_model(cfg.model, self.tokenizer, cfg.train.seed, self.device, prune)
        self.model_config = model.config
        # Appliers in a fixed order. TP first: it swaps parameters for DTensors that the later wrappers take
        # as they are. Checkpointing wraps whole (TP-sharded) blocks: `full` recomputation repeats their TP
        # collectives (in the same order on every rank), `selective` keeps their outputs. Compile sees the
        # final block code. Pipeline stages are then cut over the wrapped blocks. FSDP2 comes last: it
        # shards the TP DTensors over the data-parallel mesh dims (2-D), with one root per pipeline stage.
        apply_tensor_parallel(model, self.dims, self.mesh, cfg.parallel)
        apply_activation_checkpointing(model, cfg.parallel.activation_checkpoint)
        if cfg.train.compile:
            for block in model.blocks():
                block.compile()
        stages = (
            pipeline_stages(model, self.plan, pp_rank, self.stage.logits_loss_sum, self.precision.autocast)
            if self.plan
            else {}
        )
        self.model = apply_data_parallel(
            model, self.dims, self.mesh, cfg.parallel, cfg.train.precision, self.device, list(stages.values())
        )
        self.inner = unwrap(self.model)
        self.pipeline = (
            PipelineRunner(
                self.plan,
                model,
                stages,
                self.mesh,
                self.device,
                self._stream_dtype(),
                self._stream_width,
                datetime.timedelta(minutes=cfg.parallel.timeout_minutes),
            )
            if self.plan
            else None
        )
        self.params = [p for p in self.model.parameters() if p.requires_grad]

        self.global_batch = cfg.train.micro_batch * self.grad_accum * self.dims.dp
        rows = len(self.train_rows.rows)
        self.total_steps = (
            math.ceil(cfg.train.epochs * rows / self.global_batch) if cfg.train.epochs else cfg.train.steps
        )
        if self.global_batch > rows:
            self.console.print(
                f"[yellow]warning:[/] the global batch ({self.global_batch} rows) is larger than the "
                f"training data ({rows} rows): rows repeat within a step"
            )
        self.optimizer = build_optimizer(self.model, cfg.train, cfg.parallel, self.dims.dp_mesh(self.mesh))
        self.scheduler = build_scheduler(self.optimizer, self.total_steps, cfg.train)
        self.order = GlobalOrder(rows, cfg.train.seed)
        self.start_step, self.samples_seen, self.step = 0, 0, 0
        self.watchdog: Watchdog | None = None  # started by train(); train_step also runs without it
        self._memory_logged = False
        ck = cfg.checkpoint
        self.checkpointer = Checkpointer(self.checkpoint_root, ck.keep, ck.async_save)
        self.bad_steps, self.bad_in_a_row = 0, 0
        self._resume()
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardforge-data")
        self._pending: Future | None = None
        self._built = self.start_step
        self.pad_id = self.tokenizer.pad_token_id
        # Sequence parallel splits every row's tokens evenly over the TP ranks. A pipeline builds a schedule
        # per micro-batch shape: widths rounded to 1/8 of max_length keep the number of shapes small.
        self.seq_multiple = self.dims.tp if cfg.parallel.sequence_parallel else 1
        if self.plan is not None:
            self.seq_multiple = math.lcm(self.seq_multiple, max(1, cfg.data.max_length // 8))
        self.peak_flops = cfg.hardware.peak_flops or measure_matmul_peak(self.device, self.precision.dtype)
        n_params = self.model_config.num_params()
        if self.plan:
            self.console.print(self.plan.describe())
        self.console.print(
            f"model: {self.model_config.family}, {n_params / 1e6:.2f}M parameters, {cfg.train.precision}; "
            f"layout: {self.dims.describe()}; {self.total_steps} steps of {self.global_batch} rows "
            f"({cfg.train.micro_batch} per rank x {self.grad_accum} accumulation x {self.dims.dp} "
            f"data-parallel); "
            f"peak {self.peak_flops / 1e9:.1f} GFLOP/s per device on {self.device}"
        )

    def _stream_dtype(self) -> torch.dtype:
        """The dtype of the residual stream between pipeline stages: FSDP2's compute dtype under mixed
        precision, else the weights' (autocast leaves the stream in the weights' dtype)."""
        precision = self.config.train.precision
        if self.dims.sharded and precision != "fp32":
            return {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
        return next(self.inner.parameters()).dtype

    def _stream_width(self, width: int) -> int:
        """Tokens per row of the stream a pipeline stage sends: sequence parallel splits them over TP."""
        return width // self.dims.tp if self.config.parallel.sequence_parallel else width

    # ---- checkpoints -------------------------------------------------------------------------------------
    @property
    def checkpoint_root(self) -> Path:
        return self.run_dir / "checkpoints"

    def _resume_folder(self) -> Path | None:
        """Which checkpoint to continue from. Rank 0 decides and tells the others, so every rank loads the
        same one even if their views of the folder differ for a moment."""
        resume = self.config.checkpoint.resume
        if resume == "none":
            if find_latest(self.checkpoint_root, lambda _: None) is not None:
                self._warn(
                    f"checkpoint.resume=none: starting fresh; the checkpoints in {self.checkpoint_root} "
                    f"will be replaced by this run's"
                )
            return None
        choice: list[tuple[str | None, str | None]] = [(None, None)]  # (folder, error), rank 0's answer
        if self.is_main:
            try:
                found = (
                    find_latest(self.checkpoint_root, self._warn)
                    if resume == "auto"
                    else resolve_checkpoint(Path(resume), self._warn)
                )
                choice = [(str(found) if found is not None else None, None)]
            except CheckpointError as exc:
                choice = [(None, f"checkpoint.resume={resume!r}: {exc}")]
        if dist.is_initialized():
            dist.broadcast_object_list(choice, src=0)
        folder, error = choice[0]
        if error is not None:  # every rank fails alike, none is left waiting
            raise CheckpointError(error)
        return Path(folder) if folder is not None else None

    def _warn(self, message: str) -> None:
        self.console.print(f"[yellow]warning:[/] {message}")

    def _signature(self) -> dict:
        """What a continuation depends on (checked on resume, see checkpoint/compat.py)."""
        m = self.model_config
        return {
            "model": [
                m.family,
                m.vocab_size,
                m.hidden_size,
                m.intermediate_size,
                m.num_layers,
                m.num_heads,
                m.num_kv_heads,
                m.head_dim,
            ],
            "vocab_rows": padded_vocab(m.vocab_size, self.dims.tp),  # as the embedding holds it
            "global_batch": self.global_batch,
            "rows": len(self.train_rows.rows),
            "seed": self.config.train.seed,
            "optimizer_format": OPTIMIZER_FORMAT,
        }

    def _resume(self) -> None:
        """Continue from a checkpoint: weights and optimizer resharded onto this layout, schedule, loss scale,
        and the data position as a global sample index (valid for any data-parallel size)."""
        folder = self._resume_folder()
        if folder is None:
            return
        check_compatible(folder, read_trainer_state(folder), self._signature())
        state = load_checkpoint(folder, self.model, self.optimizer)
        self.start_step, self.samples_seen = state["step"], state["samples_seen"]
        self.bad_steps = state["bad_steps"]
        self.order.position = self.samples_seen
        self.scheduler.load_state_dict(state["scheduler"])
        if state["precision"]["mode"] == self.precision.mode:  # the loss scale only means something in fp16
            self.precision.load_state_dict(state["precision"])
        self.console.print(
            f"resumed from {folder} (step {self.start_step}, {self.samples_seen} samples seen, saved by "
            f"{state['layout']})"
        )
        if self.start_step >= self.total_steps:
            self._warn(
                f"the checkpoint is at step {self.start_step} and this run has {self.total_steps} steps: "
                f"nothing is left to train (raise train.steps or train.epochs to continue)"
            )

    def save_checkpoint(self, step: int) -> Path:
        """Sharded checkpoint of the whole training state at `step` (collective)."""
        state = {
            "step": step,
            "samples_seen": self.samples_seen,
            "bad_steps": self.bad_steps,
            "scheduler": self.scheduler.state_dict(),
            "precision": self.precision.state_dict(),
            "world_size": self.dims.world_size,
            "layout": self.dims.describe(),
            **self._signature(),
        }
        extra = {"config.yaml": (self.run_dir / "config.yaml").read_text()} if self.is_main else None
        folder = self.checkpointer.save(step, self.model, self.optimizer, state, extra, self._phase)
        self.console.print(f"{'writing' if self.checkpointer.async_save else 'saved'} checkpoint {folder}")
        return folder

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

    # ---- one step ----------------------------------------------------------------------------------------
    def _next_global_batch(self) -> tuple[list[Batch], StepCounts]:
        """This rank's micro-batches of the next global batch, and the counts of the whole global batch."""
        t = self.config.train
        ids = self.order.take(self.global_batch)
        tokens, targets = self.train_rows.row_counts()
        counts = StepCounts(sum(tokens[i] for i in ids), sum(targets[i] for i in ids))
        groups = split_global_batch(ids, t.micro_batch, self.grad_accum, self.dims.dp, self.dp_rank)
        rows = self.train_rows
        return [
            self.stage.collate(rows.examples, [rows.rows[i] for i in g], self.pad_id, self.seq_multiple)
            for g in groups
        ], counts

    def _prefetched_batch(self) -> tuple[list[Batch], StepCounts]:
        """The next global batch, built on a background thread while the previous step computed, so data
        preparation never stalls the step; the following one is started before returning."""
        if self._pending is None:
            self._pending = self._loader.submit(self._next_global_batch)
        batch = self._pending.result()
        self._built += 1
        more = self._built < self.total_steps
        self._pending = self._loader.submit(self._next_global_batch) if more else None
        return batch

    def train_step(self) -> tuple[torch.Tensor, torch.Tensor, StepCounts]:
        """One optimizer step: (this rank's loss sum, global grad norm) as device tensors, and global counts.

        Each micro-batch loss is divided by the target count of the *global* batch; data-parallel gradient
        averaging divides by dp, so the loss is multiplied back by dp. The result is the gradient of the mean
        over all target tokens of the global batch, however it is split across ranks and micro-steps.
        """
        micro, counts = self._prefetched_batch()
        scale = self.dims.dp / counts.targets
        loss_sum = torch.zeros((), device=self.device)
        for j, mb in enumerate(micro):
            last = j == len(micro) - 1
            self._phase(
                f"forward/backward of micro-step {j + 1}/{len(micro)} (TP/FSDP collectives"
                + (", pipeline sends and FSDP gradient reduction" if self.pipeline is not None else "")
                + (", gradient reduction)" if last and self.pipeline is None else ")")
            )
            mb = mb.to(self.device)
            if self.pipeline is not None:  # forward and backward of every pipeline micro-batch
                with loss_context(self.dims):
                    loss = self.pipeline.run(mb, lambda loss: self.precision.scale(loss * scale))
            else:
                with gradient_sync(self.model, sync=last), loss_context(self.dims):
                    with self.precision.autocast():
                        loss = self.stage.loss_sum(self.model, mb)
                    self.precision.scale(loss * scale).backward()
            loss_sum += loss.detach()
        if self.pipeline is not None:
            self.pipeline.sum_tied_grads()
        self._phase("gradient norm (all-reduce) and the optimizer step")
        overflow = self.precision.unscale(self.params)
        pp_group = self.mesh["pp"].get_group() if self.plan else None
        tied_copy = self.pipeline.tied_copy if self.pipeline is not None else None
        grad_norm = clip_grad_norm(self.params, self.config.train.clip, pp_group, tied_copy)
        first = not self.memory
        grads = memory_report(self.inner)["grad_bytes"] if first else 0
        # The norm is global (the same on every rank), so every rank skips the same steps. fp16 overflow is
        # the loss scaler's business (it lowers the scale); anything else non-finite is a bad step.
        bad = not overflow and not math.isfinite(grad_norm.item())
        if bad:
            self._bad_step()
        else:
            self.bad_in_a_row = 0
            self.precision.step(self.optimizer, overflow)
        if first:  # gradients exist before the step, optimizer states only after it
            self.memory = memory_report(self.inner, self.optimizer) | {"grad_bytes": grads}
        self.step_lr = self.scheduler.get_last_lr()[0]  # the rate this step used
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.samples_seen += self.global_batch
        return loss_sum, grad_norm, counts

    def _bad_step(self) -> None:
        """Skip an update whose loss or gradient is not finite; halt when it keeps happening."""
        self.bad_steps += 1
        self.bad_in_a_row += 1
        limit = self.config.train.max_bad_steps
        self._warn(f"non-finite loss or gradient norm: update skipped ({self.bad_in_a_row} in a row)")
        if self.bad_in_a_row >= limit:
            raise TrainingError(
                f"training diverged: {limit} steps in a row had a non-finite loss or gradient norm "
                f"(train.max_bad_steps={limit}); lower train.lr, set train.clip, check the data, or prefer "
                f"bf16 to fp16; the latest checkpoint (if any) is in {self.checkpoint_root}"
            )

    def _dp_sum(self, value: torch.Tensor) -> torch.Tensor:
        """Sum over all data-parallel ranks (over each dimension of a 2-D HSDP mesh in turn)."""
        dp_mesh = self.dims.dp_mesh(self.mesh)
        if dp_mesh is not None:
            for dim in range(dp_mesh.ndim):
                dist.all_reduce(value, group=dp_mesh.get_group(dim))
        return value

    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Mean loss over all eval target tokens. Every rank runs every batch (sharded models need all ranks
        in each forward), so the result is the same everywhere (a pipeline sums its last stage's over pp)."""
        if self.eval_rows is None:
            return None
        self.model.eval()
        rows, mb = self.eval_rows, self.config.train.micro_batch
        total, count = torch.zeros((), device=self.device), 0
        for start in range(0, len(rows.rows), mb):
            self._phase(f"evaluation, rows {start}-{start + mb} of {len(rows.rows)}")
            batch = self.stage.collate(
                rows.examples, rows.rows[start : start + mb], self.pad_id, self.seq_multiple
            ).to(self.device)
            count += batch.num_targets
            if self.pipeline is not None:
                with loss_context(self.dims):
                    total += self.pipeline.loss_sum(batch)
                continue
            with self.precision.autocast(), loss_context(self.dims):
                total += self.stage.loss_sum(self.model, batch)
        self.model.train()
        return (total / count).item()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full (unsharded) weights on CPU under our key names, without TP vocabulary padding; complete on
        rank 0 (collective call)."""
        if self.plan is not None:
            return strip_vocab_padding(self._gather_stages(), self.model_config.vocab_size)
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_model_state_dict(self.inner, options=options)
        return strip_vocab_padding(state, self.model_config.vocab_size)

    def _gather_stages(self) -> dict[str, torch.Tensor]:
        """Full weights of every pipeline stage, merged on rank 0: each stage gathers its tensors one at a
        time over data and tensor parallel (to host memory, on the ranks that send them on), then the
        pipeline group that holds rank 0 sends them there."""
        pp_mesh = self.mesh["pp"]
        sender = 0 in pp_mesh.mesh.tolist()
        state = {}
        for key, value in self.inner.state_dict().items():  # the same order on every rank of a stage
            full = value.full_tensor() if isinstance(value, DTensor) else value
            if sender:
                state[key] = full.detach().cpu()
        if not sender:
            return {}
        parts: list[dict] | None = [{} for _ in range(self.dims.pp)] if self.is_main else None
        dist.gather_object(state, parts, dst=0, group=pp_mesh.get_group())
        return {k: v for part in parts or [] for k, v in part.items()}

    # ---- the loop ----------------------------------------------------------------------------------------
    def _new_window(self) -> dict:
        """Accumulators between two log lines; the loss stays on the device until it is logged."""
        return {"loss": torch.zeros((), device=self.device), "targets": 0, "tokens": 0, "steps": 0}

    def _record(
        self,
        step: int,
        window: dict,
        grad_norm: torch.Tensor,
        elapsed: float,
        flops_per_token: float,
        is_last: bool,
    ) -> dict:
        """The metrics of the window that ends at `step` (and the eval loss when it is due)."""
        cfg = self.config
        loss = (self._dp_sum(window["loss"]) / window["targets"]).item()
        tokens_per_s = window["tokens"] / elapsed
        record = {
            "step": step,
            "loss": loss,
            "lr": self.step_lr,
            "grad_norm": grad_norm.item(),
            "tokens_per_s": tokens_per_s,
            "target_tokens_per_s": window["targets"] / elapsed,
            "mfu": flops_per_token * tokens_per_s / (self.peak_flops * self.dims.world_size),
            "step_time_s": elapsed / window["steps"],
            # From the samples consumed, not the sampler: the prefetcher has already drawn the next batch.
            "epoch": round(self.samples_seen / len(self.train_rows.rows), 4),
            **memory_bytes(self.device),
        }
        if not self._memory_logged:  # the first record of the run (or of a resumed run)
            record.update(self.memory)
            self._memory_logged = True
        if self.plan is not None:  # the schedule's theoretical idle share, next to the measured step time
            record["pp_bubble"] = self.plan.bubble_fraction
        if self.bad_steps:
            record["bad_steps"] = self.bad_steps
        if self.precision.loss_scale is not None:
            record["loss_scale"] = self.precision.loss_scale
            record["skipped_steps"] = self.precision.skipped_steps
        if self.eval_rows is not None and (
            is_last or (cfg.train.eval_every and step % cfg.train.eval_every == 0)
        ):
            record["eval_loss"] = self.evaluate()
        return record

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
            if self.watchdog is not None:
                self.watchdog.stop()

    def _phase(self, what: str) -> None:
        """Mark progress for the watchdog (what this rank is doing now, named in a hang report)."""
        if self.watchdog is not None:
            self.watchdog.beat(f"step {self.step}: {what}")

    def _loop(self) -> TrainResult:
        cfg = self.config
        writer = (
            MetricsWriter(self.run_dir, cfg.log.tensorboard, self.console, self.start_step)
            if self.is_main
            else None
        )
        self.model.train()
        window = self._new_window()
        last_loss, eval_loss, tokens_per_s = float("nan"), None, 0.0
        mean_doc = self.train_rows.num_tokens / len(self.train_rows.examples)
        flops_per_token = self.model_config.flops_per_token(int(min(cfg.data.max_length, mean_doc)))
        t0 = time.perf_counter()
        progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeRemainingColumn(),
            TextColumn("{task.fields[info]}"),
            console=self.console,
            disable=not (cfg.log.progress and self.is_main and self.console.is_terminal),
        )
        with progress:
            task = progress.add_task("train", total=self.total_steps, completed=self.start_step, info="")
            for step in range(self.start_step + 1, self.total_steps + 1):
                self.step = step
                self._phase("waiting for this step's batch (data preparation)")
                loss_sum, grad_norm, counts = self.train_step()
                if step == self.start_step + 1:
                    mib = {k: f"{v / 2**20:.1f} MiB" for k, v in self.memory.items()}
                    self.console.print(f"model-state memory on rank 0 after step {step}: {mib}")
                window["loss"] += loss_sum
                window["targets"] += counts.targets
                window["tokens"] += counts.tokens
                window["steps"] += 1
                progress.advance(task)
                is_last = step == self.total_steps
                if is_last or step % cfg.train.log_every == 0:
                    self._phase("logging (all-reduce of the window's loss) and evaluation")
                    elapsed = time.perf_counter() - t0
                    record = self._record(step, window, grad_norm, elapsed, flops_per_token, is_last)
                    last_loss, tokens_per_s = record["loss"], record["tokens_per_s"]
                    eval_loss = record.get("eval_loss", eval_loss)
                    if writer is not None:
                        writer.write(record)
                    progress.update(task, info=f"loss {last_loss:.4f}")
                    window = self._new_window()
                    t0 = time.perf_counter()
                every = cfg.checkpoint.every
                if every and (step % every == 0 or is_last):
                    self._phase("saving a checkpoint (torch.distributed.checkpoint collectives)")
                    self.save_checkpoint(step)
        self._loader.shutdown(wait=False)
        if self.watchdog is not None:  # what follows is I/O of unbounded length (final export), not steps
            self.watchdog.stop()
        self.checkpointer.wait()  # an async save still in flight is completed and committed
        history = writer.history if writer is not None else []
        if self.start_step >= self.total_steps and history:  # resumed at the end: nothing ran this time
            last_loss, eval_loss = history[-1]["loss"], history[-1].get("eval_loss")
        if writer is not None:
            writer.close()
            if cfg.log.plot:
                plot_loss(history, self.run_dir / "loss.png")
        final = self._save_final() if cfg.checkpoint.save_final else None
        return TrainResult(self.run_dir, self.total_steps, last_loss, eval_loss, tokens_per_s, final, history)

    def _save_final(self) -> Path:
        """Gather full weights (a collective) and write the HF folder from rank 0."""
        state = self.full_state_dict() if dist.is_initialized() else None
        final = self.run_dir / "final"
        if self.is_main:
            save_model(self.inner, final, tokenizer=self.tokenizer, state_dict=state)
            self.console.print(f"saved the final model (HF format) to {final}")
        if dist.is_initialized():
            dist.barrier()
        return final


def train(config: Config, console: Console | None = None) -> TrainResult:
    """Run a whole training job described by `config`; the library entry point behind `shardforge train`."""
    trainer = Trainer(config, console)
    try:
        return trainer.train()
    finally:
        if getattr(trainer, "owns_process_group", False):
            shutdown()
