"""`shardforge serve` against the real `openai` client, `generate` on a JSONL file, and `chat` through a
pseudo-terminal: each as a user runs it, in subprocesses, on a tiny random model with the bundled
tokenizer."""

from __future__ import annotations

import contextlib
import json
import os
import pty
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from shardforge.infer.engine import Engine
from shardforge.infer.engine_types import EngineConfig
from shardforge.infer.offline import chat_ids
from shardforge.infer.sampling import SamplingParams
from shardforge.models import load_model
from tests.conftest import REPO, tiny_chat_model

KEY = "test-key"
NO_EOS = {"ignore_eos": True}
ENV = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_chat_model(tmp_path_factory.mktemp("served") / "tiny-chat", 256)


@pytest.fixture(scope="module")
def long_model_dir(tmp_path_factory):
    """The same model with a long context: requests that run for many seconds, to leave or cut off."""
    return tiny_chat_model(tmp_path_factory.mktemp("served") / "tiny-long", 8192)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served(str):
    """The server's base URL, with its process (its pid, its log once stopped)."""

    proc: subprocess.Popen


@contextlib.contextmanager
def _server(model_dir, *flags: str):
    port = _free_port()
    cmd = [sys.executable, "-m", "shardforge", "serve", str(model_dir), "--port", str(port), *flags]
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    base = Served(f"http://127.0.0.1:{port}")
    base.proc = proc
    try:
        deadline = time.time() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                if proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError(f"the server did not start:\n{proc.stdout.read()}") from None
                time.sleep(0.3)
        yield base
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=30)


@pytest.fixture(scope="module")
def server(model_dir):
    with _server(model_dir, "--api-key", KEY, "--served-name", "tiny", "--block-size", "8") as base:
        yield base


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=120)


