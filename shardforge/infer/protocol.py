"""The OpenAI API's request bodies (every field its client sends, and the common extras vLLM takes: top_k,
min_p, repetition_penalty, min_tokens, ignore_eos, stop_token_ids, structured_outputs), checked by pydantic in
strict mode (a string is not a number, a number not a boolean) and turned into SamplingParams. A documented
field this server does not implement (audio, prediction, ...) is refused by name when it asks for something; a
field the API does not document is ignored, as OpenAI-compatible servers do, and logged."""

from __future__ import annotations

import json
import logging
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from shardforge.data.media import IMAGE
from shardforge.data.tools import function_calls
from shardforge.infer.grammar import Constraint
from shardforge.infer.sampling import SamplingError, SamplingParams
from shardforge.infer.tools import forced_constraint

log = logging.getLogger(__name__)
ANY_OBJECT = '{"type": "object"}'  # the schema of json_object: any JSON object
_FUNCTION_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # the OpenAI API's rule for a function's name
_TOKEN_ID = re.compile(r"-?[0-9]{1,12}")  # ASCII digits only: int() would also read "٣" and refuse "²"

# Bounds on lists a client may send, so that one request cannot slow every step of the others (each stop
# string is searched for in every new piece of text): OpenAI documents up to 4 stop strings; vLLM takes more.
MAX_STOP, MAX_STOP_CHARS, MAX_BIAS, MAX_MESSAGES = 16, 256, 1024, 8192

