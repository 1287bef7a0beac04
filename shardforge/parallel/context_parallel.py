"""Context parallel attention: a row's sequence is split over the `cp` ranks of a group, and attention is made
whole again with collectives that have autograd (torch's functional collectives).

Layout (Llama 3 / Megatron load balancing): a row of length S is cut into 2*cp equal chunks and cp rank r
holds chunks r and 2*cp-1-r, in that order. Under a causal mask early chunks see few keys and late chunks
many; pairing one of each gives every rank the same work.

Positions: masks here use the *sequence index* of a token in its (global) row, never `position_ids`: packed
rows restart `position_ids` at each document, so they cannot order tokens of different documents. Document
boundaries come from `doc_ids` [b, S] (global order, one id per token; padding has an id of its own, e.g. -1).
RoPE still uses the (sharded) `position_ids`, as without context parallel.

Two modes:
- `allgather_kv_attention` (Llama 3): all-gather K and V over the group, each rank attends with its local
  queries. Works for any head count; communication is K/V only, which is small under grouped-query attention.
- `ulysses_attention` (DeepSpeed-Ulysses): all-to-all from sequence-sharded to head-sharded, ordinary
  attention on heads/cp heads over the whole row, all-to-all back. Needs cp to divide the heads and the kv
  heads.
"""

from __future__ import annotations

import math
from dataclasses import replace
from functools import partial

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.distributed_c10d import ProcessGroup

from shardforge.errors import ConfigError
from shardforge.models.common.attention import AttentionContext, real_tokens, sdpa
from shardforge.models.moe import moe_layers
from shardforge.parallel.images import local_images, placed


