"""The bookkeeping of a paged KV cache: fixed-size blocks from a pool, reference counts, and the prefix cache
(a full block's contents keyed by a hash of every token up to its end, so that requests sharing a prompt
prefix share its blocks). No tensors here: `paged.py` holds them.

Blocks are handed out in runs where they can be: a sequence's next block is the one after its last when that
is free, and a sequence's first block starts a free run long enough for all the tokens it may reach, the rest
of which is reserved for it (softly: taken by others only when no unreserved block is left). Attention then
reads most sequences' keys as one slice of the pool, with no gather."""

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
        self.free = np.ones(num_blocks, dtype=bool)  # never filled, or evicted
        self.reserved = np.zeros(num_blocks, dtype=bool)  # free, and kept for the sequence before it
        self.free_count = num_blocks
        self.refs = [0] * num_blocks
        self.key_of: dict[int, bytes] = {}  # block -> its prefix key, for full blocks that are cached
        self.block_of: dict[bytes, int] = {}  # prefix key -> block
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached blocks nobody uses, oldest first
        self.hits = self.queries = 0  # prefix-cache tokens found / looked up

    @property
    def available(self) -> int:
        return self.free_count + len(self.evictable)

    @property
    def in_use(self) -> int:
        return self.num_blocks - self.available

    def allocate(self, after: int | None = None, span: int = 1) -> int:
        """A block to write into (refcount 1): the one after `after` (a sequence's last block) when free, else
        the start of a free run of `span` blocks (the rest reserved), else any free block, else the least
        recently used cached block (evicted)."""
        if after is not None and after + 1 < self.num_blocks and self.free[after + 1]:
            block = after + 1
        elif self.free_count:
            block = self._run_start(span)
        elif self.evictable:
            block, _ = self.evictable.popitem(last=False)
            del self.block_of[self.key_of.pop(block)]
            self.refs[block] = 1
            return block
        else:
            raise MemoryError("no KV cache block is free")  # the scheduler checks `available` first
        self.free[block] = self.reserved[block] = False
        self.free_count -= 1
        self.refs[block] = 1
        return block

    def _run_start(self, span: int) -> int:
        """The first block of the first unreserved free run of at least `span` blocks (else of the longest),
        whose next span - 1 blocks are reserved; any free block when every free one is reserved."""
        open_ = self.free & ~self.reserved
        if not open_.any():
            return int(np.flatnonzero(self.free)[0])
        edges = np.flatnonzero(np.diff(np.concatenate([[0], open_.view(np.int8), [0]])))
        starts, lengths = edges[0::2], edges[1::2] - edges[0::2]
        fits = np.flatnonzero(lengths >= span)
        run = int(fits[0]) if fits.size else int(lengths.argmax())
        start = int(starts[run])
        self.reserved[start + 1 : start + min(span, int(lengths[run]))] = True
        return start

    def share(self, block: int) -> None:
        if self.refs[block] == 0:
            self.evictable.pop(block, None)
        self.refs[block] += 1

    def release(self, blocks: list[int]) -> None:
        """Drop one reference to each block; a block nobody uses is cached if full and keyed, else freed. The
        run reserved after the last block is given up."""
        for block in reversed(blocks):  # a sequence's last blocks are evicted before its first ones
            self.refs[block] -= 1
            if self.refs[block] == 0:
                if block in self.key_of:
                    self.evictable[block] = None
                else:
                    self.free[block] = True
                    self.free_count += 1
        if blocks:
            end = blocks[-1] + 1
            while end < self.num_blocks and self.reserved[end]:
                self.reserved[end] = False
                end += 1

    def trim(self, blocks: list[int]) -> None:
        """Free a sequence's last blocks that only rejected speculative tokens were written into (never full,
        so never cached or shared), reserved for it still: its next steps take them back in the same run."""
        for block in blocks:
            self.refs[block] -= 1
            if self.refs[block] == 0:
                self.free[block] = self.reserved[block] = True
                self.free_count += 1

    def cached_prefix(
        self, tokens: list[int], limit: int, salt: bytes = b""
    ) -> tuple[list[int], list[bytes]]:
        """The cached blocks that hold the first full blocks of `tokens` (at most `limit` of them), each
        shared (refcount + 1), and the keys of those blocks; `salt` starts the chain of keys (a prompt's
        images: its blocks are another prompt's only with the same images)."""
        blocks, keys, parent = [], [], salt
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
