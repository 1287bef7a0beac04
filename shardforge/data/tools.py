"""Tool use in a record: the functions a conversation may call and an assistant's calls, in the form chat
templates read (`{"type": "function", "function": {...}}`, arguments as a JSON value)."""

from __future__ import annotations

import json
from typing import Any

from shardforge.data.values import kind, show
from shardforge.errors import DataError

Tool = dict[str, Any]  # a function's definition as chat templates take it: {"type": "function", "function"}


def function_calls(value: Any, src: str, where: str) -> list[dict[str, Any]]:
    """Function calls ({"name", "arguments"}, or OpenAI's {"type": "function", "function": {...}}) in the
    form chat templates read: arguments as a JSON value (OpenAI's JSON string decoded)."""
    calls = value if isinstance(value, list) else [value]
    out = []
    for n, call in enumerate(calls):
        call = call.get("function", call) if isinstance(call, dict) else call
        if not (isinstance(call, dict) and isinstance(call.get("name"), str) and "arguments" in call):
            raise DataError(
                f'{src}: {where} call {n} is {show(call)}; expected {{"name": "...", "arguments": {{...}}}}'
            )
        arguments = call["arguments"]
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                raise DataError(
                    f"{src}: {where} call {n}: arguments {show(arguments)} are not JSON"
                ) from None
        out.append({"type": "function", "function": {"name": call["name"], "arguments": arguments}})
    if not out:
        raise DataError(f"{src}: {where} has no function call")
    return out


def tool_definitions(value: Any, src: str, fmt: str, column: str | None) -> tuple[Tool, ...]:
    """The functions a conversation may call: a JSON list of definitions, or a string holding one (how
    LLaMA-Factory's tool data keeps them), each wrapped as {"type": "function", "function": ...}."""
    if value is None or value == "":
        return ()
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise DataError(
                f'{src}: {fmt} "{column}" is not JSON ({e.msg}); expected a list of functions'
            ) from None
    if not isinstance(value, list):
        raise DataError(f'{src}: {fmt} "{column}" is {kind(value)}; expected a list of functions')
    tools = []
    for n, tool in enumerate(value):
        function = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else tool
        if not (isinstance(function, dict) and isinstance(function.get("name"), str)):
            raise DataError(
                f'{src}: {fmt} "{column}" item {n} is {show(tool)}; expected a function definition '
                '{"name": ..., "description": ..., "parameters": {...}}'
            )
        tools.append(tool if function is not tool else {"type": "function", "function": tool})
    return tuple(tools)
