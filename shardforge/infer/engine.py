"""The generation engine: requests in, token (and text) pieces out, one continuous-batching step at a time,
over a paged KV cache and the training model's own forward.

    engine = Engine(model, tokenizer, EngineConfig(), GenerationDefaults.from_folder(folder))
    engine.add("r1", prompt_ids, SamplingParams(max_tokens=32, temperature=0))
    while engine.has_work():
        for update in engine.step(): ...

`generate()` does that loop for a list of prompts. The engine is not thread-safe: one thread drives it
(server.py's loop)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from shardforge.errors import ShardforgeError
from shardforge.infer.blocks import BlockManager
from shardforge.infer.paged import Chunk, PagedKV, PagedStep
from shardforge.infer.sampling import (
    GenerationDefaults,
    Sampler,
    SamplingError,
    SamplingParams,
    choose,
    processed_logits,
)
from shardforge.infer.sampling import top_logprobs as model_logprobs
from shardforge.infer.scheduler import Scheduler, Sequence
from shardforge.infer.text import TextStream


class RequestError(ShardforgeError):
    """A request the engine cannot take (a duplicate id, an empty prompt); `param`: the request field at
    fault (prompt or max_tokens), for an API's error."""

    def __init__(self, message: str, param: str | None = "prompt") -> None:
        super().__init__(message)
        self.param = param


class TooLong(RequestError):
    """The prompt and its new tokens do not fit the model's context or the KV cache (the OpenAI API's
    context_length_exceeded)."""


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = 16
    num_blocks: int | None = None  # None: from kv_memory_bytes
    kv_memory_bytes: int = 1 << 30
    max_step_tokens: int = 512  # prefill chunks and decodes together, per step
    max_running: int = 64
    prefix_cache: bool = True


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine's state, for metrics: sequences running and waiting, KV blocks, the prefix
    cache's tokens found / looked up, and preemptions so far."""

    running: int = 0
    waiting: int = 0
    blocks_used: int = 0
    blocks_total: int = 0
    prefix_hits: int = 0
    prefix_queries: int = 0
    preemptions: int = 0


@dataclass
class Update:
    """What one step added to one completion."""

    request_id: str
    index: int
    tokens: list[int]
    text: str
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)


@dataclass
class Completion:
    tokens: list[int]
    text: str
    finish_reason: str
    logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)


@dataclass(eq=False)
class _Request:
    request_id: str
    params: SamplingParams
    waiting_children: int  # the n - 1 other completions, admitted once the prompt is cached
    streams: dict[int, TextStream | None] = field(default_factory=dict)
    live: set[int] = field(default_factory=set)


