"""Test oracles: the papers' formulas and the reference computations that library results are checked
against, kept here because only tests use them (the library counts, measures and shards its own way)."""

from __future__ import annotations

import torch
from torch import nn

from shardforge.data.batching import Batch
from shardforge.objectives.base import CausalLM
from shardforge.parallel.activations import (
    ActivationReport,
    Forward,
    _plain,
    _storage_keys,
    _tracking,
)
from shardforge.parallel.context_parallel import local_indices


def zero_model_states(
    params: float, stage: int, n: int, weights: float, grads: float, states: float
) -> float:
    """Model-state bytes per device under ZeRO stage `stage` over `n` data-parallel ranks, for `params`
    parameters with `weights`, `grads` and `states` bytes each. Rajbhandari et al., "ZeRO: Memory
    Optimizations Toward Training Trillion Parameter Models" (SC 2020), Figure 1: with Adam in mixed
    precision (2 + 2 + 12 bytes) that is 16 unsharded, 4 + 12/N (P_os), 2 + 14/N (P_os+g), 16/N (P_os+g+p)."""
    sharded = {0: 0.0, 1: states, 2: grads + states, 3: weights + grads + states}[stage]
    return params * (weights + grads + states - sharded + sharded / n)


def korthikanti_layer_bytes(s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False,
                            recompute: str = "none") -> float:  # fmt: skip
    """Activation bytes one transformer layer keeps, fp16 activations, per Korthikanti et al., "Reducing
    Activation Recomputation in Large Transformer Models" (MLSys 2023), Table 2: s sequence, b micro-batch,
    h hidden, a heads, t tensor-parallel degree. No parallelism sbh(34 + 5as/h); TP sbh(10 + 24/t + 5as/(ht));
    TP + SP sbh/t (34 + 5as/h); selective recomputation (with TP + SP) 34 sbh/t, without SP sbh(10 + 24/t);
    full recomputation 2sbh (the layer input only)."""
    if recompute == "full":
        return 2 * s * b * h
    attention_core = 0 if recompute == "selective" else 5 * a * s / h
    if sp:
        return s * b * h / t * (34 + attention_core)
    return s * b * h * (10 + 24 / t + attention_core / t)


def shard_sequence(t: torch.Tensor, dim: int, cp: int, rank: int) -> torch.Tensor:
    """Context parallel rank `rank`'s part of `t` along the sequence dimension `dim` (input ids, position
    ids, targets, ...): its chunks of parallel/context_parallel.py's load-balanced layout."""
    return t.index_select(dim, local_indices(t.shape[dim], cp, rank, t.device))


def saved_tensor_report(model: nn.Module, forward: Forward) -> ActivationReport:
    """What autograd's saved-tensor hooks see in one forward, among the tensors the forward created. Blind to
    what checkpointing keeps; used to cross-check `activation_report` (parallel/activations.py)."""
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.extend(_plain(t))
        return t

    with _tracking(model) as created, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward()
    held = created.alive(_storage_keys(out) | _storage_keys(list(model.parameters())))
    keys = {t.untyped_storage().data_ptr() for t in saved}
    del out
    return ActivationReport([t for k, t in held.items() if k in keys])


def causal_lm_forward(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Log-probabilities [targets] of the target positions' next tokens."""
    return model(batch.input_ids, **CausalLM().model_inputs(batch))


def causal_lm_loss_sum(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Next-token cross-entropy summed over the target tokens of a micro-batch."""
    return CausalLM.loss(causal_lm_forward(model, batch), batch)["loss"]
