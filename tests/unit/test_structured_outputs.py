"""Structured outputs: every completion a constraint ends ("stop") is a whole match (JSON that `jsonschema`
validates against generated schemas, a regex's full match, one of the choices, a grammar's sentence), one cut
by max_tokens is a prefix of one; and the API's fields (response_format, structured_outputs) through the
real openai client, with bad constraints refused by name."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, Field
from starlette.testclient import TestClient

from shardforge.errors import DataError
from shardforge.infer.engine import Engine
from shardforge.infer.engine_types import EngineConfig
from shardforge.infer.grammar import Constraint
from shardforge.infer.load import load_for_inference
from shardforge.infer.offline import generate_file
from shardforge.infer.runner import EngineRunner
from shardforge.infer.sampling import SamplingError, SamplingParams
from shardforge.infer.server import build_app
from tests.conftest import tiny_chat_model

CONTEXT = 512


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    folder = tmp_path_factory.mktemp("structured") / "tiny"
    return load_for_inference(tiny_chat_model(folder, CONTEXT, hidden=32, layers=1, std=0.3))


@pytest.fixture(scope="module")
def engine(loaded):
    return Engine(
        loaded.model, loaded.tokenizer, EngineConfig(block_size=8, num_blocks=1024), loaded.defaults
    )


def _run(engine, constraints: list[Constraint], max_tokens: int = 160, n: int = 1, **kw) -> list:
    prompt = engine.tokenizer.encode("Give me the answer:")
    params = [
        SamplingParams(
            max_tokens=max_tokens, temperature=0 if i % 3 == 0 else 1.0, seed=i, n=n, constraint=c, **kw
        )
        for i, c in enumerate(constraints)
    ]
    return engine.generate([prompt] * len(constraints), params)


# ---- generated JSON schemas -------------------------------------------------------------------------------
_leaf = st.one_of(
    st.builds(lambda m: {"type": "string", "maxLength": m}, st.integers(0, 6)),
    st.builds(
        lambda lo, w: {"type": "integer", "minimum": lo, "maximum": lo + w},
        st.integers(-50, 50),
        st.integers(0, 999),
    ),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.builds(
        lambda v: {"enum": v},
        st.lists(st.text("abcxyz ", min_size=1, max_size=4), min_size=1, max_size=3, unique=True),
    ),
    st.just({"type": "number", "minimum": 0, "maximum": 10}),
)
_names = st.text("abcdefgh_", min_size=1, max_size=5)


def _object(children):
    def build(props, required_mask):
        required = [k for k, keep in zip(props, required_mask, strict=False) if keep]
        return {"type": "object", "properties": props, "required": required, "additionalProperties": False}

    return st.builds(
        build, st.dictionaries(_names, children, min_size=1, max_size=3), st.lists(st.booleans(), max_size=3)
    )


def _array(children):
    return st.builds(
        lambda items, m: {"type": "array", "items": items, "maxItems": m}, children, st.integers(0, 3)
    )


schemas = st.recursive(_leaf, lambda children: _object(children) | _array(children), max_leaves=5).map(
    lambda s: (
        s if s.get("type") == "object" else {"type": "object", "properties": {"v": s}, "required": ["v"]}
    )
)


@pytest.mark.slow
@settings(
    max_examples=4,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(st.lists(schemas, min_size=5, max_size=5))
def test_every_finished_json_output_validates_against_its_schema(engine, batch):
    outputs = _run(engine, [Constraint("json", json.dumps(s)) for s in batch])
    assert any(c.finish_reason == "stop" for [c] in outputs)  # not only cut answers
    for schema, [completion] in zip(batch, outputs, strict=True):
        if completion.finish_reason == "stop":
            jsonschema.validate(json.loads(completion.text), schema)
        else:  # cut by max_tokens: a prefix the grammar still allows
            assert completion.finish_reason == "length" and completion.text.startswith("{")


def test_json_object_regex_choice_and_grammars_match_whole(engine):
    regex = r"[0-9]{3}-[a-z]{2,4}"
    choices = ["yes", "no", "maybe so"]
    lark = 'start: "(" num ("," num)? ("," num)? ")"\nnum: /[0-9]{1,3}/'
    gbnf = 'root ::= "color: " ("red" | "green" | "blue")'
    kinds = [
        Constraint("json", '{"type": "object"}'),
        Constraint("regex", regex),
        Constraint("choice", json.dumps(choices)),
        Constraint("grammar", lark),
        Constraint("grammar", gbnf),
    ] * 3
    outputs = _run(engine, kinds, max_tokens=120)
    for constraint, [c] in zip(kinds, outputs, strict=True):
        if constraint.kind == "json":
            if c.finish_reason == "stop":
                assert isinstance(json.loads(c.text), dict)
            continue
        assert c.finish_reason == "stop", (constraint, c)
        if constraint.kind == "regex":
            assert re.fullmatch(regex, c.text), c.text
        elif constraint.kind == "choice":
            assert c.text in choices
        elif constraint.spec == lark:
            assert re.fullmatch(r"\([0-9]{1,3}(,[0-9]{1,3}){0,2}\)", c.text), c.text
        else:
            assert c.text in ("color: red", "color: green", "color: blue")


def test_every_completion_of_n_follows_its_own_grammar(engine):
    [completions] = _run(engine, [Constraint("regex", r"a+b")], n=4, max_tokens=40)
    for c in completions:
        assert c.finish_reason == "stop" and re.fullmatch("a+b", c.text), c


def test_min_tokens_holds_while_the_grammar_may_go_on_and_its_end_ends_the_answer(engine):
    """An output the grammar could end anywhere waits for min_tokens before its end token; one the grammar
    completes ends there (nothing else could follow)."""
    [[open_ended], [complete]] = _run(
        engine,
        [Constraint("regex", r"[a-z ]{1,60}"), Constraint("choice", '["ok"]')],
        min_tokens=5,
        max_tokens=40,
    )
    assert len(open_ended.tokens) >= 5 and re.fullmatch("[a-z ]{1,60}", open_ended.text), open_ended
    assert complete.text == "ok" and complete.finish_reason == "stop"


def test_a_padded_vocabulary_never_yields_a_token_past_the_tokenizer(tmp_path):
    """The model's logits are wider than the tokenizer; a bias toward a padding id cannot pick it."""
    from transformers import AutoConfig

    folder = tiny_chat_model(tmp_path / "padded", CONTEXT, hidden=32, layers=1, std=0.3)
    vocab = AutoConfig.from_pretrained(folder).vocab_size
    loaded = load_for_inference(folder)
    engine = Engine(
        loaded.model, loaded.tokenizer, EngineConfig(block_size=8, num_blocks=256), loaded.defaults
    )
    engine.grammars.vocab_size = vocab + 64  # as a model whose embedding is padded past the tokenizer
    logits = __import__("torch").zeros(1, vocab + 64)
    logits[0, vocab + 5] = 100.0
    seq = type("S", (), {})()
    seq.sampler = type("Sm", (), {})()
    seq.sampler.matcher = engine.grammars.matcher(Constraint("regex", "[a-z]+"))
    seq.sampler.params = SamplingParams()
    masked = engine._constrained(logits, [seq])
    assert masked[0, vocab:].eq(float("-inf")).all()
    assert engine.tokenizer.decode([int(masked.argmax())]).isalpha()