def _metrics(base: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{base}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {
        line.split()[0]: float(line.split()[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }


def _expected(model_dir, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    engine = Engine(load_model(model_dir), tokenizer, EngineConfig(block_size=8))
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return [c[0].tokens for c in engine.generate(prompts, params)]


def test_models_chat_and_usage(client, model_dir):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    messages = [{"role": "user", "content": "Tell me about the sea."}]
    reply = client.chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=12)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt = chat_ids(tokenizer, messages)
    assert reply.usage.prompt_tokens == len(prompt)
    (expected,) = _expected(model_dir, [prompt], 12)
    assert reply.usage.completion_tokens == len(expected)
    assert reply.choices[0].message.content == tokenizer.decode(expected, skip_special_tokens=True)
    assert reply.choices[0].finish_reason == ("stop" if expected[-1] == tokenizer.eos_token_id else "length")
    # Streamed: the same text in pieces, then the usage chunk.
    stream = client.chat.completions.create(
        model="tiny",
        messages=messages,
        temperature=0,
        max_completion_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reply.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == reply.usage.completion_tokens and not chunks[-1].choices
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == reply.choices[0].finish_reason


def test_completions_n_stop_and_logprobs(client):
    base = client.completions.create(model="tiny", prompt="The sea is", temperature=0, max_tokens=16)
    text = base.choices[0].text
    assert base.usage.completion_tokens == 16 and base.choices[0].finish_reason == "length"
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut = client.completions.create(
        model="tiny", prompt="The sea is", temperature=0, max_tokens=16, stop=[stop]
    )
    assert cut.choices[0].text == text[: text.index(stop)] and cut.choices[0].finish_reason == "stop"
    streamed = client.completions.create(
        model="tiny", prompt="The sea is", temperature=0, max_tokens=16, stop=stop, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == cut.choices[0].text
    many = client.completions.create(
        model="tiny", prompt="The sea is", temperature=1.0, seed=5, n=3, max_tokens=8, extra_body=NO_EOS
    )
    assert sorted(c.index for c in many.choices) == [0, 1, 2] and many.usage.completion_tokens == 24
    again = client.completions.create(
        model="tiny", prompt="The sea is", temperature=1.0, seed=5, n=3, max_tokens=8, extra_body=NO_EOS
    )
    assert [c.text for c in again.choices] == [c.text for c in many.choices]  # seeded: reproducible
    chat = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        temperature=0,
        max_tokens=4,
        logprobs=True,
        top_logprobs=2,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(t.top_logprobs) == 2 for t in content)
    assert all(t.logprob <= 0 and t.top_logprobs[0].logprob >= t.logprob - 1e-6 for t in content)


def test_errors_are_openai_shaped(server, client):
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server}/v1", api_key="wrong", max_retries=0).models.list()
    with pytest.raises(openai.NotFoundError, match="serves 'tiny'"):
        client.completions.create(model="other", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model="tiny", prompt="x", max_tokens=2, temperature=-1)
    with pytest.raises(openai.BadRequestError, match="top_p"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], top_p=3)
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    with pytest.raises(openai.BadRequestError, match=r"tiny reads no images \(a text model"):
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": [{"type": "text", "text": "x"}, image]}]
        )
    with pytest.raises(openai.BadRequestError, match="context") as info:
        client.completions.create(model="tiny", prompt="word " * 400, max_tokens=2)
    assert info.value.code == "context_length_exceeded" and info.value.param == "prompt"
    request = urllib.request.Request(
        f"{server}/v1/completions", data=b"{not json", headers={"Authorization": f"Bearer {KEY}"}
    )
    with pytest.raises(urllib.error.HTTPError) as bad:
        urllib.request.urlopen(request, timeout=10)
    assert bad.value.code == 400 and "error" in json.loads(bad.value.read())
    assert (
        client.completions.create(model="tiny", prompt="still up", max_tokens=2).usage.completion_tokens == 2
    )


def _rss_kib(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmRSS")).split()[1])


def test_64_concurrent_clients_get_their_own_answers(model_dir):
    """Each answer equals the same prompt's answer alone; nothing in the log; memory back where it was."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [f"Question number {i}: what is {i} plus {i}?" for i in range(64)]
    expected = _expected(model_dir, [tokenizer(p)["input_ids"] for p in prompts], 10)
    with _server(model_dir, "--served-name", "tiny", "--block-size", "8") as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=120)

        def ask(i: int) -> str:
            reply = client.completions.create(model="tiny", prompt=prompts[i], temperature=0, max_tokens=10)
            return reply.choices[0].text

        ask(0)
        first = _rss_kib(base.proc.pid)
        with ThreadPoolExecutor(64) as pool:
            for _ in range(2):
                answers = list(pool.map(ask, range(64)))
                assert answers == [tokenizer.decode(e, skip_special_tokens=True) for e in expected]
        after = _rss_kib(base.proc.pid)
        metrics = _metrics(base)
        assert metrics["shardforge_time_to_first_token_seconds_count"] >= 129
        assert metrics['shardforge_requests_total{status="finished"}'] >= 129
        base.proc.send_signal(signal.SIGTERM)
        log = base.proc.communicate(timeout=60)[0]
    assert after <= 1.1 * first, (first, after)
    assert "error" not in log.lower() and "traceback" not in log.lower(), log


def _long_request(base: str, stream: bool, timeout: float):
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=timeout)
    return client.completions.create(
        model="tiny",
        prompt="A long story:",
        max_tokens=6000,
        temperature=1.0,
        stream=stream,
        extra_body=NO_EOS,
    )


def test_clients_that_leave_free_their_blocks(long_model_dir):
    """8 streaming clients leave after two chunks and 8 others time out waiting for a whole answer: every
    request is aborted, not run to its end, and its KV blocks freed (from /metrics)."""
    with _server(long_model_dir, "--served-name", "tiny") as base:
        together = threading.Event()

        def streaming(_):
            stream = _long_request(base, True, 60)
            for i, _chunk in enumerate(stream):
                if i == 2:
                    break
            together.wait(timeout=60)
            stream.close()

        def waiting(_):
            with pytest.raises(openai.APITimeoutError):
                _long_request(base, False, 5.0)

        with ThreadPoolExecutor(16) as pool:
            futures = [pool.submit(streaming, i) for i in range(8)] + [
                pool.submit(waiting, i) for i in range(8)
            ]
            deadline = time.time() + 60
            while _metrics(base)["shardforge_running"] < 16:  # all running together before any leaves
                assert time.time() < deadline, _metrics(base)
                time.sleep(0.05)
            together.set()
            for future in futures:
                future.result()
        deadline = time.monotonic() + 120  # only stops a hang: blocks never freed
        # the gauges come from the engine thread, the counter from the output thread a moment later
        while (
            (m := _metrics(base))["shardforge_kv_blocks_in_use"] > 0
            or m["shardforge_running"] > 0
            or m['shardforge_requests_total{status="aborted"}'] < 16
        ):
            assert time.monotonic() < deadline, f"still held after the clients left: {m}"
            time.sleep(0.05)
        assert m['shardforge_requests_total{status="aborted"}'] == 16, m
        assert m.get('shardforge_requests_total{status="finished"}', 0) == 0, m  # none ran to its end
        assert m["shardforge_generation_tokens_total"] < 16 * 6000, m


def test_health_answers_while_generations_and_a_tokenization_are_in_flight(long_model_dir):
    """16 streams decoding and long prompts being tokenized: /health is not held up by either. Checked by
    order, not by a clock: one /health after another (each sent once the previous one came back) is
    answered many times over before the long prompts get their own answer, and while all 16 generations
    are still running. An event loop that the tokenizer held would answer at most the one /health waiting
    on it before the long prompts' answer."""
    with _server(long_model_dir, "--served-name", "tiny") as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=120)
        streams = [_long_request(base, True, 60) for _ in range(16)]
        for stream in streams:
            next(iter(stream))

        def big_prompts():
            with pytest.raises(openai.APIStatusError) as info:  # tokenized, then too long for the context
                client.completions.create(model="tiny", prompt=["lorem ipsum " * 20_000] * 4, max_tokens=2)
            return info.value.status_code

        with ThreadPoolExecutor(1) as pool:
            big = pool.submit(big_prompts)
            answered, before_big = 0, 0
            while not big.done():
                with urllib.request.urlopen(f"{base}/health", timeout=60) as r:
                    assert r.status == 200
                answered += 1
                before_big += not big.done()  # this answer came while the long prompts still had none
            assert big.result() == 400
        running = _metrics(base)["shardforge_running"]
        for stream in streams:
            stream.close()
    assert before_big >= 20, (before_big, answered)
    assert running == 16  # after the last /health answer, every generation was still in flight


def test_sigterm_cuts_in_flight_requests_after_the_grace_and_exits_0(long_model_dir):
    """A stream is cut and a whole answer is a 503 in the API's shape once the grace is over; exit 0, and no
    traceback in the log."""
    with _server(long_model_dir, "--served-name", "tiny", "--shutdown-grace", "1") as base:
        stream = _long_request(base, True, 60)
        next(iter(stream))
        with ThreadPoolExecutor(1) as pool:
            whole = pool.submit(_long_request, base, False, 60)
            deadline = time.time() + 30
            while _metrics(base)["shardforge_running"] < 2:
                assert time.time() < deadline
                time.sleep(0.05)
            sent = time.monotonic()
            base.proc.send_signal(signal.SIGTERM)
            chunks = []
            with contextlib.suppress(openai.APIError, httpx.HTTPError):
                for chunk in stream:  # the stream is cut once the grace is over
                    chunks.append(chunk)
            cut = time.monotonic() - sent
            with pytest.raises(openai.APIStatusError) as info:
                whole.result()
        assert info.value.status_code == 503 and "shutting down" in info.value.message
        assert base.proc.wait(timeout=30) == 0  # the timeout only stops a hang
        log = base.proc.stdout.read()
    assert not any(c.choices[0].finish_reason for c in chunks)  # cut, never ended
    # The grace: the server cuts no earlier than 1 s after the signal. A lower bound that the server's own
    # contract sets, which no slowness of this machine can fail (no upper bound is asserted).
    assert cut >= 1.0, cut
    assert "traceback" not in log.lower(), log


def test_a_chunked_body_over_the_limit_gets_413(model_dir):
    with _server(model_dir, "--served-name", "tiny") as base:
        host, port = base.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n"
            )
            chunk = b"%x\r\n%s\r\n" % (1 << 20, b" " * (1 << 20))
            with contextlib.suppress(OSError):  # the server may close before the rest is sent
                for _ in range(20):
                    sock.sendall(chunk)
            answer = sock.recv(65536)
        assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
        assert _metrics(base)["shardforge_prompt_tokens_total"] == 0


