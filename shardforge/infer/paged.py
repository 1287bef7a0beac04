"""The paged KV cache's tensors, and the cache object one engine step hands the model's forward.

A step's tokens (prefill chunks of new requests and one token of each decoding request) run as one row
[1, T], so every projection and MLP is one matmul over all of them. Attention alone is per sequence: the
step's keys and values are written into their slots in the pool, then each sequence's queries and its cached
keys (gathered from its blocks through its block table) are padded into a [sequences, ...] batch for SDPA
with an explicit mask (causal from the sequence's cached length, the sliding window where the layer has
one), and the outputs are put back in token order."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shardforge.models.attention import sdpa
from shardforge.models.llama.config import DecoderConfig
from shardforge.models.llama.model import AttentionContext


class PagedKV:
    """Per layer, keys and values of every slot: [num_blocks * block_size, kv_heads, head_dim], made on first
    write (the local head count under TP, the stream's dtype)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}

    def layer(self, layer: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if layer not in self.keys:
            shape = (self.num_blocks * self.block_size, like.shape[1], like.shape[3])
            self.keys[layer] = like.new_zeros(shape)
            self.values[layer] = like.new_zeros(shape)
        return self.keys[layer], self.values[layer]

    def copy_block(self, source: int, target: int) -> None:
        """Copy-on-write for a shared, partly filled block (n > 1 completions of one prompt)."""
        bs = self.block_size
        for store in (self.keys, self.values):
            for tensor in store.values():
                tensor[target * bs : (target + 1) * bs] = tensor[source * bs : (source + 1) * bs]

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
        total = sum(c.length for c in chunks)
        longest_q = max(c.length for c in chunks)
        longest_kv = max(c.start + c.length for c in chunks)
        slots, q_index, kv_index, q_scatter = [], [], [], []
        query_pos, key_count = [], []
        offset = 0
        for b, c in enumerate(chunks):
            table = torch.tensor(c.blocks, dtype=torch.long)
            positions = torch.arange(c.start + c.length)
            seq_slots = table[positions // bs] * bs + positions % bs
            slots.append(seq_slots[c.start :])
            kv_index.append(torch.cat([seq_slots, seq_slots.new_zeros(longest_kv - len(seq_slots))]))
            mine = torch.arange(offset, offset + c.length)
            q_index.append(torch.cat([mine, mine.new_full((longest_q - c.length,), total)]))
            q_scatter.append(b * longest_q + torch.arange(c.length))
            padding = torch.zeros(longest_q - c.length, dtype=torch.long)
            query_pos.append(torch.cat([torch.arange(c.start, c.start + c.length), padding]))
            key_count.append(c.start + c.length)
            offset += c.length
        self.slots = torch.cat(slots).to(device)
        self.q_index = torch.stack(q_index).to(device)
        self.kv_index = torch.stack(kv_index).to(device)
        self.q_scatter = torch.cat(q_scatter).to(device)
        self.query_pos = torch.stack(query_pos).to(device)  # [B, max_q]: each query's position
        keys = torch.arange(longest_kv, device=device)
        counts = torch.tensor(key_count, device=device)
        allowed = (keys[None, None, :] <= self.query_pos[:, :, None]) & (keys < counts[:, None, None])
        self.allowed = allowed[:, None]  # [B, 1, max_q, max_kv]; a padding query sees key 0 (no empty row)
        self.positions = self.query_pos.flatten()[self.q_scatter][None]  # [1, T]: the step's token positions

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
        keys[self.slots] = k[0].transpose(0, 1)
        values[self.slots] = v[0].transpose(0, 1)
        gathered_k = keys[self.kv_index].transpose(1, 2)  # [B, kv_heads, max_kv, d]
        gathered_v = values[self.kv_index].transpose(1, 2)
        tokens = q[0].transpose(0, 1)  # [T, heads, d]
        tokens = torch.cat([tokens, tokens.new_zeros(1, *tokens.shape[1:])])
        queries = tokens[self.q_index].transpose(1, 2)  # [B, heads, max_q, d]
        out = sdpa(queries, gathered_k, gathered_v, mask)  # [B, heads, max_q, d]
        heads, d = out.shape[1], out.shape[3]
        out = out.transpose(1, 2).reshape(-1, heads, d)[self.q_scatter]  # [T, heads, d], in token order
        return out.transpose(0, 1)[None]

    def advance(self, n: int) -> None:
        """The engine keeps each sequence's count of cached tokens itself."""