@pytest.mark.parametrize(
    "constraint, words",
    [
        (Constraint("regex", "a(", "structured_outputs.regex"), "unclosed group"),
        (Constraint("json", '{"type": "nonsense"}', "structured_outputs.json"), "nonsense"),
        (Constraint("grammar", "start: 'a' |", "structured_outputs.grammar"), "error"),
    ],
)
def test_a_constraint_that_does_not_compile_is_refused_naming_its_field(engine, constraint, words):
    with pytest.raises(SamplingError, match=words) as info:
        engine.check([1, 2], SamplingParams(constraint=constraint))
    assert info.value.param == constraint.param


# ---- the API ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def api(loaded):
    runner = EngineRunner(
        Engine(loaded.model, loaded.tokenizer, EngineConfig(block_size=8, num_blocks=1024), loaded.defaults),
        max_waiting=64,
    )
    client = TestClient(build_app(loaded, runner, "tiny"), raise_server_exceptions=False)
    yield (
        client,
        openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=client, max_retries=0),
    )
    runner.close()


class Person(BaseModel):
    name: str = Field(max_length=8)  # bounded, so a random model's answer ends
    age: int = Field(ge=0, le=150)
    admin: bool


def test_the_openai_client_parses_a_json_schema_answer(api):
    _, client = api
    schema = Person.model_json_schema()
    answer = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "who?"}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": schema, "strict": True},
        },
        max_tokens=200,
        temperature=0,
    )
    choice = answer.choices[0]
    assert choice.finish_reason == "stop"
    Person.model_validate_json(choice.message.content)


