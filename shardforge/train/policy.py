"""The model a run trains, built from its config: on this rank's device, pruned to the rank's pipeline
stages on the meta device (nothing allocated for the rest), with the objective's score head, and with what
trains chosen by the finetuning method before any layout is applied."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from shardforge.adapters.apply import apply_finetuning
from shardforge.config.schema import Config
from shardforge.models.build import build_model
from shardforge.parallel.dims import ParallelDims
from shardforge.parallel.pipeline_plan import PipelinePlan, split_for_pipeline


@dataclass(frozen=True)
class Policy:
    model: nn.Module
    trained: float  # the share of the parameters that train (LoRA adapters, unfrozen layers)


def build_policy(
    cfg: Config,
    tokenizer: Any,
    score_head: int,
    *,
    dims: ParallelDims,
    mesh: DeviceMesh | None,
    plan: PipelinePlan | None,
    device: torch.device,
) -> Policy:
    """`score_head` > 0: a score head of that many outputs instead of the LM head (it trains under every
    method)."""
    prune = None
    if plan is not None:  # a pipeline rank builds only its stages' part of the model
        prune = partial(split_for_pipeline, plan=plan, stages=plan.stages_of(dims.pp_rank(mesh)))
    model = build_model(cfg.model, tokenizer, cfg.train.seed, device, prune, score_head)
    apply_finetuning(model, cfg.method, cfg.train.seed, cfg.model.adapter)  # what trains, before any layout
    if score_head and model.lm_head is not None:
        model.lm_head.requires_grad_(True)
    sizes = {id(p): (p.numel(), p.requires_grad) for p in model.parameters()}
    trained = sum(n for n, grad in sizes.values() if grad) / sum(n for n, _ in sizes.values())
    return Policy(model, trained)
