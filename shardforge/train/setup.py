"""The composition root of a training run: from a Config to the parts the loop drives (process group and
mesh, data, objective, engine, optimizer, schedule, checkpoints, batch source, metrics); nothing loops."""

from __future__ import annotations

import datetime
import inspect
import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from rich.console import Console
from torch.distributed.device_mesh import DeviceMesh

from shardforge.adapters.apply import apply_finetuning
from shardforge.checkpoint.manager import CheckpointManager, signature
from shardforge.config import Config, dump_config
from shardforge.config.schema import DataSection
from shardforge.data.batch_source import BatchSource, DatasetSource
from shardforge.data.cache import DatasetCache, code_fingerprint, default_root, file_fingerprint
from shardforge.data.loader import RowSet, build_datasets
from shardforge.data.stream import StreamSource, stream_shards
from shardforge.errors import ConfigError
from shardforge.infer.sampling import GenerationDefaults
from shardforge.models.build import build_model, model_source
from shardforge.models.generic.model import packs_by_position
from shardforge.models.spec import CostModel, spec_for
from shardforge.objectives import Objective, build_objective
from shardforge.objectives.rewards import build_rewards
from shardforge.parallel.context_parallel import row_multiple
from shardforge.parallel.dims import ParallelDims
from shardforge.parallel.distributed import (
    init_distributed,
    local_rank_from_env,
    pick_backend,
    pick_device,
    world_size_from_env,
)
from shardforge.parallel.engine import Engine
from shardforge.parallel.parallelize import lay_out_frozen, parallelize
from shardforge.parallel.pipeline_plan import PipelinePlan, split_for_pipeline
from shardforge.parallel.tensor_parallel import padded_vocab
from shardforge.planner.peak import model_gemm_shapes, peak_flops
from shardforge.planner.preflight import preflight
from shardforge.train.metrics import MetricsProcessor, MetricsWriter
from shardforge.train.moe import MoEBalancer
from shardforge.train.optim import build_optimizer, build_scheduler
from shardforge.train.precision import Precision
from shardforge.train.reference import precompute_reference
from shardforge.train.rollout import RolloutSource, load_prompts
from shardforge.train.runtime import seed_everything
from shardforge.train.tracking import open_trackers


def console_for(quiet: bool = False) -> Console:
    """Library output never hard-wraps: a path or a checkpoint name in a log file (SLURM, CI, pytest)
    must stay on one line whatever the width of a terminal that is not there."""
    return Console(soft_wrap=True, quiet=quiet)


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


@dataclass
class Run:
    """Everything the loop needs, built once."""

    config: Config
    console: Console
    run_dir: Path
    device: torch.device
    dims: ParallelDims
    mesh: DeviceMesh | None
    plan: PipelinePlan | None
    is_main: bool
    owns_process_group: bool
    tokenizer: Any
    objective: Objective
    precision: Precision
    train_rows: RowSet | None  # None: the training data is streamed
    eval_rows: RowSet | None
    model_config: Any
    engine: Engine
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    checkpoints: CheckpointManager
    source: BatchSource
    grad_accum: int
    global_batch: int  # groups per optimizer step (rows, for objectives whose groups are single rows)
    total_steps: int
    seq_multiple: int  # row widths are padded to a multiple of this (sequence parallel, pipeline schedules)
    peak: tuple[float, str]  # FLOP/s per device and where that figure comes from
    costs: CostModel  # the family's cost model of this model (parameters, FLOPs)
    trained: float = 1.0  # the share of the parameters that train (LoRA adapters, unfrozen layers)
    moe: MoEBalancer | None = None  # an MoE model's balancing and routing statistics
    estimate: Any = None  # the planner's estimate of this layout (planner.search.Candidate), where it has one