def local_indices(seq_len: int, cp: int, rank: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The global sequence indices rank `rank` holds, in its local order (int64 [seq_len // cp]): chunks
    `rank` and `2*cp-1-rank` of 2*cp equal chunks."""
    if cp < 1 or not 0 <= rank < cp:
        raise ValueError(f"context parallel rank {rank} is not in 0..{cp - 1} (cp={cp})")
    if seq_len % (2 * cp) != 0:
        raise ValueError(
            f"context parallel with cp={cp} cuts each row into 2*cp={2 * cp} equal chunks: the sequence "
            f"length {seq_len} is not divisible by {2 * cp} (pad rows to a multiple of {2 * cp})"
        )
    chunk = seq_len // (2 * cp)
    first, second = rank * chunk, (2 * cp - 1 - rank) * chunk
    return torch.cat(
        [
            torch.arange(first, first + chunk, device=device),
            torch.arange(second, second + chunk, device=device),
        ]
    )


def gathered_indices(seq_len: int, cp: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The global sequence index of each entry of a gather over the group ([rank 0's local, rank 1's local,
    ...]): the key positions of `allgather_kv_attention`. Its argsort turns gathered order into global
    order."""
    return torch.cat([local_indices(seq_len, cp, r, device) for r in range(cp)])


def cp_mask(
    query_pos: torch.Tensor,
    key_pos: torch.Tensor,
    doc_ids: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Boolean attention mask (True = attend) [b or 1, 1, queries, keys] from global sequence indices
    (query_pos [queries], key_pos [keys], in any order): causal, same document when `doc_ids` [b, S] is given,
    and query - key < window when `window` is given. A query always sees itself, so no row is all False
    (SDPA would return NaN for it, e.g. a padding token)."""
    if window is not None and window < 1:
        raise ValueError(f"sliding window must be at least 1 token, got {window}")
    q, k = query_pos[:, None], key_pos[None, :]
    allowed = k <= q
    if window is not None:
        allowed = allowed & (q - k < window)
    allowed = allowed[None]
    if doc_ids is not None:
        q_doc, k_doc = doc_ids.index_select(1, query_pos), doc_ids.index_select(1, key_pos)
        allowed = allowed & (q_doc[:, :, None] == k_doc[:, None, :])
    return (allowed | (k == q)[None])[:, None]


def allgather_kv_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: ProcessGroup,
    cp: int,
    rank: int,
    query_pos: torch.Tensor | None = None,
    key_pos: torch.Tensor | None = None,
    doc_ids: torch.Tensor | None = None,
    window: int | None = None,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Llama 3's context parallel attention: all-gather K and V over `group`, attend with the local queries.

    q is [b, heads, s_local, d]; k and v [b, kv_heads, s_local, d] (kv_heads may divide heads); returns
    [b, heads, s_local, d]. query_pos [s_local] and key_pos [cp * s_local] are global sequence indices (not
    position_ids) of the local queries and of the gathered keys; by default the load-balanced layout
    (`local_indices(S, cp, rank)`, `gathered_indices(S, cp)`). doc_ids is [b, S] in global order.

    The gathered keys stay in gathered order and the mask is built from their global indices: attention does
    not depend on the order of the keys, and this skips a copy of K and V (and of their gradients) per layer,
    while the mask costs the same in either order (never plain causal here: the local queries are two chunks).
    The backward of the all-gather is a reduce-scatter sum: each rank gets the K/V gradients of all queries.
    """
    seq = q.shape[2] * cp
    if query_pos is None:
        query_pos = local_indices(seq, cp, rank, q.device)
    if key_pos is None:
        key_pos = gathered_indices(seq, cp, q.device)
    _check_doc_ids(doc_ids, q.shape[0], seq)
    k_all = funcol.all_gather_single(k.contiguous(), 2, group)
    v_all = funcol.all_gather_single(v.contiguous(), 2, group)
    return sdpa(q, k_all, v_all, cp_mask(query_pos, key_pos, doc_ids, window) if mask is None else mask)


def check_ulysses(num_heads: int, num_kv_heads: int, cp: int) -> None:
    """Ulysses gives each rank heads/cp query heads and kv_heads/cp kv heads: both must divide by cp."""
    if num_heads % cp == 0 and num_kv_heads % cp == 0:
        return
    common = math.gcd(num_heads, num_kv_heads)
    valid = ", ".join(str(c) for c in range(2, common + 1) if common % c == 0) or "none above 1"
    raise ValueError(
        f"parallel.cp_mode: ulysses splits the attention heads over the cp ranks: cp={cp} must divide both "
        f"the {num_heads} query heads and the {num_kv_heads} kv heads (per tensor-parallel rank). Valid cp "
        f"values: {valid}; or use the all-gather mode, which has no head constraint"
    )


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: ProcessGroup,
    cp: int,
    gathered_pos: torch.Tensor | None = None,
    doc_ids: torch.Tensor | None = None,
    window: int | None = None,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """DeepSpeed-Ulysses: all-to-all so each rank holds heads/cp query heads and kv_heads/cp kv heads over the
    whole row, attend, all-to-all back. Shapes as in `allgather_kv_attention`; gathered_pos [S] is the global
    sequence index of each entry of [rank 0's local, rank 1's local, ...] (by default
    `gathered_indices(S, cp)`) and must be a permutation of range(S).

    After the all-to-all the row is put back in global order (a copy linear in S): attention is then exactly
    the single-process one on fewer heads, so without documents or window SDPA runs plain causal with no mask.
    """
    check_ulysses(q.shape[1], k.shape[1], cp)
    seq = q.shape[2] * cp
    if gathered_pos is None:
        gathered_pos = gathered_indices(seq, cp, q.device)
    _check_doc_ids(doc_ids, q.shape[0], seq)
    to_global = torch.argsort(gathered_pos)
    q_h, k_h, v_h = (_seq_to_heads(t, group, cp).index_select(2, to_global) for t in (q, k, v))
    if mask is None:
        mask = ulysses_mask(seq, doc_ids, window, q.device)
    out = sdpa(q_h, k_h, v_h, mask)
    return _heads_to_seq(out.index_select(2, gathered_pos), group, cp)


def ulysses_mask(seq: int, doc_ids: torch.Tensor | None, window: int | None, device) -> torch.Tensor | None:
    """The whole rows' mask after Ulysses' all-to-all (global order): None when plain causal will do."""
    if doc_ids is None and (window is None or window >= seq):
        return None
    pos = torch.arange(seq, device=device)
    return cp_mask(pos, pos, doc_ids, window)


def _seq_to_heads(t: torch.Tensor, group: ProcessGroup, cp: int) -> torch.Tensor:
    """[b, h, s_local, d] sharded by sequence -> [b, h/cp, cp * s_local, d] sharded by heads, the sequence
    in gathered order."""
    b, h, s, d = t.shape
    # all_to_all_single splits dim 0: put the destination rank (the head group) first.
    send = t.reshape(b, cp, h // cp, s, d).transpose(0, 1).contiguous()
    recv = funcol.all_to_all_single(send, None, None, group)  # [source rank, b, h/cp, s, d]
    return recv.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * s, d)


def _heads_to_seq(t: torch.Tensor, group: ProcessGroup, cp: int) -> torch.Tensor:
    """The inverse of `_seq_to_heads`: [b, h/cp, cp * s_local, d] -> [b, h, s_local, d]."""
    b, hc, seq, d = t.shape
    s = seq // cp
    send = t.reshape(b, hc, cp, s, d).permute(2, 0, 1, 3, 4).contiguous()  # [destination rank, b, h/cp, s, d]
    recv = funcol.all_to_all_single(send, None, None, group)  # [source rank = head group, b, h/cp, s, d]
    return recv.transpose(0, 1).reshape(b, cp * hc, s, d)


def _check_doc_ids(doc_ids: torch.Tensor | None, batch: int, seq: int) -> None:
    if doc_ids is not None and tuple(doc_ids.shape) != (batch, seq):
        raise ValueError(
            f"doc_ids must be the whole rows [batch={batch}, seq={seq}] in global order (not this rank's "
            f"shard), got {tuple(doc_ids.shape)}"
        )


class ContextParallel:
    """Installed on a model as its `sequence_split` (apply_context_parallel): each forward's attention over
    the sequence split across the cp group. `context` makes one forward's state (its ranks' global indices,
    the rows' document ids and token mask), which the layers reach as the forward's cache."""

    def __init__(self, group: ProcessGroup, cp: int, rank: int, mode: str) -> None:
        self.group, self.cp, self.rank, self.mode = group, cp, rank, mode

    def context(self, cfg, position_ids: torch.Tensor, doc_ids: torch.Tensor | None):
        step = _SplitForward(self, position_ids.shape[1] * self.cp, doc_ids, cfg.sliding_window, position_ids)
        return AttentionContext(cache=step, tokens=step.tokens)


class _SplitForward:
    """One forward under context parallel: what `Attention.forward` calls as `ctx.cache.attend`."""

    def __init__(self, split: ContextParallel, seq: int, doc_ids, window, position_ids: torch.Tensor) -> None:
        self.split, self.doc_ids, self.window, self.seq = split, doc_ids, window, seq
        self.masks: dict[bool, torch.Tensor | None] = {}  # (full, sliding), made once per forward
        index = local_indices(seq, split.cp, split.rank, position_ids.device)
        local_docs = None if doc_ids is None else doc_ids.index_select(1, index)
        self.tokens = real_tokens(position_ids, local_docs, index)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sliding: bool):
        s, window = self.split, self.window if sliding else None
        if sliding not in self.masks:
            if s.mode == "ulysses":
                mask = ulysses_mask(self.seq, self.doc_ids, window, q.device)
            else:
                query = local_indices(self.seq, s.cp, s.rank, q.device)
                mask = cp_mask(query, gathered_indices(self.seq, s.cp, q.device), self.doc_ids, window)
            # Additive, in the queries' dtype: SDPA would otherwise convert a boolean mask in every layer
            # and keep each converted copy for backward.
            self.masks[sliding] = None if mask is None else _additive(mask, q.dtype)
        mask = self.masks[sliding]
        if s.mode == "ulysses":
            return ulysses_attention(q, k, v, s.group, s.cp, doc_ids=self.doc_ids, window=window, mask=mask)
        return allgather_kv_attention(q, k, v, s.group, s.cp, s.rank, doc_ids=self.doc_ids, mask=mask)


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean mask (True: attend) as SDPA's additive one: 0 where allowed, -inf elsewhere."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def split_batch(batch, cp: int, rank: int, model=None):
    """This cp rank's part of a micro-batch (duck-typed: `input_ids`, `fields()`, `from_fields`, `images`):
    every per-token tensor cut to the rank's two chunks of each row; `doc_ids` stays whole (the attention
    masks read the whole row); per-row values stay as they are. A vision-language `model`'s images are
    placed from the whole rows first (parallel/images.py), then cut to the rank's tokens."""
    seq = batch.targets.shape[1]
    index = local_indices(seq, cp, rank, batch.targets.device)
    images = None
    if batch.images is not None:
        images = local_images(placed(model, batch).images, index)
        batch = replace(batch, images=None)

    def cut(key: str, value):
        if key == "doc_ids" or value is None or value.dim() < 2 or value.shape[1] != seq:
            return value
        return value.index_select(1, index)

    fields = {key: cut(key, value) for key, value in batch.fields().items()}
    ids = None if batch.input_ids is None else batch.input_ids.index_select(1, index)
    out = type(batch).from_fields(ids, fields)
    return out if images is None else replace(out, images=images)


def apply_context_parallel(model, dims, mesh, mode: str) -> None:
    """Split every row's sequence over the mesh's cp dimension: the model's attention goes through the cp
    group, and its MoE layers count routing statistics over the whole rows (a no-op at cp=1)."""
    if dims.cp == 1:
        return
    group, rank = mesh["cp"].get_group(), mesh.get_local_rank("cp")
    model.sequence_split = ContextParallel(group, dims.cp, rank, mode)
    for layer in moe_layers(model):
        layer.stats_group = group


def batch_splitter(dims, mesh, model):
    """What an engine applies to each micro-batch before its forward: this rank's part under context
    parallel, None without it (`model`: where a vision-language one places its images)."""
    if dims.cp == 1:
        return None
    return partial(split_batch, cp=dims.cp, rank=mesh.get_local_rank("cp"), model=model)


def check_context_parallel(cfg, dims, parallel, max_length: int, whole_sequences: bool, stage: str) -> None:
    """The rules cp must satisfy, before any process group exists. `whole_sequences`: the objective scores
    whole sequences (its trait); `stage` names it in the message."""
    if dims.cp == 1:
        return
    if whole_sequences:
        raise ConfigError(
            f"parallel.cp={dims.cp} with method.stage={stage}: the stage scores whole sequences "
            f"(per-sequence sums), which context parallel splits over ranks; use cp=1 (cp serves pt and sft)"
        )
    multiple = dims.cp_multiple(parallel.sequence_parallel)
    if max_length % multiple:
        raise ConfigError(
            f"parallel.cp={dims.cp}: each row is cut into 2 x cp chunks"
            + (f" of which tp={dims.tp} splits each rank's part again" if multiple != 2 * dims.cp else "")
            + f", so data.max_length must be a multiple of {multiple} (it is {max_length}; e.g. "
            f"{max_length // multiple * multiple or multiple})"
        )
    if parallel.cp_mode == "ulysses":
        try:
            check_ulysses(cfg.num_heads // dims.tp, int(cfg.kv_heads_per_rank(dims.tp)), dims.cp)
        except ValueError as exc:
            raise ConfigError(
                str(exc) + (f" (per tp rank: tp={dims.tp} splits the heads first)" if dims.tp > 1 else "")
            ) from None
