"""Continuous batching: which sequences run in the next step, and how many of their tokens.

Every step, running sequences go first (one token each when decoding, the next chunk of a long prompt
otherwise), then waiting ones are admitted in arrival order while the step's token budget, the sequence cap
and the KV blocks last. A new sequence first takes the cached blocks of its longest known prompt prefix.
When a running sequence needs a block and none is left, the latest arrival is preempted: its blocks are
released and it waits again at the front, to be recomputed (its full blocks usually come back from the
prefix cache)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from shardforge.infer.blocks import BlockManager
from shardforge.infer.media import RequestImages
from shardforge.infer.sampling import Sampler


@dataclass(eq=False)
class Sequence:
    """One completion: the prompt and the tokens made so far, and where their keys and values are."""

    request_id: str
    index: int  # which of the request's n completions
    tokens: list[int]
    prompt_len: int
    sampler: Sampler
    max_tokens: int
    blocks: list[int] = field(default_factory=list)
    keys: list[bytes] = field(default_factory=list)  # prefix keys of its full blocks, in order
    computed: int = 0  # tokens whose keys and values are in its blocks
    copy_from: list[int] = field(default_factory=list)  # cached blocks its first blocks are copied from
    finish_reason: str | None = None
    preemptions: int = 0
    media: RequestImages | None = None  # the prompt's images, encoded
    draft: list[int] = field(default_factory=list)  # speculative tokens run after its last one this step
    draft_probs: Any = None  # the distributions a draft model drew them from (infer/speculative.py: Draft)
    adapter: int = 0  # its LoRA adapter's slot (infer/multi_lora.py); 0: the base
    adapter_salt: bytes = b""  # that adapter's prefix-cache salt: the same prompt under two never shares

    @property
    def salt(self) -> bytes:
        """Where its prefix-cache keys start: its images' digest (none: b""), then its adapter's."""
        return (self.media.salt if self.media is not None else b"") + self.adapter_salt

    @property
    def output(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    @property
    def uncomputed(self) -> int:
        return len(self.tokens) - self.computed


class Scheduler:
    def __init__(
        self, blocks: BlockManager, max_step_tokens: int, max_running: int, prefix_cache: bool = True
    ) -> None:
        self.blocks, self.prefix_cache = blocks, prefix_cache
        self.max_step_tokens, self.max_running = max_step_tokens, max_running
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0

    def add(self, seq: Sequence, first: bool = False) -> None:
        (self.waiting.appendleft if first else self.waiting.append)(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a finished or aborted sequence out, releasing its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)

    def schedule(self) -> list[tuple[Sequence, int]]:
        """The next step's (sequence, tokens to compute) pairs, with the blocks they need allocated."""
        budget, chosen = self.max_step_tokens, []
        for seq in list(self.running):
            if budget == 0:
                break
            if seq not in self.running:  # preempted for an earlier one in this loop
                continue
            n = min(seq.uncomputed + len(seq.draft), budget)
            if n < seq.uncomputed + len(seq.draft):  # the budget cuts its draft short (or out)
                seq.draft = seq.draft[: max(0, n - seq.uncomputed)]
            while not self._grow(seq, seq.computed + n):
                if seq.draft:  # a draft never preempts anyone: the sequence decodes plainly
                    seq.draft, n = [], min(seq.uncomputed, budget)
                    continue
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if seq in self.running:
                chosen.append((seq, n))
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_running:
            seq = self.waiting[0]
            self._attach_prefix(seq)
            n = min(seq.uncomputed, budget)
            if not self._grow(seq, seq.computed + n):
                self._release(seq)  # its prefix blocks are not held while it waits
                break
            self.waiting.popleft()
            self.running.append(seq)
            chosen.append((seq, n))
            budget -= n
        return chosen

    def computed(self, seq: Sequence, n: int) -> None:
        """After the step: n more tokens are cached; each block they filled joins the prefix cache. Cached
        blocks it copied its prefix from (in this step's forward) are let go."""
        if seq.copy_from:
            self.blocks.release(seq.copy_from)
            seq.copy_from = []
        seq.computed += n
        size = self.blocks.block_size
        while len(seq.keys) < seq.computed // size:
            i = len(seq.keys)
            parent = seq.keys[-1] if seq.keys else seq.salt
            tokens = seq.tokens[i * size : (i + 1) * size]
            if self.prefix_cache:
                seq.keys.append(self.blocks.register(seq.blocks[i], parent, tokens))
            else:
                seq.keys.append(b"")

    def rolled_back(self, seq: Sequence) -> None:
        """After a speculative step: the blocks past its tokens that rejected draft tokens were written into
        are let go (kept reserved for it, so its next blocks are the same run), and its draft is cleared."""
        keep = -(-len(seq.tokens) // self.blocks.block_size)
        if len(seq.blocks) > keep:
            self.blocks.trim(seq.blocks[keep:])
            del seq.blocks[keep:]
        seq.draft, seq.draft_probs = [], None

    def _attach_prefix(self, seq: Sequence) -> None:
        """Start from the cached blocks of the longest known prefix. A request with one completion copies
        them into the start of a run of its own (the step's forward copies them: `Chunk.copy_from`), so its
        keys stay one slice of the pool that attention reads in place; shared blocks would split its keys
        over two runs and send every one of its decode steps through a gather (a shared system prompt did
        that to most of a 64-request burst: 12% of the time went to the gathers). The n completions of one
        prompt keep sharing its blocks: they decode together through one batched gather."""
        if seq.blocks or not self.prefix_cache:
            return
        size = self.blocks.block_size
        limit = (len(seq.tokens) - 1) // size  # the last token is always computed
        cached, seq.keys = self.blocks.cached_prefix(seq.tokens, limit, seq.salt)
        seq.blocks, seq.computed = cached, len(cached) * size
        if cached and seq.sampler.params.n == 1 and self.blocks.free_count >= len(cached):
            span = -(-(seq.prompt_len + seq.max_tokens - 1) // size)
            own: list[int] = []
            for i in range(len(cached)):
                own.append(self.blocks.allocate(own[-1] if own else None, span - i))
            seq.blocks, seq.copy_from = own, cached

    def _grow(self, seq: Sequence, tokens: int) -> bool:
        needed = -(-tokens // self.blocks.block_size) - len(seq.blocks)
        if needed > self.blocks.available:
            return False
        reach = seq.prompt_len + seq.max_tokens - 1  # the last token is sampled, never cached
        span = -(-reach // self.blocks.block_size) - len(seq.blocks)
        for i in range(needed):
            seq.blocks.append(self.blocks.allocate(seq.blocks[-1] if seq.blocks else None, span - i))
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)

    def _release(self, seq: Sequence) -> None:
        self.blocks.release(seq.blocks)
        self.blocks.release(seq.copy_from)  # not admitted after all: the copy never ran
        seq.blocks, seq.keys, seq.computed, seq.copy_from = [], [], 0, []
        seq.draft, seq.draft_probs = [], None
