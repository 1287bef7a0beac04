"""The paged KV cache's tensors, and the cache object one engine step hands the model's forward.

A step's tokens (prefill chunks of new requests and one token of each decoding request) run as one row
[1, T], so every projection and MLP is one matmul over all of them. Attention alone is per sequence: the
step's keys and values are written into their slots in the pool, then each sequence's queries and its cached
keys (gathered from its blocks through its block table) are padded into a [sequences, ...] batch for SDPA
with an explicit mask (causal from the sequence's cached length, the sliding window where the layer has
one), and the outputs are put back in token order."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from shardforge.models.attention import sdpa
from shardforge.models.llama.config import DecoderConfig
from shardforge.models.llama.model import AttentionContext


class PagedKV:
    """Per layer, keys and values of every block: [num_blocks, block_size, kv_heads, head_dim], made on first
    write (the local head count under TP, the stream's dtype). A sequence's keys are gathered block by block
    (contiguous copies, ten times faster here than slot by slot)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}

    def layer(self, layer: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if layer not in self.keys:
            shape = (self.num_blocks, self.block_size, like.shape[1], like.shape[3])
            self.keys[layer] = like.new_zeros(shape)
            self.values[layer] = like.new_zeros(shape)
        return self.keys[layer], self.values[layer]

    def copy_block(self, source: int, target: int) -> None:
        """Copy-on-write for a shared, partly filled block (n > 1 completions of one prompt)."""
        for store in (self.keys, self.values):
            for tensor in store.values():
                tensor[target] = tensor[source]

    @staticmethod
    def bytes_per_block(cfg: DecoderConfig, block_size: int, dtype: torch.dtype) -> int:
        """Keys and values of one block over all layers (under TP each rank holds 1/tp of it)."""
        return (
            2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * torch.finfo(dtype).bits // 8
        )


@dataclass
class Chunk:
    """One sequence's part of a step: its block table, how many of its tokens are cached already, and how
    many this step adds."""

    blocks: list[int]
    start: int
    length: int


@dataclass
class _Group:
    """Sequences attended together: similar key lengths, and either all decoding or one prefill chunk, so that
    padding to the group's longest costs little."""

    block_table: torch.Tensor  # [G, max_blocks]; padding reads block 0
    q_index: torch.Tensor  # [G, max_q] into the step's tokens (+ a zero row for padding)
    tokens: torch.Tensor  # [Tg]: which of the step's tokens the group's real queries are
    q_scatter: torch.Tensor  # [Tg] into the flattened [G * max_q]
    query_pos: torch.Tensor  # [G, max_q]: each query's position
    full: torch.Tensor  # [G, 1, max_q, max_blocks * block_size] (True = attend)
    sliding: torch.Tensor | None = None  # made in context(), when the model's window is known


class PagedStep:
    """The `cache` a step's forward takes (models/llama/model.py calls `context`, `attend` and `advance`)."""

    def __init__(self, kv: PagedKV, chunks: list[Chunk], device: torch.device) -> None:
        self.kv, self.device = kv, device
        lengths = np.array([c.length for c in chunks], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        self.total = int(lengths.sum())
        positions = [np.arange(c.start, c.start + c.length) for c in chunks]
        slots = [
            np.asarray(c.blocks)[p // kv.block_size] * kv.block_size + p % kv.block_size
            for c, p in zip(chunks, positions, strict=True)
        ]
        self.slots = self._put(np.concatenate(slots))  # [T]: where this step's keys and values go
        self.positions = self._put(np.concatenate(positions))[None]  # [1, T]: the step's token positions
        self.groups = [self._group([chunks[i] for i in g], offsets[g]) for g in _grouping(chunks)]

    def _put(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64)).to(self.device)

    def _group(self, chunks: list[Chunk], offsets: np.ndarray) -> _Group:
        bs = self.kv.block_size
        starts = np.array([c.start for c in chunks], dtype=np.int64)
        lengths = np.array([c.length for c in chunks], dtype=np.int64)
        table = np.zeros((len(chunks), max(len(c.blocks) for c in chunks)), dtype=np.int64)
        for b, c in enumerate(chunks):
            table[b, : len(c.blocks)] = c.blocks
        column = np.arange(int(lengths.max()))[None, :]
        real = column < lengths[:, None]  # [G, max_q]: real queries
        query_pos = self._put(np.where(real, starts[:, None] + column, 0))
        keys = torch.arange(table.shape[1] * bs, device=self.device)
        ends = self._put(starts + lengths)
        full = (keys <= query_pos[:, :, None]) & (keys < ends[:, None, None])  # a padding query sees key 0
        return _Group(
            block_table=self._put(table),
            q_index=self._put(np.where(real, offsets[:, None] + column, self.total)),
            tokens=self._put((offsets[:, None] + column)[real]),
            q_scatter=self._put((np.arange(len(chunks))[:, None] * column.shape[1] + column)[real]),
            query_pos=query_pos,
            full=full[:, None],
        )

    def context(self, cfg: DecoderConfig, position_ids: torch.Tensor) -> AttentionContext:
        for g in self.groups:
            if cfg.sliding_window is None:
                g.sliding = g.full
            else:
                keys = torch.arange(g.full.shape[-1], device=self.device)
                g.sliding = g.full & ((g.query_pos[:, :, None] - keys) < cfg.sliding_window)[:, None]
        return AttentionContext(cache=self)

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sliding: bool
    ) -> torch.Tensor:
        """q [1, heads, T, d], k and v [1, kv_heads, T, d] for the step's tokens -> the attention output
        [1, heads, T, d]."""
        keys, values = self.kv.layer(layer, k)
        kv_heads, d = keys.shape[2], keys.shape[3]
        keys.view(-1, kv_heads, d)[self.slots] = k[0].transpose(0, 1)
        values.view(-1, kv_heads, d)[self.slots] = v[0].transpose(0, 1)
        tokens = q[0].transpose(0, 1)  # [T, heads, d]
        padded = torch.cat([tokens, tokens.new_zeros(1, *tokens.shape[1:])])
        out = torch.empty_like(tokens)
        for g in self.groups:
            queries = padded[g.q_index].transpose(1, 2)  # [G, heads, max_q, d]
            mask = g.sliding if sliding else g.full
            result = sdpa(
                queries, _gather(keys, g.block_table), _gather(values, g.block_table), mask
            ).transpose(1, 2)  # [G, max_q, heads, d]
            out[g.tokens] = result.reshape(-1, *result.shape[2:])[g.q_scatter]
        return out.transpose(0, 1)[None]

    def advance(self, n: int) -> None:
        """The engine keeps each sequence's count of cached tokens itself."""


def _gather(pool: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """[G, kv_heads, max_blocks * block_size, d]: each row's blocks, in order."""
    return pool.index_select(0, table.flatten()).view(table.shape[0], -1, *pool.shape[2:]).transpose(1, 2)


def _grouping(chunks: list[Chunk]) -> list[np.ndarray]:
    """Decoding sequences by key length (in powers of two of blocks, small buckets merged upwards); each
    prefill chunk alone (its queries would pad every decode's)."""
    prefills = [np.array([i]) for i, c in enumerate(chunks) if c.length > 1]
    decodes = sorted((len(c.blocks), i) for i, c in enumerate(chunks) if c.length == 1)
    groups, current, limit = [], [], 0
    for blocks, i in decodes:
        if current and blocks > limit and len(current) >= 4:
            groups.append(np.array(current))
            current = []
        if not current:
            limit = 1 << (blocks - 1).bit_length()  # this bucket takes sequences of up to `limit` blocks
        current.append(i)
        limit = max(limit, blocks)
    if current:
        groups.append(np.array(current))
    return groups + prefills
