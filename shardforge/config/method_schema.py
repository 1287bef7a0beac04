"""The config's method section: the stage, the finetuning kind, and each stage's and adapter's settings."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from shardforge.config.paths import FileRef
from shardforge.config.section import ModelPath, Section, StageName

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
    extra_modules: list[Literal["embed_tokens", "norm", "lm_head"]] = []  # noqa: RUF012 (pydantic copies it)
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
