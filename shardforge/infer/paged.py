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
    def bytes_per_block(cfg: DecoderConfig, block_size: int, dtype: torch.dtype, tp: int = 1) -> int:
        heads = max(1, cfg.num_kv_heads // tp)
        return 2 * cfg.num_layers * block_size * heads * cfg.head_dim * torch.finfo(dtype).bits // 8


@dataclass
class Chunk:
    """One sequence's part of a step: its block table, how many of its tokens are cached already, and how
    many this step adds."""

    blocks: list[int]
    start: int
    length: int


class PagedStep:
    """The `cache` a step's forward takes (models/llama/model.py calls `context`, `attend` and `advance`)."""

    def __init__(self, kv: PagedKV, chunks: list[Chunk], device: torch.device) -> None:
        self.kv = kv
        bs = kv.block_size
        starts = np.array([c.start for c in chunks], dtype=np.int64)
        lengths = np.array([c.length for c in chunks], dtype=np.int64)
        ends = starts + lengths
        batch, longest_q = len(chunks), int(lengths.max())
        table = np.zeros((batch, max(len(c.blocks) for c in chunks)), dtype=np.int64)
        for b, c in enumerate(chunks):
            table[b, : len(c.blocks)] = c.blocks
        rows = np.arange(batch)[:, None]

        def slot(positions: np.ndarray) -> np.ndarray:  # [B, n] positions -> their slots in the pool
            return table[rows, np.minimum(positions // bs, table.shape[1] - 1)] * bs + positions % bs

        offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        column = np.arange(longest_q)[None, :]
        real = column < lengths[:, None]  # [B, max_q]: real queries (row-major = the step's token order)
        query_pos = np.where(real, starts[:, None] + column, 0)
        q_index = np.where(real, offsets[:, None] + column, int(lengths.sum()))  # padding -> a zero row

        def put(array: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(array)).to(device)

        self.slots = put(slot(query_pos)[real])  # [T]: where this step's keys and values go
        self.block_table, self.q_index = put(table), put(q_index)  # [B, max_blocks]: padding reads block 0
        self.q_scatter = put((rows * longest_q + column)[real])  # [T] into the flattened [B * max_q]
        self.query_pos = put(query_pos)  # [B, max_q]: each query's position
        self.positions = put(query_pos[real])[None]  # [1, T]: the step's token positions
        key_range = torch.arange(table.shape[1] * bs, device=device)
        allowed = (key_range <= self.query_pos[:, :, None]) & (key_range < put(ends)[:, None, None])
        self.allowed = allowed[:, None]  # [B, 1, max_q, max_kv]; a padding query sees key 0 (no empty row)

    def context(self, cfg: DecoderConfig, position_ids: torch.Tensor) -> AttentionContext:
        if cfg.sliding_window is None:
            return AttentionContext(full=self.allowed, sliding=self.allowed, cache=self)
        keys = torch.arange(self.allowed.shape[-1], device=self.allowed.device)
        near = (self.query_pos[:, :, None] - keys[None, None, :]) < cfg.sliding_window
        return AttentionContext(full=self.allowed, sliding=self.allowed & near[:, None], cache=self)

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None
    ) -> torch.Tensor:
        """q [1, heads, T, d], k and v [1, kv_heads, T, d] for the step's tokens -> the attention output
        [1, heads, T, d]."""
        keys, values = self.kv.layer(layer, k)
        kv_heads, d = keys.shape[2], keys.shape[3]
        keys.view(-1, kv_heads, d)[self.slots] = k[0].transpose(0, 1)
        values.view(-1, kv_heads, d)[self.slots] = v[0].transpose(0, 1)
        batch, blocks = self.block_table.shape[0], self.block_table.flatten()

        def gathered(pool: torch.Tensor) -> torch.Tensor:  # [B, kv_heads, max_blocks * block_size, d]
            return pool.index_select(0, blocks).view(batch, -1, kv_heads, d).transpose(1, 2)

        tokens = q[0].transpose(0, 1)  # [T, heads, d]
        tokens = torch.cat([tokens, tokens.new_zeros(1, *tokens.shape[1:])])
        queries = tokens[self.q_index].transpose(1, 2)  # [B, heads, max_q, d]
        out = sdpa(queries, gathered(keys), gathered(values), mask)  # [B, heads, max_q, d]
        heads, d = out.shape[1], out.shape[3]
        out = out.transpose(1, 2).reshape(-1, heads, d)[self.q_scatter]  # [T, heads, d], in token order
        return out.transpose(0, 1)[None]

    def advance(self, n: int) -> None:
        """The engine keeps each sequence's count of cached tokens itself."""
