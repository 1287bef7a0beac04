"""The one typed config tree. Every face (YAML, CLI overrides, web form) produces this object."""

from __future__ import annotations

import math
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from shardforge.config.optimizers import OptimizerSection
from shardforge.config.paths import FileRef
from shardforge.config.stages import STAGES, Choices, known_stage

# A key whose value is a file or folder (config/paths.py); the web UI keeps all of them inside its root.
FilePath = Annotated[str, FileRef()]
ModelPath = Annotated[str, FileRef(model=True)]  # a model to load, which may read other folders besides

# A registered stage name (config/stages.py); the web form offers the registry's names.
StageName = Annotated[str, AfterValidator(known_stage), Choices(lambda: STAGES)]


class Section(BaseModel):
    """Base for every config section: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


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


DataFormat = Literal["alpaca", "sharegpt", "openai", "text"]


class DatasetSpec(Section):
    """One dataset: a file in a known format, or a named entry of a LLaMA-Factory dataset_info.json."""

    path: FilePath | None = None
    format: DataFormat | None = None
    name: str | None = None
    dataset_info: FilePath | None = None
    text_column: str = "text"
    max_samples: int | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _one_source(self) -> DatasetSpec:
        if self.path is not None and self.name is not None:
            raise ValueError("set either path (+ format) or name (+ dataset_info), not both")
        if self.path is None and self.name is None:
            raise ValueError("a dataset needs path (+ format) or name (+ dataset_info)")
        if self.name is not None and self.dataset_info is None:
            raise ValueError(f"dataset name {self.name!r} needs dataset_info (path to dataset_info.json)")
        return self


class DataSection(Section):
    train: list[DatasetSpec] = Field(min_length=1)
    eval: list[DatasetSpec] = []
    max_length: int = Field(default=1024, ge=8)
    packing: bool = True
    train_on_prompt: bool = False
    template: Literal["auto", "chatml"] = "auto"
    truncation: Literal["right", "error", "lf"] = "right"
    pt_blocks: bool = False  # pt: documents concatenated and cut in max_length blocks (LLaMA-Factory's)
    default_system: str | None = None  # the system message of conversations that have none
    # passed to the chat template as enable_thinking (Qwen3-style: false puts an empty thought in the prompt
    # and trains without the replies' thoughts; true trains on the thought); None: not passed
    enable_thinking: bool | None = None
    # images of a vision-language model's data resized into this many pixels first (LLaMA-Factory's
    # image_max_pixels / image_min_pixels), then through the model's own image processor
    image_max_pixels: int = Field(default=768 * 768, ge=1)
    image_min_pixels: int = Field(default=32 * 32, ge=1)
    mix: Literal["concat", "interleave_under", "interleave_over"] = "concat"  # several data sets (mixing.py)
    mix_probs: list[float] | None = None  # interleaving: each data set's chance per record (None: in turn)
    mask_history: bool = False  # sft: targets on the last assistant turn only (LLaMA-Factory's)
    eval_fraction: float = Field(default=0.0, ge=0.0, lt=1.0)
    eval_count: int | None = Field(default=None, ge=1)  # hold out this many records instead (LF's val_size N)
    cache: bool = True  # tokenize once into memory-mapped arrays, reused by later runs and every rank
    cache_dir: FilePath | None = None  # None: $XDG_CACHE_HOME/shardforge/datasets (~/.cache/...)
    workers: int | None = Field(default=None, ge=1)  # encoding processes; None: the cores (shared by a node)
    streaming: bool = False  # read, tokenize and pack the training files on the fly (too large to cache)
    stream_window: int = Field(default=4096, ge=1)  # records shuffled and packed together when streaming

    @model_validator(mode="after")
    def _mixing(self) -> DataSection:
        probs = self.mix_probs
        if probs is None:
            return self
        if self.mix == "concat":
            raise ValueError("data.mix_probs: only with data.mix interleave_under or interleave_over")
        for what, sets in (("train", self.train), ("eval", self.eval)):
            if sets and len(sets) != len(probs):
                raise ValueError(f"data.mix_probs has {len(probs)} values for {len(sets)} data.{what} sets")
        if any(p < 0 for p in probs) or abs(sum(probs) - 1) > 1e-6:
            raise ValueError(f"data.mix_probs {probs}: chances of at least 0 that sum to 1")
        return self


LINEAR_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# a mixture of experts' fused 3-D expert weights (adapters/expert_lora.py; peft's target_parameters), in the
# order transformers registers them
EXPERT_TARGETS = ("experts.gate_up_proj", "experts.down_proj")


class LoraSection(Section):
    """LoRA as PEFT defines it: W x + (alpha / rank) B A x (alpha / sqrt(rank) with rslora), A
    kaiming-uniform, B zero; DoRA adds a magnitude per output row over the row norms of W + BA (detached)."""

    rank: int = Field(default=8, ge=1)
    alpha: float = Field(default=16.0, gt=0)
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    # all: every linear of the decoder blocks (docs/config.md says per family kind), or module names; the
    # fused experts only when named (EXPERT_TARGETS)
    targets: Literal["all"] | list[str] = "all"
    dora: bool = False
    rslora: bool = False
    # LoRA+ (Hayou et al. 2024): B trains at train.lr times this ratio (LLaMA-Factory's loraplus_lr_ratio)
    plus_lr_ratio: float | None = Field(default=None, gt=0)
    # PiSSA (Meng et al. 2024; LLaMA-Factory's pissa_init): A and B start from W's principal singular
    # directions (adapters/lora.py says how the base stays as it was)
    init: Literal["default", "pissa"] = "default"
    pissa_iter: int = Field(default=16, ge=-1)  # fast SVD's iterations (peft's pissa_niter_N); -1: full SVD

    @model_validator(mode="after")
    def _pissa(self) -> LoraSection:
        if self.init == "pissa" and self.dora:
            raise ValueError("method.lora.init=pissa with dora: PiSSA starts plain LoRA; set dora: false")
        return self

    @model_validator(mode="after")
    def _known_targets(self) -> LoraSection:
        if self.targets == "all":
            return self
        if not self.targets:
            raise ValueError("method.lora.targets is empty; give module names or all")
        unknown = [t for t in self.targets if t not in LINEAR_TARGETS + EXPERT_TARGETS]
        if unknown:
            raise ValueError(
                f"method.lora.targets: unknown module {', '.join(map(repr, unknown))}; valid: all, or "
                f"some of {', '.join(LINEAR_TARGETS + EXPERT_TARGETS)}"
            )
        experts = [t for t in self.targets if t in EXPERT_TARGETS]
        if experts and self.init == "pissa":
            raise ValueError(
                f"method.lora.targets {', '.join(experts)}: PiSSA initialises linears' adapters; the fused "
                f"experts take the default init (init: default), or leave them out of the targets"
            )
        if experts and (self.dora or self.dropout):
            raise ValueError(
                f"method.lora.targets {', '.join(experts)}: the fused experts take neither dora nor dropout "
                f"(peft's adapter on a 3-D weight has neither); set dora: false and dropout: 0"
            )
        return self


class OFTSection(Section):
    """OFT as peft defines it (LLaMA-Factory's finetuning_type: oft): each adapted linear's input rotated by
    a block-diagonal orthogonal matrix of blocks `block_size` wide (adapters/oft.py)."""

    block_size: int = Field(default=32, ge=2)  # peft's oft_block_size (adjusted per layer to a divisor)
    targets: Literal["all"] | list[str] = "all"
    # peft's use_cayley_neumann: the Cayley transform by its 5-term Neumann series, else solved exactly
    cayley_neumann: bool = True

    @model_validator(mode="after")
    def _known_targets(self) -> OFTSection:
        if self.targets != "all":
            unknown = [t for t in self.targets if t not in LINEAR_TARGETS]
            if unknown or not self.targets:
                raise ValueError(
                    f"method.oft.targets: {', '.join(map(repr, unknown)) or 'empty'}; valid: all, or some of "
                    f"{', '.join(LINEAR_TARGETS)}"
                )
        return self


class FreezeSection(Section):
    """Freeze tuning: the last N decoder layers train (negative: the first N), plus named modules."""

    trainable_layers: int = 2
    extra_modules: list[Literal["embed_tokens", "norm", "lm_head"]] = []
    # LLaMA Pro (LLaMA-Factory's use_llama_pro): a model expanded by `shardforge expand` trains its new
    # blocks, the last of every (layers / trainable_layers): trainable_layers is the number of blocks added
    llama_pro: bool = False

    @model_validator(mode="after")
    def _some_layers(self) -> FreezeSection:
        if self.trainable_layers == 0 and not self.extra_modules:
            raise ValueError("method.freeze: trainable_layers=0 and no extra_modules leaves nothing to train")
        if self.llama_pro and self.trainable_layers <= 0:
            raise ValueError(
                f"method.freeze.llama_pro: trainable_layers={self.trainable_layers}; give the number of "
                f"blocks `shardforge expand` added (a positive number)"
            )
        return self


class PrefSection(Section):
    """Preference training (stages dpo and kto): the loss, its hyper-parameters and the reference model.

    ref: auto = the policy with its adapters disabled for LoRA (no second copy), a frozen copy of the
    starting weights otherwise (sharded as the policy is); precompute = the starting policy's log-probs of
    every sequence, computed once before training (then no reference model is held, under any layout); a
    folder = that HF model, or that PEFT adapter on its base; none = no reference (only orpo and simpo)."""

    loss: Literal["sigmoid", "ipo", "hinge", "robust", "orpo", "simpo"] = "sigmoid"
    beta: float = Field(default=0.1, gt=0)
    label_smoothing: float = Field(default=0.0, ge=0, lt=0.5)
    ftx: float = Field(default=0.0, ge=0)
    simpo_gamma: float = 0.5
    ref: Annotated[str, FileRef(("auto", "none", "precompute"), model=True)] = Field(
        default="auto", min_length=1
    )


class KTOSection(Section):
    """Stage kto: beta, and the weights of desirable and undesirable examples' losses."""

    beta: float = Field(default=0.1, gt=0)
    desirable_weight: float = Field(default=1.0, gt=0)
    undesirable_weight: float = Field(default=1.0, gt=0)


class RewardSpec(Section):
    """One reward function of an RL stage (objectives/rewards.py): a built-in `name` (math_answer, format,
    length), an import path `pkg.mod:fn`, or `model`: a reward model folder from stage rm; its `weight` in
    the sum. `pattern`: the format reward's regex; `cache`: the length reward's soft zone in tokens
    (DAPO's L_cache; default max_new_tokens / 4)."""

    name: str | None = None
    model: ModelPath | None = None
    weight: float = 1.0
    pattern: str | None = None
    cache: int | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _one_kind(self) -> RewardSpec:
        if (self.name is None) == (self.model is None):
            raise ValueError(
                "a reward needs either name (math_answer, format, length or pkg.mod:fn) or model"
            )
        return self


class RLSection(Section):
    """Stages grpo and ppo: rollouts (group_size completions per prompt, sampled by the inference engine on
    the training weights), the rewards, and the clipped policy loss with its token aggregation (TRL's
    definitions of grpo, dapo and dr_grpo). kl_beta > 0 adds the k3 KL estimate against the reference model
    (method.pref.ref: auto = adapters disabled for LoRA, else a frozen copy)."""

    group_size: int = Field(default=8, ge=1)
    max_new_tokens: int = Field(default=256, ge=1)
    temperature: float = Field(default=1.0, gt=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    loss: Literal["grpo", "dapo", "dr_grpo"] = "dapo"
    clip: tuple[float, float] = (0.2, 0.28)
    kl_beta: float = Field(default=0.0, ge=0)
    scale_rewards: Literal["group", "batch", "none"] = "group"
    epochs_per_rollout: int = Field(default=1, ge=1)
    rewards: list[RewardSpec] = Field(default_factory=lambda: [RewardSpec(name="math_answer")], min_length=1)
    filter_groups: bool = False

    @model_validator(mode="after")
    def _clip_range(self) -> RLSection:
        low, high = self.clip
        if not (0 < low < 1 and high > 0):
            raise ValueError(f"clip={list(self.clip)}: expected [low, high] with 0 < low < 1 and high > 0")
        return self


class PPOSection(Section):
    """Stage ppo: GAE's gamma and lambda, the value loss's weight and clip range, and the critic: a value
    head on the policy (`head`; `auto` is the same), or a separate critic model, a folder (an `rm` run's
    output, or any HF model of the policy's vocabulary, given a fresh one-output score head), trained whole
    beside the policy."""

    gamma: float = Field(default=1.0, ge=0, le=1)
    lam: float = Field(default=0.95, ge=0, le=1)
    vf_coef: float = Field(default=0.1, ge=0)
    value_clip: float = Field(default=0.2, gt=0)
    critic: Annotated[str, FileRef(("auto", "head"), model=True)] = Field(default="auto", min_length=1)

    @property
    def critic_folder(self) -> str | None:
        """The separate critic model's folder; None for a value head on the policy (`auto`, `head`)."""
        return None if self.critic in ("auto", "head") else self.critic


class MoESection(Section):
    """How a mixture-of-experts model keeps its experts' loads even (models/moe.py; MoE models only)."""

    balance: Literal["aux_loss", "bias", "none"] = "aux_loss"  # bias: DeepSeek-V3's aux-loss-free method
    aux_loss_coef: float | None = Field(default=None, ge=0)  # None: the checkpoint's router_aux_loss_coef
    z_loss_coef: float = Field(default=0.0, ge=0)  # ST-MoE's router z-loss
    bias_rate: float = Field(default=1e-3, gt=0)  # balance=bias: the bias's step per update
    capacity_factor: float | None = Field(default=None, gt=0)  # None: dropless

    @model_validator(mode="after")
    def _one_balance(self) -> MoESection:
        if self.balance != "aux_loss" and self.aux_loss_coef:
            raise ValueError(
                f"method.moe.aux_loss_coef={self.aux_loss_coef} is set, but method.moe.balance="
                f"{self.balance} uses no auxiliary loss: set balance: aux_loss, or remove aux_loss_coef"
            )
        return self


class VisionSection(Section):
    """Which parts of a vision-language model train (LLaMA-Factory's freeze_vision_tower,
    freeze_multi_modal_projector, freeze_language_model, with its defaults): the tower and the projector
    stay frozen unless set false; a text model ignores the section."""

    freeze_tower: bool = True
    freeze_projector: bool = True
    freeze_language_model: bool = False

    def tower_passes(self, finetuning: str) -> int:
        """Forward passes' worth of work an image's patches cost in the tower per step: 1 frozen (nothing
        before it needs a gradient), 2 with adapters in it (input gradients), 3 trained (and weights')."""
        return 1 if self.freeze_tower else 2 if finetuning == "lora" else 3


class SFTSection(Section):
    """Supervised fine-tuning's token loss: cross-entropy, or DFT (Wu et al. 2025, "On the Generalization of
    SFT"; LLaMA-Factory's use_dft_loss): each target token's cross-entropy weighted by its probability,
    detached, which rescales SFT's gradient the way a policy gradient with that reward would."""

    loss: Literal["cross_entropy", "dft"] = "cross_entropy"


class MethodSection(Section):
    stage: StageName = "sft"
    finetuning: Literal["full", "freeze", "lora", "oft"] = "full"
    lora: LoraSection = LoraSection()
    oft: OFTSection = OFTSection()
    freeze: FreezeSection = FreezeSection()
    sft: SFTSection = SFTSection()
    vision: VisionSection = VisionSection()
    pref: PrefSection = PrefSection()
    kto: KTOSection = KTOSection()
    rl: RLSection = RLSection()
    ppo: PPOSection = PPOSection()
    moe: MoESection = MoESection()

    @property
    def adapters(self) -> bool:
        """Adapters train over a frozen base (LoRA, OFT): the base with them switched off is the start."""
        return self.finetuning in ("lora", "oft")

    @model_validator(mode="after")
    def _reference(self) -> MethodSection:
        if self.pref.ref != "none":
            return self
        if self.stage == "kto":
            raise ValueError(
                "method.pref.ref=none: stage kto compares the policy with a reference model; use ref: auto"
            )
        if self.stage == "dpo" and self.pref.loss not in ("orpo", "simpo"):
            raise ValueError(
                f"method.pref.ref=none: the {self.pref.loss!r} loss needs a reference model; use ref: auto, "
                f"or a reference-free loss (orpo, simpo)"
            )
        return self


# Pipeline schedules by how many stages each rank runs, and which split backward (zero bubble).
ONE_STAGE_SCHEDULES = ("gpipe", "1f1b")
INTERLEAVED_SCHEDULES = ("interleaved_1f1b", "zero_bubble")  # pp_virtual >= 2 stages per rank
V_SCHEDULES = ("zbv", "dualpipev")  # exactly 2 stages per rank: r and 2pp-1-r
ZERO_BUBBLE_SCHEDULES = ("zero_bubble", "zbv", "dualpipev")


def zero_bubble_refusal(parallel: ParallelSection, replicas: int = 1, world_size: int = 1) -> str | None:
    """Why `parallel` may not run its zero-bubble schedule, else None: the schedule's weight-gradient pass
    does not reach FSDP2's gathered parameters, and DDP does not take pipeline stages, so it runs without
    data parallel. The one home of that rule: the config refuses what it knows (zero_stage >= 2),
    ParallelDims what the world size tells (the data-parallel `replicas` it resolved)."""
    if parallel.pp == 1 or parallel.pp_schedule not in ZERO_BUBBLE_SCHEDULES:
        return None
    if parallel.zero_stage >= 2:
        return (
            f"parallel.pp_schedule={parallel.pp_schedule} computes weight gradients in a pass of their own, "
            f"which does not reach FSDP2's gathered parameters (torch 2.13), so it cannot be combined "
            f"with data parallel: with parallel.zero_stage={parallel.zero_stage} use pp_schedule 1f1b, gpipe "
            f"or interleaved_1f1b"
        )
    if replicas > 1:
        return (
            f"parallel.pp_schedule={parallel.pp_schedule} cannot be combined with data parallel "
            f"({replicas} replicas here): use 1f1b, gpipe or interleaved_1f1b with "
            f"parallel.zero_stage 2 or 3, or use all {world_size} processes for pp x tp"
        )
    return None


class ParallelSection(Section):
    """Parallel layout. Degrees multiply to the world size; -1 on dp_shard means "the rest of the world".
    auto: the planner chooses every degree, ZeRO stage, checkpointing, offload and the micro-batch (for the
    same global batch) at launch; `parallel: auto` in YAML is short for `parallel: {auto: true}`."""

    auto: bool = False
    dp_replicate: int = Field(default=1, ge=1)
    dp_shard: int = Field(default=-1, ge=-1)
    tp: int = Field(default=1, ge=1)
    pp: int = Field(default=1, ge=1)
    cp: int = Field(default=1, ge=1)
    ep: int = Field(default=1, ge=1)
    cp_mode: Literal["allgather", "ulysses"] = "allgather"  # K/V all-gathered (Llama 3) or heads all-to-all
    zero_stage: Literal[0, 1, 2, 3] = 0
    offload: Literal["none", "optimizer", "params"] = "none"
    grad_compression: Literal["none", "fp16", "powersgd"] = "none"
    powersgd_rank: int = Field(default=1, ge=1)
    reduce_dtype: Literal["fp32", "bf16"] = "fp32"
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    timeout_minutes: float = Field(default=10.0, gt=0)
    sequence_parallel: bool = True
    activation_checkpoint: Literal["none", "full", "selective"] = "none"
    pp_schedule: Literal["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble", "zbv", "dualpipev"] = "1f1b"
    pp_microbatches: int | None = Field(default=None, ge=1)  # per micro-step; None: one per stage
    pp_virtual: int = Field(default=1, ge=1)  # stages per pipeline rank (interleaved and V schedules)
    pp_layers: str | None = None  # decoder layers per stage, e.g. "3,4,4,3"; None: balanced by cost

    @model_validator(mode="after")
    def _built_layouts_only(self) -> ParallelSection:
        if self.cp > 1 and self.dp_replicate > 1 and self.zero_stage >= 2:
            raise ValueError(
                f"parallel.cp={self.cp} with HSDP (dp_replicate={self.dp_replicate} x sharding): not "
                f"supported; use dp_replicate=1 (FSDP over dp_shard x cp) or zero_stage 0/1"
            )
        if self.ep > 1 and (self.zero_stage < 2 or self.dp_replicate > 1):
            raise ValueError(
                f"parallel.ep={self.ep} splits the experts over data-parallel ranks that shard the model: "
                f"set parallel.zero_stage to 2 or 3 and parallel.dp_replicate=1 (it is zero_stage="
                f"{self.zero_stage}, dp_replicate={self.dp_replicate})"
            )
        self._check_pipeline()
        if self.dp_shard == 0:
            raise ValueError("parallel.dp_shard must be >= 1, or -1 for the rest of the world")
        if self.offload != "none" and self.zero_stage < 2:
            raise ValueError(
                f"parallel.offload={self.offload} needs sharded states: set parallel.zero_stage to 2 or 3 "
                f"(it is {self.zero_stage})"
            )
        if self.grad_compression != "none" and self.zero_stage >= 2:
            raise ValueError(
                f"parallel.grad_compression={self.grad_compression} is a DDP communication hook: it needs "
                f"parallel.zero_stage 0 or 1 (it is {self.zero_stage})"
            )
        return self

    def _check_pipeline(self) -> None:
        if self.pp == 1:
            fields = ParallelSection.model_fields
            defaults = {k: field.default for k, field in fields.items() if k.startswith("pp_")}
            unused = [k for k, default in defaults.items() if getattr(self, k) != default]
            if unused:
                raise ValueError(
                    f"parallel.{unused[0]} is set but parallel.pp=1: set parallel.pp > 1 to use it"
                )
            return
        if self.pp_schedule in ONE_STAGE_SCHEDULES and self.pp_virtual != 1:
            raise ValueError(
                f"parallel.pp_schedule={self.pp_schedule} runs one stage per rank, but parallel.pp_virtual="
                f"{self.pp_virtual}: use interleaved_1f1b or zero_bubble for virtual stages, or pp_virtual=1"
            )
        if self.pp_schedule in INTERLEAVED_SCHEDULES and self.pp_virtual < 2:
            raise ValueError(
                f"parallel.pp_schedule={self.pp_schedule} interleaves several stages per rank: set "
                f"parallel.pp_virtual >= 2 (it is {self.pp_virtual})"
            )
        if (refused := zero_bubble_refusal(self)) is not None:
            raise ValueError(refused)
        if self.pp_schedule in V_SCHEDULES and self.pp_virtual != 2:
            raise ValueError(
                f"parallel.pp_schedule={self.pp_schedule} is V-shaped, exactly two stages per rank: set "
                f"parallel.pp_virtual=2 (it is {self.pp_virtual})"
            )


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

    report_to: list[Tracker] = ["tensorboard"]  # as LLaMA-Factory's report_to; [] or none: no tracker
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
    figures: dict[str, float] = {}  # any other preset figure by name, e.g. {host_gbps: 25, overlap: 0.5}


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
