"""The OpenAI API's request bodies (the fields its client sends, and the common extras vLLM takes: top_k,
min_p, repetition_penalty, min_tokens, ignore_eos, stop_token_ids), checked by pydantic and turned into
SamplingParams; unknown fields are ignored, as OpenAI-compatible servers do."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from shardforge.infer.sampling import SamplingParams


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] = Field(default_factory=list)
    user: str | None = None

    def sampling(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            seed=self.seed,
            n=self.n,
            stop=stop,
            stop_token_ids=tuple(self.stop_token_ids),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
        ).check()


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None

    @field_validator("content")
    @classmethod
    def _text_only(cls, content: str | list[dict[str, Any]] | None) -> str | list[dict[str, Any]] | None:
        """The models served here read text: a part of another type (an image, audio) is a bad request, not
        something to drop silently."""
        for part in content if isinstance(content, list) else ():
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(
                    f"a content part of type {part.get('type')!r} is not supported: this model reads text "
                    f"only (parts of type 'text' with a string 'text')"
                )
        return content

    def text(self) -> str:
        """The message's text: the text parts of a content list joined."""
        if isinstance(self.content, list):
            return "".join(part["text"] for part in self.content)
        return self.content or ""


class ChatRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    def params(self) -> SamplingParams:
        limit = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self.sampling(limit, (self.top_logprobs or 0) if self.logprobs else None)


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # the OpenAI completions API's default
    logprobs: int | None = None
    echo: bool = False

    def params(self) -> SamplingParams:
        return self.sampling(self.max_tokens, self.logprobs)

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(x, int) for x in p):
            return [list(p)]
        return list(p)


def validation_message(exc: ValidationError) -> tuple[str, str]:
    """(a one-line message naming the field, the field) for a pydantic error."""
    first = exc.errors()[0]
    where = ".".join(str(part) for part in first["loc"]) or "body"
    return f"{where}: {first['msg']}", where
