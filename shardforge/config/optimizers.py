"""The optimizer a run uses (train.optimizer): AdamW, or one of the optimizers LLaMA-Factory's users pick.

Each choice's own keys live in a sub-section named like it (`train.optimizer.galore.rank`), with LLaMA-Factory
0.9.5's defaults, so a converted LF config trains the same way. The layout rule (`layout_refusal`) lives
here, a leaf of the config package, so the planner's preflight and the optimizer builder read one rule.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from shardforge.config.section import Section

OptimizerName = Literal["adamw", "adamw_8bit", "muon", "galore", "apollo", "badam", "adam_mini"]
# the ones ZeroRedundancyOptimizer can hold (it builds `optimizer_class(param_groups, **defaults)` over each
# rank's whole parameters); tests/dist/test_optimizer_layouts.py checks each against one process
ZERO1 = ("adamw_8bit", "muon", "galore")
_NOT_ZERO1 = {
    "apollo": "seeds each random projection with the parameter's index in its optimizer, which ZeRO-1's "
    "partition renumbers (the run would differ from one process)",
    "badam": "switches blocks by toggling requires_grad",
    "adam_mini": "is built from the model's named parameters, not parameter groups",
}


# measured by resuming a checkpoint (docs/optimizers.md): these states do not come back as they were
_NO_RESUME = {
    "apollo": "keeps projector and norm-limiter state that a checkpoint does not restore exactly (a resumed "
    "run's weights drift from the uninterrupted one's)",
    "badam": "keeps its states on working copies of the active block, not on the model's parameters, which "
    "the checkpoint's optimizer state cannot name",
}


class GaloreSection(Section):
    """GaLore (Zhao et al. 2024) through galore-torch's GaLoreAdamW; LF's galore_* keys."""

    # all: every linear of the decoder blocks (LF's find_all_linear_modules: not lm_head), or module names
    targets: Literal["all"] | list[str] = "all"
    rank: int = Field(default=16, ge=1)
    update_interval: int = Field(default=200, ge=1)  # steps between projector refreshes (an SVD each)
    scale: float = Field(default=2.0, gt=0)
    proj_type: Literal["std", "reverse_std", "right", "left", "full"] = "std"
    # LF steps each parameter in its post-accumulate-grad hook; here the same update after the backward
    # (docs/optimizers.md): equal math, the gradients are held until the step
    layerwise: bool = False


class ApolloSection(Section):
    """APOLLO (Zhu et al. 2024) through apollo-torch's APOLLOAdamW; LF's apollo_* keys."""

    targets: Literal["all"] | list[str] = "all"
    rank: int = Field(default=16, ge=1)
    update_interval: int = Field(default=200, ge=1)
    scale: float = Field(default=32.0, gt=0)
    proj: Literal["svd", "random"] = "random"
    proj_type: Literal["std", "right", "left"] = "std"
    scale_type: Literal["channel", "tensor"] = "channel"
    scale_front: bool = False
    layerwise: bool = False


class BadamSection(Section):
    """BAdam (Luo et al. 2024) through the badam package; LF's badam_* keys."""

    mode: Literal["layer", "ratio"] = "layer"
    start_block: int | None = Field(default=None, ge=0)
    switch_mode: Literal["ascending", "descending", "random", "fixed"] = "ascending"
    switch_interval: int = Field(default=50)  # -1: never switch (LF's meaning)
    update_ratio: float = Field(default=0.05, gt=1e-6, le=1.0)
    mask_mode: Literal["adjacent", "scatter"] = "adjacent"

    @model_validator(mode="after")
    def _interval(self) -> BadamSection:
        if self.switch_interval == 0 or self.switch_interval < -1:
            raise ValueError(
                f"train.optimizer.badam.switch_interval={self.switch_interval}: give the steps between block "
                f"switches (>= 1), or -1 never to switch"
            )
        return self


class MuonSection(Section):
    """Muon (torch.optim.Muon) on the hidden 2-D weights; the defaults are LF's third_party/muon."""

    momentum: float = Field(default=0.95, ge=0, lt=1)
    nesterov: bool = True
    ns_steps: int = Field(default=5, ge=1, lt=100)


_SUBSECTIONS = {"galore": GaloreSection, "apollo": ApolloSection, "badam": BadamSection, "muon": MuonSection}


