"""ModelSpec: everything the engine needs to know about one model family, as data."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from shardforge.errors import ModelError


@dataclass(frozen=True)
class PipelineCosts:
    """Forward FLOPs per token of the pieces a pipeline split places: the embedding (first stage), each
    decoder layer, and the final norm + LM head + loss (last stage)."""

    embed: float
    layers: list[float]
    head: float


@dataclass(frozen=True)
class ModelSpec:
    """One model family. `tp_plan(config, tp, sequence_parallel)` checks the shapes and returns the
    tensor-parallel plan (module pattern -> ParallelStyle); `pipeline_costs(config, seq_len)` is the cost
    of each piece that the pipeline split balances."""

    name: str
    model_type: str  # config.json model_type
    architecture: str  # config.json architectures[0]
    config_cls: type
    model_cls: type[nn.Module]
    config_from_hf: Callable[[Any], Any]  # transformers config -> our config
    hf_config_from: Callable[[Any], Any]  # our config -> transformers config
    key_to_hf: Callable[[str], str]
    key_from_hf: Callable[[str], str]
    flops_per_token: Callable[[Any, int], float]
    tp_plan: Callable[[Any, int, bool], dict[str, Any]] | None = None
    pipeline_costs: Callable[[Any, int], PipelineCosts] | None = None


_REGISTRY: dict[str, ModelSpec] = {}


def register(spec: ModelSpec) -> None:
    _REGISTRY[spec.model_type] = spec


def supported() -> list[str]:
    return sorted(f"{s.model_type} ({s.architecture})" for s in _REGISTRY.values())


def spec_for(model_type: str | None, architectures: list[str] | None = None) -> ModelSpec:
    """Find the family by config.json's model_type, falling back to its architectures list."""
    if model_type in _REGISTRY:
        return _REGISTRY[model_type]
    for spec in _REGISTRY.values():
        if spec.architecture in (architectures or []):
            return spec
    raise ModelError(
        f"unsupported model (model_type={model_type!r}, architectures={architectures}); "
        f"supported: {', '.join(supported())}"
    )
