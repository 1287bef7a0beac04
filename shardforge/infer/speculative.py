"""Speculative decoding: what proposes draft tokens, and the check that the target's one forward over them
keeps its distribution.

A proposer guesses the next k tokens of a decoding sequence cheaply: prompt lookup (the last n tokens found
earlier in the sequence, the tokens that followed them proposed; no second model) or a small draft model of
the same tokenizer (infer/draft.py). The engine runs the sequence's last token and the k guesses as one chunk
of the target's step over the paged cache, takes the logits at those k + 1 positions, and `verify` keeps a
prefix of the guesses by rejection sampling (Leviathan et al. 2023): the tokens it returns are distributed
as the target's own (greedy: equal to its argmax token for token)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Protocol

import numpy as np
import torch

from shardforge.errors import ConfigError

MAX_SPECULATIVE_TOKENS = 32  # past this a draft is almost never all accepted: the target's chunk is waste


@dataclass(frozen=True)
class SpeculativeConfig:
    """`method`: "ngram" (prompt lookup) or "draft" (a draft model, given to the engine); `num_tokens`: the
    draft tokens proposed a step (`--num-speculative-tokens`); `prompt_lookup_min/max`: the n-gram sizes
    tried, longest first (vLLM's names)."""

    method: Literal["ngram", "draft"] = "ngram"
    num_tokens: int = 4
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 3

    def check(self, max_step_tokens: int) -> SpeculativeConfig:
        """Raise a ConfigError naming the flag at fault; return self."""
        if self.method not in ("ngram", "draft"):
            raise ConfigError(f"--speculative {self.method!r}: it must be 'ngram' (or give --draft MODEL)")
        limit = min(MAX_SPECULATIVE_TOKENS, max_step_tokens - 1)
        if not 1 <= self.num_tokens <= limit:
            raise ConfigError(
                f"--num-speculative-tokens {self.num_tokens}: it must be in [1, {limit}] (at most "
                f"{MAX_SPECULATIVE_TOKENS}, and the token and its drafts must fit --max-step-tokens "
                f"{max_step_tokens})"
            )
        if self.prompt_lookup_min < 1:
            raise ConfigError(f"--prompt-lookup-min {self.prompt_lookup_min}: it must be >= 1")
        if self.prompt_lookup_max < self.prompt_lookup_min:
            raise ConfigError(
                f"--prompt-lookup-max {self.prompt_lookup_max} is below --prompt-lookup-min "
                f"{self.prompt_lookup_min}: the n-gram sizes are inverted"
            )
        return self


@dataclass
class Draft:
    """A sequence's proposed tokens and, for a draft model's sampled ones, the distributions they were drawn
    from ([k, vocab] probabilities; None: each token was certain, as prompt lookup's are)."""

    tokens: list[int]
    probs: torch.Tensor | None = None


class Proposer(Protocol):
    def propose(self, seqs: list, limits: list[int]) -> list[Draft]:
        """For each sequence (scheduler.Sequence, decoding: only its last token uncomputed), at most
        `limits[i]` draft tokens (possibly none)."""
        ...

    def drop(self, seq: object) -> None:
        """Forget a sequence that ended (a draft model's cache blocks)."""
        ...


class NgramProposer:
    """Prompt lookup (vLLM's `ngram`, transformers' `prompt_lookup_num_tokens`): the sequence's last n tokens,
    n from `prompt_lookup_max` down to `prompt_lookup_min`, are looked for earlier in its tokens; the first
    match's following tokens are the draft."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.min, self.max = config.prompt_lookup_min, config.prompt_lookup_max

    def propose(self, seqs: list, limits: list[int]) -> list[Draft]:
        return [Draft(lookup(seq.tokens, self.min, self.max, k)) for seq, k in zip(seqs, limits, strict=True)]

    def drop(self, seq: object) -> None:
        pass


def lookup(tokens: list[int], low: int, high: int, k: int) -> list[int]:
    """The up to k tokens that followed the first earlier occurrence of the longest suffix n-gram
    (low <= n <= high) of `tokens`; [] when none occurs."""
    if k < 1 or len(tokens) < low + 1:
        return []
    array = np.asarray(tokens, dtype=np.int64)
    for n in range(min(high, len(tokens) - 1), low - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(array[:-1], n)  # the n-grams before the last
        hits = np.flatnonzero((windows == array[-n:]).all(axis=1))
        if hits.size:
            start = int(hits[0]) + n
            return tokens[start : start + k]
    return []


def verify(
    probs: torch.Tensor,
    draft: list[int],
    draft_probs: torch.Tensor | None,
    generator: torch.Generator | None,
) -> tuple[list[int], int]:
    """The tokens one sequence emits from its target distributions `probs` [k + 1, vocab] (after the request's
    penalties, temperature and filters; row i: the next token after the i-th draft token) and its k draft
    tokens drawn from `draft_probs` [k, vocab] (None: point masses). Returns (tokens, drafts accepted): the
    accepted drafts then one more token. `generator` None: greedy (a draft token is kept where it is the
    argmax; the first that is not is replaced by the argmax; all kept, the bonus is the last row's argmax).
    Else Leviathan et al.'s rule: keep x with probability min(1, p(x) / q(x)); on a rejection draw from
    max(0, p - q) renormalized; all kept, one bonus draw from the last row. Each emitted token is then
    distributed as the target's."""
    k = len(draft)
    if generator is None:
        best = probs.argmax(-1).tolist()
        accepted = 0
        while accepted < k and draft[accepted] == best[accepted]:
            accepted += 1
        return [*draft[:accepted], best[accepted]], accepted
    rows = probs[:k].gather(1, torch.tensor(draft, device=probs.device)[:, None])[:, 0].double().cpu()
    if draft_probs is None:
        q = torch.ones(k, dtype=torch.float64)
    else:
        index = torch.tensor(draft, device=draft_probs.device)[:, None]
        q = draft_probs.gather(1, index)[:, 0].double().cpu()
    uniforms = torch.rand(k, generator=generator, dtype=torch.float64)
    for i in range(k):
        if uniforms[i] * q[i] < rows[i]:  # u < p / q, with q > 0 (x was drawn from q)
            continue
        if draft_probs is None:
            residual = probs[i].double().clone()
            residual[draft[i]] = 0.0
        else:
            residual = (probs[i].double() - draft_probs[i].double()).clamp_min(0.0)
        return [*draft[:i], draw(residual, generator)], i
    return [*draft, draw(probs[k].double(), generator)], k


def draw(weights: torch.Tensor, generator: torch.Generator) -> int:
    """One token from unnormalized non-negative `weights` [vocab], by the inverse of its distribution function
    (one uniform draw from the request's generator, as sampling.choose draws)."""
    cumulative = weights.cumsum(-1)
    total = cumulative[-1]
    if not total > 0:  # nothing left (rounding): the most likely token
        return int(weights.argmax())
    u = torch.rand(1, generator=generator, dtype=torch.float64).to(weights.device) * total
    picked = int(torch.searchsorted(cumulative, u, right=True)[0])
    if picked >= weights.shape[-1]:  # u rounded up to the total: the last token with any weight
        picked = int(torch.nonzero(weights > 0)[-1, 0])
    return picked


def same_vocabulary(target: Any, draft: Any, name: str) -> None:
    """A ConfigError naming `--draft` unless the draft model's tokenizer maps every token as the target's does
    (a draft token must mean the same text to the target)."""
    ours, theirs = target.get_vocab(), draft.get_vocab()
    if ours == theirs:
        return
    differ = sorted(t for t in set(ours) | set(theirs) if ours.get(t) != theirs.get(t))
    raise ConfigError(
        f"--draft {name}: its tokenizer's vocabulary differs from the model's ({len(theirs)} vs {len(ours)} "
        f"tokens; {len(differ)} differ, e.g. {differ[:3]!r}): a draft model must share the tokenizer"
    )
