"""Tool-use and reasoning data: LLaMA-Factory's glaive_toolcall form (function_call / observation turns and a
tools column) and OpenAI's (assistant tool_calls, tool turns) read as chat templates take them, encoded with
the model's own tool format; data.enable_thinking as Qwen3-style templates mean it. (tests/lf checks the
same against LLaMA-Factory's own encoding.)"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from shardforge.config.data_schema import DatasetSpec
from shardforge.data.formats import Reading, default_fields, parse_record
from shardforge.data.loader import read_dataset
from shardforge.data.templates import encode_chats, encode_pairs, resolve_template
from shardforge.errors import DataError
from shardforge.objectives import reading_for
from tests.chat_templates import QWEN3_THINKING, QWEN_TOOLS, tokenizer_with

TOOLS = [
    {"name": "weather", "description": "the weather", "parameters": {"type": "object", "properties": {}}}
]
GLAIVE = {
    "conversations": [
        {"from": "human", "value": "rain in Oslo?"},
        {"from": "function_call", "value": '{"name": "weather", "arguments": {"city": "Oslo"}}'},
        {"from": "observation", "value": '{"rain": true}'},
        {"from": "gpt", "value": "Yes, it rains."},
    ],
    "tools": json.dumps(TOOLS),
}
CALL = {"type": "function", "function": {"name": "weather", "arguments": {"city": "Oslo"}}}


def read(tmp_path: Path, rows: list[Any], fmt: str = "sharegpt", stage: str = "sft") -> list:
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return read_dataset(DatasetSpec(path=str(path), format=fmt), reading_for(stage))


def test_glaive_records_read_as_template_messages_with_their_tools(tmp_path: Path) -> None:
    (record,) = read(tmp_path, [GLAIVE])
    assert record.tools == ({"type": "function", "function": TOOLS[0]},)
    assert list(record.messages) == [
        {"role": "user", "content": "rain in Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "content": '{"rain": true}'},
        {"role": "assistant", "content": "Yes, it rains."},
    ]


def test_openai_tool_calls_with_json_string_arguments_and_parallel_calls(tmp_path: Path) -> None:
    calls = [
        {"id": "1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}},
        {"id": "2", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Rome"}'}},
    ]
    row = {
        "messages": [
            {"role": "user", "content": "Oslo and Rome?"},
            {"role": "assistant", "content": None, "tool_calls": calls},
            {"role": "tool", "content": "rain"},
            {"role": "tool", "content": "sun"},
        ],
        "tools": [{"type": "function", "function": TOOLS[0]}],
    }
    with pytest.raises(DataError, match="turn 3 is a tool turn where a assistant turn was expected"):
        read(tmp_path, [row], "openai")
    row["messages"][3:] = [{"role": "assistant", "content": "Rain, then sun."}]
    (record,) = read(tmp_path, [row], "openai")
    rome = {"type": "function", "function": {"name": "weather", "arguments": {"city": "Rome"}}}
    assert record.messages[1] == {"role": "assistant", "content": "", "tool_calls": [CALL, rome]}
    assert record.tools == tuple(row["tools"])


def _glaive(**change: Any) -> dict:
    turns = [dict(t) for t in GLAIVE["conversations"]]
    for i, value in change.pop("turn", {}).items():
        turns[i]["value"] = value
    return {**GLAIVE, "conversations": turns, **change}


@pytest.mark.parametrize(
    ("row", "message"),
    [
        (_glaive(tools="[{"), r'sharegpt "tools" is not JSON \(.*\); expected a list of functions'),
        (_glaive(tools={"name": "f"}), 'sharegpt "tools" is an object; expected a list of functions'),
        (
            _glaive(tools='[{"description": "x"}]'),
            'sharegpt "tools" item 0 is .* expected a function definition',
        ),
        (_glaive(turn={1: "weather(city=Oslo)"}), 'turn 1 is a function call whose "value" is not JSON'),
        (_glaive(turn={1: '{"name": "weather"}'}), r'turn 1 call 0 is \{"name": "weather"\}; expected'),
        (_glaive(turn={1: "[]"}), "turn 1 has no function call"),
        (_glaive(turn={1: '{"name": "f", "arguments": "{x"}'}), 'arguments "\\{x" are not JSON'),
    ],
)
def test_bad_tool_data_names_the_record_and_the_field(tmp_path: Path, row: dict, message: str) -> None:
    with pytest.raises(DataError, match=r"data\.jsonl:1: .*" + message):
        read(tmp_path, [row])


def test_kto_completion_must_be_a_reply(tmp_path: Path) -> None:
    row = {"conversations": GLAIVE["conversations"][:2], "label": True}
    with pytest.raises(DataError, match="a KTO completion is a text reply; this one is a function call"):
        read(tmp_path, [row], stage="kto")


def test_dataset_info_reads_tools_only_from_a_named_column(tmp_path: Path) -> None:
    (tmp_path / "g.json").write_text(json.dumps([GLAIVE]))
    info = {
        "named": {"file_name": "g.json", "formatting": "sharegpt", "columns": {"tools": "tools"}},
        "unnamed": {"file_name": "g.json", "formatting": "sharegpt"},
    }
    (tmp_path / "dataset_info.json").write_text(json.dumps(info))
    tools = {}
    for name in info:
        spec = DatasetSpec(name=name, dataset_info=str(tmp_path / "dataset_info.json"))
        tools[name] = read_dataset(spec, reading_for("sft"))[0].tools
    assert tools == {"named": ({"type": "function", "function": TOOLS[0]},), "unnamed": ()}


def _runs(tokenizer: Any, ids: np.ndarray, flags: np.ndarray) -> tuple[list[str], list[str]]:
    """The trained and the untrained stretches of a sequence, decoded."""
    edges = [0, *np.flatnonzero(np.diff(flags.astype(int))) + 1, len(ids)]
    runs: tuple[list[str], list[str]] = ([], [])
    for a, b in itertools.pairwise(edges):
        runs[0 if flags[a] else 1].append(tokenizer.decode(ids[a:b].tolist()))
    return runs


@pytest.fixture(scope="module")
def tool_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return AutoTokenizer.from_pretrained(tokenizer_with(QWEN_TOOLS, tmp_path_factory.mktemp("tools")))


def test_calls_are_trained_in_the_template_s_tool_format_and_results_are_not(
    tmp_path: Path, tool_tokenizer: Any
) -> None:
    (record,) = read(tmp_path, [GLAIVE])
    template = resolve_template(tool_tokenizer, "auto")
    ((ids, flags),) = encode_chats(
        tool_tokenizer, template, [(list(record.messages), record.tools, "r")], False
    )
    trained, untrained = _runs(tool_tokenizer, ids, flags)
    call = '<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call><|im_end|>\n'
    assert trained == [call, "Yes, it rains.<|im_end|>\n"]
    assert f"<tools>\n{json.dumps({'type': 'function', 'function': TOOLS[0]})}\n</tools>" in untrained[0]
    assert untrained[1].startswith('<|im_start|>user\n<tool_response>\n{"rain": true}\n</tool_response>')


def test_a_template_without_a_tool_format_is_refused_not_silently_dropped(
    tmp_path: Path, tool_tokenizer: Any
) -> None:
    (record,) = read(tmp_path, [GLAIVE])
    chatml = resolve_template(tool_tokenizer, "chatml")
    with pytest.raises(DataError, match="r: the chat template has no tool format"):
        encode_chats(tool_tokenizer, chatml, [(list(record.messages), record.tools, "r")], False)
    with pytest.raises(DataError, match="r: the chat template does not render assistant turns with function"):
        encode_chats(tool_tokenizer, chatml, [(list(record.messages), (), "r")], False)
    pair = ([*record.messages[:3], {"role": "assistant", "content": "a"}], "b", record.tools, "p")
    with pytest.raises(DataError, match="p: the chat template has no tool format"):
        encode_pairs(tool_tokenizer, chatml, [pair])


@pytest.fixture(scope="module")
def thinking_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return AutoTokenizer.from_pretrained(tokenizer_with(QWEN3_THINKING, tmp_path_factory.mktemp("think")))


@pytest.mark.parametrize(
    ("reply", "thinking", "prompt_end", "trained"),
    [
        ("4", None, "assistant\n", "<think>\n\n</think>\n\n4<|im_end|>\n"),
        ("4", True, "assistant\n", "<think>\n\n</think>\n\n4<|im_end|>\n"),
        ("4", False, "<think>\n\n</think>\n\n", "4<|im_end|>\n"),
        ("<think>\n2+2\n</think>\n\n4", True, "assistant\n", "<think>\n2+2\n</think>\n\n4<|im_end|>\n"),
        ("<think>\n2+2\n</think>\n\n4", False, "<think>\n\n</think>\n\n", "4<|im_end|>\n"),
    ],
)
def test_enable_thinking_trains_on_the_thought_or_puts_an_empty_one_in_the_prompt(
    thinking_tokenizer: Any, reply: str, thinking: bool | None, prompt_end: str, trained: str
) -> None:
    template = resolve_template(thinking_tokenizer, "auto", thinking)
    messages = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": reply}]
    ((ids, flags),) = encode_chats(thinking_tokenizer, template, [(messages, (), "r")], False)
    (got,), (prompt,) = _runs(thinking_tokenizer, ids, flags)
    assert (prompt.endswith(prompt_end), got) == (True, trained)


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
ROLES = ["human", "gpt", "function_call", "observation", "system", "tool", "user", "assistant", 7, None]
VALUES = JSON | st.sampled_from(['{"name": "f", "arguments": {}}', '[{"name": "f"}]', "[]", "{"])
TURN = st.fixed_dictionaries(
    {"from": st.sampled_from(ROLES), "value": VALUES},
    optional={"role": st.sampled_from(ROLES), "content": VALUES, "tool_calls": JSON},
)
ROW = st.fixed_dictionaries(
    {"conversations": st.lists(TURN, max_size=5) | JSON},
    optional={"tools": JSON | st.sampled_from(["[]", '[{"name": "f"}]', "[{"]), "system": JSON},
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    row=ROW,
    fmt=st.sampled_from(["sharegpt", "openai", "alpaca"]),
    stage=st.sampled_from(["sft", "dpo", "kto"]),
)
def test_any_record_is_read_or_refused_with_its_source(row: dict, fmt: str, stage: str) -> None:
    """Records of any shape, tool turns among them: a record or a DataError naming it, never a traceback."""
    how: Reading = reading_for(stage)
    try:
        parse_record(row, "f:1", fmt, default_fields(fmt), how)
    except DataError as e:
        assert str(e).startswith("f:1: ")


def test_a_run_s_data_with_tools_is_prepared_and_cached(tmp_path: Path, tool_tokenizer: Any) -> None:
    """Through the config and the loader (worker-picklable encoder, the dataset cache): every record kept,
    the calls among the targets."""
    from shardforge.config import load_config
    from shardforge.data.build import build_data
    from shardforge.models.build import model_source
    from shardforge.objectives import build_objective, reading_of

    path = tmp_path / "glaive.jsonl"
    path.write_text("".join(json.dumps(GLAIVE) + "\n" for _ in range(3)))
    config = load_config(None, base={
        "model": {"preset": "tiny-llama", "tokenizer": tool_tokenizer.name_or_path},
        "data": {"train": [{"path": str(path), "format": "sharegpt"}], "max_length": 512, "packing": False,
                 "cache_dir": str(tmp_path / "cache")},
        "output_dir": str(tmp_path / "run"),
    })  # fmt: skip
    objective = build_objective(config.method)
    for _ in range(2):  # built, then read from the cache
        train, _ = build_data(config, model_source(config.model)[1], objective, reading_of(objective), True)
        assert len(train.examples) == 3
        example = train.examples[0]
        trained, _ = _runs(tool_tokenizer, np.asarray(example.input_ids), np.asarray(example.trained))
        assert trained[0].startswith('<tool_call>\n{"name": "weather"')
