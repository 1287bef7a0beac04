"""Tool calls in chat completions: the model's own call format, found from its chat template, read back out of
what it wrote into OpenAI's `tool_calls` (whole, or while streaming: content is sent until a call may be
starting, the calls at the end); and `tool_choice: required` or a named function, which vLLM answers with a
structured output (a JSON list of calls, or the named function's arguments) instead of the model's format.

The formats (vLLM's parsers of the same names): `hermes` (Qwen 2.5 / Hermes: `<tool_call>{"name", "arguments"}
</tool_call>` blocks after any text), `llama3_json` (Llama 3.1 / 3.2: the reply is a JSON object `{"name",
"parameters"}`, optionally after `<|python_tag|>`; several in a JSON list or separated by `;`), `mistral`
(v0.3: `[TOOL_CALLS]` then a JSON list of `{"name", "arguments"}`)."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from shardforge.infer.grammar import Constraint


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as the OpenAI API carries it


@dataclass(frozen=True)
class ToolFormat:
    """One family's way of writing calls: `start` finds where the first call begins in the raw output (special
    tokens kept), `parse` reads the calls and the text before them (None: not well-formed, so it is text),
    `hold` says how many characters at the end of streamed text might begin a call."""

    name: str
    marker: str  # what begins a call

    def start(self, raw: str) -> int | None:
        if self.name == "llama3_json":
            stripped = raw.lstrip()
            opens = stripped.startswith(
                ("{", "[", self.marker)
            )  # a call, several in a list, or `;`-separated
            return len(raw) - len(stripped) if opens else None
        at = raw.find(self.marker)
        return at if at >= 0 else None

    def hold(self, text: str) -> int:
        if self.name == "llama3_json":
            return len(text) if not text.strip() else 0  # a reply that is only whitespace so far
        for size in range(min(len(self.marker), len(text)), 0, -1):
            if self.marker.startswith(text[-size:]):
                return size
        return 0

    def parse(self, raw: str) -> tuple[str, list[ToolCall]] | None:
        at = self.start(raw)
        if at is None:
            return None
        body = raw[at:]
        if self.name == "hermes":
            blocks = re.findall(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", body, re.DOTALL)
            values = [_json(closed or open_) for closed, open_ in blocks]
            key = "arguments"
        elif self.name == "llama3_json":
            found = _json_sequence(body.strip().removeprefix(self.marker)) or []
            values = [v for value in found for v in (value if isinstance(value, list) else [value])]
            key = "parameters"
        else:
            found = _json(body[len(self.marker) :])
            values = found if isinstance(found, list) else [found]
            key = "arguments"
        calls = [_call(value, key) for value in values or [None]]
        if any(call is None for call in calls):
            return None
        return raw[:at], [c for c in calls if c is not None]


FORMATS = {
    "hermes": ToolFormat("hermes", "<tool_call>"),
    "llama3_json": ToolFormat("llama3_json", "<|python_tag|>"),
    "mistral": ToolFormat("mistral", "[TOOL_CALLS]"),
}


def detect(template: str) -> ToolFormat | None:
    """The call format a chat template teaches (None: it shows no tool format this server reads)."""
    if "<tool_call>" in template:
        return FORMATS["hermes"]
    if "[TOOL_CALLS]" in template:
        return FORMATS["mistral"]
    if "<|python_tag|>" in template or ("ipython" in template and '"parameters"' in template):
        return FORMATS["llama3_json"]
    return None


def _json(text: str) -> Any:
    try:
        return json.loads(text.strip())
    except json.JSONDecodeError:
        return None


def _json_sequence(text: str) -> list[Any] | None:
    """JSON values one after another, separated by `;` or whitespace (Llama 3's several calls)."""
    decoder, values, at = json.JSONDecoder(), [], 0
    while at < len(text):
        try:
            value, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            return None
        values.append(value)
        while at < len(text) and text[at] in "; \n\t\r":
            at += 1
    return values or None


def _call(value: Any, key: str) -> ToolCall | None:
    """A call object: its name and arguments (`parameters` or `arguments`, whichever it has)."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get(key, value.get("arguments", value.get("parameters")))
    if arguments is None:
        return None
    return ToolCall(
        value["name"], arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    )


# ---- tool_choice: required / a named function ------------------------------------------------------------
def forced_constraint(tools: list[dict], choice: str, parallel: bool) -> Constraint:
    """The structured output that makes the model call: for a named function its arguments (the function's
    parameters schema); for `required`, a list of at least one call of any function (vLLM's schema)."""
    functions = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in tools}
    if choice != "required":
        return Constraint("json", json.dumps(functions[choice]), "tool_choice")
    each = [
        {
            "type": "object",
            "properties": {"name": {"type": "string", "enum": [name]}, "parameters": schema},
            "required": ["name", "parameters"],
        }
        for name, schema in functions.items()
    ]
    listed: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": each}}
    if not parallel:
        listed["maxItems"] = 1
    return Constraint("json", json.dumps(listed), "tool_choice")


def forced_calls(text: str, choice: str) -> list[ToolCall] | None:
    """The calls a forced answer holds (None: it was cut before it was whole)."""
    value = _json(text)
    if value is None:
        return None
    if choice != "required":
        return [ToolCall(choice, json.dumps(value, ensure_ascii=False))]
    calls = [_call(v, "parameters") for v in value] if isinstance(value, list) else [None]
    return None if any(c is None for c in calls) else [c for c in calls if c is not None]


@dataclass(frozen=True)
class Tooling:
    """What a chat request lets the model do with its tools: `choice` none, auto, required or the name of the
    function it must call; `fmt` the model's call format (for auto)."""

    choice: str = "none"
    fmt: ToolFormat | None = None

    @property
    def forced(self) -> bool:
        return self.choice not in ("none", "auto")

    def answer(self, text: str, raw: str) -> tuple[str | None, list[ToolCall]]:
        """(the message's content, its calls) from a whole completion: its text, and `raw`, its tokens decoded
        with special tokens kept (Mistral's [TOOL_CALLS] and Llama's <|python_tag|> are special tokens)."""
        if self.forced:
            calls = forced_calls(text, self.choice)
            return (None, calls) if calls else (text, [])
        parsed = self.fmt.parse(raw) if self.choice == "auto" and self.fmt is not None else None
        if parsed is None:
            return text, []
        return parsed[0].strip() or None, parsed[1]

    def finish_reason(self, calls: list[ToolCall], finish: str | None) -> str | None:
        """OpenAI's: tool_calls when the model chose to call, stop when the request named the function."""
        if not calls:
            return finish
        return "stop" if self.forced and self.choice != "required" else "tool_calls"


def tool_call_json(call: ToolCall, index: int | None = None) -> dict[str, Any]:
    """A call as the API writes it (with `index` in a streamed delta)."""
    out: dict[str, Any] = {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }
    return out if index is None else {"index": index, **out}


class CallStream:
    """One streamed choice of a request that may call: its content pieces are sent as they come, except text
    that may begin a call; once a call has begun (or when the call is forced), the rest is kept for `finish`,
    which reads the calls, or, if they are not well-formed, hands the kept text out as content."""

    def __init__(self, tooling: Tooling, tokenizer: Any) -> None:
        self.tooling, self.tokenizer = tooling, tokenizer
        self.tokens: list[int] = []
        self.text = ""
        self.sent = 0
        self.calling = tooling.forced

    def update(self, tokens: list[int], text: str, stop_token: bool) -> str:
        """The content to send now for this update's tokens and text."""
        self.tokens += tokens[:-1] if stop_token else tokens
        self.text += text
        fmt = self.tooling.fmt
        if fmt is None or self.tooling.choice != "auto":
            return "" if self.calling else self._flush(len(self.text))
        if not self.calling and fmt.start(self.raw()) is not None:
            self.calling = True
        return "" if self.calling else self._flush(len(self.text) - fmt.hold(self.text))

    def _flush(self, upto: int) -> str:
        piece = self.text[self.sent : upto]
        self.sent = max(self.sent, upto)
        return piece

    def raw(self) -> str:
        return self.tokenizer.decode(self.tokens, skip_special_tokens=False)

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(the content not sent yet, the calls): the text before the calls, less what was sent."""
        if self.calling:
            if self.tooling.forced:
                _, calls = self.tooling.answer(self.text, "")
                if calls:
                    return "", calls
            else:
                assert self.tooling.fmt is not None
                parsed = self.tooling.fmt.parse(self.raw())
                if parsed is not None:
                    sent = self.text[: self.sent]
                    before = parsed[0]
                    return (before[len(sent) :] if before.startswith(sent) else "").rstrip(), parsed[1]
        return self._flush(len(self.text)), []
