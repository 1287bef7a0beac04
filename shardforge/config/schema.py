"""The one typed config tree. Every face (YAML, CLI overrides, web form) produces this object; the data,
method and parallel sections have files of their own."""

from __future__ import annotations

import math
from typing import Annotated, Literal

from pydantic import Field, model_validator

from shardforge.config.data_schema import DataSection
from shardforge.config.method_schema import EXPERT_TARGETS, MethodSection
from shardforge.config.optimizers import OptimizerSection
from shardforge.config.parallel_schema import ParallelSection
from shardforge.config.paths import FileRef
from shardforge.config.section import FilePath, ModelPath, Section


class ModelSection(Section):
    path: ModelPath | None = None
    preset: str | None = None
    tokenizer: FilePath | None = None
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    adapter: ModelPath | None = None  # a PEFT LoRA folder to start from (method.finetuning=lora)
    quantize: Literal["none", "nf4"] = "none"  # nf4: QLoRA, the frozen base's block linears in 4 bits
    # auto: our own implementation where the family has one, else transformers' modules (models/generic)
    backend: Literal["auto", "native", "hf"] = "auto"

    @model_validator(mode="after")
    def _one_source(self) -> ModelSection:
        if (self.path is None) == (self.preset is None):
            raise ValueError("set exactly one of model.path (an HF folder) or model.preset (a preset name)")
        if self.preset is not None and self.tokenizer is None:
            raise ValueError("model.preset needs model.tokenizer (a folder with a tokenizer)")
        return self


class ProfileSection(Section):
    """torch.profiler over a few steps (train/profiling.py): Chrome traces and where the time went."""

    start: int = Field(default=10, ge=1)  # the first profiled step (later than warm-up steps)
    steps: int = Field(default=3, ge=1)


class TrainSection(Section):
    steps: int | None = Field(default=200, gt=0)
    epochs: float | None = Field(default=None, gt=0)
    micro_batch: int = Field(default=8, ge=1)
    grad_accum: int = Field(default=1, ge=1)
    global_batch: int | None = Field(default=None, ge=1)
    lr: float = Field(default=3.0e-4, gt=0)
    min_lr_ratio: float = Field(default=0.1, ge=0, le=1)
    schedule: Literal["constant", "linear", "cosine"] = "cosine"
    warmup: int = Field(default=10, ge=0)
    warmup_ratio: float | None = Field(default=None, ge=0, lt=1)
    warmup_from_zero: bool = False  # transformers' warmup: step k at lr x k / warmup (LLaMA-Factory's runs)
    weight_decay: float = Field(default=0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = Field(default=1e-8, gt=0)
    optimizer: OptimizerSection = OptimizerSection()
    clip: float | None = Field(default=1.0, gt=0)
    # NEFTune: uniform noise of alpha / sqrt(L d) on the token embeddings while training (train/neftune.py)
    neftune_alpha: float | None = Field(default=None, gt=0)
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    seed: int = 0
    log_every: int = Field(default=10, ge=1)
    max_bad_steps: int = Field(default=5, ge=1)  # consecutive non-finite steps (skipped) before the run halts
    eval_every: int | None = Field(default=None, ge=1)
    compile: bool = False
    profile: ProfileSection | None = None  # {start, steps}: profile those steps (None: no profiling)

    @model_validator(mode="after")
    def _adam(self) -> TrainSection:
        if not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"train.betas={list(self.betas)}: each must be at least 0 and below 1")
        if not math.isfinite(self.eps):
            raise ValueError(f"train.eps={self.eps}: a finite positive number")
        return self

    @model_validator(mode="after")
    def _length(self) -> TrainSection:
        if self.steps is None and self.epochs is None:
            raise ValueError("set train.steps or train.epochs")
        return self


class CheckpointSection(Section):
    """Sharded training checkpoints (torch.distributed.checkpoint) under `<output_dir>/checkpoints`."""

    every: int | None = Field(default=None, ge=1)  # steps between checkpoints; None: none during the run
    keep: int | None = Field(default=3, ge=1)  # complete checkpoints kept (oldest deleted first); None: all
    resume: Annotated[str, FileRef(words=("auto", "none"))] = (
        "auto"  # auto (latest complete one in output_dir, if any) | none | a checkpoint folder
    )
    async_save: bool = False  # stage to host memory, write in the background while training continues
    save_final: bool = True  # the HF-format model in <output_dir>/final
    # MoE experts in exported folders: one tensor per expert (published checkpoints) or transformers 5's 3-D
    expert_layout: Literal["per_expert", "fused"] = "per_expert"


