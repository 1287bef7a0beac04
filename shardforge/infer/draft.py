"""A draft model's proposals for speculative decoding: a small model of the target's tokenizer, on a paged
pool of its own, runs k cheap steps per engine step (the first catches its cache up with the tokens the
target accepted, each next one feeds its previous guess) over every speculating sequence at once.

Its cache is kept per sequence as the tokens it holds keys for; a step first rolls it back to the longest
prefix that agrees with the sequence's tokens (rejected guesses are dropped there), so nothing else has to
tell it what the target kept."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch

from shardforge.infer.blocks import BlockManager
from shardforge.infer.executor import LocalRunner, StepInput
from shardforge.infer.paged import Chunk, PagedKV
from shardforge.infer.sampling import Sampler, choose, processed_logits
from shardforge.infer.speculative import Draft
from shardforge.models.common.protocol import CausalModel


@dataclass
class _Cached:
    """The keys a sequence has in the draft's pool: its tokens[:base], then the guesses `fed` after them."""

    blocks: list[int] = field(default_factory=list)
    base: int = 0
    fed: list[int] = field(default_factory=list)

    def agreed(self, tokens: list[int]) -> int:
        """How many cached positions still hold the sequence's tokens."""
        n = 0
        for guess, token in zip(self.fed, tokens[self.base :], strict=False):
            if guess != token:
                break
            n += 1
        return min(self.base, len(tokens)) + n


class DraftProposer:
    def __init__(self, model: CausalModel, kv: PagedKV, vocab_size: int) -> None:
        """`vocab_size`: the target's logits' width (the draft's is cut or padded to it)."""
        self.model, self.vocab_size = model.eval(), vocab_size
        self.runner = LocalRunner(model, kv)
        self.context = model.config.max_position
        self.blocks = BlockManager(kv.num_blocks, kv.block_size)
        self.cached: dict[Any, _Cached] = {}

    def drop(self, seq: Any) -> None:
        state = self.cached.pop(seq, None)
        if state is not None:
            self.blocks.release(state.blocks)

    @torch.no_grad()
    def propose(self, seqs: list, limits: list[int]) -> list[Draft]:
        limits = list(limits)
        drafts = [Draft([]) for _ in seqs]
        live: list[int] = []  # rows that have room in the draft's pool
        chunks, ids = [], []
        for i, (seq, k) in enumerate(zip(seqs, limits, strict=True)):
            state = self.cached.setdefault(seq, _Cached())
            start = state.agreed(seq.tokens)
            k = min(k, self.context - len(seq.tokens) + 1)  # positions past the draft's context: fewer
            if k < 1 or not self._grow(state, len(seq.tokens) + k - 1):
                continue
            live.append(i)
            limits[i] = k
            chunks.append(Chunk(list(state.blocks), start, len(seq.tokens) - start))
            ids += seq.tokens[start:]
            state.base, state.fed = len(seq.tokens), []
        guesses: dict[int, list[int]] = {i: [] for i in live}
        probs: dict[int, list[torch.Tensor]] = {i: [] for i in live}
        rows = live
        while rows:
            last = list(torch.tensor([c.length for c in chunks]).cumsum(0) - 1)
            logits = self._logits(StepInput(ids, chunks, [int(x) for x in last]))
            samplers = [self._sampler(seqs[i]) for i in rows]
            x = processed_logits(logits, samplers)
            tokens = choose(x, samplers)
            p = x.softmax(-1)
            for row, (i, token) in enumerate(zip(rows, tokens, strict=True)):
                guesses[i].append(token)
                probs[i].append(p[row])
            rows = [i for i in rows if len(guesses[i]) < limits[i]]
            chunks, ids = [], []
            for i in rows:  # the next step feeds each one's latest guess
                seq, state = seqs[i], self.cached[seqs[i]]
                state.fed.append(guesses[i][-1])
                chunks.append(Chunk(list(state.blocks), len(seq.tokens) + len(state.fed) - 1, 1))
                ids.append(guesses[i][-1])
        for i in live:
            sampled = not seqs[i].sampler.params.greedy
            drafts[i] = Draft(guesses[i], torch.stack(probs[i]) if sampled else None)
        return drafts

    def _logits(self, step: StepInput) -> torch.Tensor:
        logits = self.runner.run(step)
        width = logits.shape[-1]
        if width > self.vocab_size:
            return logits[:, : self.vocab_size]
        if width < self.vocab_size:  # tokens the draft cannot propose
            pad = logits.new_full((logits.shape[0], self.vocab_size - width), -torch.inf)
            return torch.cat([logits, pad], dim=-1)
        return logits

    @staticmethod
    def _sampler(seq: Any) -> Sampler:
        """The request's temperature and filters on its own generator; no penalties (any draft distribution
        is right, so long as the one drawn from is the one `verify` is given)."""
        params = seq.sampler.params
        plain = replace(params, repetition_penalty=None, presence_penalty=0.0, frequency_penalty=0.0)
        return Sampler(replace(plain, logit_bias=()), seq.sampler.generator)

    def _grow(self, state: _Cached, slots: int) -> bool:
        """Blocks for `slots` positions; False (its cache dropped) when the pool has no room."""
        needed = -(-slots // self.blocks.block_size) - len(state.blocks)
        if needed > self.blocks.available:
            self.blocks.release(state.blocks)
            state.blocks, state.base, state.fed = [], 0, []
            return False
        for _ in range(needed):
            state.blocks.append(self.blocks.allocate(state.blocks[-1] if state.blocks else None))
        return True
