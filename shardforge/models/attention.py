"""Attention over packed rows. SDPA has no variable-length kernel on CPU, and a block-diagonal mask over a
packed row still pays for the whole row x row score matrix. Instead, the documents of a micro-batch are
gathered into a [documents, longest document] batch, attended with plain causal SDPA, and scattered back: the
cost is documents x longest-document squared instead of rows x row-length squared. Exact: the same scores."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


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


def doc_layout(doc_lengths: list[list[int]], seq: int) -> DocLayout:
    """Layout of rows made of consecutive documents with the given lengths (each row padded to `seq`)."""
    lengths = [n for row in doc_lengths for n in row]
    num_docs, max_len = len(lengths), max(lengths)
    pad_token, pad_out = len(doc_lengths) * seq, num_docs * max_len
    gather = torch.full((num_docs, max_len), pad_token, dtype=torch.long)
    scatter = torch.full((len(doc_lengths) * seq,), pad_out, dtype=torch.long)
    doc = 0
    for r, row in enumerate(doc_lengths):
        start = r * seq
        for n in row:
            positions = torch.arange(start, start + n)
            gather[doc, :n] = positions
            scatter[positions] = doc * max_len + torch.arange(n)
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
