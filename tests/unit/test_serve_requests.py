"""The server's answer to every request body a client may send, in-process (the ASGI app over a tiny model):
generated bodies never get a 5xx and never hang, and each field is checked as the OpenAI API documents it,
with its name as the error's `param`."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai.types import completion_create_params as completion_params
from openai.types.chat import completion_create_params as chat_params
from starlette.testclient import TestClient

from shardforge.infer import server
from shardforge.infer.engine import Engine
from shardforge.infer.engine_types import EngineConfig
from shardforge.infer.http import MAX_BODY_BYTES
from shardforge.infer.load import load_for_inference
from shardforge.infer.protocol import MAX_MESSAGES, ChatRequest, CompletionRequest
from shardforge.infer.runner import EngineRunner, Unavailable
from shardforge.infer.sampling import SamplingParams
from shardforge.infer.server import build_app
from tests.conftest import tiny_chat_model

CONTEXT = 96
GEMMA_LIKE = (  # Gemma's and Mistral's templates refuse a system turn / roles that do not alternate
    "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    folder = tmp_path_factory.mktemp("requests") / "tiny"
    return load_for_inference(tiny_chat_model(folder, CONTEXT, hidden=32, layers=1, std=0.3))


@pytest.fixture(scope="module")
def runner(loaded):
    config = EngineConfig(block_size=8, num_blocks=512)
    runner = EngineRunner(Engine(loaded.model, loaded.tokenizer, config, loaded.defaults), max_waiting=64)
    yield runner
    runner.close()


@pytest.fixture(scope="module")
def app(loaded, runner):
    return build_app(loaded, runner, "tiny")


@pytest.fixture(scope="module")
def client(app):
    return TestClient(app, raise_server_exceptions=False)


def _chat(client, **fields):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **fields}
    return client.post("/v1/chat/completions", json=body)


def _completion(client, **fields):
    return client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 4, **fields})


def _refused(response, param: str, status: int = 400) -> str:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert error["type"] and error["message"]
    return error["message"]


def _spy(monkeypatch, name: str) -> list:
    """The calls the server makes to one of the helpers it imported (infer/server.py's module globals)."""
    calls = []
    real = getattr(server, name)
    monkeypatch.setattr(server, name, lambda *args, **kwargs: calls.append(args) or real(*args, **kwargs))
    return calls


# ---- generated bodies -------------------------------------------------------------------------------------
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
wild = (
    json_values
    | st.sampled_from([2**63 - 1, 2**63, -(2**63), 10**30, "0.5", "true", 1e308, -1e308, -1, 0, 21, 129])
    | st.dictionaries(st.integers(-5, 2000).map(str), st.floats(-150, 150), max_size=3)
)
plausible = {  # values a client may well send; each field is sometimes wild instead
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "n": st.integers(1, 4),
    "stop": st.text(min_size=1, max_size=3) | st.lists(st.text(min_size=1, max_size=3), max_size=3),
    "seed": st.integers(-(2**63), 2**63 - 1),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "logit_bias": st.dictionaries(st.integers(0, 1023).map(str), st.floats(-100, 100), max_size=3),
    "top_k": st.integers(-1, 50),
    "min_p": st.floats(0, 1),
    "repetition_penalty": st.floats(0.5, 2),
    "min_tokens": st.integers(0, 8),
    "ignore_eos": st.booleans(),
    "stop_token_ids": st.lists(st.integers(0, 1023), max_size=3),
    "user": st.text(max_size=8),
    "max_tokens": st.integers(1, 12),
    "max_completion_tokens": st.integers(1, 12),
    "logprobs": st.booleans() | st.integers(0, 5),
    "top_logprobs": st.integers(0, 5),
    "echo": st.booleans(),
    "response_format": st.just({"type": "text"}),
    "tools": st.just([]),
    "best_of": st.just(1),
    "metadata": st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=2),
    "store": st.booleans(),
}
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user"] * 6 + ["assistant", "system", "tool", "wizard", 3])},
    optional={
        "content": st.text(max_size=30)
        | st.text(max_size=30)
        | st.none()
        | st.lists(
            st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]), "text": json_values})
        )
        | json_values
    },
)
fields = {name: st.sampled_from([good] * 9 + [wild]).flatmap(lambda s: s) for name, good in plausible.items()}
model = st.sampled_from(["tiny"] * 8 + ["other", 7])
chat_bodies = st.fixed_dictionaries(
    {"model": model, "messages": st.lists(message, min_size=1, max_size=3) | json_values}, optional=fields
)
prompts = (
    st.text(max_size=30)
    | st.lists(st.integers(-2, 1100), max_size=6)
    | st.lists(st.lists(st.integers(0, 1023), max_size=3), max_size=2)
    | json_values
)
completion_bodies = st.fixed_dictionaries({"model": model, "prompt": prompts}, optional=fields)
requests = (
    st.tuples(st.just("/v1/chat/completions"), chat_bodies)
    | st.tuples(st.just("/v1/completions"), completion_bodies)
    | st.tuples(st.sampled_from(["/v1/chat/completions", "/v1/completions"]), json_values)
)


