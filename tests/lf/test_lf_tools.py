"""The server's tool-call parsers read back exactly what LLaMA-Factory's own tool formatters write for Qwen
(hermes), Llama 3 and Mistral, and agree with LF's own extractors on generated calls (LF's
data/tool_utils.py, imported from its source)."""

from __future__ import annotations

import importlib.util
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardforge.infer.tools import FORMATS
from tests.lf.reference_env import reference

pytestmark = pytest.mark.slow

LF_FORMATS = {"qwen": "hermes", "llama3": "llama3_json", "mistral": "mistral"}


@pytest.fixture(scope="module")
def lf_tools():
    path = reference().src / "src" / "llamafactory" / "data" / "tool_utils.py"
    spec = importlib.util.spec_from_file_location("lf_tool_utils", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-1000, 1000) | st.text(max_size=8),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=5), children, max_size=3)
    ),
    max_leaves=6,
)
calls = st.lists(
    st.tuples(
        st.from_regex(r"[a-zA-Z_][a-zA-Z0-9_-]{0,12}", fullmatch=True),
        st.dictionaries(st.text(min_size=1, max_size=6), json_values, max_size=3),
    ),
    min_size=1,
    max_size=3,
)


@pytest.mark.parametrize("lf_name", sorted(LF_FORMATS))
@settings(max_examples=60, deadline=None, derandomize=True)
@given(drawn=calls)
def test_our_parser_reads_what_lfs_formatter_writes(lf_tools, lf_name, drawn):
    utils = lf_tools.TOOLS[lf_name]
    functions = [lf_tools.FunctionCall(name, json.dumps(args)) for name, args in drawn]
    written = utils.function_formatter(functions)
    if lf_name == "mistral":
        written = "[TOOL_CALLS] " + written  # the template's slot puts the special token first
    parsed = FORMATS[LF_FORMATS[lf_name]].parse(written)
    assert parsed is not None, written
    prefix, ours = parsed
    assert prefix.strip() == ""
    theirs = utils.tool_extractor(written.removeprefix("[TOOL_CALLS] "))
    assert [(c.name, json.loads(c.arguments)) for c in ours] == [
        (c.name, json.loads(c.arguments)) for c in theirs
    ]
    assert [(c.name, json.loads(c.arguments)) for c in ours] == [(n, a) for n, a in drawn]


@pytest.mark.parametrize(
    "lf_name, text",
    [
        ("qwen", "It is sunny."),
        ("qwen", "<tool_call>\n{not json}\n</tool_call>"),
        ("qwen", '<tool_call>\n{"name": "f"}\n</tool_call>'),  # no arguments
        ("llama3", "The answer is {x}."),
        ("llama3", '{"nom": "f", "parameters": {}}'),
        ("mistral", "plain words"),
    ],
)
def test_what_lf_reads_as_text_is_text_here_too(lf_tools, lf_name, text):
    assert isinstance(lf_tools.TOOLS[lf_name].tool_extractor(text), str)
    assert FORMATS[LF_FORMATS[lf_name]].parse(text) is None
