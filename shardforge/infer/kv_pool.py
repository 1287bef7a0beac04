"""Where a rank's steps run: its paged KV pool, sized from the engine's settings, and the model runner over
it (or the recompute runner for a family whose attention bypasses the pool)."""

from __future__ import annotations

import logging

import torch
from torch.distributed.tensor import DTensor

from shardforge.infer.cpu_kernels import cpu_kernels
from shardforge.infer.engine_types import EngineConfig
from shardforge.infer.executor import LocalRunner, ModelRunner, attends_paged
from shardforge.infer.paged import PagedKV
from shardforge.infer.recompute import RecomputeRunner
from shardforge.models.common.protocol import CausalModel
from shardforge.models.generic.config import model_type_of
from shardforge.models.generic.verified import refuse_measured

log = logging.getLogger(__name__)


def kv_blocks(model: CausalModel, config: EngineConfig) -> int:
    """The pool's block count: the config's, or as many as its memory budget holds (the same on every rank
    of a group: the whole model's head count sizes it)."""
    param = next(model.parameters())
    per_block = PagedKV.bytes_per_block(model.config, config.block_size, param.dtype)
    return config.num_blocks or max(1, config.kv_memory_bytes // per_block)


def paged_pool(model: CausalModel, config: EngineConfig) -> PagedKV:
    """A rank's pool of `kv_blocks` blocks, with the CPU decode kernel where it applies (fp32 on CPU). Its
    memory is zeroed here, not in the first step, as vLLM reserves its cache when the engine starts (each
    layer's is made on first use where its size or dtype is not known here: under tensor parallel, where each
    rank holds some of the heads, and under autocast, which sets the stream's dtype)."""
    param = next(model.parameters())
    fast = config.decode_kernel and param.device.type == "cpu" and param.dtype == torch.float32
    num_blocks = kv_blocks(model, config)
    arena = None
    if not isinstance(param, DTensor) and not torch.is_autocast_enabled(param.device.type):
        cfg = model.config
        per_layer = 2 * num_blocks * config.block_size * cfg.num_kv_heads * cfg.head_dim
        arena = torch.zeros(per_layer * len(model.blocks()), dtype=param.dtype, device=param.device)
    return PagedKV(num_blocks, config.block_size, cpu_kernels() if fast else None, arena)


def local_runner(model: CausalModel, config: EngineConfig) -> ModelRunner:
    """The model's forward on this rank: over a paged pool where every layer attends through it and the
    family is known to decode right that way (`pages`: every native family; the generic backend's measured
    ones), else on the recompute runner (right, slower), said once in the log."""
    refuse_measured(model_type_of(model.config.family), "generate")
    if model.pages and attends_paged(model):
        return LocalRunner(model, paged_pool(model, config))
    log.warning(
        "%s: its attention does not go through the engine's paged KV cache (or is not verified to decode "
        "right over it: docs/families.md); the engine recomputes each sequence whole per step: right, slower",
        model.config.family,
    )
    return RecomputeRunner(model, kv_blocks(model, config), config.block_size)