def test_json_object_streamed_and_whole_agree(api):
    _, client = api
    ask = dict(model="tiny", messages=[{"role": "user", "content": "json"}], max_tokens=120, temperature=0)
    whole = client.chat.completions.create(response_format={"type": "json_object"}, **ask)
    pieces = client.chat.completions.create(response_format={"type": "json_object"}, stream=True, **ask)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in pieces if chunk.choices)
    assert text == whole.choices[0].message.content
    if whole.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


def test_structured_outputs_extra_on_both_endpoints(api):
    _, client = api
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "pick"}],
        max_tokens=20,
        extra_body={"structured_outputs": {"choice": ["red", "green"]}},
    )
    assert chat.choices[0].message.content in ("red", "green")
    done = client.completions.create(
        model="tiny", prompt="x", max_tokens=20, extra_body={"structured_outputs": {"regex": "[0-9]{4}"}}
    )
    assert re.fullmatch("[0-9]{4}", done.choices[0].text)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "{"}}},
            "response_format.json_schema.schema",
        ),
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
            "response_format",
        ),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "(("}}, "structured_outputs.regex"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
        ({"structured_outputs": {"json": {"type": 3}}}, "structured_outputs.json"),
        ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern"),
        ({"structured_outputs": {"unknown": 1}}, "structured_outputs.unknown"),
        ({"guided_json": {"type": "object"}}, "guided_json"),
        ({"guided_choice": ["a"]}, "guided_choice"),
    ],
)
def test_bad_structured_output_fields_are_400s_naming_the_field(api, body, param):
    http, _ = api
    response = http.post(
        "/v1/chat/completions",
        json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **body},
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.json()


def test_generate_takes_structured_outputs_per_line_and_names_a_bad_one(engine, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    lines = [{"prompt": "x", "structured_outputs": {"regex": "[0-9]{3}"}}, {"prompt": "y", "max_tokens": 5}]
    prompts.write_text("".join(json.dumps(line) + "\n" for line in lines))
    generate_file(engine, prompts, tmp_path / "out.jsonl", SamplingParams(max_tokens=10, temperature=0))
    first = json.loads((tmp_path / "out.jsonl").read_text().splitlines()[0])["completions"][0]
    assert re.fullmatch("[0-9]{3}", first["text"]) and first["finish_reason"] == "stop"
    for bad, words in [
        ({"regex": "(("}, "line 1: structured_outputs.regex"),
        ({"nope": 1}, "nope"),
        ("x", "dict"),
    ]:
        prompts.write_text(json.dumps({"prompt": "x", "structured_outputs": bad}) + "\n")
        with pytest.raises(DataError, match=words):
            generate_file(engine, prompts, tmp_path / "out.jsonl", SamplingParams(max_tokens=10))