Role = Literal["system", "developer", "user", "assistant", "tool", "function"]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    include_usage: bool = False


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` extra: exactly one of a JSON schema, a regex, a choice of strings, a Lark /
    GBNF grammar, or any JSON object."""

    model_config = ConfigDict(extra="forbid", strict=True)

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(default=None, min_length=1, max_length=1024)
    grammar: str | None = None
    json_object: bool | None = None
    # vLLM's, not implemented here: refused by name when set
    whitespace_pattern: str | None = None
    structural_tag: str | None = None
    disable_any_whitespace: bool | None = None
    disable_additional_properties: bool | None = None
    disable_fallback: bool | None = None

    def constraint(self) -> Constraint | None:
        for name in ("whitespace_pattern", "structural_tag", "disable_additional_properties"):
            if getattr(self, name) is not None:
                raise SamplingError(
                    f"structured_outputs.{name} is not supported by this server", f"structured_outputs.{name}"
                )
        asked = {
            "json": self.json_,
            "regex": self.regex,
            "choice": self.choice,
            "grammar": self.grammar,
            "json_object": self.json_object or None,
        }
        given = [name for name, value in asked.items() if value is not None]
        if len(given) > 1:
            raise SamplingError(
                f"structured_outputs: give one of json, regex, choice, grammar, json_object (got {given})",
                "structured_outputs",
            )
        if not given:
            return None
        name = given[0]
        param = f"structured_outputs.{name}"
        if name == "json_object":
            return Constraint("json", ANY_OBJECT, param)
        if name == "json":
            return json_constraint(self.json_, param)
        if name == "choice":
            return Constraint("choice", json.dumps(self.choice), param)
        return Constraint(name, str(asked[name]), param)  # type: ignore[arg-type]


def json_constraint(schema: dict[str, Any] | str | None, param: str) -> Constraint:
    """A JSON schema given as an object or as JSON text."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise SamplingError(f"{param}: the schema is not valid JSON: {exc}", param) from None
    if not isinstance(schema, (dict, bool)):
        raise SamplingError(f"{param}: a JSON schema is an object (got {type(schema).__name__})", param)
    return Constraint("json", json.dumps(schema), param)


# The structured-output fields vLLM took before 0.12, which it now ignores: a silently unconstrained answer
# is worse than a refusal that names the replacement.
_LEGACY_GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend")


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)

    model: str
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP)] | None = None  # one string: MAX_STOP_CHARS
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = Field(default=None, max_length=MAX_BIAS)
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] = Field(default_factory=list, max_length=MAX_BIAS)
    structured_outputs: StructuredOutputs | None = None
    # documented, and with no effect on what is generated: accepted and ignored
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None

    def unsupported(self) -> dict[str, Any]:
        """The documented fields this server does not implement, by name: each one's value and its neutral
        value(s), which are accepted."""
        return {}

    def constraint(self) -> Constraint | None:
        """The structured output asked for, if any."""
        return self.structured_outputs.constraint() if self.structured_outputs is not None else None

    def sampling(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """The sampling parameters; SamplingError naming the field for a bad or unsupported one."""
        for name, neutral in self.unsupported().items():
            value = getattr(self, name)
            if value is not None and value not in neutral:
                raise SamplingError(f"{name} is not supported by this server (got {value!r})", name)
        if self.stream_options is not None and not self.stream:
            raise SamplingError("stream_options is only allowed with stream: true", "stream_options")
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if any(len(stop) > MAX_STOP_CHARS for stop in stops):
            raise SamplingError(f"stop: a stop string is longer than {MAX_STOP_CHARS} characters", "stop")
        legacy = [name for name in _LEGACY_GUIDED if name in (self.model_extra or {})]
        if legacy:
            raise SamplingError(
                f"{legacy[0]} is vLLM's field from before 0.12: use structured_outputs "
                f'(e.g. {{"structured_outputs": {{"{legacy[0].removeprefix("guided_")}": ...}}}})',
                legacy[0],
            )
        if self.model_extra:
            log.warning("ignored request fields the OpenAI API does not have: %s", sorted(self.model_extra))
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
            logit_bias=_logit_bias(self.logit_bias),
            constraint=self.constraint(),
        ).check()


def _logit_bias(bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """The API's {"token id": bias} map as (id, bias) pairs (ids written as decimal integers)."""
    pairs: dict[int, float] = {}
    for key, value in (bias or {}).items():
        if not _TOKEN_ID.fullmatch(key):
            raise SamplingError(
                f"logit_bias: the key {key[:40]!r} is not a token id (an integer)", "logit_bias"
            )
        pairs[int(key)] = value
    return tuple(sorted(pairs.items()))


class Message(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    role: Role
    content: str | list[dict[str, Any]] | None = None

    @field_validator("content")
    @classmethod
    def _text_or_images(cls, content: str | list[dict[str, Any]] | None) -> str | list[dict[str, Any]] | None:
        """Text parts, and image parts for a vision-language model (the server refuses them for a text
        one); a part of another type (audio, a file) is a bad request, not something to drop silently."""
        for part in content if isinstance(content, list) else ():
            kind = part.get("type")
            image = part.get("image_url")
            url = image.get("url") if isinstance(image, dict) else None
            if kind == "image_url" and isinstance(url, str) and url:
                continue
            if kind == "image_url":
                raise ValueError('an image_url part needs {"image_url": {"url": "<a data URL or a path>"}}')
            if kind != "text" or not isinstance(part.get("text"), str):
                raise ValueError(
                    f"a content part of type {kind!r} is not supported: parts of type 'text' (with a string "
                    f"'text') and, for a vision-language model, 'image_url'"
                )
        return content

    def text(self) -> str:
        """The message's text: the text parts of a content list joined."""
        if isinstance(self.content, list):
            return "".join(part["text"] for part in self.content if part.get("type") == "text")
        return self.content or ""

    def marked_text(self) -> str:
        """The text with an `<image>` mark where each image part was (data/media.py's form)."""
        if not isinstance(self.content, list):
            return self.content or ""
        return "".join(p["text"] if p["type"] == "text" else IMAGE for p in self.content)

    def for_template(self, content: str) -> dict[str, Any]:
        """The message as chat templates take it: an assistant's tool_calls with their arguments decoded (the
        API carries them as JSON text; templates write them as JSON values), a tool result's call id."""
        message: dict[str, Any] = {"role": self.role, "content": content}
        extra = self.model_extra or {}
        if self.role == "assistant" and extra.get("tool_calls"):
            message["tool_calls"] = function_calls(
                extra["tool_calls"], "messages", "an assistant turn's tool_calls"
            )
        if self.role == "tool" and isinstance(extra.get("tool_call_id"), str):
            message["tool_call_id"] = extra["tool_call_id"]
        return message

    def image_urls(self) -> list[str]:
        return [
            p["image_url"]["url"]
            for p in self.content or ()
            if isinstance(p, dict) and p["type"] == "image_url"
        ]


class ChatRequest(_Common):
    messages: list[Message] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    functions: list[Any] | None = None
    function_call: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None
    prediction: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    web_search_options: dict[str, Any] | None = None
    moderation: dict[str, Any] | None = None
    # documented, and with no effect on what is generated here (OpenAI's own caching and abuse detection)
    prompt_cache_key: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None

    def unsupported(self) -> dict[str, Any]:
        return {
            "functions": ([],),
            "function_call": ("none",),
            "audio": (),
            "modalities": (["text"],),
            "prediction": (),
            "reasoning_effort": (),
            "verbosity": (),
            "web_search_options": (),
            "moderation": (),
        }

    def constraint(self) -> Constraint | None:
        """response_format's JSON (object or schema), or structured_outputs; not both."""
        choice = self.tool_choice_name()
        if choice not in ("none", "auto"):
            if self.response_format not in (None, {"type": "text"}) or self.structured_outputs is not None:
                raise SamplingError(
                    f"tool_choice={choice!r} is answered with a structured output: give no response_format "
                    "or structured_outputs with it",
                    "tool_choice",
                )
            return forced_constraint(self.template_tools(), choice, self.parallel_tool_calls is not False)
        fmt = self.response_format
        kind = fmt.get("type") if fmt is not None else "text"
        if kind == "text":
            return super().constraint()
        if self.structured_outputs is not None and self.structured_outputs.constraint() is not None:
            raise SamplingError("give response_format or structured_outputs, not both", "response_format")
        if kind == "json_object":
            return Constraint("json", ANY_OBJECT, "response_format")
        if kind != "json_schema":
            raise SamplingError(
                f"response_format.type={kind!r} is invalid: it must be text, json_object or json_schema",
                "response_format.type",
            )
        spec = (fmt or {}).get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise SamplingError(
                'response_format: json_schema needs {"json_schema": {"name": ..., "schema": {...}}}',
                "response_format.json_schema",
            )
        return json_constraint(spec["schema"], "response_format.json_schema.schema")

    def tool_choice_name(self) -> str:
        """What the model may do with `tools`: none, auto, required, or the name of the function it must call
        (auto when tools are given and tool_choice is not, as the OpenAI API defines)."""
        tools, choice = self.tools or [], self.tool_choice
        names = []
        for i, tool in enumerate(tools):
            function = (
                tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
            )
            name = function.get("name") if isinstance(function, dict) else None
            if not (isinstance(name, str) and _FUNCTION_NAME.fullmatch(name)):
                raise SamplingError(
                    f'tools[{i}] must be {{"type": "function", "function": {{"name": ..., "parameters": '
                    "{...}}} with a name of letters, digits, _ and - (at most 64)",
                    f"tools[{i}]",
                )
            parameters = function.get("parameters")  # type: ignore[union-attr]
            if parameters is not None and not isinstance(parameters, dict):
                raise SamplingError(
                    f"tools[{i}].function.parameters must be a JSON schema object", f"tools[{i}]"
                )
            names.append(name)
        if choice is None:
            return "auto" if tools else "none"
        if isinstance(choice, dict):
            function = choice.get("function") if choice.get("type") == "function" else None
            named = function.get("name") if isinstance(function, dict) else None
            if named not in names:
                raise SamplingError(
                    f"tool_choice names the function {named!r}, which is not in tools ({names})",
                    "tool_choice",
                )
            return str(named)
        if choice not in ("none", "auto", "required"):
            raise SamplingError(
                f"tool_choice={choice!r} is invalid: it must be none, auto, required or "
                '{"type": "function", "function": {"name": ...}}',
                "tool_choice",
            )
        if choice != "none" and not tools:
            raise SamplingError(f"tool_choice={choice!r} needs tools", "tool_choice")
        return choice

    def template_tools(self) -> list[dict]:
        return list(self.tools or [])

    def params(self) -> SamplingParams:
        if self.top_logprobs is not None:
            if not 0 <= self.top_logprobs <= 20:
                raise SamplingError(
                    f"top_logprobs={self.top_logprobs} is invalid: it must be an integer in [0, 20]",
                    "top_logprobs",
                )
            if not self.logprobs:
                raise SamplingError("top_logprobs needs logprobs: true", "top_logprobs")
        limit = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        try:
            return self.sampling(limit, (self.top_logprobs or 0) if self.logprobs else None)
        except SamplingError as exc:
            if exc.param == "max_tokens" and self.limit_field == "max_completion_tokens":
                message = str(exc).replace("max_tokens", "max_completion_tokens")
                raise SamplingError(message, "max_completion_tokens") from None
            raise

    @property
    def limit_field(self) -> str:
        """The field that set the new-token limit (the engine's errors call it max_tokens)."""
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # the OpenAI completions API's default
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def unsupported(self) -> dict[str, Any]:
        return {"suffix": ("",), "best_of": (1, self.n)}

    @property
    def limit_field(self) -> str:
        return "max_tokens"

    def params(self) -> SamplingParams:
        if self.echo and self.logprobs is not None:
            raise SamplingError(
                "echo with logprobs is not supported (it needs the prompt tokens' log-probabilities)", "echo"
            )
        return self.sampling(self.max_tokens, self.logprobs)

    def prompts(self) -> list[str | list[int]]:
        """The prompts, one or several; SamplingError (param prompt) for none or an empty one."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise SamplingError("prompt: the list of prompts is empty", "prompt")
        prompts = [list(p)] if all(isinstance(x, int) for x in p) else list(p)
        if any(isinstance(x, list) and not x for x in prompts):
            raise SamplingError("prompt: a list of token ids is empty", "prompt")
        return prompts


def validation_message(exc: ValidationError) -> tuple[str, str]:
    """(a one-line message naming the field, the field) for a pydantic error."""
    first = exc.errors()[0]
    if first["type"] == "json_invalid":
        return f"the body is not valid JSON: {first['msg']}", "body"
    where = ".".join(str(part) for part in first["loc"] if not _union_member(part)) or "body"
    return f"{where}: {first['msg']}", where


def _union_member(part: str | int) -> bool:
    """pydantic names the member of a union it tried in the error's location (`stop.str`): not a field."""
    return isinstance(part, str) and (part in {"str", "int", "float", "bool", "none"} or "[" in part)
