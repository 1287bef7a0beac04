"""Tool calling through the real openai client, against a tiny model that learned the bundled tool-use data
(examples/data/demo_tools.jsonl: LLaMA-Factory's glaive_toolcall form) in a few hundred steps with a Qwen 2.5
style chat template: the model's <tool_call> output comes back as OpenAI `tool_calls` (whole and streamed),
the call's result goes back as a `tool` message and the model answers from it; a request it answers without
a call gets content; `required` and a named function are enforced by a structured output."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import openai
import pytest
from starlette.testclient import TestClient

from shardforge.config import load_config
from shardforge.infer.engine import Engine
from shardforge.infer.engine_types import EngineConfig
from shardforge.infer.load import load_for_inference
from shardforge.infer.runner import EngineRunner
from shardforge.infer.server import build_app
from shardforge.train.trainer import Trainer
from tests.chat_templates import HERMES_SHORT, tokenizer_with

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "examples" / "data" / "demo_tools.jsonl"
TOOLS = [
    {"type": "function", "function": t}
    for t in json.loads(json.loads(DATA.read_text().splitlines()[0])["tools"])
]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    root = tmp_path_factory.mktemp("tools")
    config = {
        "output_dir": str(root / "run"),
        "model": {"preset": "tiny-llama", "tokenizer": str(tokenizer_with(HERMES_SHORT, root / "tokenizer"))},
        "data": {"train": [{"path": str(DATA), "format": "sharegpt"}], "max_length": 256, "packing": False},
        "method": {"stage": "sft"},
        "train": {"steps": 600, "lr": 3e-3, "micro_batch": 8, "schedule": "constant", "warmup": 0, "seed": 0},
        "log": {"tensorboard": False, "plot": False},
    }
    Trainer(load_config(None, base=config)).train()
    loaded = load_for_inference(root / "run" / "final")
    engine = Engine(
        loaded.model, loaded.tokenizer, EngineConfig(block_size=16, num_blocks=512), loaded.defaults
    )
    runner = EngineRunner(engine, max_waiting=16)
    http = TestClient(build_app(loaded, runner, "tiny"), raise_server_exceptions=False)
    yield openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=http, max_retries=0)
    runner.close()


def _ask(client, messages, **kw):
    return client.chat.completions.create(
        model="tiny", messages=messages, **{"tools": TOOLS, "max_tokens": 100, "temperature": 0, **kw}
    )


def test_a_call_comes_back_as_tool_calls_and_its_result_is_answered(client):
    question = {"role": "user", "content": "weather in Oslo?"}
    first = _ask(client, [question]).choices[0]
    assert first.finish_reason == "tool_calls", first
    [call] = first.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Oslo"}
    followed = [
        question,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"weather": "snow"})},
    ]
    answer = _ask(client, followed).choices[0]
    assert answer.finish_reason == "stop" and not answer.message.tool_calls
    assert answer.message.content == "snow in Oslo."


def test_streamed_calls_equal_the_whole_answer(client):
    messages = [{"role": "user", "content": "add 3 and 4"}]
    whole = _ask(client, messages).choices[0]
    chunks = list(_ask(client, messages, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    streamed = [call for d in deltas for call in d.tool_calls or []]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert "".join(d.content or "" for d in deltas) == (whole.message.content or "")
    assert (
        [(c.function.name, json.loads(c.function.arguments)) for c in streamed]
        == [(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls]
        == [("add", {"a": 3, "b": 4})]
    )


def test_a_request_without_a_call_gets_content(client):
    for stream in (False, True):
        reply = _ask(client, [{"role": "user", "content": "say apple"}], stream=stream)
        if stream:
            text = "".join(c.choices[0].delta.content or "" for c in reply if c.choices)
        else:
            assert reply.choices[0].finish_reason == "stop" and not reply.choices[0].message.tool_calls
            text = reply.choices[0].message.content
        assert text == "apple"


def test_required_and_a_named_function_are_enforced(client):
    """The forced answers are the structured output's (vLLM's schema), not the format the model learned, so
    the model fills them as best it can: what is checked is that they parse and fit the functions' schemas.
    Offered the weather function alone, which takes a string: under any engine's JSON grammar a tiny model's
    digits for an integer argument may run on to max_tokens (seen with `add`)."""
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    ask = [{"role": "user", "content": "weather in Paris?"}]
    weather = [t for t in TOOLS if t["function"]["name"] == "get_weather"]
    forced = {"tools": weather, "max_tokens": 300}
    required = _ask(client, ask, tool_choice="required", parallel_tool_calls=False, **forced).choices[0]
    assert required.finish_reason == "tool_calls", required
    [call] = required.message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    named = _ask(
        client, ask, tool_choice={"type": "function", "function": {"name": "get_weather"}}, **forced
    ).choices[0]  # fmt: skip
    assert named.message.tool_calls, named
    [call] = named.message.tool_calls
    assert named.finish_reason == "stop" and named.message.content is None
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), schemas["get_weather"])


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools[0]"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools[0]"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
        ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f"}}]}]}, "messages"),
    ],
)
def test_bad_tool_fields_are_400s_naming_the_field(client, fields, param):
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS, **fields}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", max_tokens=4, **body)
    assert info.value.body["param"] == param, info.value.body