class Engine:
    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any = None,
        config: EngineConfig | None = None,
        defaults: GenerationDefaults | None = None,
    ) -> None:
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.config = config = config or EngineConfig()
        self.defaults = defaults or GenerationDefaults(
            eos_token_ids=(tokenizer.eos_token_id,) if getattr(tokenizer, "eos_token_id", None) else ()
        )
        cfg = model.config
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        per_block = PagedKV.bytes_per_block(cfg, config.block_size, self.dtype)
        num_blocks = config.num_blocks or max(1, config.kv_memory_bytes // per_block)
        self.kv = PagedKV(num_blocks, config.block_size)
        self.blocks = BlockManager(num_blocks, config.block_size)
        self.scheduler = Scheduler(
            self.blocks, config.max_step_tokens, config.max_running, config.prefix_cache
        )
        self.context = cfg.max_position
        self.requests: dict[str, _Request] = {}

    # ---- requests ----------------------------------------------------------------------------------------
    def add(self, request_id: str, prompt: list[int], params: SamplingParams) -> SamplingParams:
        """Queue a request; returns its parameters as filled from the model's defaults."""
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already running", None)
        params = self.check(prompt, params)
        first = self._sequence(request_id, 0, prompt, params)
        request = _Request(request_id, params, params.n - 1)
        self.requests[request_id] = request
        self._start(request, first)
        return params

    def check(self, prompt: list[int], params: SamplingParams) -> SamplingParams:
        """The request's parameters filled from the model's defaults (max_tokens from the room the context
        leaves), or a RequestError / SamplingError saying why the engine cannot take it. It reads only what
        never changes, so a server's threads may call it while the engine steps."""
        if not prompt:
            raise RequestError("the prompt has no tokens")
        params = self.defaults.fill(params.check())
        params.check_tokens(self.model.config.vocab_size)
        room = self.context - len(prompt)
        if room < 1:
            raise TooLong(
                f"the prompt has {len(prompt)} tokens; the model's context is {self.context} (it leaves no "
                f"room for a new token)"
            )
        max_tokens = min(params.max_tokens or room, room)
        if params.max_tokens is not None and params.max_tokens > room:
            raise TooLong(
                f"max_tokens={params.max_tokens} and the prompt's {len(prompt)} tokens exceed the model's "
                f"context of {self.context} tokens (at most {room} new tokens fit)",
                "max_tokens",
            )
        if params.min_tokens > max_tokens:
            raise SamplingError(
                f"min_tokens={params.min_tokens} is more than the {max_tokens} new tokens the model's "
                f"context of {self.context} leaves after the prompt's {len(prompt)}",
                "min_tokens",
            )
        eos = () if params.ignore_eos else self.defaults.eos_token_ids
        if params.min_tokens and len({*eos, *params.stop_token_ids}) >= self.model.config.vocab_size:
            raise SamplingError(
                "stop_token_ids and the end-of-sequence tokens cover the whole vocabulary: no token may come "
                "before min_tokens",
                "stop_token_ids",
            )
        capacity = self.blocks.num_blocks * self.config.block_size
        if len(prompt) + max_tokens > capacity:
            raise TooLong(
                f"the prompt's {len(prompt)} tokens and {max_tokens} new ones exceed the KV cache's "
                f"{capacity} slots; give the engine more blocks or ask for fewer tokens",
                "max_tokens",
            )
        return replace(params, max_tokens=max_tokens)

    def stats(self) -> EngineStats:
        """What the engine holds now (read on its own thread; the server exports the snapshot)."""
        blocks = self.blocks
        return EngineStats(
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            blocks_used=blocks.in_use,
            blocks_total=blocks.num_blocks,
            prefix_hits=blocks.hits,
            prefix_queries=blocks.queries,
            preemptions=self.scheduler.preemptions,
        )

    def abort(self, request_id: str) -> None:
        """Stop a request (a client went away): its blocks are released now."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        for seq in [*self.scheduler.running, *self.scheduler.waiting]:
            if seq.request_id == request_id:
                self.scheduler.remove(seq)

    def has_work(self) -> bool:
        return bool(self.scheduler.running or self.scheduler.waiting)

    # ---- one step ----------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> list[Update]:
        plan = self.scheduler.schedule()
        if not plan:
            return []
        chunks = [Chunk(list(s.blocks), s.computed, n, list(s.copy_from)) for s, n in plan]
        ids = [t for s, n in plan for t in s.tokens[s.computed : s.computed + n]]
        last, ends, offset = [], [], 0
        for seq, n in plan:
            offset += n
            if seq.computed + n == len(seq.tokens):  # its last token: the next one is sampled
                last.append(offset - 1)
                ends.append(seq)
        logits = self.forward(ids, chunks, last)
        for seq, n in plan:
            self.scheduler.computed(seq, n)
        updates = []
        rows = logits.float().cpu()
        greedy = any(seq.sampler.plain_greedy for seq in ends)
        argmax = rows.argmax(-1).tolist() if greedy else [-1] * len(ends)  # plain greedy rows, in one pass
        for row, best, seq in zip(rows, argmax, ends, strict=True):
            updates.append(self._advance(seq, row, best))
        return updates

    def forward(self, ids: list[int], chunks: list[Chunk], last: list[int]) -> torch.Tensor:
        """One step's model forward: the logits [len(last), vocab] of the tokens at the `last` indices.
        (infer/tp.py's engine first hands the same arguments to the other TP ranks.)"""
        return step_forward(self.model, self.kv, ids, chunks, last, self.device)

    def _advance(self, seq: Sequence, logits: torch.Tensor, argmax: int) -> Update:
        request = self.requests[seq.request_id]
        params = seq.sampler.params
        if seq.index == 0 and request.waiting_children and seq.computed >= seq.prompt_len:
            self._spawn_children(request, seq.tokens[: seq.prompt_len])
        made = len(seq.output)
        stops = () if params.ignore_eos else self.defaults.eos_token_ids
        stop_ids = (*stops, *params.stop_token_ids)
        suppress = stop_ids if made < params.min_tokens else ()
        if seq.sampler.plain_greedy and not suppress:
            token = argmax
        else:
            token = choose(processed_logits(logits, seq.sampler, seq.tokens, suppress), seq.sampler)
        seq.tokens.append(token)
        seq.sampler.observe(token)
        logprobs = [model_logprobs(logits, token, params.logprobs)] if params.logprobs is not None else []
        stream = request.streams[seq.index]
        finish = "stop" if token in stop_ids else None
        if stream is not None:
            stream.update(seq.output[:-1] if finish else seq.output)  # a stop token has no text
            finish = "stop" if stream.stopped is not None else finish
        if finish is None and len(seq.output) >= seq.max_tokens:
            finish = "length"
        text = stream.delta(final=finish is not None) if stream is not None else ""
        if finish is not None:
            self._finish(request, seq, finish)
        return Update(seq.request_id, seq.index, [token], text, finish, logprobs)

    # ---- bookkeeping -------------------------------------------------------------------------------------
    def _sequence(self, request_id: str, index: int, prompt: list[int], params: SamplingParams) -> Sequence:
        return Sequence(
            request_id, index, list(prompt), len(prompt), Sampler.create(params, index), params.max_tokens
        )

    def _start(self, request: _Request, seq: Sequence, first: bool = False) -> None:
        p = request.params
        stream = (
            TextStream(self.tokenizer, p.stop, p.include_stop_in_output)
            if self.tokenizer is not None
            else None
        )
        request.streams[seq.index] = stream
        request.live.add(seq.index)
        self.scheduler.add(seq, first=first)

    def _spawn_children(self, request: _Request, prompt: list[int]) -> None:
        """The other n - 1 completions, queued first: their prompt blocks come from the prefix cache."""
        for index in range(request.params.n - 1, 0, -1):
            self._start(
                request, self._sequence(request.request_id, index, prompt, request.params), first=True
            )
        request.waiting_children = 0

    def _finish(self, request: _Request, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        self.scheduler.remove(seq)
        request.live.discard(seq.index)
        if not request.live and not request.waiting_children:
            del self.requests[request.request_id]

    # ---- offline -----------------------------------------------------------------------------------------
    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams | list[SamplingParams],
        progress: Callable[[int, int], None] | None = None,
    ) -> list[list[Completion]]:
        """Every prompt's completions (n per prompt), run together by continuous batching; `progress` is
        called as (prompts done, prompts) when one finishes."""
        many = params if isinstance(params, list) else [params] * len(prompts)
        results: dict[str, dict[int, Completion]] = {}
        for i, (prompt, p) in enumerate(zip(prompts, many, strict=True)):
            self.add(f"gen-{i}", prompt, p)
            results[f"gen-{i}"] = {}
        finished = 0
        while self.has_work():
            for u in self.step():
                done = results[u.request_id].setdefault(u.index, Completion([], "", ""))
                done.tokens += u.tokens
                done.text += u.text
                done.logprobs += u.logprobs
                if u.finish_reason:
                    done.finish_reason = u.finish_reason
                    if u.request_id not in self.requests:
                        finished += 1
                        if progress is not None:
                            progress(finished, len(prompts))
        return [[results[f"gen-{i}"][k] for k in sorted(results[f"gen-{i}"])] for i in range(len(prompts))]


def step_forward(
    model: nn.Module, kv: PagedKV, ids: list[int], chunks: list[Chunk], last: list[int], device: torch.device
) -> torch.Tensor:
    paged = PagedStep(kv, chunks, device)
    mask = sampled_positions(len(ids), last, device)
    logits = model(torch.tensor(ids, device=device)[None], paged.positions, output_mask=mask, cache=paged)
    return whole_vocabulary(logits, model.config.vocab_size)


def sampled_positions(tokens: int, last: list[int], device: torch.device) -> torch.Tensor:
    """The step's output mask [1, tokens]: the head runs only where a next token is sampled."""
    mask = torch.zeros(1, tokens, dtype=torch.bool, device=device)
    mask[0, last] = True
    return mask


def whole_vocabulary(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Logits over the real vocabulary: TP's vocabulary shards gathered, and the rows a training layout padded
    the vocabulary with (never tokens) cut off."""
    logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
    return logits[..., :vocab_size]