def test_a_full_queue_answers_429(model_dir):
    with _server(model_dir, "--max-running", "1", "--max-waiting", "1", "--served-name", "tiny") as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=120)

        def ask(_):
            try:
                client.completions.create(model="tiny", prompt="go", max_tokens=64, extra_body=NO_EOS)
                return 200, None
            except openai.RateLimitError as exc:
                return 429, exc.response.headers.get("retry-after")

        with ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(ask, range(6)))
        assert (429, "1") in answers and (200, None) in answers


def test_serve_beyond_loopback_needs_a_key(model_dir):
    proc = subprocess.run(
        [sys.executable, "-m", "shardforge", "serve", str(model_dir), "--host", "0.0.0.0"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env=ENV,
    )
    assert proc.returncode == 2 and "--api-key" in proc.stderr


def test_generate_writes_every_prompt(model_dir, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    rows = [{"id": "a", "prompt": "The sea"}, {"id": "b", "messages": [{"role": "user", "content": "hi"}]}]
    rows.append({"id": "c", "prompt_ids": [5, 6, 7], "max_tokens": 3})
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out.jsonl"
    cmd = [sys.executable, "-m", "shardforge", "generate", str(model_dir), "--prompts", str(prompts)]
    cmd += ["--out", str(out), "--temperature", "0", "--max-tokens", "6"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO, env=ENV)
    assert proc.returncode == 0, proc.stderr
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in results] == ["a", "b", "c"]
    assert len(results[2]["completions"][0]["tokens"]) == 3
    assert all(1 <= len(r["completions"][0]["tokens"]) <= 6 for r in results)
    prompts.write_text('{"id": "x"}\n')
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO, env=ENV)
    assert proc.returncode == 2 and f"{prompts}:1" in proc.stderr and "prompt" in proc.stderr