def build_run(config: Config, console: Console, objective: Objective | None = None) -> Run:
    """Every check that needs no other rank runs first, so a bad value fails alike everywhere."""
    cfg = config
    world = world_size_from_env()
    shape, tokenizer = model_source(cfg.model)
    if str(shape.family).startswith("hf:") and cfg.data.packing and not packs_by_position(shape.hf):
        console.print(
            f"data.packing is off: the generic backend has no per-document attention for {shape.model_type}, "
            f"so rows are padded (one example each)"
        )
        cfg = cfg.model_copy(update={"data": cfg.data.model_copy(update={"packing": False})})
    auto, owns = cfg.parallel.auto, False
    device = pick_device(cfg.hardware.device, local_rank_from_env())
    if auto and world > 1:  # under torchrun or srun (the shardforge launcher passes its choice to the ranks)
        owns = init_distributed(pick_backend(cfg.parallel.backend, device), cfg.parallel.timeout_minutes)
        cfg = _auto_from_rank_0(cfg, world, shape)
    main = int(os.environ.get("RANK", "0")) == 0  # the other ranks need no measured peak (rank 0 logs)
    cfg, dims, grad_accum, plan, estimate = preflight(cfg, world, shape, measure=main)
    if cfg.hardware.threads:
        torch.set_num_threads(cfg.hardware.threads)
    run_dir = Path(cfg.output_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"output_dir {str(run_dir)!r} cannot be created: {exc.strerror}") from None

    owns = init_distributed(pick_backend(cfg.parallel.backend, device), cfg.parallel.timeout_minutes) or owns
    mesh = dims.build_mesh(device.type, datetime.timedelta(minutes=cfg.parallel.timeout_minutes))
    is_main = not dist.is_initialized() or dist.get_rank() == 0
    console = console if is_main else console_for(quiet=True)
    if auto:
        console.print(
            f"parallel: auto chose {estimate.layout.describe()} ({' '.join(estimate.layout.overrides())})"
        )
    seed_everything(cfg.train.seed)
    if is_main:
        dump_config(cfg, run_dir / "config.yaml")

    objective = objective or build_objective(cfg.method)
    precision = Precision(cfg.train.precision, device)
    rl = _reader_stage(objective) == "rl"  # its rows are rollouts: no data set to encode
    train_rows, eval_rows = (None, None) if rl else build_data(cfg, tokenizer, objective, console)

    # A pipeline rank builds only its stages' part of the model (pruned on the meta device).
    pp_rank = dims.pp_rank(mesh)
    prune = partial(split_for_pipeline, plan=plan, stages=plan.stages_of(pp_rank)) if plan else None
    num_labels = getattr(objective, "num_labels", 0)  # a reward model's score head
    model = build_model(cfg.model, tokenizer, cfg.train.seed, device, prune, num_labels)
    model_config = model.config
    apply_finetuning(model, cfg.method, cfg.train.seed, cfg.model.adapter)  # what trains, before any layout
    if num_labels and model.lm_head is not None:
        model.lm_head.requires_grad_(True)  # a new score head trains under every method
    sizes = {id(p): (p.numel(), p.requires_grad) for p in model.parameters()}
    trained = sum(n for n, grad in sizes.values() if grad) / sum(n for n, _ in sizes.values())
    bind = getattr(objective, "bind_reference", None)  # a preference objective's reference model
    if bind is not None:
        # Pipeline stages run chunks, never `prepare`; RL scores its reference through the stages instead.
        blocker = "pipeline parallel" if dims.pp > 1 and not rl else None
        console.print(bind(model, cfg.method.finetuning, cfg.model.adapter, cfg.model.path, blocker))
        if objective.reference == "precomputed":
            _precompute_reference(cfg, tokenizer, objective, model if plan is None else None, train_rows,
                                  eval_rows, run_dir, device, precision, console)  # fmt: skip
    engine = parallelize(model, dims, mesh, cfg, plan, objective, precision.autocast, device)
    moe = MoEBalancer.build(model, cfg.method.moe, model_config, dims)
    if getattr(objective, "reference_model", None) is not None:  # sharded as the policy is, never trained
        objective.reference_model = lay_out_frozen(objective.reference_model, dims, mesh, cfg, device)
    bind_reduce = getattr(objective, "bind_reduce", None)  # an objective's statistic over the whole batch
    if bind_reduce is not None:
        bind_reduce(engine.dp_sum)

    global_batch = cfg.train.micro_batch * grad_accum * dims.dp
    prompts = _rl_prompts(cfg, tokenizer, console) if rl else []
    groups = train_rows.num_groups if train_rows is not None else len(prompts) or math.inf  # a stream: inf
    total = math.ceil(cfg.train.epochs * groups / global_batch) if cfg.train.epochs else cfg.train.steps
    if global_batch > groups:
        console.print(
            f"[yellow]warning:[/] the global batch ({global_batch} groups of rows) is larger than the "
            f"training data ({groups}): rows repeat within a step"
        )
    optimizer = build_optimizer(engine.model, cfg.train, cfg.parallel, dims.dp_mesh(mesh))
    scheduler = build_scheduler(optimizer, total, cfg.train)
    warn = lambda message: console.print(f"[yellow]warning:[/] {message}")  # noqa: E731
    vocab_rows = padded_vocab(model_config.vocab_size, dims.tp)
    # Sequence parallel splits every row's tokens evenly over the TP ranks. A pipeline builds a schedule
    # per micro-batch shape: widths rounded to 1/8 of max_length keep the number of shapes small.
    multiple = dims.tp if cfg.parallel.sequence_parallel else 1
    if dims.cp > 1:  # 2 x cp chunks per row (each rank's part split again by sequence parallel)
        multiple = math.lcm(multiple, row_multiple(dims, cfg.parallel.sequence_parallel))
    if plan is not None:
        multiple = math.lcm(multiple, max(1, cfg.data.max_length // 8))
    split = (cfg.train.micro_batch, grad_accum, dims.dp, dims.dp_rank(mesh))
    collate = (objective.collate, tokenizer.pad_token_id, multiple)
    source: BatchSource
    if rl:
        defaults = GenerationDefaults.from_folder(cfg.model.path, tokenizer.eos_token_id)
        rewards = build_rewards(cfg.method.rl.rewards, cfg.method.rl.max_new_tokens, device)
        source = RolloutSource(
            prompts, cfg.method.rl, rewards, tokenizer, defaults, objective, engine, dims, mesh,
            precision.autocast, cfg.train.seed, split, multiple,
        )  # fmt: skip
    elif train_rows is not None:
        source = DatasetSource(train_rows, cfg.train.seed, *split, *collate)
    else:
        source = StreamSource(
            cfg.data, _reader_stage(objective), objective.encoder(tokenizer, cfg.data), cfg.train.seed, split,
            *collate,
        )  # fmt: skip
    data_id = len(train_rows.rows) if train_rows is not None else source.identity()
    critic = getattr(model, "critic", None)  # PPO's separate critic model: checkpointed with the policy
    critic_config = critic.config if critic is not None else None
    sig = signature(
        model_config, vocab_rows, global_batch, data_id, cfg.train.seed, _finetuning(cfg), critic_config
    )
    parts = (engine.model, optimizer, scheduler, precision)
    layout = (dims.world_size, dims.describe())
    checkpoints = CheckpointManager(run_dir / "checkpoints", cfg.checkpoint, sig, parts, layout, warn)
    # Only rank 0 logs MFU, so only it probes: the other ranks wait at their first collective meanwhile
    # instead of competing for the cores the probe measures.
    shapes = model_gemm_shapes(model_config, cfg.train.micro_batch * cfg.data.max_length, dims.tp)
    peak = (
        peak_flops(device, precision.dtype, cfg.hardware.peak_flops, shapes)
        if is_main
        else (cfg.hardware.peak_flops or math.nan, "rank 0 measures the peak")
    )
    return Run(
        cfg, console, run_dir, device, dims, mesh, plan, is_main, owns, tokenizer, objective, precision,
        train_rows, eval_rows, model_config, engine, optimizer, scheduler, checkpoints, source, grad_accum,
        global_batch, total, multiple, peak, spec_for(model_config.family).costs(model_config), trained, moe,
        estimate,
    )  # fmt: skip


def _rl_prompts(cfg: Config, tokenizer: Any, console: Console) -> list:
    """An RL stage's prompts, with how many did not leave room for max_new_tokens."""
    room = cfg.data.max_length - cfg.method.rl.max_new_tokens
    prompts, too_long = load_prompts(cfg.data, tokenizer, room)
    if cfg.data.eval:
        console.print(
            f"[yellow]warning:[/] stage {cfg.method.stage} does not evaluate: data.eval is not read"
        )
    console.print(
        f"train prompts: {len(prompts)}, {cfg.method.rl.group_size} completions each per rollout"
        + (f"; {too_long} left out (longer than {room} tokens)" if too_long else "")
    )
    return prompts


def _auto_from_rank_0(cfg: Config, world: int, shape: Any) -> Config:
    """`parallel: auto` on ranks started by torchrun or srun: rank 0 searches and every rank takes its layout
    (searches on different machines, or with differently measured peaks, could choose differently). Rank
    0's error, when nothing fits, is every rank's."""
    message: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            message[0] = preflight(cfg, world, shape)[0].model_dump()
        except ConfigError as exc:
            message[0] = str(exc)
    dist.broadcast_object_list(message, src=0)
    if isinstance(message[0], str):
        raise ConfigError(message[0])
    return Config.model_validate(message[0])


def _finetuning(cfg: Config) -> dict | None:
    """What a parameter-efficient run's checkpoint depends on besides itself: the method's settings and the
    base it does not hold (re-read from model.path on resume). None for full fine-tuning."""
    method = cfg.method
    if method.finetuning == "full":
        return None
    settings = method.lora if method.finetuning == "lora" else method.freeze
    weights = sorted(Path(cfg.model.path).glob("*.safetensors")) if cfg.model.path else []
    base = file_fingerprint(weights) if weights else f"preset {cfg.model.preset}"
    identity = {"method": method.finetuning, "settings": settings.model_dump(), "base": base}
    return json.loads(json.dumps(identity))  # as the checkpoint stores it (lists, not tuples)


def _reader_stage(objective: Objective) -> str:
    """How the readers present records: text (pt), chat (sft) or preference pairs (pref)."""
    return getattr(objective, "reader_stage", "pt" if objective.reads_text else "sft")


def _precompute_reference(
    cfg: Config,
    tokenizer: Any,
    objective: Objective,
    model: torch.nn.Module | None,
    train_rows: RowSet | None,
    eval_rows: RowSet | None,
    run_dir: Path,
    device: torch.device,
    precision: Precision,
    console: Console,
) -> None:
    """`ref: precompute` with the starting policy: `model` itself before any layout, or (a pipeline rank holds
    only its stages) a whole copy built for this pass and dropped after it."""
    if train_rows is None:
        raise ConfigError("method.pref.ref=precompute needs the training data cached, not data.streaming")
    if model is None:
        model = build_model(cfg.model, tokenizer, cfg.train.seed, device)
        apply_finetuning(model, cfg.method, cfg.train.seed, cfg.model.adapter)
    # What the starting policy's log-probs depend on (fresh LoRA adapters change nothing: B starts at 0).
    identity = {"model": cfg.model.model_dump(), "seed": cfg.train.seed, "precision": cfg.train.precision}
    rowsets = {"train": train_rows, "eval": eval_rows}
    precompute_reference(
        objective, model, rowsets, run_dir, json.loads(json.dumps(identity)),
        cfg.train.micro_batch, tokenizer.pad_token_id, precision.autocast, console.print,
    )  # fmt: skip


def build_data(
    cfg: Config, tokenizer: Any, objective: Objective, console: Console, builder: bool | None = None
) -> tuple[RowSet | None, RowSet | None]:
    """Train and eval rows through the dataset cache (local rank 0 builds it, unless `builder` says). With
    data.streaming the training files are streamed (no train rows here) and only the eval files cached."""
    data, stage = cfg.data, _reader_stage(objective)
    if data.streaming:
        if objective.group_size > 1:
            raise ConfigError(
                f"data.streaming: objective {objective.name} trains on groups of {objective.group_size} "
                f"sequences, which a stream does not keep together; set data.streaming=false"
            )
        shards = stream_shards(data.train, stage)  # errors in the file list show before any step
        console.print(
            f"train data: streamed from {len(shards)} file(s), {data.stream_window} records packed together"
        )
        if not data.eval:
            return None, None
        only_eval = data.model_copy(update={"train": data.eval, "eval": [], "streaming": False})
        evaluation, _ = _cached_rows(cfg, only_eval, tokenizer, objective, console, builder, ("eval",))
        return None, evaluation
    return _cached_rows(cfg, data, tokenizer, objective, console, builder, ("train", "eval"))


def _cached_rows(
    cfg: Config,
    data: DataSection,
    tokenizer: Any,
    objective: Objective,
    console: Console,
    builder: bool | None,
    names: tuple[str, ...],
) -> tuple[RowSet, RowSet | None]:
    """The rows of `data` (its train and eval files, called `names`) through the dataset cache."""
    encoder = objective.encoder(tokenizer, data)
    cache, encoders = None, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # ranks of this node that encode
    if data.cache:
        root = Path(data.cache_dir) if data.cache_dir else default_root()
        builder = local_rank_from_env() == 0 if builder is None else builder
        cache, encoders = DatasetCache(root, builder, console.print), 1
    workers = data.workers or max(1, len(os.sched_getaffinity(0)) // encoders)
    identity = _encoding_identity(tokenizer, objective, cfg)
    stage, seed = _reader_stage(objective), cfg.train.seed
    rows = build_datasets(data, stage, encoder, seed, objective.group_size, cache, identity, workers)
    for what, part in zip(names, rows, strict=False):
        if part is not None:
            console.print(f"{what} data: {_describe_rows(part, cfg)}")
    return rows


def prepare_data(cfg: Config, console: Console) -> dict[str, Any]:
    """Build the dataset cache ahead of a job (`shardforge data prepare`) and report what it holds."""
    if not cfg.data.cache:
        raise ConfigError("data.cache=false: there is no dataset cache to prepare (set data.cache=true)")
    _, tokenizer = model_source(cfg.model)
    rows = build_data(cfg, tokenizer, build_objective(cfg.method), console, builder=True)
    report = {}
    for what, part in zip(("train", "eval"), rows, strict=True):
        if part is None:
            continue
        lengths = part.examples.lengths
        edges = [0, *(2**k for k in range(4, 17)), 2**62]  # tokens per sequence: 0-16, 16-32, ... 64k+
        counts, _ = np.histogram(lengths, bins=edges)
        report[what] = {
            "records": part.stats.records,
            "sequences": len(part.examples),
            "tokens": part.num_tokens,
            "targets": part.num_targets,
            "truncated": part.stats.truncated,
            "dropped_no_target": len(part.stats.dropped_no_target),
            "rows": len(part.rows),
            "row_fill": part.num_tokens / (len(part.rows) * cfg.data.max_length),
            "length_histogram": {
                f"{lo}-{hi}": int(n) for lo, hi, n in zip(edges, edges[1:], counts, strict=False) if n
            },
        }
    return report


def _encoding_identity(tokenizer: Any, objective: Objective, cfg: Config) -> dict:
    """What encoding depends on besides the data: the tokenizer (its files, size and chat template), the
    objective (its settings and code) and the encoding code."""
    folder = Path(getattr(tokenizer, "name_or_path", "") or ".")
    tokenizer_files = [p for p in folder.iterdir() if p.is_file()] if folder.is_dir() else []
    code = [
        Path(inspect.getfile(cls))
        for cls in type(objective).__mro__
        if cls.__module__.startswith("shardforge")
    ]
    return {
        "tokenizer": (
            file_fingerprint(tokenizer_files),
            len(tokenizer),
            getattr(tokenizer, "chat_template", None),
        ),
        "objective": (objective.name, objective.group_size, objective.reads_text, cfg.method.model_dump()),
        "code": code_fingerprint(code),
    }


def _describe_rows(rows: RowSet, cfg: Config) -> str:
    fill = rows.num_tokens / (len(rows.rows) * cfg.data.max_length)
    mode = f"packed into {len(rows.rows)} rows ({fill:.0%} full)" if cfg.data.packing else "one per row"
    if rows.group_size > 1:
        mode = f"{rows.num_groups} groups of {rows.group_size} rows"
    return (
        f"{rows.stats.summary()}; {len(rows.examples)} examples, {rows.num_tokens} tokens, "
        f"{rows.num_targets} targets, {mode}"
    )


def metrics_for(run: Run, start_step: int, warn: Callable[[str], None]) -> MetricsProcessor:
    """The run's metrics processor: JSONL/TensorBoard sinks and the plot on rank 0 only."""
    log = run.config.log
    writer = None
    if run.is_main:
        trackers = open_trackers(log, run.run_dir, start_step, warn)
        writer = MetricsWriter(run.run_dir, trackers, run.console, start_step)
    # The schedule's theoretical idle share, next to the measured step time.
    static = {"pp_bubble": run.plan.bubble_fraction} if run.plan is not None else {}
    plot = run.run_dir / "loss.png" if log.plot else None
    world = run.dims.world_size
    flops = partial(run.costs.train_flops, trained=run.trained)  # frozen weights need no weight gradients
    return MetricsProcessor(run.objective, flops, run.peak, world, run.device, warn, writer, plot, static)


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
