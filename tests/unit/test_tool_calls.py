"""The tool-call formats while streaming: content is sent until a call may begin (a marker split over pieces
is held back), the calls come at the end, a call that is not well-formed comes back as the text it was, and
the whole answer equals the streamed one for each format (tests/lf checks the parsers against LLaMA-Factory's
own formatters and extractors; tests/e2e/test_tool_calls.py the flow through the openai client)."""

from __future__ import annotations

import json

import pytest

from shardforge.infer.tools import FORMATS, CallStream, Tooling, detect, forced_calls, forced_constraint


class PieceTokenizer:
    """Each token id stands for one piece of text; `special` pieces vanish from the text a client sees."""

    def __init__(self, pieces: list[str], special: set[str]) -> None:
        self.pieces, self.special = pieces, special

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(
            self.pieces[i] for i in ids if not (skip_special_tokens and self.pieces[i] in self.special)
        )


CALL = {"name": "get_weather", "arguments": {"city": "Oslo"}}
CASES = {
    "hermes": (
        ["Let me look. ", "<tool", "_call>\n", json.dumps(CALL), "\n</tool_call>"],
        set(),
        "Let me look.",
    ),
    "hermes-one-piece": (["ok<tool_call>" + json.dumps(CALL) + "</tool_call>"], set(), "ok"),
    "llama3_json": (
        ["<|python_tag|>", '{"name": "get_weather", ', '"parameters": {"city": "Oslo"}}'],
        {"<|python_tag|>"},
        None,
    ),
    "llama3_json-no-tag": ([" ", '{"name": "get_weather", "parameters": {"city": "Oslo"}}'], set(), None),
    "mistral": (["Sure", "[TOOL_CALLS]", " [", json.dumps(CALL), "]"], {"[TOOL_CALLS]"}, "Sure"),
}


def _stream(fmt: str, pieces: list[str], special: set[str]):
    tokenizer = PieceTokenizer(pieces, special)
    stream = CallStream(Tooling("auto", FORMATS[fmt]), tokenizer)
    sent = [stream.update([i], tokenizer.decode([i]), False) for i in range(len(pieces))]
    rest, calls = stream.finish()
    return "".join(sent) + rest, calls, tokenizer


@pytest.mark.parametrize("case", sorted(CASES))
def test_streamed_content_and_calls_equal_the_whole_answer(case):
    pieces, special, content = CASES[case]
    fmt = case.split("-")[0]
    text, calls, tokenizer = _stream(fmt, pieces, special)
    ids = list(range(len(pieces)))
    whole_content, whole_calls = Tooling("auto", FORMATS[fmt]).answer(
        tokenizer.decode(ids), tokenizer.decode(ids, skip_special_tokens=False)
    )
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"})]
    assert calls == whole_calls and whole_content == content
    assert text.strip() == (content or "")


@pytest.mark.parametrize(
    "fmt, pieces",
    [
        ("hermes", ["I use <tool", "_call> tags: ", "<tool_call>{oops}</tool_call>"]),
        ("hermes", ["a < b and <tool", " is a word"]),
        ("llama3_json", ["{not json", " at all"]),
        ("llama3_json", ['{"name": "f"}']),  # no arguments
        ("mistral", ["plain ", "[TOOL_CALLS]", " nonsense"]),
    ],
)
def test_what_is_not_a_well_formed_call_is_content(fmt, pieces):
    special = {"[TOOL_CALLS]"} if fmt == "mistral" else set()
    text, calls, tokenizer = _stream(fmt, pieces, special)
    assert calls == [] and text == tokenizer.decode(list(range(len(pieces))))


def test_several_calls_in_each_format():
    two = [{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]
    texts = {
        "hermes": "".join(f"<tool_call>\n{json.dumps(c)}\n</tool_call>\n" for c in two),
        "llama3_json": "; ".join(json.dumps({"name": c["name"], "parameters": c["arguments"]}) for c in two),
        "mistral": "[TOOL_CALLS] " + json.dumps(two),
    }
    for fmt, text in texts.items():
        parsed = FORMATS[fmt].parse(text)
        assert parsed is not None, fmt
        assert [(c.name, json.loads(c.arguments)) for c in parsed[1]] == [("a", {"x": 1}), ("b", {})], fmt


@pytest.mark.parametrize(
    "template, fmt",
    [
        ("{{- '<tool_call>\\n' + tool_call | tojson }}", "hermes"),
        (
            "{%- if tools %}[AVAILABLE_TOOLS]{{ tools|tojson }}[/AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS]",
            "mistral",
        ),
        ("{{- '<|python_tag|>' + tool_call.name }}", "llama3_json"),
        ('<|start_header_id|>ipython<|end_header_id|> {"name": ..., "parameters": ...}', "llama3_json"),
        ("{{ '<|im_start|>' + message.role }}", None),
    ],
)
def test_the_format_is_found_from_the_chat_template(template, fmt):
    found = detect(template)
    assert (found.name if found else None) == fmt


def test_forced_answers_read_back_as_calls():
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    assert json.loads(forced_constraint(tools, "required", False).spec)["maxItems"] == 1
    assert "maxItems" not in json.loads(forced_constraint(tools, "required", True).spec)
    [call] = forced_calls('[{"name": "add", "parameters": {"a": 1}}]', "required") or []
    assert (call.name, json.loads(call.arguments)) == ("add", {"a": 1})
    [named] = forced_calls('{"a": 2}', "add") or []
    assert (named.name, json.loads(named.arguments)) == ("add", {"a": 2})
    assert forced_calls('[{"name": "add", "param', "required") is None  # cut by max_tokens
