"""Structured outputs: a request's constraint (a JSON schema, a regex, a choice of strings, a grammar)
compiled by llguidance against the model's tokenizer, and a matcher per completion that says, before each
token, which tokens may come next (a mask applied to the row's logits in the batched sampler) and follows the
tokens that came. llguidance computes a 49k-token mask in tens of microseconds by walking the tokenizer's trie
with an Earley parser over a lexer, and takes JSON schemas, regexes and Lark / GBNF grammars in one format."""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal

import llguidance
import llguidance.hf
import numpy as np
import torch

from shardforge.errors import ShardforgeError

log = logging.getLogger(__name__)

# JSON is written compactly (no whitespace between tokens), so a model cannot pad an answer with spaces until
# max_tokens: OpenAI's outputs and vLLM's `disable_any_whitespace` look so.
_JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False}


class ConstraintError(ShardforgeError):
    """A constraint that does not compile; `param`: the request field it came from."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Constraint:
    """A structured output: what the completion must match. `spec`: a JSON schema (as JSON text), a regex, a
    JSON list of strings (choice) or a Lark / GBNF grammar; `param`: the request field it came from (for
    errors)."""

    kind: Literal["json", "regex", "choice", "grammar"]
    spec: str
    param: str = "structured_outputs"


def grammar_text(constraint: Constraint) -> str:
    """The llguidance grammar of a constraint (not yet checked against a tokenizer)."""
    kind, spec = constraint.kind, constraint.spec
    if kind == "json":
        return llguidance.LLMatcher.grammar_from_json_schema(spec, defaults=_JSON_OPTIONS)  # type: ignore
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(spec)
    if kind == "choice":
        return llguidance.LLMatcher.grammar_from_lark(
            "start: " + " | ".join(json.dumps(c) for c in json.loads(spec))
        )
    return llguidance.grammar_from("grammar", spec)  # Lark, or GBNF (llama.cpp's), as vLLM's `grammar` takes


class Grammars:
    """The engine's compiler of constraints: the tokenizer wrapped once (its vocabulary as llguidance's trie),
    each constraint checked on the caller's thread (a bad schema is a 400 naming the field), and a matcher
    made per completion."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self._hf = tokenizer
        self.vocab_size = vocab_size  # the model's logits' width (may be padded past the tokenizer's)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._executor: llguidance.LLExecutor | None = None
        self._compiled = lru_cache(maxsize=256)(self._compile)

    def _llg(self, param: str) -> llguidance.LLTokenizer:
        if self._tokenizer is None:
            try:
                self._tokenizer = llguidance.hf.from_tokenizer(self._hf)
            except (ValueError, TypeError) as exc:
                raise ConstraintError(
                    f"{param}: structured outputs need the model's fast (tokenizers) tokenizer: {exc}", param
                ) from None
        return self._tokenizer

    def _compile(self, constraint: Constraint) -> str:
        try:
            grammar = grammar_text(constraint)
        except ValueError as exc:
            raise ConstraintError(f"{constraint.param}: {_one_line(exc)}", constraint.param) from None
        error = llguidance.LLMatcher.validate_grammar(grammar, self._llg(constraint.param))
        if error and not error.startswith("WARNING"):
            raise ConstraintError(f"{constraint.param}: {_one_line(error)}", constraint.param)
        return grammar

    def check(self, constraint: Constraint) -> None:
        """ConstraintError (the request field as param) if the constraint does not compile."""
        self._compiled(constraint)

    def matcher(self, constraint: Constraint) -> Matcher:
        return Matcher(llguidance.LLMatcher(self._llg(constraint.param), self._compiled(constraint)))

    def allowed(self, matchers: list[Matcher], extra: list[tuple[int, ...]]) -> torch.Tensor:
        """[rows, vocab] booleans: the tokens each matcher allows next, and where it may end, `extra` (the
        request's end-of-sequence and stop tokens: the engine ends a completion on any of them). The masks are
        computed together on llguidance's threads."""
        if self._executor is None:
            self._executor = llguidance.LLExecutor(num_threads=max(1, min(4, torch.get_num_threads())))
        rows, words = len(matchers), math.ceil(self._llg("").vocab_size / 32)
        bitmask = np.zeros((rows, words), dtype=np.int32)
        pairs = [(m.llg, row) for row, m in enumerate(matchers)]
        self._executor.unsafe_compute_mask_ptr(pairs, bitmask.ctypes.data, words * 4, rows)
        # bit j of word w is token 32 w + j: the little-endian bytes' bits, lowest first (numpy: one pass,
        # no thread pool, where torch's small ops waited ms for their threads on a busy machine)
        bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")
        mask = np.zeros((rows, self.vocab_size), dtype=bool)
        width = min(self.vocab_size, bits.shape[1])
        mask[:, :width] = bits[:, :width]
        for row, (m, ids) in enumerate(zip(matchers, extra, strict=True)):
            if m.accepting and ids:
                mask[row, list(ids)] = True
        return torch.from_numpy(mask)


class Matcher:
    """One completion's place in its grammar."""

    def __init__(self, llg: llguidance.LLMatcher) -> None:
        self.llg = llg

    @property
    def accepting(self) -> bool:
        """The output so far is a whole match: it may end here."""
        return self.llg.is_accepting()

    @property
    def done(self) -> bool:
        """Nothing may follow (the grammar is complete, or the matcher failed)."""
        return self.llg.is_stopped()

    def accept(self, token: int) -> bool:
        """Follow a sampled token; False (logged once) if the grammar did not allow it."""
        if self.llg.consume_token(token):
            return True
        log.error("structured output: token %d left the grammar: %s", token, self.llg.get_error())
        return False


def _one_line(message: object) -> str:
    """llguidance's error (several lines, with a caret under the place) as one line."""
    return " ".join(str(message).split())[:500] or "invalid"