@settings(
    max_examples=300,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(request=requests)
def test_generated_bodies_never_get_a_5xx_or_hang(client, request):
    path, body = request
    response = client.post(path, content=json.dumps(body))  # a hang is the suite's timeout (pyproject.toml)
    assert response.status_code < 500, (body, response.text)
    if response.status_code >= 400:
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    elif "text/event-stream" in response.headers["content-type"]:
        assert response.text.rstrip().endswith("data: [DONE]")
    else:
        assert response.json()["choices"] is not None
    assert client.get("/health").json() == {"status": "ok"}


@settings(max_examples=60, deadline=None, derandomize=True)
@given(raw=st.binary(max_size=64) | st.text(max_size=64).map(str.encode))
def test_bytes_that_are_not_json_get_a_400(client, raw):
    response = client.post("/v1/chat/completions", content=raw)
    assert response.status_code in (400, 404), raw


# ---- named cases ------------------------------------------------------------------------------------------
def test_json_nested_50000_deep_is_a_400(client):
    response = client.post("/v1/chat/completions", content=b'{"model": "tiny", "x": ' + b"[" * 50_000)
    assert "not valid JSON" in _refused(response, "body")
    nested = b'{"model": "tiny", "messages": [{"role": "user", "content": "hi", "x": ' + b"[" * 5000
    response = client.post("/v1/chat/completions", content=nested + b"]" * 5000 + b"}]}")
    assert response.status_code == 400


@pytest.mark.parametrize("seed", [2**63 - 1, -(2**63), 9_300_000_000_000, 0])
def test_any_int64_seed_samples_and_repeats(client, seed):
    first = _completion(client, seed=seed, temperature=1.0, max_tokens=6, ignore_eos=True)
    assert first.status_code == 200, first.text
    again = _completion(client, seed=seed, temperature=1.0, max_tokens=6, ignore_eos=True)
    assert first.json()["choices"][0]["text"] == again.json()["choices"][0]["text"]


def test_a_seed_beyond_int64_is_refused_by_name(client):
    _refused(_completion(client, seed=2**63, temperature=1.0), "seed")


def test_a_template_that_refuses_the_messages_is_a_400_naming_them(client, loaded):
    original = loaded.tokenizer.chat_template
    loaded.tokenizer.chat_template = GEMMA_LIKE
    try:
        system = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
        assert "System role not supported" in _refused(_chat(client, messages=system), "messages")
        twice = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
        assert "alternate" in _refused(_chat(client, messages=twice), "messages")
        assert _chat(client).status_code == 200
    finally:
        loaded.tokenizer.chat_template = original


def _greedy_tokens(client, **fields) -> list[str]:
    response = _completion(
        client, prompt=[5, 6, 7], temperature=0, max_tokens=5, ignore_eos=True, logprobs=0, **fields
    )
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["logprobs"]["tokens"]


def test_logit_bias_is_applied(client, loaded):
    plain = _greedy_tokens(client)
    first = loaded.tokenizer.convert_tokens_to_ids(loaded.tokenizer.tokenize(plain[0]))[0]
    banned = _greedy_tokens(client, logit_bias={str(first): -100})
    assert plain[0] not in banned, (plain, banned)
    forced = _greedy_tokens(client, logit_bias={"42": 100})
    assert forced == [loaded.tokenizer.decode([42])] * 5
    seeded = _completion(
        client, temperature=1.0, seed=3, logit_bias={"42": 100}, max_tokens=4, ignore_eos=True
    )
    assert seeded.json()["choices"][0]["text"] == loaded.tokenizer.decode([42] * 4)


@pytest.mark.parametrize("bias", [{"1024": 1}, {"-1": 1}, {"abc": 1}, {"5": 101}, {"5": -100.5}], ids=str)
def test_a_bad_logit_bias_is_refused_by_name(client, bias):
    _refused(_chat(client, logit_bias=bias), "logit_bias")


def test_top_logprobs_is_checked_under_its_own_name(client):
    assert "logprobs" in _refused(_chat(client, top_logprobs=2), "top_logprobs")
    assert "[0, 20]" in _refused(_chat(client, logprobs=True, top_logprobs=21), "top_logprobs")
    response = _chat(client, logprobs=True, top_logprobs=3)
    assert len(response.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == 3


def test_min_tokens_is_checked_against_max_tokens_and_the_context(client):
    _refused(_chat(client, min_tokens=5, max_tokens=4), "min_tokens")
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "min_tokens": 10_000}
    assert "context" in _refused(client.post("/v1/chat/completions", json=body), "min_tokens")


def test_max_tokens_is_filled_from_the_context(client, loaded):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "ignore_eos": True}
    response = client.post("/v1/chat/completions", json=body).json()
    usage = response["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == CONTEXT
    assert response["choices"][0]["finish_reason"] == "length"
    too_many = _chat(client, max_tokens=CONTEXT)
    assert (
        "context" in _refused(too_many, "max_tokens")
        and too_many.json()["error"]["code"] == "context_length_exceeded"
    )


@pytest.mark.parametrize("prompt", [[], [[]], [[1, 2], []]], ids=str)
def test_an_empty_prompt_is_refused(client, prompt):
    _refused(_completion(client, prompt=prompt), "prompt")


@pytest.mark.parametrize(
    "field, value",
    [
        ("audio", {"voice": "alloy"}),
        ("reasoning_effort", "high"),
        ("moderation", {"input": {"mode": "block"}}),
    ],
)
def test_an_unimplemented_field_is_refused_by_name(client, field, value):
    assert "not supported" in _refused(_chat(client, **{field: value}), field)


def test_neutral_values_of_unimplemented_fields_are_accepted(client):
    assert _chat(client, response_format={"type": "text"}, tools=[], tool_choice="none").status_code == 200
    assert _completion(client, best_of=1, suffix="").status_code == 200
    _refused(_completion(client, suffix="!"), "suffix")
    _refused(_completion(client, best_of=3), "best_of")


@pytest.mark.parametrize(
    "field, value",
    [("temperature", "0.5"), ("stream", "yes"), ("n", 1.5), ("max_tokens", True), ("stop", 3), ("seed", "1")],
)
def test_values_of_the_wrong_type_are_refused_by_name(client, field, value):
    _refused(_chat(client, **{field: value}), field)


def test_an_unknown_role_is_refused_by_name(client):
    _refused(_chat(client, messages=[{"role": "wizard", "content": "hi"}]), "messages.0.role")


def test_bodies_over_the_limit_are_refused_while_read(client):
    chunk = b" " * (1 << 20)

    def chunks():
        for _ in range(MAX_BODY_BYTES // len(chunk) + 2):
            yield chunk

    assert client.post("/v1/completions", content=chunks()).status_code == 413
    response = client.post(
        "/v1/completions", content=b"{}", headers={"content-length": str(MAX_BODY_BYTES + 1)}
    )
    assert response.status_code == 413


def test_a_prompt_that_cannot_fit_is_refused_without_tokenizing(client, monkeypatch):
    tokenized = _spy(monkeypatch, "token_ids")
    response = _completion(client, prompt="word " * 1_000_000)
    assert _refused(response, "prompt") and response.json()["error"]["code"] == "context_length_exceeded"
    assert tokenized == []
    assert _completion(client, prompt="word " * 4).status_code == 200 and len(tokenized) == 1  # the spy sees


# ---- found by an adversarial client ----------------------------------------------------------------------
def test_min_tokens_with_every_token_a_stop_token_is_refused_and_the_engine_lives(client):
    every = list(range(1024))
    response = _completion(client, temperature=1.0, min_tokens=1, max_tokens=3, stop_token_ids=every)
    _refused(response, "stop_token_ids")
    assert client.get("/health").status_code == 200 and _completion(client).status_code == 200


def test_a_stopped_engine_answers_503_in_the_apis_shape(client, runner):
    runner.error = RuntimeError("boom")
    try:
        response = _chat(client)
        assert response.status_code == 503 and response.json()["error"]["type"] == "service_unavailable"
        assert client.get("/health").status_code == 503
    finally:
        runner.error = None


@pytest.mark.parametrize(
    "key",
    ["\u00b2", "\u0663", "9" * 5000, "1e3", " 5"],
    ids=["superscript", "arabic", "long", "float", "space"],
)
def test_logit_bias_keys_are_ascii_token_ids(client, key):
    _refused(_chat(client, logit_bias={key: 1}), "logit_bias")


def test_more_prompts_than_the_queue_holds_is_a_400_not_a_429(client):
    assert "--max-waiting" in _refused(_completion(client, prompt=[[5]] * 65), "prompt")


def test_lists_a_client_sends_are_bounded(client, monkeypatch):
    templated = _spy(monkeypatch, "chat_text")
    many = [{"role": "user", "content": "x"}] * 200_000
    assert str(MAX_MESSAGES) in _refused(_chat(client, messages=many), "messages")
    assert templated == []  # refused as read, before the chat template saw a message
    assert _chat(client).status_code == 200 and len(templated) == 1  # the spy sees a chat that is templated
    _refused(_chat(client, stop=[f"s{i}" for i in range(17)]), "stop")
    _refused(_chat(client, stop="x" * 257), "stop")
    _refused(_chat(client, logit_bias={str(i): 1 for i in range(1025)}), "logit_bias")


def test_streamed_completions_carry_logprobs_and_the_echo(client):
    whole = _completion(
        client, prompt="hello", temperature=0, max_tokens=4, ignore_eos=True, logprobs=1
    ).json()
    body = {"model": "tiny", "prompt": "hello", "temperature": 0, "max_tokens": 4, "ignore_eos": True}
    chunks = [
        json.loads(line[6:])
        for line in client.post(
            "/v1/completions", json={**body, "stream": True, "logprobs": 1}
        ).text.splitlines()
        if line.startswith("data: {")
    ]
    tokens = [t for c in chunks for t in c["choices"][0]["logprobs"]["tokens"]]
    offsets = [o for c in chunks for o in c["choices"][0]["logprobs"]["text_offset"]]
    assert tokens == whole["choices"][0]["logprobs"]["tokens"]
    assert offsets == whole["choices"][0]["logprobs"]["text_offset"]
    echoed = client.post("/v1/completions", json={**body, "stream": True, "echo": True}).text
    first = json.loads(echoed.splitlines()[0][6:])
    assert first["choices"][0]["text"].startswith("hello")
    _refused(_completion(client, echo=True, logprobs=1), "echo")


def test_errors_name_the_field_the_client_sent(client):
    _refused(_chat(client, max_completion_tokens=0), "max_completion_tokens")
    _refused(_completion(client, prompt=""), "prompt")
    _refused(_completion(client, prompt=["a", ""]), "prompt")
    _refused(_completion(client, prompt=[5] * CONTEXT), "prompt")
    _refused(_completion(client, max_tokens=100_000), "max_tokens")
    _refused(_chat(client, stream_options={"include_usage": True}), "stream_options")


def test_a_tiny_temperature_is_greedy(client):
    def text(**fields):
        return _completion(client, prompt="hello", max_tokens=6, ignore_eos=True, **fields).json()["choices"][
            0
        ]["text"]

    assert text(temperature=1e-45) == text(temperature=1e-300) == text(temperature=0)


def test_routing_errors_are_the_apis_json(client):
    for method, path, status in (("get", "/v1/chat/completions", 405), ("post", "/v1/nothing", 404)):
        response = getattr(client, method)(path)
        assert response.status_code == status and set(response.json()["error"]) >= {"message", "type"}
    assert client.get("/v1/models/tiny").json()["id"] == "tiny"
    assert client.get("/v1/models/other").json()["error"]["code"] == "model_not_found"
    assert client.head("/health").status_code == 200 and client.head("/v1/models").status_code == 200


@pytest.mark.parametrize(
    "params, body",
    [
        (chat_params.CompletionCreateParamsBase, ChatRequest),
        (completion_params.CompletionCreateParamsBase, CompletionRequest),
    ],
    ids=["chat", "completions"],
)
def test_every_field_the_openai_client_sends_is_declared(params, body):
    """The anchor's own list: each request field of the openai package's types is validated here (used,
    refused by name, or accepted as having no effect), never ignored as unknown."""
    assert set(params.__annotations__) - set(body.model_fields) == set()


def test_a_stop_string_found_on_the_output_thread_ends_the_completion_in_the_engine(client, runner):
    """Text is made on the runner's output thread; a stop string it finds finishes the completion in the
    engine (through the inbox): the answer is cut before it, n=2 completions both end, nothing is held."""
    free = _completion(client, max_tokens=24, temperature=0.0, ignore_eos=True).json()["choices"][0]["text"]
    stop = free[len(free) // 2 : len(free) // 2 + 2]
    assert stop.strip(), free
    cut = _completion(client, max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop], n=2).json()
    for choice in cut["choices"]:
        assert choice["text"] == free[: free.index(stop)] and choice["finish_reason"] == "stop"
    deadline = time.monotonic() + 60  # only stops a hang: the engine frees the blocks on its next step
    while runner.stats.blocks_used and time.monotonic() < deadline:
        time.sleep(0.02)
    assert runner.stats.blocks_used == 0 and runner.stats.running == 0


def test_an_error_on_the_output_thread_fails_requests_instead_of_hanging_them(loaded):
    """Text is made on the runner's output thread: if making it raises (a tokenizer bug), the open request
    ends at once, the engine stops, and new requests are refused as unavailable."""

    class Broken:
        eos_token_id = loaded.tokenizer.eos_token_id

        def decode(self, *args, **kwargs):
            raise ValueError("a tokenizer bug")

    engine = Engine(loaded.model, Broken(), EngineConfig(block_size=8, num_blocks=64), loaded.defaults)
    runner = EngineRunner(engine)

    async def ask():
        stream = runner.submit("r", [1, 2, 3], SamplingParams(max_tokens=4), asyncio.get_running_loop())
        return [u async for u in stream]

    try:
        assert asyncio.run(asyncio.wait_for(ask(), timeout=10)) == []
        assert isinstance(runner.error, ValueError)
        with pytest.raises(Unavailable):
            runner.submit("s", [1, 2, 3], SamplingParams(max_tokens=4), None)
    finally:
        runner.close()
    assert not runner.thread.is_alive() and not runner.output_thread.is_alive()


def test_one_stop_string_is_bounded_by_its_characters_not_the_list_bound(client):
    """A plain string `stop` of 17-256 characters is one stop string (the 16 bounds a list of them)."""
    assert _completion(client, stop="0123456789abcdefg").status_code == 200
    assert _chat(client, stop="x" * 256).status_code == 200
    _refused(_chat(client, stop="x" * 257), "stop")


def test_a_request_is_counted_before_its_client_hears_it_ended(loaded):
    """/metrics agrees with what clients saw: the runner counts a request's end (`on_finish`) before it
    wakes the client, so a client that has its answer and then reads /metrics finds it counted."""
    ended: list[str] = []
    seen_before_count: list[bool] = []
    loops: list[asyncio.AbstractEventLoop] = []
    config = EngineConfig(block_size=8, num_blocks=64)
    runner = EngineRunner(Engine(loaded.model, loaded.tokenizer, config, loaded.defaults))

    async def ask():
        loop = asyncio.get_running_loop()
        loops.append(loop)
        stream = runner.submit("r", [1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True), loop)
        updates = [u async for u in stream]
        ended.append("client")
        return updates

    def counted(timing):
        # Let the client's event loop run all it had been handed by now, and all that handed on in turn (the
        # end of its stream put in its queue, the queue waking the task, the task ending): callbacks run in
        # the order they were scheduled, so once three rounds of our own have run, a client that had been
        # woken before this count has ended. No sleep: the verdict does not depend on the machine's speed.
        for _ in range(3):
            drained = threading.Event()
            loops[0].call_soon_threadsafe(drained.set)
            assert drained.wait(timeout=60), "the client's event loop did not run"
        seen_before_count.append(bool(ended))
        ended.append(timing.reason)

    runner.on_finish = counted
    try:
        assert len(asyncio.run(asyncio.wait_for(ask(), timeout=30))) > 0
    finally:
        runner.close()
    assert seen_before_count == [False] and ended == ["finished", "client"]
