"""The engine's settings, and what it hands out (updates, completions, stats) or refuses (request errors)."""

from __future__ import annotations

from dataclasses import dataclass, field

from shardforge.errors import ShardforgeError
from shardforge.infer.speculative import SpeculativeConfig


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
    decode_kernel: bool = True  # CPU fp32: one call a layer for the decodes (infer/cpu_kernels.py)
    speculative: SpeculativeConfig | None = None  # drafts checked in the target's step (speculative.py)


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
    spec_drafts: int = 0  # speculative steps of a sequence (one verification each)
    spec_draft_tokens: int = 0  # draft tokens the target checked
    spec_accepted_tokens: int = 0  # of those, kept


@dataclass
class Update:
    """What one step added to one completion."""

    request_id: str
    index: int
    tokens: list[int]
    text: str
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)
    stop_token: bool = False  # it ended on an end-of-sequence or stop token (a token with no text)


@dataclass
class Completion:
    tokens: list[int]
    text: str
    finish_reason: str
    logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)