@pytest.mark.parametrize("flags", [[], ["--tp", "2"]], ids=["one-process", "tp2"])
def test_chat_in_a_terminal(model_dir, flags):
    """One exchange, /reset, and end of input, through a pseudo-terminal (rank 0 reads it under --tp 2)."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: the chat command on the terminal
        os.chdir(REPO)
        cmd = [
            sys.executable,
            "-m",
            "shardforge",
            "chat",
            str(model_dir),
            "--temperature",
            "0",
            "--max-tokens",
            "8",
            *flags,
        ]
        os.execve(sys.executable, cmd, ENV)
    screen = ""

    def read_until(marker: str, timeout: float = 120) -> str:
        nonlocal screen
        deadline = time.time() + timeout
        while marker not in screen:
            assert time.time() < deadline, f"no {marker!r} on the screen:\n{screen}"
            ready, _, _ = select.select([fd], [], [], 1)
            if ready:
                screen += os.read(fd, 4096).decode(errors="replace")
        at = screen.index(marker) + len(marker)
        seen, screen = screen[:at], screen[at:]
        return seen

    try:
        read_until("> ")
        os.write(fd, b"hello there\n")
        reply = read_until("> ")
        assert "hello there" in reply and len(reply.strip()) > len("hello there")
        os.write(fd, b"/reset\n")
        assert "(conversation reset)" in read_until("> ")
        os.write(fd, b"\x04")  # Ctrl-D: end of input
        rest = screen
        with contextlib.suppress(OSError):  # the terminal's last output, until the command closes it (EIO)
            while chunk := os.read(fd, 4096):
                rest += chunk.decode(errors="replace")
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, (
            f"exit {os.waitstatus_to_exitcode(status)}:\n{rest[-3000:]}"
        )
    finally:
        with contextlib.suppress(ProcessLookupError, ChildProcessError):
            os.kill(pid, 9)
            os.waitpid(pid, 0)


def test_generate_under_tp_equals_one_process(model_dir, tmp_path):
    """`--tp 2`: two ranks, the training TP plan, rank 0 driving; `--tp 4` over the model's 2 kv heads, which
    each pair of ranks replicates: greedy tokens equal one process's."""
    prompts = tmp_path / "prompts.jsonl"
    rows = [{"prompt_ids": list(range(5 + 7 * i, 20 + 9 * i))} for i in range(4)]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    outputs = []
    for flags in ([], ["--tp", "2"], ["--tp", "4"]):
        out = tmp_path / f"out{'-'.join(flags)}.jsonl"
        cmd = [sys.executable, "-m", "shardforge", "generate", str(model_dir), "--prompts", str(prompts)]
        cmd += ["--out", str(out), "--temperature", "0", "--max-tokens", "12", *flags]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO, env=ENV)
        assert proc.returncode == 0, proc.stderr[-3000:]
        ranks = f"over {flags[-1]} tensor-parallel ranks" if flags else "tensor-parallel ranks"
        assert (ranks in proc.stdout) == bool(flags)
        outputs.append(
            [json.loads(line)["completions"][0]["tokens"] for line in out.read_text().splitlines()]
        )
    assert outputs[0] == outputs[1] == outputs[2] and all(len(t) >= 1 for t in outputs[0])