Tracker = Literal["tensorboard", "mlflow", "wandb"]


class LogSection(Section):
    """Where metric records go besides metrics.jsonl and the console (train/tracking.py)."""

    # as LLaMA-Factory's report_to; [] or none: no tracker
    report_to: list[Tracker] = ["tensorboard"]  # noqa: RUF012 (a pydantic field: copied per instance)
    tracking_uri: Annotated[str, FileRef(urls=True)] | None = (
        None  # MLflow: a server URL or a folder (None: <output_dir>/mlruns)
    )
    experiment: str | None = None  # the MLflow experiment / W&B project (None: "shardforge")
    run_name: str | None = None  # the tracked run's name (None: the output folder's name)
    plot: bool = True
    progress: bool = True
    all_ranks: bool = False  # every rank's log lines (each naming its rank), not rank 0's alone

    @model_validator(mode="before")
    @classmethod
    def _spellings(cls, data: object) -> object:
        """`report_to: mlflow` and `none` as LLaMA-Factory writes them; `tensorboard: false` (the older key)
        removes TensorBoard from report_to, `true` adds it."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        names = data.get("report_to", ["tensorboard"])
        if isinstance(names, str):
            names = [] if names == "none" else [n.strip() for n in names.split(",")]
        if "tensorboard" in data:
            on = data.pop("tensorboard")
            names = [n for n in names if n != "tensorboard"] + (["tensorboard"] if on else [])
        data["report_to"] = list(dict.fromkeys(names)) if isinstance(names, list) else names
        return data

    @property
    def tensorboard(self) -> bool:
        return "tensorboard" in self.report_to


class HardwareSection(Section):
    """The devices a run uses, and the cluster the planner plans for (planner/hardware.py): a preset's
    figures (None: the device this process sees), with any of them overridden."""

    device: Literal["auto", "cpu", "cuda"] = "auto"
    peak_flops: float | None = Field(default=None, gt=0)
    threads: int | None = Field(default=None, ge=1)
    preset: str | None = None  # h100, h200, a100-40, a100-80, l40s, h20, ascend-910b, cpu
    nodes: int = Field(default=1, ge=1)
    devices_per_node: int | None = Field(default=None, ge=1)  # None: the processes / nodes
    memory_gib: float | None = Field(default=None, gt=0)  # per device
    intra_node_gbps: float | None = Field(default=None, gt=0)  # GB/s per device and direction
    inter_node_gbps: float | None = Field(default=None, gt=0)
    # any other preset figure by name, e.g. {host_gbps: 25, overlap: 0.5}
    figures: dict[str, float] = {}  # noqa: RUF012 (a pydantic field: copied per instance)


def expand_shorthands(tree: object) -> object:
    """`parallel: auto` is `parallel: {auto: true}` (so dotted overrides can reach into it); in place."""
    if isinstance(tree, dict) and tree.get("parallel") == "auto":
        tree["parallel"] = {"auto": True}
    return tree


class Config(Section):
    output_dir: FilePath = "runs/default"

    @model_validator(mode="before")
    @classmethod
    def _parallel_auto(cls, data: object) -> object:
        return expand_shorthands(dict(data)) if isinstance(data, dict) else data

    model: ModelSection
    data: DataSection
    method: MethodSection = MethodSection()
    parallel: ParallelSection = ParallelSection()
    train: TrainSection = TrainSection()
    checkpoint: CheckpointSection = CheckpointSection()
    log: LogSection = LogSection()
    hardware: HardwareSection = HardwareSection()

    @model_validator(mode="after")
    def _peft_settings(self) -> Config:
        if self.model.quantize == "nf4" and not self.method.adapters:
            raise ValueError(
                f"model.quantize=nf4 freezes the base in 4 bits, so only adapters can train: set "
                f"method.finetuning=lora or oft (it is {self.method.finetuning})"
            )
        if self.model.quantize == "nf4" and self.parallel.tp > 1:
            raise ValueError(
                f"model.quantize=nf4 with parallel.tp={self.parallel.tp}: NF4 weights are not split by "
                f"tensor parallel here; use data parallel (zero_stage=3 shards them) or pipeline parallel"
            )
        experts = self.method.finetuning == "lora" and self.method.lora.targets != "all"
        experts = experts and [t for t in self.method.lora.targets if t in EXPERT_TARGETS]
        split = {k: v for k, v in (("tp", self.parallel.tp), ("ep", self.parallel.ep)) if v > 1}
        if experts and split:
            layout = ", ".join(f"parallel.{k}={v}" for k, v in split.items())
            raise ValueError(
                f"method.lora.targets {', '.join(experts)} with {layout}: adapters on the fused experts "
                f"are not split across ranks here; use data or pipeline parallel, or adapt the linears only"
            )
        if self.method.lora.init == "pissa" and self.method.finetuning == "lora":
            refused = {"model.quantize=nf4": self.model.quantize == "nf4",
                       f"model.adapter={self.model.adapter!r}": self.model.adapter is not None,
                       f"parallel.tp={self.parallel.tp}": self.parallel.tp > 1}  # fmt: skip
            for what, bad in refused.items():
                if bad:
                    raise ValueError(
                        f"method.lora.init=pissa with {what}: PiSSA starts new adapters from a "
                        f"full-precision base's singular vectors, held whole on each rank (init: default "
                        f"works with it)"
                    )
        if self.method.lora.plus_lr_ratio is not None and self.method.finetuning != "lora":
            raise ValueError(
                f"method.lora.plus_lr_ratio (LoRA+) with method.finetuning={self.method.finetuning}: it sets "
                f"the learning rate of LoRA's B matrices; set method.finetuning: lora, or drop it"
            )
        if self.method.finetuning == "oft":
            refused = {f"parallel.tp={self.parallel.tp}": self.parallel.tp > 1,
                       "method.vision.freeze_tower=false": not self.method.vision.freeze_tower}  # fmt: skip
            for what, bad in refused.items():
                if bad:
                    raise ValueError(
                        f"method.finetuning=oft with {what}: OFT adapts the decoder's linears, each held "
                        f"whole on its rank (method.finetuning=lora works with it)"
                    )
        if self.model.adapter is not None and self.method.finetuning != "lora":
            raise ValueError(
                f"model.adapter={self.model.adapter!r} starts from a LoRA adapter: set "
                f"method.finetuning=lora (it is {self.method.finetuning})"
            )
        return self

    @model_validator(mode="after")
    def _last_turn(self) -> Config:
        if self.data.mask_history and (self.method.stage != "sft" or self.data.train_on_prompt):
            raise ValueError(
                f"data.mask_history trains on the last assistant turn of a conversation: stage sft only, "
                f"without data.train_on_prompt (it is stage {self.method.stage}, train_on_prompt "
                f"{self.data.train_on_prompt})"
            )
        return self

    @model_validator(mode="after")
    def _streaming(self) -> Config:
        if not self.data.streaming:
            return self
        if self.train.epochs is not None:
            raise ValueError(
                f"train.epochs={self.train.epochs}: with data.streaming the corpus length is not known "
                f"ahead; set train.steps instead"
            )
        if self.data.eval_fraction > 0 or self.data.eval_count:
            held = (
                f"data.eval_count={self.data.eval_count}"
                if self.data.eval_count
                else (f"data.eval_fraction={self.data.eval_fraction}")
            )
            raise ValueError(
                f"{held}: a stream cannot hold out a share of its records; give evaluation files in "
                "data.eval instead"
            )
        return self

    @model_validator(mode="after")
    def _neftune(self) -> Config:
        degrees = (("tp", self.parallel.tp), ("cp", self.parallel.cp), ("pp", self.parallel.pp))
        split = {k: v for k, v in degrees if v > 1}
        if self.train.neftune_alpha is not None and split:
            layout = ", ".join(f"parallel.{k}={v}" for k, v in split.items())
            raise ValueError(
                f"train.neftune_alpha with {layout}: NEFTune draws each row's noise from the whole row's "
                f"tokens on the rank that embeds it; use data parallel (any zero_stage) instead"
            )
        return self

    @model_validator(mode="after")
    def _master_weights(self) -> Config:
        if self.train.precision == "fp16" and self.model.dtype != "float32":
            raise ValueError(
                f"train.precision=fp16 keeps fp32 master weights and scales the loss: "
                f"set model.dtype=float32 "
                f"(it is {self.model.dtype})"
            )
        return self
