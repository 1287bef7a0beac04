"""The run's parameters as the planner counts them: each tensor's size and how the engine splits it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from shardforge.adapters.apply import apply_finetuning
from shardforge.config.schema import Config
from shardforge.dtypes import DTYPE_BYTES
from shardforge.models.quantize import nf4_storage_bytes, quantized_names
from shardforge.models.spec import spec_for
from shardforge.parallel.tensor_parallel import matches_plan_key
from shardforge.planner.layout import traits_of
from shardforge.sharding.lora_styles import ADAPTER, COLWISE, ROWWISE
from shardforge.sharding.styles import KVColwiseParallel

STEP_BYTES = 4  # AdamW's per-tensor step counter (fp32)
FP32_BYTES = 4


@dataclass(frozen=True)
class ParamSpec:
    """One parameter tensor as the engine will split it."""

    name: str
    shape: tuple[int, ...]
    itemsize: float  # bytes per element (an NF4 weight: its codes and scales per element)
    trained: bool
    tp_dim: int | None  # the dimension tensor parallel splits; None: whole on every tp rank
    kv_heads: int | None  # a key / value projection's: whole on every rank when tp exceeds them
    expert: bool  # dimension 0 split over ep
    vocab: bool  # dimension 0 padded to a multiple of tp
    layer: int | None  # its decoder layer; None: embedding (first stage) or final norm / head (last)
    first: bool  # on the first pipeline stage (embedding) rather than the last (final norm, head)


def _tp_dims(model: torch.nn.Module, plan: dict) -> tuple[dict[str, int | None], set[str]]:
    """Parameter name -> the dimension its module's TP style splits (the styles the family plans use), and
    the key / value projections' parameters (split by kv heads)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    dims: dict[str, int | None] = {}
    kv: set[str] = set()
    for mod_name, module in model.named_modules():
        style = next((s for k, s in plan.items() if matches_plan_key(k, mod_name)), None)
        if not isinstance(style, ColwiseParallel | RowwiseParallel):
            continue
        if isinstance(style, KVColwiseParallel):
            kv |= {f"{mod_name}.{pname}" for pname, _ in module.named_parameters(recurse=False)}
        colwise = isinstance(style, ColwiseParallel)
        if hasattr(module, ADAPTER):
            table = {
                k: (p.dim if hasattr(p, "dim") else None)
                for k, p in (COLWISE if colwise else ROWWISE).items()
            }
        elif isinstance(module, torch.nn.Embedding):
            table = {"weight": 1 if colwise else 0}
        else:
            table = {"weight": 0 if colwise else 1, "bias": 0 if colwise else None}
        for pname, _ in module.named_parameters(recurse=False):
            dims[f"{mod_name}.{pname}"] = table.get(pname)
    return dims, kv


def inventory(shape: object, cfg: Config) -> list[ParamSpec]:
    """The run's parameters in `model.parameters()` order, with how the engine splits each."""
    spec = spec_for(shape.family)
    score_head = traits_of(cfg).score_head
    if score_head and not shape.num_labels:
        shape = shape.with_score_head(score_head)
    with torch.device("meta"):
        model = spec.build(shape)
        apply_finetuning(model, cfg.method, cfg.train.seed, None)
    plan = spec.tp_plan(shape, 1, True) if spec.tp_plan is not None else {}
    tp_dims, kv_params = _tp_dims(model, plan)
    itemsize = DTYPE_BYTES[cfg.model.dtype]
    nf4 = cfg.model.quantize == "nf4"
    out = []
    quantized = quantized_names(model) if cfg.model.quantize == "nf4" else set()
    for name, p in model.named_parameters():
        parts = model.canonical_name(name).split(".")  # the generic backend's names, as ours are spelled
        layer = int(parts[1]) if parts[0] == "layers" else None
        size = itemsize
        if nf4 and not p.requires_grad and name in quantized:
            size = nf4_storage_bytes(p.numel(), itemsize) / p.numel()
        vocab = parts[0] in ("embed_tokens", "lm_head") and not shape.num_labels
        split = tp_dims.get(name)
        # the embedding, and a vision-language model's tower, on the first pipeline stage
        first = parts[0] == "embed_tokens" or shape.part_of(model.canonical_name(name)) != "language"
        out.append(
            ParamSpec(
                name,
                tuple(p.shape),
                size,
                p.requires_grad,
                split,
                shape.num_kv_heads if name in kv_params else None,
                "experts" in parts,
                vocab,
                layer,
                first,
            )
        )
    if shape.tie_embeddings:  # a pipeline's last stage holds its own copy of the head
        embed = next(p for p in out if p.first)
        out.append(dataclasses.replace(embed, name="lm_head.weight", first=False))
    return out
