"""What a request asks the sampler for, and the sampler: penalties, temperature, top-k, top-p and min-p in
transformers' order, then a draw from each request's own generator, so that a seeded request's tokens do not
depend on what else is in the batch."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from shardforge.errors import ShardforgeError
from shardforge.infer.grammar import Constraint, Matcher


class SamplingError(ShardforgeError):
    """A request's sampling parameters are out of range: names the parameter and what is valid."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """None means unset: the model's generation_config.json gives the value, else the neutral one.
    `temperature` 0 (below 1e-5) means greedy (as in the OpenAI API and vLLM)."""

    max_tokens: int | None = None
    min_tokens: int = 0
    temperature: float | None = None
    top_k: int | None = None  # 0 or -1: all tokens
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None  # transformers' (CTRL's): over the prompt and the output
    presence_penalty: float = 0.0  # OpenAI's: over the output
    frequency_penalty: float = 0.0
    seed: int | None = None
    n: int = 1
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; 0: the chosen token's; k: and the k most likely
    include_stop_in_output: bool = False
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), as the OpenAI API's
    constraint: Constraint | None = None  # a structured output (infer/grammar.py)

    def check(self) -> SamplingParams:
        """Raise a SamplingError naming the first bad parameter; return self."""
        rules = [
            ("max_tokens", self.max_tokens is None or self.max_tokens >= 1, "an integer >= 1"),
            ("min_tokens", self.min_tokens >= 0, "an integer >= 0"),
            ("temperature", self.temperature is None or 0.0 <= self.temperature <= 100.0, "in [0, 100]"),
            ("top_k", self.top_k is None or self.top_k >= -1, "-1, 0 (all tokens) or a positive integer"),
            ("top_p", self.top_p is None or 0.0 < self.top_p <= 1.0, "in (0, 1]"),
            ("min_p", self.min_p is None or 0.0 <= self.min_p <= 1.0, "in [0, 1]"),
            ("repetition_penalty", self.repetition_penalty is None or self.repetition_penalty > 0, "> 0"),
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0, "in [-2, 2]"),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0, "in [-2, 2]"),
            ("n", 1 <= self.n <= 128, "an integer in [1, 128]"),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= 20, "an integer in [0, 20]"),
            ("seed", self.seed is None or -(1 << 63) <= self.seed < 1 << 63, "a 64-bit signed integer"),
        ]
        for name, ok, valid in rules:
            if not ok:
                raise SamplingError(f"{name}={getattr(self, name)!r} is invalid: it must be {valid}", name)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise SamplingError(
                f"min_tokens={self.min_tokens} is more than max_tokens={self.max_tokens}", "min_tokens"
            )
        if any(not s for s in self.stop):
            raise SamplingError("stop strings must not be empty", "stop")
        bad = [value for _, value in self.logit_bias if not -100.0 <= value <= 100.0]
        if bad:
            raise SamplingError(
                f"logit_bias value {bad[0]!r} is invalid: it must be in [-100, 100]", "logit_bias"
            )
        return self

    def check_tokens(self, vocab_size: int) -> None:
        """The token ids it names (logit_bias, stop_token_ids) exist in a vocabulary of `vocab_size`."""
        for param, ids in (
            ("logit_bias", [t for t, _ in self.logit_bias]),
            ("stop_token_ids", self.stop_token_ids),
        ):
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise SamplingError(
                    f"{param}: token id {bad[0]} is not in the vocabulary (ids 0..{vocab_size - 1})", param
                )

    @property
    def greedy(self) -> bool:
        """Temperature 0, or one so small that dividing by it would overflow (vLLM's threshold)."""
        return self.temperature is not None and self.temperature < GREEDY_BELOW


@dataclass(frozen=True)
class GenerationDefaults:
    """The model's generation_config.json: the values it sets fill a request's unset ones (as vLLM does:
    only what the file says, not transformers' class defaults such as top_k=50)."""

    values: dict = field(default_factory=dict)
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_folder(cls, folder: str | Path | None, tokenizer_eos: int | None = None) -> GenerationDefaults:
        path = Path(folder) / "generation_config.json" if folder is not None else None
        raw = json.loads(path.read_text()) if path is not None and path.is_file() else {}
        eos = raw.get("eos_token_id", tokenizer_eos)
        eos_ids = tuple(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if tokenizer_eos is not None and tokenizer_eos not in eos_ids:
            eos_ids += (tokenizer_eos,)
        keys = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")  # SamplingParams' names too
        values = {k: raw[k] for k in keys if raw.get(k) is not None}
        if raw.get("max_new_tokens") is not None:
            values["max_tokens"] = raw["max_new_tokens"]
        return cls(values, eos_ids)

    def fill(self, params: SamplingParams) -> SamplingParams:
        """The request's values, then the file's, then temperature 1 (the OpenAI API's default)."""
        unset = {k: v for k, v in self.values.items() if getattr(params, k) is None}
        filled = replace(params, **unset) if unset else params
        return replace(filled, temperature=1.0) if filled.temperature is None else filled


@dataclass
class Sampler:
    """One request's sampling state: its parameters (filled with defaults), its generator and the counts of
    the tokens it has produced (presence and frequency penalties)."""

    params: SamplingParams
    generator: torch.Generator | None = None
    counts: dict[int, int] = field(default_factory=dict)
    matcher: Matcher | None = None  # its place in a structured output's grammar

    @classmethod
    def create(cls, params: SamplingParams, index: int = 0, matcher: Matcher | None = None) -> Sampler:
        """`index`: which of the request's n completions (each has its own stream of draws)."""
        generator = None
        if not params.greedy:
            generator = torch.Generator()
            if params.seed is not None:
                # any int64 seed; the same stream as before for the seeds that fitted unreduced
                generator.manual_seed((params.seed * 1_000_003 + index) % (1 << 64))
            else:
                generator.seed()
        return cls(params, generator, matcher=matcher)

    @property
    def plain_greedy(self) -> bool:
        """Greedy with no penalty: the argmax of the model's logits."""
        p = self.params
        return (
            p.greedy
            and p.repetition_penalty in (None, 1.0)
            and not (p.presence_penalty or p.frequency_penalty or p.logit_bias)
        )

    def observe(self, token: int) -> None:
        self.counts[token] = self.counts.get(token, 0) + 1


def processed_logits(
    logits: torch.Tensor,
    samplers: Sequence[Sampler],
    histories: Sequence[list[int]] | None = None,
    suppress: Sequence[tuple[int, ...]] | None = None,
) -> torch.Tensor:
    """A batch of rows' logits [rows, vocab] (fp32, on their device) after each row's penalties, temperature
    and top-k / top-p / min-p filters, in transformers' order; filtered-out tokens are -inf. `histories`:
    each row's prompt and output tokens (repetition penalty); `suppress`: tokens that may not come yet (eos
    and stop tokens before min_tokens). A logit bias comes first: it is added to the model's logits (as the
    OpenAI API defines it). Row-wise operations only, so a row's result does not depend on the others."""
    x = logits.float()
    if any(suppress or ()) or any(_penalized(s.params) for s in samplers):
        x = x.clone()
        for row, sampler in enumerate(samplers):
            _penalize(x[row], sampler, histories[row] if histories else [], suppress[row] if suppress else ())
    drawn = [row for row, s in enumerate(samplers) if not s.params.greedy]
    if not drawn:
        return x
    params = [samplers[row].params for row in drawn]
    rows = torch.tensor(drawn, device=x.device)
    xs = x if len(drawn) == len(samplers) else x.index_select(0, rows)  # a new tensor below in any case
    temperature = [p.temperature or 1.0 for p in params]
    if any(t != 1.0 for t in temperature):
        xs = xs / torch.tensor(temperature, dtype=x.dtype, device=x.device)[:, None]
    elif xs is x or xs is logits:
        xs = xs.clone()
    vocab = x.shape[-1]
    k = [p.top_k if p.top_k is not None and 0 < p.top_k < vocab else 0 for p in params]
    if any(k):
        at = [i for i, ki in enumerate(k) if ki]
        part = xs[at]
        kth_index = torch.tensor([[k[i] - 1] for i in at], device=x.device)
        kth = torch.topk(part, max(k)).values.gather(1, kth_index)
        xs[at] = part.masked_fill(part < kth, -math.inf)
    at = [i for i, p in enumerate(params) if p.top_p is not None and p.top_p < 1.0]
    if at:
        part = xs[at]
        ordered, order = torch.sort(part, descending=False)
        cumulative = ordered.softmax(-1).cumsum(-1)
        keep = torch.tensor([1 - (params[i].top_p or 1.0) for i in at], dtype=x.dtype, device=x.device)
        drop = cumulative <= keep[:, None]  # the least likely tokens whose mass is at most 1 - top_p
        drop[:, -1] = False  # the most likely token always stays
        xs[at] = part.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), -math.inf)
    at = [i for i, p in enumerate(params) if p.min_p is not None and p.min_p > 0]
    if at:
        part = xs[at]
        probs = part.softmax(-1)
        floor = torch.tensor([params[i].min_p for i in at], dtype=x.dtype, device=x.device)[:, None]
        xs[at] = part.masked_fill(probs < floor * probs.max(-1, keepdim=True).values, -math.inf)
    if len(drawn) == len(samplers):
        return xs
    x = x.clone() if x is logits else x
    x[drawn] = xs
    return x