class OptimizerSection(Section):
    """`name` picks the optimizer; train.lr, betas, eps and weight_decay are its hyperparameters (LF's
    learning_rate, adam_beta1/2, adam_epsilon, weight_decay); the sub-section of the chosen name its own."""

    name: OptimizerName = "adamw"
    galore: GaloreSection = GaloreSection()
    apollo: ApolloSection = ApolloSection()
    badam: BadamSection = BadamSection()
    muon: MuonSection = MuonSection()

    @model_validator(mode="after")
    def _only_the_chosen(self) -> OptimizerSection:
        """Keys changed for another optimizer than the chosen one would be silently unused: say so (a
        sub-section at its defaults is fine: a resolved config dumped into a run folder holds them all)."""
        for key, section in _SUBSECTIONS.items():
            if key != self.name and getattr(self, key) != section():
                raise ValueError(
                    f"train.optimizer.{key} is set but train.optimizer.name is {self.name}: set "
                    f"train.optimizer.name: {key}, or drop train.optimizer.{key}"
                )
        return self


def layout_refusal(
    optimizer: OptimizerSection,
    *,
    world: int,
    zero_stage: int,
    tp: int,
    pp: int,
    offload: str,
    grad_accum: int,
    clip: float | None,
    finetuning: str,
    lora_plus: bool,
    checkpoint_every: int | None = None,
) -> str | None:
    """Why this optimizer cannot run this layout and method (a message naming the keys and what would work),
    or None. The one home of the rule: the planner's preflight and `build_optimizer` both ask it."""
    name = optimizer.name
    key = f"train.optimizer.name={name}"
    if lora_plus and name not in ("adamw", "adamw_8bit"):
        return (
            f"method.lora.plus_lr_ratio (LoRA+) with {key}: LoRA+ sets learning rates per parameter group of "
            f"AdamW; use train.optimizer.name adamw or adamw_8bit"
        )
    if name in ("galore", "apollo", "badam") and finetuning in ("lora", "oft"):
        return (
            f"{key} with method.finetuning={finetuning}: {name} trains full weights (LLaMA-Factory refuses "
            f"it with adapters too); use method.finetuning full or freeze"
        )
    if name == "badam" and optimizer.badam.mode == "layer" and finetuning != "full":
        return (
            f"{key} (mode layer) with method.finetuning={finetuning}: BAdam switches requires_grad over "
            f"every decoder block, which would train the blocks the freeze keeps; use method.finetuning "
            f"full, or train.optimizer.badam.mode: ratio"
        )
    if name == "adamw":
        return None
    what = {
        "adamw_8bit": "keeps bitsandbytes' 8-bit states of whole tensors",
        "muon": "orthogonalizes whole weight matrices (Newton-Schulz)",
        "galore": "projects whole weight matrices (an SVD per matrix)",
        "apollo": "projects whole weight matrices",
        "badam": "switches the trained block by toggling requires_grad",
        "adam_mini": "keeps one second moment per whole head or neuron",
    }[name]
    if checkpoint_every is not None and name in _NO_RESUME:
        return (
            f"{key} with checkpoint.every={checkpoint_every}: {name} {_NO_RESUME[name]}, so a resumed run "
            f"would not continue this one; set checkpoint.every: null (the final model is still saved)"
        )
    whole = "parallel.zero_stage 0 (DDP)" + (" or 1 (ZeRO-1)" if name in ZERO1 else "")
    if offload != "none":
        return f"{key} with parallel.offload={offload}: offload is AdamW's (host states); use offload: none"
    if tp > 1:
        return f"{key} {what}; parallel.tp={tp} splits them: use parallel.tp 1 with {whole}"
    if world > 1 and zero_stage >= 2:
        return f"{key} {what}; parallel.zero_stage={zero_stage} shards them: use {whole}"
    if world > 1 and zero_stage == 1 and name not in ZERO1:
        return (
            f"{key} with parallel.zero_stage=1: ZeRO-1's ZeroRedundancyOptimizer cannot hold it ({name} "
            f"{_NOT_ZERO1[name]}); use parallel.zero_stage 0 (DDP)"
        )
    if pp > 1:
        return f"{key} is built over the whole model; parallel.pp={pp} splits it: use parallel.pp 1"
    if name == "badam" and world > 1:
        return (
            f"{key} {what}, which data parallel (DDP) cannot follow (LF runs it on DeepSpeed ZeRO-3 only): "
            f"run it in one process"
        )
    for sub in ("galore", "apollo"):
        if name == sub and getattr(optimizer, sub).layerwise:
            if world > 1:
                return (
                    f"train.optimizer.{sub}.layerwise steps each parameter in its gradient hook, before data "
                    f"parallel reduces it (LLaMA-Factory refuses it distributed too): run one process or "
                    f"layerwise: false"
                )
            if grad_accum != 1:
                return (
                    f"train.optimizer.{sub}.layerwise steps each parameter when its gradient is ready, so it "
                    f"cannot accumulate gradients (LLaMA-Factory refuses it too): use train.grad_accum 1 "
                    f"(it is {grad_accum}) or layerwise: false"
                )
            if clip is not None:
                return (
                    f"train.optimizer.{sub}.layerwise steps before any clipping (LLaMA-Factory's run never "
                    f"clips): set train.clip: null, or layerwise: false"
                )
    return None
