"""The paged KV cache's tensors, and the cache object one engine step hands the model's forward.

A step's tokens (prefill chunks of new requests and one token of each decoding request) run as one row
[1, T], so every projection and MLP is one matmul over all of them. The step's keys and values are written
into their slots in the pool; then each sequence's queries attend to its cached keys. Where those are one
slice of the pool (blocks.py hands out blocks in runs where it can), the sequence attends alone with one SDPA
call on the slice: no copy, no padding, no mask for a decode (its sliding window is a shorter slice), its
causal / sliding-window mask for a prefill chunk. Decodes whose keys are split over runs (the n completions
of one prompt: the prompt's blocks are shared through the prefix cache) are attended together: their blocks
gathered by their block tables padded to the longest, one masked SDPA call. Measured on this CPU, one layer
(benchmarks/paged_attention.py): a batched gather beats one gather per sequence 2x at RL's sizes, while a
slice beats any gather where the keys are long (a 64-request burst of 50M ran 1.9x slower batched)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from shardforge.models.common.attention import AttentionContext, sdpa
from shardforge.models.common.config import DecoderConfig


class PagedKV:
    """Per layer, keys and values of every slot: [1, kv_heads, num_blocks * block_size, head_dim] (block b
    holds slots b * block_size onwards), made on first write (the local head count under TP, the stream's
    dtype). Heads first, so that a run of consecutive blocks is a slice SDPA reads in place (measured here:
    2x faster attention than gathering every sequence's blocks into a padded batch). Zeros, not garbage: a
    batched decode multiplies the masked slots' values by 0 (NaN * 0 is NaN)."""

    def __init__(
        self, num_blocks: int, block_size: int, kernel: Any = None, arena: torch.Tensor | None = None
    ) -> None:
        """`kernel`: the CPU decode-attention kernel (infer/cpu_kernels.py) for fp32 pools, or None.
        `arena`: zeroed memory made with the pool, that layers carve their keys and values from as they come
        (so that the first step does not pay for it: zero-filling a 1 GiB pool took 2 s, 10% of a 64-request
        job here); a layer that does not fit in what is left gets memory of its own."""
        self.num_blocks, self.block_size, self.kernel = num_blocks, block_size, kernel
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.arena, self.carved = arena, 0

    def layer(self, layer: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if layer not in self.keys:
            shape = (1, like.shape[1], self.num_blocks * self.block_size, like.shape[3])
            self.keys[layer], self.values[layer] = self._zeros(shape, like), self._zeros(shape, like)
        return self.keys[layer], self.values[layer]

    def _zeros(self, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        arena, n = self.arena, math.prod(shape)
        fits = arena is not None and arena.dtype == like.dtype and arena.device == like.device
        if not fits or self.carved + n > arena.numel():
            return like.new_zeros(shape)
        self.carved += n
        return arena[self.carved - n : self.carved].view(shape)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy blocks (source, destination) in every layer this pool holds."""
        size = self.block_size
        src = torch.tensor([s * size + i for s, _ in pairs for i in range(size)])
        dst = torch.tensor([d * size + i for _, d in pairs for i in range(size)])
        for pool in (*self.keys.values(), *self.values.values()):
            pool[:, :, dst.to(pool.device)] = pool[:, :, src.to(pool.device)]

    @staticmethod
    def bytes_per_block(cfg: DecoderConfig, block_size: int, dtype: torch.dtype) -> int:
        """Keys and values of one block over all layers (under TP each rank holds 1/tp of it)."""
        return (
            2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * torch.finfo(dtype).bits // 8
        )


@dataclass
class Chunk:
    """One sequence's part of a step: its block table, how many of its tokens are cached already, and how
    many this step adds; `copy_from`: cached blocks whose keys and values its first blocks take first."""

    blocks: list[int]
    start: int
    length: int
    copy_from: list[int] = field(default_factory=list)


Where = tuple[int, int] | torch.Tensor  # a sequence's keys in the pool: one slice, or the slots in order


@dataclass
class _Span:
    """One sequence's part of the step's attention: its queries (tokens lo:hi of the step), where its keys
    are in the pool (all of them; for a decode under a sliding window, the window's), and, for a prefill
    chunk, its masks (None: plainly causal)."""

    lo: int
    hi: int
    start: int  # keys cached before this step
    keys: Where
    window_keys: Where | None = None
    full: torch.Tensor | None = None
    sliding: torch.Tensor | None = None

    def attend(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, sliding: bool, softcap: float | None
    ) -> torch.Tensor:
        queries = q[:, :, self.lo : self.hi]
        if self.hi - self.lo == 1:  # a decode sees every cached key (or the window's): no mask
            where = self.window_keys if sliding and self.window_keys is not None else self.keys
            if softcap is not None:
                return capped(queries, _read(keys, where), _read(values, where), None, softcap)
            return F.scaled_dot_product_attention(
                queries, _read(keys, where), _read(values, where), enable_gqa=True
            )
        mask = self.sliding if sliding else self.full
        if softcap is not None:
            n = self.hi - self.lo  # a chunk that starts its sequence has no mask: plainly causal
            causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()[None, None]
            keys_, values_ = _read(keys, self.keys), _read(values, self.keys)
            return capped(queries, keys_, values_, mask if mask is not None else causal, softcap)
        return sdpa(queries, _read(keys, self.keys), _read(values, self.keys), mask)


def capped(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, softcap: float
) -> torch.Tensor:
    """Attention whose scores are soft-capped before the softmax (Gemma 2: cap x tanh(score / cap)), as
    transformers' eager attention computes it; `mask` True = attend (None: every key). SDPA has no hook for
    it, so the scores are made whole: prefill chunks and decodes are small."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, -math.inf)
    return torch.matmul(scores.softmax(-1), v)


class _Decodes:
    """The step's decoding sequences whose keys are split over runs of blocks, attended as one batch: `rows`
    are their tokens in the step, `table` their block tables padded with block 0 to the longest."""

    def __init__(self, rows: list[int], chunks: list[Chunk], block_size: int, device: torch.device) -> None:
        self.block_size = block_size
        ends = [c.start + 1 for c in chunks]
        width = -(-max(ends) // block_size)
        table = np.zeros((len(chunks), width), dtype=np.int64)
        for row, (c, end) in enumerate(zip(chunks, ends, strict=True)):
            used = c.blocks[: -(-end // block_size)]
            table[row, : len(used)] = used
        self.rows = torch.tensor(rows, device=device)
        self.table = torch.from_numpy(table.reshape(-1)).to(device)
        self.batch, self.keys = len(chunks), width * block_size
        key = torch.arange(self.keys, device=device)[None]
        end = torch.tensor(ends, device=device)[:, None]
        visible = key < end  # [batch, keys]: which padded keys it attends (a sliding layer's: slide())
        self.visible = {False: visible, True: visible}

    def slide(self, window: int) -> None:
        """Sliding layers see only the last `window` keys (the query is the sequence's last position)."""
        last = self.visible[False].sum(-1, keepdim=True) - 1
        key = torch.arange(self.keys, device=last.device)[None]
        self.visible[True] = self.visible[False] & (last - key < window)

    def attend(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, sliding: bool, softcap: float | None
    ) -> torch.Tensor:
        """q [1, heads, T, d] -> these sequences' outputs [1, heads, batch, d], each over its visible keys."""
        kv_heads, d = keys.shape[1], keys.shape[3]
        k, v = (self._gather(pool, kv_heads, d) for pool in (keys, values))  # [batch, kv_heads, keys, d]
        queries = q[0].index_select(1, self.rows).transpose(0, 1)[:, :, None]  # [batch, heads, 1, d]
        mask = self.visible[sliding][:, None, None]
        attend = sdpa if softcap is None else partial(capped, softcap=softcap)
        out = attend(queries, k, v, mask)  # [batch, heads, 1, d]
        return out[:, :, 0].transpose(0, 1)[None]

    def _gather(self, pool: torch.Tensor, kv_heads: int, d: int) -> torch.Tensor:
        blocks = pool.view(kv_heads, -1, self.block_size * d).index_select(1, self.table)
        return blocks.view(kv_heads, self.batch, self.keys, d).transpose(0, 1)


def _read(pool: torch.Tensor, where: Where) -> torch.Tensor:
    """[1, kv_heads, keys, d]: a view of the pool when one slice holds the keys, else a gather."""
    if isinstance(where, tuple):
        return pool[:, :, where[0] : where[1]]
    return pool.index_select(2, where)


class PagedStep:
    """The `cache` a step's forward takes (models/llama/model.py calls `context`, `attend` and `advance`)."""

    def __init__(self, kv: PagedKV, chunks: list[Chunk], device: torch.device) -> None:
        self.kv, self.device = kv, device
        self.attended: list[int] = []  # each layer's call through this step, in order (executor.py checks)
        bs = kv.block_size
        copies = [pair for c in chunks for pair in zip(c.copy_from, c.blocks, strict=False)]
        if copies:
            kv.copy_blocks(copies)
        positions = [np.arange(c.start, c.start + c.length) for c in chunks]
        slots = [np.asarray(c.blocks)[p // bs] * bs + p % bs for c, p in zip(chunks, positions, strict=True)]
        self.slots = self._put(np.concatenate(slots))  # [T]: where this step's keys and values go
        self.positions = self._put(np.concatenate(positions))[None]  # [1, T]: the step's token positions
        self.spans: list[_Span] = []
        decodes: list[tuple[int, Chunk]] = []
        lo = 0
        self.slices: list[list[tuple[int, int]]] = []
        kernel: list[tuple[int, list[tuple[int, int]]]] = []  # decodes for the kernel: (row, their slices)
        for c in chunks:
            slices = _slices(c.blocks, c.start + c.length, bs)
            if c.length == 1 and kv.kernel is not None:
                kernel.append((lo, slices))  # with the others, by the kernel, wherever its keys are
            elif c.length == 1 and len(slices) > 1:
                decodes.append((lo, c))  # its keys need a gather: gathered and attended with the others
            else:
                self.spans.append(_Span(lo, lo + c.length, c.start, self._where(slices, 0)))
                self.slices.append(slices)
            lo += c.length
        self.kernel_rows = self._put(np.array([r for r, _ in kernel])) if kernel else None
        self.kernel_slices = [slices for _, slices in kernel]
        whole = _ranges(self.kernel_slices, None)
        self.ranges = {False: whole, True: whole}  # the kernel's slices (sliding layers': `context`)
        self.decodes = (
            _Decodes([r for r, _ in decodes], [c for _, c in decodes], bs, device) if decodes else None
        )

    def _where(self, slices: list[tuple[int, int]], first: int) -> Where:
        """Where the keys from the `first`-th on are: a slice, or (split over runs) their slots."""
        parts = []
        for a, b in slices:
            if first >= b - a:
                first -= b - a
                continue
            parts.append((a + first, b))
            first = 0
        if len(parts) == 1:
            return parts[0]
        return self._put(np.concatenate([np.arange(a, b) for a, b in parts]))

    def _put(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64)).to(self.device)

    def context(self, cfg: DecoderConfig, position_ids: torch.Tensor) -> AttentionContext:
        """Each prefill chunk's masks, now that the model's window is known: causal from the chunk's cached
        length (none when it starts the sequence), and the sliding window where it cuts."""
        window = cfg.sliding_window
        if window is not None and self.decodes is not None:
            self.decodes.slide(window)
        if window is not None and self.kernel_slices:  # sliding layers' decodes see the window's keys
            self.ranges[True] = _ranges(self.kernel_slices, window)
        for s, slices in zip(self.spans, self.slices, strict=True):
            n, end = s.hi - s.lo, s.start + s.hi - s.lo
            if n == 1:
                if window is not None and end > window:
                    s.window_keys = self._where(slices, end - window)
                continue
            query = torch.arange(s.start, end, device=self.device)[:, None]
            key = torch.arange(end, device=self.device)[None]
            if s.start:
                s.full = (key <= query)[None, None]
            if window is not None and end > window:
                s.sliding = ((key <= query) & (query - key < window))[None, None]
            else:
                s.sliding = s.full
        return AttentionContext(cache=self)

    def through_every_layer(self, layers: int) -> bool:
        """Whether each of the model's `layers` attended through this step exactly once (a family that
        attends twice in a layer, as DiffLlama does, would overwrite its own keys in the pool)."""
        return len(self.attended) == len(set(self.attended)) == layers

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        sliding: bool,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """q [1, heads, T, d], k and v [1, kv_heads, T, d] for the step's tokens -> the attention output
        [1, heads, T, d]; `softcap`: the family soft-caps its scores (the generic backend's Gemma 2)."""
        self.attended.append(layer)
        keys, values = self.kv.layer(layer, k)
        keys[0, :, self.slots] = k[0]
        values[0, :, self.slots] = v[0]
        decoded = self.decodes.attend(q, keys, values, sliding, softcap) if self.decodes is not None else None
        if not self.spans and self.kernel_rows is None:  # a step of batched decodes only (in their order)
            return decoded
        out = torch.empty_like(q)
        if decoded is not None:
            out[:, :, self.decodes.rows] = decoded
        if self.kernel_rows is not None:
            out[:, :, self.kernel_rows] = self._kernel_attend(q, keys, values, sliding, softcap)
        for s in self.spans:
            out[:, :, s.lo : s.hi] = s.attend(q, keys, values, sliding, softcap)
        return out

    def _kernel_attend(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, sliding: bool, softcap: float | None
    ) -> torch.Tensor:
        """The decodes' outputs [1, heads, rows, d]: the kernel, where it applies (an fp32 pool on CPU, no
        soft cap), else one SDPA call each over its slots."""
        rows, (starts, ends, offsets) = self.kernel_rows, self.ranges[sliding]
        if softcap is not None or keys.dtype != torch.float32 or keys.device.type != "cpu":
            bounds, offsets = list(zip(starts.tolist(), ends.tolist(), strict=True)), offsets.tolist()
            parts = [
                _Span(row, row + 1, 0, self._where(bounds[offsets[i] : offsets[i + 1]], 0)).attend(
                    q, keys, values, False, softcap
                )
                for i, row in enumerate(rows.tolist())
            ]
            return torch.cat(parts, dim=2)
        queries = q[0].index_select(1, rows)  # [heads, rows, d]
        out = torch.empty_like(queries)
        self.kv.kernel.decode_attention(
            queries, keys[0], values[0], starts, ends, offsets, out, q.shape[-1] ** -0.5
        )
        return out[None]

    def advance(self, n: int) -> None:
        """The engine keeps each sequence's count of cached tokens itself."""


def _ranges(decodes: list[list[tuple[int, int]]], window: int | None) -> tuple[torch.Tensor, ...]:
    """The kernel's view of the decodes' keys: every slice's start and end, and where each decode's slices
    begin (CSR offsets); under a window, only the last `window` keys of each."""
    starts: list[int] = []
    ends: list[int] = []
    offsets = [0]
    for slices in decodes:
        kept, left = [], window
        for a, b in reversed(slices):
            if left is not None:
                if left <= 0:
                    break
                a = max(a, b - left)
                left -= b - a
            kept.append((a, b))
        for a, b in reversed(kept):
            starts.append(a)
            ends.append(b)
        offsets.append(len(starts))
    return tuple(torch.tensor(x, dtype=torch.int64) for x in (starts, ends, offsets))


def _slices(blocks: list[int], length: int, block_size: int) -> list[tuple[int, int]]:
    """The pool slots of a sequence's first `length` keys, as (start, end) slices: one per run of consecutive
    blocks."""
    used = np.asarray(blocks[: -(-length // block_size)], dtype=np.int64)
    breaks = np.flatnonzero(np.diff(used) != 1) + 1
    out = []
    for run in np.split(used, breaks):
        out.append((int(run[0]) * block_size, (int(run[-1]) + 1) * block_size))
    a, b = out[-1]
    out[-1] = (a, b - (-length % block_size))  # the last block holds only the first keys
    return out