def _penalized(p: SamplingParams) -> bool:
    """Whether `_penalize` changes the row (a bias or a penalty)."""
    repetition = p.repetition_penalty not in (None, 1.0)
    return bool(p.logit_bias or p.presence_penalty or p.frequency_penalty or repetition)


def _penalize(x: torch.Tensor, sampler: Sampler, history: list[int], suppress: tuple[int, ...]) -> None:
    """One row's logit bias, penalties and suppressed tokens, in place."""
    p = sampler.params
    if p.logit_bias:
        ids, bias = zip(*p.logit_bias, strict=True)
        x[list(ids)] += torch.tensor(bias, dtype=x.dtype, device=x.device)
    if p.repetition_penalty not in (None, 1.0) and history:
        seen = torch.tensor(sorted(set(history)), dtype=torch.long, device=x.device)
        scores = x[seen]
        x[seen] = torch.where(scores > 0, scores / p.repetition_penalty, scores * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and sampler.counts:
        seen = torch.tensor(list(sampler.counts), dtype=torch.long, device=x.device)
        counts = torch.tensor(list(sampler.counts.values()), dtype=x.dtype, device=x.device)
        x[seen] -= p.presence_penalty + p.frequency_penalty * counts
    if suppress:
        x[list(suppress)] = -math.inf


def choose(x: torch.Tensor, samplers: Sequence[Sampler]) -> list[int]:
    """Each row's next token from processed logits [rows, vocab]: the argmax when greedy, else a draw from the
    row's own generator by the inverse of the distribution function (one uniform number and a search of the
    cumulative probabilities: `torch.multinomial` draws an exponential number per vocabulary entry, measured
    at 0.9 ms a row of a 49k vocabulary here, most of a small model's decode step on CPU). One transfer to
    the host for the whole batch."""
    tokens = x.argmax(-1)
    drawn = [row for row, s in enumerate(samplers) if not s.params.greedy]
    if drawn:
        rows = torch.tensor(drawn, device=x.device)
        part = x if len(drawn) == len(samplers) else x.index_select(0, rows)
        cumulative = part.softmax(-1).cumsum(-1)
        u = torch.cat([torch.rand(1, generator=samplers[r].generator, dtype=x.dtype) for r in drawn])
        u = u.to(x.device)[:, None] * cumulative[:, -1:]
        picked = torch.searchsorted(cumulative, u, right=True)[:, 0]
        over = picked >= part.shape[-1]
        if over.any():  # u rounded up to the total: the last token with any probability
            last = (part > -math.inf).cumsum(-1).argmax(-1)
            picked = torch.where(over, last, picked)
        tokens[rows] = picked
    return tokens.tolist()


def top_logprobs(
    logits: torch.Tensor, tokens: list[int], ks: list[int | None]
) -> list[tuple[float, list[tuple[int, float]]] | None]:
    """For each row that asks (k not None): the chosen token's log-probability under the model (before
    penalties and filters, as vLLM reports it) and the k most likely tokens with theirs."""
    asked = {row: k for row, k in enumerate(ks) if k is not None}
    out: list[tuple[float, list[tuple[int, float]]] | None] = [None] * len(ks)
    if not asked:
        return out
    rows = torch.tensor(list(asked), device=logits.device)
    part = (logits if len(asked) == len(ks) else logits.index_select(0, rows)).float()
    total = part.logsumexp(-1, keepdim=True)  # log p = logit - logsumexp: no [rows, vocab] output
    picked = torch.tensor([[tokens[r]] for r in asked], device=part.device)
    chosen = (part.gather(1, picked) - total)[:, 0].tolist()
    best = torch.topk(part, max(asked.values()))
    indices, values = best.indices.tolist(), (best.values - total).tolist()
    for i, (row, k) in enumerate(asked.items()):
        out[row] = (chosen[i], list(zip(indices[i][:k], values[i][:k], strict=True)))
    return out
