"""Tensor parallel for the generic backend, from the plan transformers declares for each family as data
(`config.base_model_tp_plan`: module pattern -> style name), mapped onto torch's ParallelStyles:

- `colwise` / `rowwise`: Megatron's split of q/k/v, gate/up by output columns and o/down by input rows;
- `colwise_gather_output` / `rowwise_split_input`: the same weights split, the output gathered whole and the
  next input split again, for modules whose output is used whole (OLMo 2's q/k norms over all heads, Phi-3's
  fused qkv_proj and gate_up_proj): correct, with more communication.

The embedding and the LM head are split over the vocabulary (as the Llama family's plan does: the fused head
takes the logit shards under `loss_parallel`), and every other module with parameters (the norms) is
replicated as DTensors, so that one optimizer and clipping path serves all parameters. Families for which
transformers declares no plan, or a style outside this table, are refused with their model_type named."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from shardforge.errors import ConfigError
from shardforge.models.generic.config import GenericConfig
from shardforge.models.generic.model import HFCausalLM
from shardforge.models.llama.plan import check_tensor_parallel
from shardforge.sharding.styles import ReplicateParallel

STYLES: dict[str, Callable[[], ParallelStyle]] = {
    "colwise": ColwiseParallel,
    "rowwise": RowwiseParallel,
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
    "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
}


def tensor_parallel_plan(cfg: GenericConfig, tp: int, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """Module pattern (the wrapper's names: `hf.<base model>.layers.*...`) -> style. `sequence_parallel` is
    unused: ModelSpec.tp_plan's signature has it, but transformers' modules keep the residual stream whole, so
    this plan never splits it (planner/layout.py's `check_generic` refuses tp > 1 with sequence parallel)."""
    declared = dict(getattr(cfg.hf, "base_model_tp_plan", None) or {})
    unknown = sorted({style for style in declared.values() if style not in STYLES})
    if not declared or unknown:
        if tp == 1:  # asked for the plan's structure only (the planner's inventory): nothing is split
            return {}
        why = (
            f"its styles {', '.join(unknown)} are not supported" if unknown else "transformers declares none"
        )
        raise ConfigError(
            f"parallel.tp={tp}: no tensor-parallel plan for {cfg.model_type} on the generic backend ({why}); "
            f"use data parallel (parallel.dp_shard) or a native family"
        )
    check_tensor_parallel(cfg, tp)
    base = f"hf.{MODEL_FOR_CAUSAL_LM_MAPPING[type(cfg.hf)].base_model_prefix}."
    plan: dict[str, ParallelStyle] = {base + key: STYLES[style]() for key, style in declared.items()}
    plan[base + "embed_tokens"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    plan["hf.lm_head"] = ColwiseParallel(
        input_layouts=Replicate(), output_layouts=Shard(-1), use_local_output=False
    )
    for pattern in _replicated(cfg, plan):
        plan[pattern] = ReplicateParallel()
    return plan


def _replicated(cfg: GenericConfig, plan: dict[str, ParallelStyle]) -> list[str]:
    """The other modules that hold parameters of their own (norms), as patterns over the layers."""
    with torch.device("meta"):
        model = HFCausalLM(cfg)
    split = [key.split(".") for key in plan]
    out: list[str] = []
    for name, module in model.named_modules():
        if not any(True for _ in module.parameters(recurse=False)):
            continue
        parts = ["*" if p.isdigit() else p for p in name.split(".")]
        if any(_covers(s, parts) for s in split) or ".".join(parts) in out:
            continue
        out.append(".".join(parts))
    return out


def _covers(pattern: list[str], parts: list[str]) -> bool:
    """Whether a plan pattern names this module or one that contains it."""
    return len(parts) >= len(pattern) and all(
        p == "*" or p == q for p, q in zip(pattern, parts, strict=False)
    )
