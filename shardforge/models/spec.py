"""ModelSpec: everything the engine needs to know about one model family, as data."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

from torch import nn

from shardforge.errors import ModelError

CheckpointMode = Literal["none", "selective", "full"]  # train.activation_checkpoint


@dataclass(frozen=True)
class PipelineCosts:
    """Forward FLOPs per token of the pieces a pipeline split places: the embedding (first stage), each
    decoder layer, and the final norm + LM head + loss (last stage)."""

    embed: float
    layers: list[float]
    head: float


@dataclass(frozen=True)
class ParamCounts:
    """Parameters by group, per layer where layers hold them: what memory and FLOP formulas multiply."""

    embedding: int
    attention: tuple[int, ...]
    mlp: tuple[int, ...]
    norms: tuple[int, ...]
    final_norm: int
    head: int  # 0 when tied to the embedding (one tensor, counted once)
    vision: int = 0  # a vision-language model's tower and projector
    tower: int = 0  # of which the tower's (where a family counts it apart)

    @property
    def total(self) -> int:
        """Equals the built model's parameter count (shared tensors once)."""
        layers = sum(self.attention) + sum(self.mlp) + sum(self.norms)
        return self.embedding + layers + self.final_norm + self.head + self.vision


@dataclass(frozen=True)
class ActivationBytes:
    """Bytes one training forward keeps for backward on one rank. Tokens are the micro-batch's positions
    (padding included), scored ones those the LM head projects."""

    per_token: float  # the blocks, the embedding output, RoPE tables, the final norm
    per_scored: float  # the fused LM head and log-probabilities (models/head.py), per scored position
    fixed: float = 0.0  # whatever the batch: the fused head's weight gradient, made in the forward
    layers: tuple[float, ...] = ()  # per token, each decoder layer's share of per_token (pipeline stages)
    tail: float = 0.0  # per token, the final norm's share (the last pipeline stage's)

    def total(self, tokens: int, scored: int) -> float:
        return tokens * self.per_token + scored * self.per_scored + self.fixed

    def stage(self, layers: tuple[int, ...], last: bool) -> ActivationBytes:
        """What a pipeline stage holding these decoder layers keeps (each stage makes its own RoPE tables;
        the last one runs the final norm and the head)."""
        shared = self.per_token - sum(self.layers) - self.tail
        per_token = shared + sum(self.layers[i] for i in layers) + self.tail * last
        return ActivationBytes(per_token, self.per_scored * last, self.fixed * last, (), 0.0)


