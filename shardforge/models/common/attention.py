"""How tokens may attend, made once per forward (`AttentionContext`: masks, a per-document layout, or a KV
cache, whose protocol `Cache` is here), and which positions are real tokens.

Attention over packed rows. SDPA has no variable-length kernel on CPU, and a block-diagonal mask over a
packed row still pays for the whole row x row score matrix. Instead, the documents of a micro-batch are
gathered into a [documents, longest document] batch, attended with plain causal SDPA, and scattered back: the
cost is documents x longest-document squared instead of rows x row-length squared. Exact: the same scores."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from shardforge.models.common.config import DecoderConfig


@dataclass
class DocLayout:
    """Where the documents of a packed micro-batch sit.

    gather:  [num_docs * max_len] indices into the flattened [batch * seq + 1] tokens (the last one is a zero
             row used to pad short documents).
    scatter: [batch * seq] indices into the flattened [num_docs * max_len + 1] per-document outputs (the last
             one is a zero row for the padding at the end of packed rows).
    """

    gather: torch.Tensor
    scatter: torch.Tensor
    num_docs: int
    max_len: int

    def to(self, device: torch.device) -> DocLayout:
        return DocLayout(
            self.gather.to(device, non_blocking=True),
            self.scatter.to(device, non_blocking=True),
            self.num_docs,
            self.max_len,
        )


def doc_layout(doc_lengths: list[list[int]], seq: int, trunks: list[int] | None = None) -> DocLayout:
    """Layout of rows made of consecutive documents with the given lengths (each row padded to `seq`).

    `trunks`: each row starts with a prefix of that many tokens that all its documents share (a group's
    prompt, kept once): each document is then attended as [trunk, document], whose causal mask lets the
    trunk see only itself and the document see the trunk and its own earlier tokens, and the trunk's
    outputs are taken from the row's first document. Exact: every document's scores are those it would
    have after its own copy of the prefix."""
    trunks = trunks or [0] * len(doc_lengths)
    num_docs = sum(map(len, doc_lengths))
    max_len = max(t + n for t, row in zip(trunks, doc_lengths, strict=True) for n in row)
    pad_token, pad_out = len(doc_lengths) * seq, num_docs * max_len
    gather = torch.full((num_docs, max_len), pad_token, dtype=torch.long)
    scatter = torch.full((len(doc_lengths) * seq,), pad_out, dtype=torch.long)
    doc = 0
    for r, (trunk, row) in enumerate(zip(trunks, doc_lengths, strict=True)):
        shared = torch.arange(r * seq, r * seq + trunk)
        scatter[shared] = doc * max_len + torch.arange(trunk)  # the first document's copy of the trunk
        start = r * seq + trunk
        for n in row:
            positions = torch.arange(start, start + n)
            gather[doc, :trunk] = shared
            gather[doc, trunk : trunk + n] = positions
            scatter[positions] = doc * max_len + torch.arange(trunk, trunk + n)
            start += n
            doc += 1
    return DocLayout(gather.flatten(), scatter, num_docs, max_len)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Attention with a boolean mask (True = attend), or causal when it is None. q is [b, heads, s, d]; k and
    v may have fewer (grouped-query) heads, which SDPA's `enable_gqa` shares without copying them per
    group (on CPU: exact, with or without a mask). On CUDA, torch runs grouped-query attention only in its
    flash kernel (no mask) and the math kernel: with a mask, K/V are repeated instead so that the
    memory-efficient kernel stays usable (transformers' `use_gqa_in_sdpa` makes the same choice)."""
    groups = q.shape[1] // k.shape[1]
    if mask is not None and groups > 1 and q.device.type == "cuda":
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True)


