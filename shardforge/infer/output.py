"""Output processing: the engine core's token updates made into text updates (detokenized, stop strings
found and cut, pieces that never split a character). It keeps its own copy of each completion's tokens, so
it can run on a thread of its own while the core steps (infer/runner.py), or inline after each step
(`Engine.generate`, the terminal and web chats). A stop string ends a completion here, where it is found:
the caller tells the core to finish it (vLLM's output processor does the same), and any token the core made
for it meanwhile is dropped."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from shardforge.infer.sampling import SamplingParams
from shardforge.infer.text import TextStream


@dataclass
class _Completion:
    stream: TextStream | None
    tokens: list[int] = field(default_factory=list)
    ended: bool = False


@dataclass
class _Request:
    params: SamplingParams
    left: int  # completions not ended yet
    completions: dict[int, _Completion] = field(default_factory=dict)


@dataclass
class Processed:
    """What one batch of updates became: the updates to hand out (with text), the completions a stop string
    ended (request id, index: the core should finish them) and the requests all of whose completions ended."""

    updates: list[Any]
    stopped: list[tuple[str, int]]
    done: list[str]


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, _Request] = {}

    def start(self, request_id: str, params: SamplingParams) -> None:
        """A request the core has taken (its parameters as filled: n, stop strings)."""
        self.requests[request_id] = _Request(params, params.n)

    def drop(self, request_id: str) -> None:
        """An aborted request: nothing more of it is handed out."""
        self.requests.pop(request_id, None)

    def process(self, updates: list[Any]) -> Processed:
        out, stopped, done = [], [], []
        for update in updates:
            request = self.requests.get(update.request_id)
            if request is None:
                continue
            completion = request.completions.get(update.index)
            if completion is None:
                completion = request.completions[update.index] = _Completion(self._stream(request.params))
            if completion.ended:  # a stop string ended it; the core made this token before it heard
                continue
            core_finished = update.finish_reason is not None
            update = self._text(completion, update, request.params.min_tokens)
            if update.finish_reason is not None:
                completion.ended = True
                request.left -= 1
                if not core_finished:  # a stop string, found here
                    stopped.append((update.request_id, update.index))
                if request.left == 0:
                    del self.requests[update.request_id]
                    done.append(update.request_id)
            out.append(update)
        return Processed(out, stopped, done)

    def _stream(self, params: SamplingParams) -> TextStream | None:
        if self.tokenizer is None:
            return None
        return TextStream(self.tokenizer, params.stop, params.include_stop_in_output)

    @staticmethod
    def _text(completion: _Completion, update: Any, min_tokens: int) -> Any:
        completion.tokens += update.tokens
        stream = completion.stream
        if stream is None:
            return update
        finish = update.finish_reason
        # a stop token (eos, stop_token_ids) has no text; stop strings count from min_tokens on (vLLM's
        # rule; the core suppresses stop tokens until then)
        visible = completion.tokens[:-1] if update.stop_token else completion.tokens
        stream.update(visible, stops=len(completion.tokens) >= min_tokens)
        if stream.stopped is not None:
            finish = "stop"
        return replace(update, text=stream.delta(final=finish is not None), finish_reason=finish)
