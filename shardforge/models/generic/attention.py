"""The generic backend in shardforge's inference engine: transformers' attention modules project, normalize
and rotate as their family does, then call the attention function their config names; for an engine step
that function is this one, which attends over the paged KV cache (infer/paged.py: the step's keys and
values written to their slots, each sequence attending to its own), so a family we do not implement
decodes with continuous batching over the paged cache too. Training keeps the family's own attention. A
call with arguments the paged path does not implement (attention sinks, a position bias) attends over the
step's tokens alone and is not counted as attended, which the engine's check sees."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "shardforge_paged"  # the attention implementation a generic model switches to for an engine step
CACHE = "shardforge_cache"  # the keyword the step's PagedStep travels under, through the family's forward


def paged_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """query [1, heads, T, d], key / value [1, kv_heads, T, d] (rotated) -> [1, T, heads, d], as
    transformers' attention functions return it. The step's own masks replace `attention_mask`."""
    paged = kwargs.get(CACHE)
    if paged is None or _unsupported(kwargs):  # not an engine step, or one the paged path cannot take
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    d = query.shape[-1]
    if scaling is not None and abs(scaling * d**0.5 - 1.0) > 1e-12:  # SDPA's default scale is d^-1/2
        query = query * (scaling * d**0.5)
    out = paged.attend(module.layer_idx, query, key, value, sliding_window is not None, softcap)
    return out.transpose(1, 2), None


# what families pass that does not change the math here (the step's positions and masks are the cache's own)
_IGNORED = frozenset({CACHE, "position_ids", "use_cache", "output_attentions", "cache_position", "is_causal"})


def _unsupported(kwargs: dict[str, Any]) -> list[str]:
    """Arguments that change the attention the paged path computes (GPT-OSS's sinks `s_aux`, a relative
    position bias, sparse block indices): a layer given one does not attend through the cache, so the
    engine's check (infer/executor.py: attends_paged) puts the family on the recompute runner."""
    return [k for k, v in kwargs.items() if k not in _IGNORED and v is not None]


AttentionInterface.register(NAME, paged_attention)
AttentionMaskInterface.register(NAME, sdpa_mask)  # made by the family's forward, unused by a step
