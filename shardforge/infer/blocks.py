"""The bookkeeping of a paged KV cache: fixed-size blocks from a pool, reference counts, and the prefix cache
(a full block's contents keyed by a hash of every token up to its end, so that requests sharing a prompt
prefix share its blocks). No tensors here: `paged.py` holds them."""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np


def block_key(parent: bytes, tokens: list[int]) -> bytes:
    """A full block's identity: its tokens and, through the parent's key, every token before them."""
    return hashlib.sha256(parent + np.asarray(tokens, dtype=np.int64).tobytes()).digest()


class BlockManager:
    """Blocks are free (never filled, or evicted), in use (refcount > 0) or cached (refcount 0 but still
    holding a full block that a later request may reuse; evicted least recently used first when the free
    list runs out)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out block 0 first
        self.refs = [0] * num_blocks
        self.key_of: dict[int, bytes] = {}  # block -> its prefix key, for full blocks that are cached
        self.block_of: dict[bytes, int] = {}  # prefix key -> block
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached blocks nobody uses, oldest first
        self.hits = self.queries = 0  # prefix-cache tokens found / looked up

    @property
    def available(self) -> int:
        return len(self.free) + len(self.evictable)

    @property
    def in_use(self) -> int:
        return self.num_blocks - self.available

    def allocate(self) -> int:
        """A block to write into (refcount 1); evicts the least recently used cached block if none is free."""
        if self.free:
            block = self.free.pop()
        elif self.evictable:
            block, _ = self.evictable.popitem(last=False)
            del self.block_of[self.key_of.pop(block)]
        else:
            raise MemoryError("no KV cache block is free")  # the scheduler checks `available` first
        self.refs[block] = 1
        return block

    def share(self, block: int) -> None:
        if self.refs[block] == 0:
            self.evictable.pop(block, None)
        self.refs[block] += 1

    def release(self, blocks: list[int]) -> None:
        """Drop one reference to each block; a block nobody uses is cached if full and keyed, else freed."""
        for block in reversed(blocks):  # a sequence's last blocks are evicted before its first ones
            self.refs[block] -= 1
            if self.refs[block] == 0:
                if block in self.key_of:
                    self.evictable[block] = None
                else:
                    self.free.append(block)

    def cached_prefix(self, tokens: list[int], limit: int) -> tuple[list[int], list[bytes]]:
        """The cached blocks that hold the first full blocks of `tokens` (at most `limit` of them), each
        shared (refcount + 1), and the keys of those blocks."""
        blocks, keys, parent = [], [], b""
        for i in range(limit):
            key = block_key(parent, tokens[i * self.block_size : (i + 1) * self.block_size])
            block = self.block_of.get(key)
            if block is None:
                break
            self.share(block)
            blocks.append(block)
            keys.append(key)
            parent = key
        self.queries += limit * self.block_size
        self.hits += len(blocks) * self.block_size
        return blocks, keys

    def register(self, block: int, parent: bytes, tokens: list[int]) -> bytes:
        """Offer a block that has just been filled to the prefix cache; returns its key. If another block
        already holds these contents, that one stays the cached copy."""
        key = block_key(parent, tokens)
        if key not in self.block_of and block not in self.key_of:
            self.block_of[key] = block
            self.key_of[block] = key
        return key