def attention_per_document(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: DocLayout, window: int | None = None
) -> torch.Tensor:
    """Causal attention within each document; q and the result are [batch, heads, seq, head_dim], k and v
    [batch, kv_heads, seq, head_dim]."""
    b, h, s, d = q.shape

    def per_doc(x: torch.Tensor) -> torch.Tensor:
        heads = x.shape[1]
        flat = x.transpose(1, 2).reshape(b * s, heads, d)
        flat = torch.cat([flat, flat.new_zeros(1, heads, d)])
        return flat[layout.gather].view(layout.num_docs, layout.max_len, heads, d).transpose(1, 2)

    mask = None
    if window is not None and layout.max_len > window:
        pos = torch.arange(layout.max_len, device=q.device)
        mask = (pos[None, :] <= pos[:, None]) & (pos[:, None] - pos[None, :] < window)
    out = sdpa(per_doc(q), per_doc(k), per_doc(v), mask)
    flat = out.transpose(1, 2).reshape(layout.num_docs * layout.max_len, h, d)
    flat = torch.cat([flat, flat.new_zeros(1, h, d)])
    return flat[layout.scatter].view(b, s, h, d).transpose(1, 2)


class Cache(Protocol):
    """What a forward with a cache calls: `context` once (the cache makes and keeps this forward's masks),
    `attend` per layer (store this forward's keys and values, attend over what the cache holds, with the
    sliding-window mask on a sliding layer), `advance` at the end. `KVCache` is the
    contiguous one of `generate`; infer/paged.py has the paged one of the engine."""

    def context(self, cfg: DecoderConfig, position_ids: torch.Tensor) -> AttentionContext: ...

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sliding: bool
    ) -> torch.Tensor: ...

    def advance(self, n: int) -> None: ...


@dataclass
class AttentionContext:
    """How tokens may attend, computed once per forward: boolean masks [b, 1, s, keys] (True = attend; None =
    plain causal) for full and sliding-window layers, or a per-document layout for packed rows, and the
    KV cache the layers write to."""

    full: torch.Tensor | None = None
    sliding: torch.Tensor | None = None
    layout: DocLayout | None = None
    window: int | None = None
    cache: Cache | None = None
    tokens: torch.Tensor | None = None  # [b, s] True at real tokens (set for MoE models: real_tokens)


def real_tokens(
    position_ids: torch.Tensor, doc_ids: torch.Tensor | None, columns: torch.Tensor | None = None
) -> torch.Tensor:
    """Which positions hold tokens rather than padding, as collate lays rows out: padding has document id
    -1 in packed rows, and position 0 after a row's first column in rows of one document. `columns`: the
    positions' columns in their whole rows (a context-parallel rank holds parts of rows)."""
    if doc_ids is not None:
        return doc_ids >= 0
    if columns is None:
        columns = torch.arange(position_ids.shape[1], device=position_ids.device)
    return (position_ids > 0) | (columns == 0)


def attention_context(
    cfg: DecoderConfig,
    position_ids: torch.Tensor,
    doc_ids: torch.Tensor | None,
    layout: DocLayout | None,
    cache: Cache | None = None,
) -> AttentionContext:
    if cache is not None:
        if doc_ids is not None or layout is not None:
            raise ValueError("a KV cache holds one sequence per row: packed rows (doc_ids) cannot use it")
        return cache.context(cfg, position_ids)
    if layout is not None:
        return AttentionContext(layout=layout, window=cfg.sliding_window)
    seq, device = position_ids.shape[1], position_ids.device
    needs_window = cfg.sliding_window is not None and seq > cfg.sliding_window
    if doc_ids is None and not needs_window:
        return AttentionContext()
    pos = torch.arange(seq, device=device)
    allowed = (pos[None, :] <= pos[:, None])[None]
    if doc_ids is not None:
        allowed = allowed & (doc_ids[:, :, None] == doc_ids[:, None, :])
    full = allowed[:, None]
    if not needs_window:
        return AttentionContext(full=full, sliding=full)
    window = (pos[:, None] - pos[None, :]) < cfg.sliding_window
    return AttentionContext(full=full, sliding=full & window[None, None])
