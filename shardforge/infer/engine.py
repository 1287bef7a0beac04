"""The generation engine: requests in, token (and text) pieces out, one continuous-batching step at a time,
over a paged KV cache and the training model's own forward.

    engine = Engine(model, tokenizer, EngineConfig(), GenerationDefaults.from_folder(folder))
    engine.add("r1", prompt_ids, SamplingParams(max_tokens=32, temperature=0))
    while engine.has_work():
        for update in engine.step(): ...

A step is schedule (scheduler.py) -> execute (executor.py: the model runner on one process, or led over the
ranks of a tensor-parallel or pipeline layout) -> sample (every row of the step in one batch, on the model's
device) -> update (request state). Text comes from the output processor (output.py): inline after each step,
or, for a server, on a thread of its own (`detokenize=False`: the engine hands out tokens only).
`generate()` runs the loop for a list of prompts. The engine is not thread-safe: one thread drives it
(runner.py's engine thread)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from shardforge.errors import ConfigError
from shardforge.infer.blocks import BlockManager
from shardforge.infer.draft import DraftProposer
from shardforge.infer.engine_types import Completion, EngineConfig, EngineStats, RequestError, TooLong, Update
from shardforge.infer.executor import Executor, LocalRunner, StepInput, attends_paged
from shardforge.infer.grammar import ConstraintError, Grammars
from shardforge.infer.kv_pool import kv_blocks, local_runner, paged_pool
from shardforge.infer.media import RequestImages, step_images
from shardforge.infer.multi_lora import AdapterSet
from shardforge.infer.output import OutputProcessor
from shardforge.infer.paged import Chunk
from shardforge.infer.recompute import RecomputeRunner
from shardforge.infer.sampling import (
    GenerationDefaults,
    Sampler,
    SamplingError,
    SamplingParams,
    choose,
    processed_logits,
    top_logprobs,
)
from shardforge.infer.scheduler import Scheduler, Sequence
from shardforge.infer.speculative import NgramProposer, Proposer, verify
from shardforge.models.common.images import ImageInputs
from shardforge.models.common.protocol import CausalModel


@dataclass(eq=False)
class _Request:
    request_id: str
    params: SamplingParams
    waiting_children: int  # the n - 1 other completions, admitted once the prompt is cached
    live: dict[int, Sequence] = field(default_factory=dict)
    adapter: tuple[int, bytes] = (0, b"")  # its LoRA adapter's (slot, prefix-cache salt); 0: the base


class Engine:
    def __init__(
        self,
        model: CausalModel,
        tokenizer: Any = None,
        config: EngineConfig | None = None,
        defaults: GenerationDefaults | None = None,
        executor: Executor | None = None,
        draft: CausalModel | None = None,
    ) -> None:
        """`executor`: where steps run (None: the model's own forward on this process, over a pool of
        `kv_blocks(model, config)` blocks; a led executor's runners hold pools of that size). `draft`: the
        draft model of `config.speculative`'s "draft" method (its vocabulary checked by the caller)."""
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.config = config = config or EngineConfig()
        self.defaults = defaults or GenerationDefaults(
            eos_token_ids=(tokenizer.eos_token_id,) if getattr(tokenizer, "eos_token_id", None) else ()
        )
        num_blocks = kv_blocks(model, config)
        if executor is None:
            executor = Executor(local_runner(model, config))
        self.executor = executor
        self.output = OutputProcessor(tokenizer)
        self.grammars = Grammars(tokenizer, model.config.vocab_size) if tokenizer is not None else None
        self.detokenize = True  # text inline after each step (a server's runner turns it off: its own thread)
        self.blocks = BlockManager(num_blocks, config.block_size)
        self.scheduler = Scheduler(
            self.blocks, config.max_step_tokens, config.max_running, config.prefix_cache
        )
        self.context = model.config.max_position
        self.requests: dict[str, _Request] = {}
        self.proposer = self._proposer(draft, num_blocks)
        self.lora: AdapterSet | None = None  # many LoRA adapters on this base (multi_lora.py: attach sets it)
        self.spec_drafts = self.spec_draft_tokens = self.spec_accepted_tokens = 0

    def _proposer(self, draft: CausalModel | None, num_blocks: int) -> Proposer | None:
        """The speculative proposer the config asks for, or a ConfigError naming the flag where it cannot
        apply: a tensor-parallel or pipeline layout (its steps are broadcast one token a sequence), or a model
        whose attention does not go through the paged cache (the recompute runner)."""
        spec = self.config.speculative
        if spec is None:
            if draft is not None:
                raise ConfigError("a draft model was given but no speculative method (--draft)")
            return None
        flag = "--draft" if spec.method == "draft" else "--speculative ngram"
        spec.check(self.config.max_step_tokens)
        runner = self.executor.runner
        if self.executor.group is not None or not isinstance(runner, LocalRunner):
            kind = "the recompute runner" if isinstance(runner, RecomputeRunner) else "this layout"
            raise ConfigError(
                f"{flag}: speculative decoding runs on one process over the paged KV cache, not on {kind} "
                "(--tp, pipeline stages, or a family whose attention does not go through the paged cache)"
            )
        if spec.method == "ngram":
            if draft is not None:
                raise ConfigError("--draft and --speculative ngram: choose one way of drafting")
            return NgramProposer(spec)
        if draft is None:
            raise ConfigError("--draft: the draft method needs a draft model")
        if not (draft.pages and attends_paged(draft)):
            raise ConfigError(
                f"--draft: the draft model ({draft.config.family}) does not attend through the paged KV cache"
            )
        pool = paged_pool(draft, replace(self.config, num_blocks=num_blocks))
        return DraftProposer(draft, pool, self.model.config.vocab_size)

    # ---- requests ----------------------------------------------------------------------------------------
    def add(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        images: ImageInputs | None = None,
        adapter: str | None = None,
    ) -> SamplingParams:
        """Queue a request; returns its parameters as filled from the model's defaults. `images`: a
        vision-language model's images for the prompt's image tokens (encoded here, once). `adapter`: the
        name of a LoRA adapter of `self.lora` to run it under (None: the base)."""
        if request_id in self.requests:
            raise RequestError(f"request id {request_id!r} is already running", None)
        params = self.check(prompt, params)
        lora = self._adapter(adapter)
        media = self._images(prompt, images)
        first = self._sequence(request_id, 0, prompt, params, media)
        first.adapter, first.adapter_salt = lora
        request = _Request(request_id, params, params.n - 1, adapter=lora)
        self.requests[request_id] = request
        if self.detokenize:
            self.output.start(request_id, params)
        self._start(request, first)
        return params

    def _adapter(self, name: str | None) -> tuple[int, bytes]:
        """A LoRA adapter's (slot, salt) by name, or a RequestError on the `model` field."""
        if name is None:
            return 0, b""
        if self.lora is None:
            raise RequestError(f"no LoRA adapter named {name!r} is loaded (this engine serves none)", "model")
        try:
            return self.lora.resolve(name)
        except KeyError:
            raise RequestError(f"no LoRA adapter named {name!r} is loaded", "model") from None

    def _images(self, prompt: list[int], images: ImageInputs | None) -> RequestImages | None:
        if images is None:
            return None
        if not self.model.vision:
            raise RequestError(f"{self.model.config.family} is a text model: it takes no images")
        if not isinstance(self.executor.runner, (LocalRunner, RecomputeRunner)):
            raise RequestError("images are not placed by this layout's runner yet (one process or --tp only)")
        media = RequestImages.encode(self.model, prompt, images)
        if len(media.slots) != len(media.embeddings):
            raise RequestError(
                f"the prompt has {len(media.slots)} image tokens but its {len(images.grid_thw)} image(s) "
                f"make {len(media.embeddings)}: each image's place must be expanded to its tokens"
            )
        return media

    def check(self, prompt: list[int], params: SamplingParams) -> SamplingParams:
        """The request's parameters filled from the model's defaults (max_tokens from the room the context
        leaves), or a RequestError / SamplingError saying why the engine cannot take it. It reads only what
        never changes, so a server's threads may call it while the engine steps."""
        if not prompt:
            raise RequestError("the prompt has no tokens")
        params = self.defaults.fill(params.check())
        params.check_tokens(self.model.config.vocab_size)
        if params.constraint is not None:
            if self.grammars is None:
                raise SamplingError("structured outputs need the model's tokenizer", params.constraint.param)
            try:
                self.grammars.check(params.constraint)
            except ConstraintError as exc:
                raise SamplingError(str(exc), exc.param) from None
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
            spec_drafts=self.spec_drafts,
            spec_draft_tokens=self.spec_draft_tokens,
            spec_accepted_tokens=self.spec_accepted_tokens,
        )

    def abort(self, request_id: str) -> None:
        """Stop a request (a client went away): its blocks are released now."""
        self.output.drop(request_id)
        request = self.requests.pop(request_id, None)
        if request is None:
            return
        for seq in list(request.live.values()):
            self.scheduler.remove(seq)
            if self.proposer is not None:
                self.proposer.drop(seq)

    def finish(self, request_id: str, index: int) -> None:
        """End one completion that a stop string ended (the output processor found it)."""
        request = self.requests.get(request_id)
        if request is not None and index in request.live:
            self._finish(request, request.live[index], "stop")

    def has_work(self) -> bool:
        return bool(self.scheduler.running or self.scheduler.waiting)

    # ---- one step ----------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> list[Update]:
        """Schedule, execute, sample, update; then (with `detokenize`) the text of what the step made."""
        self._propose()
        plan = self.scheduler.schedule()
        planned = {seq for seq, _ in plan}
        for seq in self.scheduler.running:  # a draft the step has no room for is dropped
            if seq.draft and seq not in planned:
                seq.draft, seq.draft_probs = [], None
        if not plan:
            return []
        chunks = [Chunk(list(s.blocks), s.computed, n, list(s.copy_from)) for s, n in plan]
        ids = [t for s, n in plan for t in _step_tokens(s, n)]
        last: list[int] = []
        ends: list[Sequence] = []  # sequences whose next token is sampled, in the plan's order
        offset = 0
        for seq, n in plan:
            offset += n
            if seq.draft:  # its last token and its drafts: every one of their positions is checked
                last.extend(range(offset - n, offset))
                ends.append(seq)
            elif seq.computed + n == len(seq.tokens):  # its last token: the next one is sampled
                last.append(offset - 1)
                ends.append(seq)
        parts = [(s.media, s.computed, s.computed + n, s.prompt_len) for s, n in plan]
        images = step_images(parts, self.model.config.hidden_size)
        if self.lora is not None:  # each token's adapter (multi_lora.py), in the step's row order
            self.lora.begin([s.adapter for s, n in plan for _ in range(n)])
        logits = self.executor.execute(StepInput(ids, chunks, last, images))
        for seq, n in plan:
            if not seq.draft:  # a speculating one's count is known once its drafts are checked
                self.scheduler.computed(seq, n)
        for seq in ends:  # the prompt is cached: the request's other completions start from it
            request = self.requests[seq.request_id]
            if seq.index == 0 and request.waiting_children and seq.computed >= seq.prompt_len:
                self._spawn_children(request, seq.tokens[: seq.prompt_len], seq.media)
        updates = self._sample_all(logits, ends)
        if not self.detokenize:
            return updates
        processed = self.output.process(updates)
        for request_id, index in processed.stopped:
            self.finish(request_id, index)
        return processed.updates

    def _sample_all(self, logits: torch.Tensor, ends: list[Sequence]) -> list[Update]:
        """The step's updates: one sampled token for each plain row (one batch), the checked drafts and one
        more token for each speculating sequence (infer/speculative.py: `verify`), in the plan's order."""
        if not any(seq.draft for seq in ends):
            tokens, logprobs = self._sample(logits, ends)
            return [self._advance(*row) for row in zip(ends, tokens, logprobs, strict=True)]
        plain: list[tuple[Sequence, int]] = []
        spec: list[tuple[Sequence, int]] = []
        row = 0
        for seq in ends:
            (spec if seq.draft else plain).append((seq, row))
            row += len(seq.draft) + 1
        done: dict[Sequence, Update] = {}
        if plain:
            index = torch.tensor([r for _, r in plain], device=logits.device)
            seqs = [seq for seq, _ in plain]
            tokens, logprobs = self._sample(logits.index_select(0, index), seqs)
            for seq, token, lp in zip(seqs, tokens, logprobs, strict=True):
                done[seq] = self._advance(seq, token, lp)
        for seq, update in self._speculated(logits, spec):
            done[seq] = update
        return [done[seq] for seq in ends]

    def _speculated(
        self, logits: torch.Tensor, spec: list[tuple[Sequence, int]]
    ) -> list[tuple[Sequence, Update]]:
        """Each speculating sequence's drafts checked against the target's distributions at its k + 1
        positions (the request's penalties, bias and min_tokens applied at each as if the drafts before it
        had been sampled), its tokens advanced one by one (a stop or its length ends it mid-draft), and its
        cache rolled back past the rejected ones."""
        rows: list[int] = []
        samplers: list[Sampler] = []
        histories: list[list[int]] = []
        suppress: list[tuple[int, ...]] = []
        for seq, first in spec:
            sampler, params = seq.sampler, seq.sampler.params
            stops = (*self._eos(params), *params.stop_token_ids)
            repetition = params.repetition_penalty not in (None, 1.0)
            for j in range(len(seq.draft) + 1):
                rows.append(first + j)
                counts = dict(sampler.counts)
                for token in seq.draft[:j]:
                    counts[token] = counts.get(token, 0) + 1
                samplers.append(Sampler(params, sampler.generator, counts))
                histories.append(seq.tokens + seq.draft[:j] if repetition else [])
                suppress.append(stops if len(seq.output) + j < params.min_tokens else ())
        raw = logits.index_select(0, torch.tensor(rows, device=logits.device))
        x = processed_logits(raw, samplers, histories, suppress)
        out = []
        at = 0
        for seq, _ in spec:
            k, params = len(seq.draft), seq.sampler.params
            target = x[at : at + k + 1]
            greedy = params.greedy
            probs = target if greedy else target.softmax(-1)
            draft_probs = None if seq.draft_probs is None else seq.draft_probs[:k].to(probs.device)
            tokens, accepted = verify(
                probs, seq.draft, draft_probs, None if greedy else seq.sampler.generator
            )
            logprobs = top_logprobs(raw[at : at + len(tokens)], tokens, [params.logprobs] * len(tokens))
            at += k + 1
            self.spec_drafts += 1
            self.spec_draft_tokens += k
            self.spec_accepted_tokens += accepted
            update = Update(seq.request_id, seq.index, [], "")
            for token, lp in zip(tokens, logprobs, strict=True):
                one = self._advance(seq, token, lp)
                update.tokens += one.tokens
                update.logprobs += one.logprobs
                update.finish_reason, update.stop_token = one.finish_reason, one.stop_token
                if one.finish_reason is not None:
                    break
            if update.finish_reason is None:  # the last token and the accepted drafts are cached now
                self.scheduler.computed(seq, 1 + accepted)
                self.scheduler.rolled_back(seq)
            out.append((seq, update))
        return out

    def _propose(self) -> None:
        """Draft tokens for the running sequences that decode next and may speculate (see `_speculates`),
        each at most k and one fewer than the tokens it has left (the last one is the target's own)."""
        if self.proposer is None:
            return
        assert self.config.speculative is not None
        seqs, limits = [], []
        for seq in self.scheduler.running:
            room = seq.max_tokens - len(seq.output) - 1
            if seq.uncomputed == 1 and room >= 1 and self._speculates(seq):
                seqs.append(seq)
                limits.append(min(self.config.speculative.num_tokens, room))
        if not seqs:
            return
        for seq, draft in zip(seqs, self.proposer.propose(seqs, limits), strict=True):
            seq.draft, seq.draft_probs = draft.tokens, draft.probs

    def _speculates(self, seq: Sequence) -> bool:
        """Whether a sequence may speculate. Falls back to plain decoding (the request is served, only not
        sped up): a structured output (its grammar would have to check and roll back each draft), stop
        strings (the output processor finds them per update: tokens drafted past one would be handed out
        with it), a prompt with images (the draft model does not see them), and a request whose other
        completions have not started yet."""
        request = self.requests.get(seq.request_id)
        return (
            seq.sampler.matcher is None
            and not seq.sampler.params.stop
            and seq.media is None
            and request is not None
            and not request.waiting_children
        )

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list]:
        """Every row's next token in one batch on the logits' device, and the log-probabilities asked for."""
        samplers = [seq.sampler for seq in seqs]
        suppress = [self._suppressed(seq) for seq in seqs]
        if any(s.matcher is not None for s in samplers):
            logits = self._constrained(logits, seqs)
        if all(s.plain_greedy for s in samplers) and not any(suppress):
            tokens = logits.argmax(-1).tolist()
        else:
            tokens = choose(processed_logits(logits, samplers, [s.tokens for s in seqs], suppress), samplers)
        return tokens, top_logprobs(logits, tokens, [s.params.logprobs for s in samplers])

    def _constrained(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """The logits with what each structured output's grammar does not allow next at -inf (its end and
        stop tokens allowed where the output so far is a whole match)."""
        assert self.grammars is not None  # `check` refused constraints without a tokenizer
        rows = [row for row, seq in enumerate(seqs) if seq.sampler.matcher is not None]
        matchers = [m for seq in seqs if (m := seq.sampler.matcher) is not None]
        ends = [
            (*self._eos(seqs[row].sampler.params), *seqs[row].sampler.params.stop_token_ids) for row in rows
        ]
        allowed = self.grammars.allowed(matchers, ends).to(logits.device)
        logits = logits.float().clone()
        index = torch.tensor(rows, device=logits.device)
        logits[index] = logits[index].masked_fill(~allowed, -torch.inf)
        return logits

    def _suppressed(self, seq: Sequence) -> tuple[int, ...]:
        """The stop tokens, while the completion is shorter than min_tokens."""
        params = seq.sampler.params
        if len(seq.output) >= params.min_tokens:
            return ()
        return (*self._eos(params), *params.stop_token_ids)

    def _eos(self, params: SamplingParams) -> tuple[int, ...]:
        return () if params.ignore_eos else self.defaults.eos_token_ids

    def _advance(self, seq: Sequence, token: int, logprobs: Any) -> Update:
        request = self.requests[seq.request_id]
        params = seq.sampler.params
        seq.tokens.append(token)
        seq.sampler.observe(token)
        stop_token = token in self._eos(params) or token in params.stop_token_ids
        finish = "stop" if stop_token else None
        matcher = seq.sampler.matcher
        if finish is None and matcher is not None and (not matcher.accept(token) or matcher.done):
            finish = "stop"  # the structured output is complete: nothing else may follow
        if finish is None and len(seq.output) >= seq.max_tokens:
            finish = "length"
        if finish is not None:
            self._finish(request, seq, finish)
        return Update(
            seq.request_id, seq.index, [token], "", finish, [logprobs] if logprobs else [], stop_token
        )

    # ---- bookkeeping -------------------------------------------------------------------------------------
    def _sequence(
        self,
        request_id: str,
        index: int,
        prompt: list[int],
        params: SamplingParams,
        media: RequestImages | None = None,
    ) -> Sequence:
        assert params.max_tokens is not None  # filled by `check`
        matcher = None
        if params.constraint is not None and self.grammars is not None:
            matcher = self.grammars.matcher(params.constraint)
        sampler = Sampler.create(params, index, matcher)
        return Sequence(request_id, index, list(prompt), len(prompt), sampler, params.max_tokens, media=media)

    def _start(self, request: _Request, seq: Sequence, first: bool = False) -> None:
        request.live[seq.index] = seq
        self.scheduler.add(seq, first=first)

    def _spawn_children(self, request: _Request, prompt: list[int], media: RequestImages | None) -> None:
        """The other n - 1 completions, queued first: their prompt blocks come from the prefix cache."""
        for index in range(request.params.n - 1, 0, -1):
            child = self._sequence(request.request_id, index, prompt, request.params, media)
            child.adapter, child.adapter_salt = request.adapter
            self._start(request, child, first=True)
        request.waiting_children = 0

    def _finish(self, request: _Request, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        self.scheduler.remove(seq)
        if self.proposer is not None:
            self.proposer.drop(seq)
        request.live.pop(seq.index, None)
        if not request.live and not request.waiting_children:
            del self.requests[request.request_id]

    # ---- offline -----------------------------------------------------------------------------------------
    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams | list[SamplingParams],
        progress: Callable[[int, int], None] | None = None,
        images: list[ImageInputs | None] | None = None,
        adapters: list[str | None] | None = None,
    ) -> list[list[Completion]]:
        """Every prompt's completions (n per prompt), run together by continuous batching; `progress` is
        called as (prompts done, prompts) when one finishes; `images`: each prompt's, if any; `adapters`:
        each prompt's LoRA adapter name (None: the base)."""
        many = params if isinstance(params, list) else [params] * len(prompts)
        pictures = images or [None] * len(prompts)
        loras = adapters or [None] * len(prompts)
        results: dict[str, dict[int, Completion]] = {}
        for i, (prompt, p) in enumerate(zip(prompts, many, strict=True)):
            self.add(f"gen-{i}", prompt, p, pictures[i], loras[i])
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


def _step_tokens(seq: Sequence, n: int) -> list[int]:
    """The n tokens a sequence computes this step: from its first uncached one on, then its drafts."""
    tokens = seq.tokens[seq.computed : seq.computed + n]
    return tokens + seq.draft[: n - len(tokens)] if seq.draft else tokens