def causal_pairs(lengths: Iterable[int]) -> int:
    """The (query, key) pairs causal attention needs over documents of these lengths: n(n+1)/2 each. A
    dense kernel over rows of width s executes rows * s * s instead."""
    return sum(n * (n + 1) // 2 for n in lengths)


@dataclass(frozen=True)
class CostModel:
    """What one model costs, in one place: parameters by group, forward FLOPs per piece, activation bytes.
    Read by pipeline balancing, MFU and the planner; checked against FlopCounterMode, the built model and
    `activation_report` (tests/unit/test_costs.py)."""

    params: ParamCounts
    embed_flops: float  # forward, per token (a lookup: 0)
    layer_flops: tuple[float, ...]  # forward matmul FLOPs per token, per decoder layer
    pair_flops: tuple[float, ...]  # forward FLOPs per (query, key) score pair, per layer (QK^T and AV)
    head_flops: float  # forward, per scored token: the head runs on target positions only
    # (mode, dtype bytes, tp, sequence_parallel) -> bytes kept for backward; the family's formula.
    activations: Callable[[CheckpointMode, int, int, bool], ActivationBytes]
    patch_flops: float = 0.0  # forward, per image patch through a vision-language model's tower and projector
    # what the tower keeps for backward per patch and activation byte, where it gets gradients (trained,
    # or adapters in it): per layer 12 of its widths (norms, q/k/v and their rotated copies, attention out,
    # MLP input) and 3 of its MLP's (the activation's input and output), and the projector's (checked
    # against activation_report: tests/unit/test_vision_data.py)
    patch_activations: float = 0.0

    def forward_flops(self, tokens: int, scored: int, attention_pairs: int) -> float:
        """Forward FLOPs of `tokens` positions of which `scored` reach the LM head, with `attention_pairs`
        (query, key) pairs evaluated per layer, summed over rows (see `causal_pairs`)."""
        body = tokens * (self.embed_flops + sum(self.layer_flops))
        return body + attention_pairs * sum(self.pair_flops) + scored * self.head_flops

    def train_flops(
        self,
        tokens: int,
        scored: int,
        attention_pairs: int,
        trained: float = 1.0,
        patches: int = 0,
        tower_passes: int = 1,
    ) -> float:
        """Forward + backward: backward computes input and weight gradients, twice the forward. With a share
        `trained` < 1 of the weights training (LoRA, freeze), the weight gradients of the rest are not
        computed: the matmuls cost (2 + trained) forwards, attention (no weights) still three. A
        vision-language model's `patches` cost `tower_passes` forwards of its tower: 1 where it is frozen
        (nothing before it needs a gradient), 2 with LoRA in it (input gradients; the adapters' are small),
        3 where it trains."""
        pairs = attention_pairs * sum(self.pair_flops)
        matmuls = self.forward_flops(tokens, scored, attention_pairs) - pairs
        tower = patches * self.patch_flops * tower_passes
        return (2 + trained) * matmuls + 3 * pairs + tower

    def pipeline(self, seq_len: int) -> PipelineCosts:
        """Forward FLOPs per token of each piece a pipeline split places, rows of `seq_len` tokens with causal
        attention (about seq_len / 2 pairs per token); backward is ~2x forward for all of them alike."""
        pairs_per_token = seq_len / 2
        layers = [m + p * pairs_per_token for m, p in zip(self.layer_flops, self.pair_flops, strict=True)]
        return PipelineCosts(embed=self.embed_flops, layers=layers, head=self.head_flops)

    def activation_bytes(
        self,
        mode: CheckpointMode = "none",
        dtype_bytes: int = 4,
        tp: int = 1,
        sequence_parallel: bool = False,
    ) -> ActivationBytes:
        """Per-rank bytes kept for backward by `train.activation_checkpoint` mode, for activations of
        `dtype_bytes` each, under tensor parallel degree `tp` (with or without sequence parallel)."""
        return self.activations(mode, dtype_bytes, tp, sequence_parallel and tp > 1)


@dataclass(frozen=True)
class Slot:
    """Where an HF tensor goes when several fill one of our parameters (per-expert checkpoint keys): the
    parameter `key`, `index` into it, then chunk `chunk[0]` of `chunk[1]` along the next dimension."""

    key: str
    index: tuple[int, ...] = ()
    chunk: tuple[int, int] | None = None

    def view(self, param: Any) -> Any:
        target = param[self.index] if self.index else param
        return target.chunk(self.chunk[1], 0)[self.chunk[0]] if self.chunk else target


@dataclass(frozen=True)
class ModelSpec:
    """One model family. `tp_plan(config, tp, sequence_parallel)` checks the shapes and returns the
    tensor-parallel plan (module pattern -> ParallelStyle); `costs(config)` is its cost model (parameters,
    FLOPs per piece, activation bytes), which pipeline balancing, MFU and the planner read."""

    name: str
    model_type: str  # config.json model_type
    architecture: str  # config.json architectures[0]
    model_cls: Callable[..., nn.Module]  # (config, mlp=...) -> the model
    config_from_hf: Callable[[Any], Any]  # transformers config -> our config
    hf_config_from: Callable[[Any], Any]  # our config -> transformers config
    key_to_hf: Callable[[str], str]
    key_from_hf: Callable[[str], str | Slot]
    costs: Callable[[Any], CostModel]
    tp_plan: Callable[[Any, int, bool], dict[str, Any]] | None = None
    mlp: Callable[[Any, int], nn.Module] | None = None  # (config, layer) -> a block's MLP; None: the default
    # (our key, tensor, layout) -> HF (key, tensor) pairs, where one of ours is written as several (experts)
    split_to_hf: Callable[[str, Any, str], list[tuple[str, Any]]] | None = None
    # A family that reads and writes its folders itself (the generic backend: transformers' own loading and
    # saving, with the weight conversions of its families): (folder, config, dtype, device) -> model, and
    # (model, folder, HF-named tensors, max shard bytes) -> None
    load_folder: Callable[[Any, Any, Any, Any], nn.Module] | None = None
    save_folder: Callable[[nn.Module, Any, dict, int], None] | None = None
    # An HF module's path in transformers' model class where it differs from the checkpoint's key prefix
    # (transformers 5's Qwen2-VL holds the decoder at model.language_model.*): where peft names adapters
    runtime_module: Callable[[str], str] | None = None

    def peft_module(self, hf_module: str) -> str:
        """The module path peft names an adapter by (its path in transformers' model)."""
        return self.runtime_module(hf_module) if self.runtime_module is not None else hf_module

    def tensors_to_hf(self, key: str, tensor: Any, layout: str = "per_expert") -> list[tuple[str, Any]]:
        """The HF tensors one of our parameters is written as."""
        if self.split_to_hf is not None:
            return self.split_to_hf(key, tensor, layout)
        return [(self.key_to_hf(key), tensor)]

    def build(self, config: Any) -> nn.Module:
        """The family's model for `config` (call under `torch.device("meta")` to allocate nothing)."""
        return self.model_cls(config, mlp=self.mlp)


_REGISTRY: dict[str, ModelSpec] = {}


def register(spec: ModelSpec) -> None:
    _REGISTRY[spec.model_type] = spec


# The generic backend (models/generic registers it): its spec, and which model_types transformers provides.
_GENERIC: list[tuple[ModelSpec, Callable[[str | None], bool]]] = []


def register_generic(spec: ModelSpec, provides: Callable[[str | None], bool]) -> None:
    _GENERIC[:] = [(spec, provides)]


def supported() -> list[str]:
    return sorted(f"{s.model_type} ({s.architecture})" for s in _REGISTRY.values())


def spec_for(
    model_type: str | None, architectures: list[str] | None = None, backend: str = "auto"
) -> ModelSpec:
    """Find the family by config.json's model_type, falling back to its architectures list. `backend`
    (model.backend): `native` our own implementation only, `hf` transformers' modules (models/generic),
    `auto` ours where we have the family, else transformers'. A generic model's family is "hf:<type>"."""
    generic, provides = _GENERIC[0] if _GENERIC else (None, lambda _t: False)
    if model_type is not None and model_type.startswith("hf:") and generic is not None:
        return generic
    if backend != "hf":
        if model_type in _REGISTRY:
            return _REGISTRY[model_type]
        for spec in _REGISTRY.values():
            if spec.architecture in (architectures or []):
                return spec
    if backend != "native" and generic is not None and provides(model_type):
        return generic
    hint = (
        "; model.backend: auto (or hf) runs it with transformers' own modules"
        if backend == "native" and provides(model_type)
        else ""
    )
    raise ModelError(
        f"unsupported model (model_type={model_type!r}, architectures={architectures}); natively "
        f"supported: {', '.join(supported())}; transformers has no causal LM for it either{hint}"
        if not hint
        else f"model_type={model_type!r} has no native family (natively supported: {', '.join(supported())})"
        f"{hint}"
    )


def costs_for(config: Any) -> CostModel:
    """The cost model of a built model's config (its family's)."""
    return spec_for(config.family).costs(config)
