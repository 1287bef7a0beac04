"""An OpenAI-compatible HTTP API over the engine (FastAPI + uvicorn): /v1/models, /v1/chat/completions,
/v1/completions (streamed as server-sent events or whole), /health and /metrics (Prometheus). Concurrent
requests are batched together by the engine; errors are OpenAI-shaped JSON and never stop the server."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import ValidationError

from shardforge.errors import ConfigError
from shardforge.infer.engine import RequestError, TooLong, Update
from shardforge.infer.load import Loaded
from shardforge.infer.offline import chat_ids
from shardforge.infer.protocol import ChatRequest, CompletionRequest, validation_message
from shardforge.infer.runner import EngineRunner, QueueFull, Timing
from shardforge.infer.sampling import SamplingError

MAX_BODY_BYTES = 8 << 20


class APIError(Exception):
    def __init__(
        self, status: int, message: str, kind: str, param: str | None = None, code: str | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code

    def response(self) -> JSONResponse:
        body = {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}
        return JSONResponse({"error": body}, status_code=self.status)


class Metrics:
    def __init__(self, runner: EngineRunner) -> None:
        self.registry = registry = CollectorRegistry()
        self.requests = Counter("shardforge_requests", "Requests by outcome", ["status"], registry=registry)
        self.prompt_tokens = Counter("shardforge_prompt_tokens", "Prompt tokens taken", registry=registry)
        self.output_tokens = Counter("shardforge_generation_tokens", "Tokens generated", registry=registry)
        self.ttft = Histogram(
            "shardforge_time_to_first_token_seconds",
            "Time from arrival to the first token",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=registry,
        )
        self.tpot = Histogram(
            "shardforge_time_per_output_token_seconds",
            "Time per output token after the first",
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
            registry=registry,
        )
        engine = runner.engine
        for name, doc, read in (
            ("shardforge_queue_length", "Requests waiting", lambda: len(engine.scheduler.waiting)),
            ("shardforge_running", "Sequences running", lambda: len(engine.scheduler.running)),
            ("shardforge_kv_blocks_in_use", "KV cache blocks in use", lambda: engine.blocks.in_use),
            ("shardforge_kv_blocks_total", "KV cache blocks", lambda: engine.blocks.num_blocks),
        ):
            Gauge(name, doc, registry=registry).set_function(read)

    def finished(self, timing: Timing) -> None:
        self.output_tokens.inc(timing.tokens)
        if timing.first is not None:
            self.ttft.observe(timing.first - timing.arrived)
            if timing.tokens > 1 and timing.last is not None:
                self.tpot.observe((timing.last - timing.first) / (timing.tokens - 1))


def build_app(loaded: Loaded, runner: EngineRunner, served_name: str, api_key: str | None = None) -> FastAPI:
    app = FastAPI(title="shardforge", docs_url=None, redoc_url=None)
    tokenizer = loaded.tokenizer
    metrics = Metrics(runner)
    runner.on_finish = metrics.finished
    created = int(time.time())

    @app.middleware("http")
    async def guard(request: Request, call_next):
        """Auth and body size for every /v1 route; APIError -> its JSON."""
        try:
            if request.url.path.startswith("/v1/"):
                if api_key is not None and request.headers.get("authorization") != f"Bearer {api_key}":
                    raise APIError(
                        401, "missing or wrong API key", "authentication_error", code="invalid_api_key"
                    )
                size = int(request.headers.get("content-length") or 0)
                if size > MAX_BODY_BYTES:
                    raise APIError(
                        413, f"the body has {size} bytes; at most {MAX_BODY_BYTES}", "invalid_request_error"
                    )
            return await call_next(request)
        except APIError as exc:
            return exc.response()

    @app.get("/health")
    async def health() -> dict:
        if runner.error is not None:
            return JSONResponse({"status": "error", "error": repr(runner.error)}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics_text() -> PlainTextResponse:
        return PlainTextResponse(
            generate_latest(metrics.registry).decode(), media_type="text/plain; version=0.0.4"
        )

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [_model_card(served_name, created)]}

    async def parse(request: Request, kind: type) -> Any:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise APIError(400, "the body is not valid JSON", "invalid_request_error") from None
        try:
            parsed = kind.model_validate(body)
        except ValidationError as exc:
            message, where = validation_message(exc)
            raise APIError(400, message, "invalid_request_error", param=where) from None
        if parsed.model != served_name:
            raise APIError(
                404,
                f"the model {parsed.model!r} does not exist; this server serves {served_name!r}",
                "invalid_request_error",
                param="model",
                code="model_not_found",
            )
        try:
            return parsed, parsed.params()
        except SamplingError as exc:
            raise APIError(400, str(exc), "invalid_request_error", param=exc.param) from None

    def encode(prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, list):
            if any(not 0 <= t < len(tokenizer) for t in prompt):
                raise APIError(
                    400, "prompt: a token id is out of the vocabulary", "invalid_request_error", "prompt"
                )
            return prompt
        return tokenizer(prompt)["input_ids"]

    async def start(request_id: str, prompt: list[int], params) -> AsyncIterator[Update]:
        """The request's update stream, after its first update (so that a refusal is an HTTP error)."""
        try:
            stream = runner.stream(request_id, prompt, params)
            first = await stream.__anext__()
        except QueueFull as exc:
            metrics.requests.labels("rejected").inc()
            raise APIError(429, str(exc), "rate_limit_exceeded", code="queue_full") from None
        except RequestError as exc:
            metrics.requests.labels("rejected").inc()
            status, code = (413, "context_length_exceeded") if isinstance(exc, TooLong) else (400, None)
            raise APIError(status, str(exc), "invalid_request_error", code=code) from None
        metrics.prompt_tokens.inc(len(prompt))

        async def chained() -> AsyncIterator[Update]:
            try:
                yield first
                async for update in stream:
                    yield update
                metrics.requests.labels("finished").inc()
            finally:
                await stream.aclose()

        return chained()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        try:
            body, params = await parse(request, ChatRequest)
            messages = [{"role": m.role, "content": m.text()} for m in body.messages]
            prompt = chat_ids(tokenizer, messages)
            rid = f"chatcmpl-{uuid.uuid4().hex}"
            updates = await start(rid, prompt, params)
        except APIError as exc:
            return exc.response()
        head = {"id": rid, "created": int(time.time()), "model": served_name}
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            return _sse(_chat_chunks(head, updates, params.n, len(prompt), usage, tokenizer))
        choices, completion_tokens = await _collect(updates, params.n)
        out = []
        for index, c in choices.items():
            choice = {
                "index": index,
                "message": {"role": "assistant", "content": c["text"]},
                "finish_reason": c["finish"],
                "logprobs": _chat_logprobs(c["logprobs"], c["tokens"], tokenizer) if body.logprobs else None,
            }
            out.append(choice)
        return {
            **head,
            "object": "chat.completion",
            "choices": out,
            "usage": _usage(len(prompt), completion_tokens),
        }

    @app.post("/v1/completions")
    async def completions(request: Request):
        try:
            body, params = await parse(request, CompletionRequest)
            prompts = [encode(p) for p in body.prompts()]
            rid = f"cmpl-{uuid.uuid4().hex}"
            streams = [await start(f"{rid}-{i}", p, params) for i, p in enumerate(prompts)]
        except APIError as exc:
            return exc.response()
        head = {"id": rid, "created": int(time.time()), "model": served_name}
        prompt_tokens = sum(map(len, prompts))
        if body.stream:
            if len(streams) > 1:
                return APIError(
                    400, "stream with several prompts is not supported", "invalid_request_error"
                ).response()
            usage = body.stream_options is not None and body.stream_options.include_usage
            return _sse(_completion_chunks(head, streams[0], prompt_tokens, usage))
        out, completion_tokens = [], 0
        for i, updates in enumerate(streams):
            choices, made = await _collect(updates, params.n)
            completion_tokens += made
            for index, c in choices.items():
                logprobs = (
                    _completion_logprobs(c["logprobs"], c["tokens"], tokenizer)
                    if body.logprobs is not None
                    else None
                )
                text = (tokenizer.decode(prompts[i]) if body.echo else "") + c["text"]
                out.append(
                    {
                        "index": i * params.n + index,
                        "text": text,
                        "finish_reason": c["finish"],
                        "logprobs": logprobs,
                    }
                )
        return {
            **head,
            "object": "text_completion",
            "choices": out,
            "usage": _usage(prompt_tokens, completion_tokens),
        }

    return app


def _model_card(name: str, created: int) -> dict:
    return {"id": name, "object": "model", "created": created, "owned_by": "shardforge"}


def _usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def _collect(updates: AsyncIterator[Update], n: int) -> tuple[dict[int, dict], int]:
    choices = {i: {"text": "", "tokens": [], "logprobs": [], "finish": None} for i in range(n)}
    made = 0
    async for u in updates:
        c = choices[u.index]
        c["text"] += u.text
        c["tokens"] += u.tokens
        c["logprobs"] += u.logprobs
        c["finish"] = u.finish_reason or c["finish"]
        made += len(u.tokens)
    return choices, made


def _sse(chunks: AsyncIterator[dict]) -> StreamingResponse:
    async def body() -> AsyncIterator[str]:
        async for chunk in chunks:
            yield f"data: {json.dumps(chunk)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _chat_chunks(
    head: dict, updates: AsyncIterator[Update], n: int, prompt_tokens: int, usage: bool, tokenizer: Any
) -> AsyncIterator[dict]:
    base = {**head, "object": "chat.completion.chunk"}
    for index in range(n):
        yield {
            **base,
            "choices": [
                {"index": index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
            ],
        }
    made = 0
    async for u in updates:
        made += len(u.tokens)
        delta = {"content": u.text} if u.text else {}
        logprobs = _chat_logprobs(u.logprobs, u.tokens, tokenizer) if u.logprobs else None
        if delta or u.finish_reason or logprobs:
            choice = {
                "index": u.index,
                "delta": delta,
                "finish_reason": u.finish_reason,
                "logprobs": logprobs,
            }
            yield {**base, "choices": [choice]}
    if usage:
        yield {**base, "choices": [], "usage": _usage(prompt_tokens, made)}


async def _completion_chunks(
    head: dict, updates: AsyncIterator[Update], prompt_tokens: int, usage: bool
) -> AsyncIterator[dict]:
    base = {**head, "object": "text_completion"}
    made = 0
    async for u in updates:
        made += len(u.tokens)
        if u.text or u.finish_reason:
            yield {
                **base,
                "choices": [
                    {"index": u.index, "text": u.text, "finish_reason": u.finish_reason, "logprobs": None}
                ],
            }
    if usage:
        yield {**base, "choices": [], "usage": _usage(prompt_tokens, made)}


def _token_entry(tokenizer: Any, token: int, logprob: float) -> dict:
    text = tokenizer.decode([token])
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def _chat_logprobs(logprobs: list, tokens: list[int], tokenizer: Any) -> dict:
    content = []
    for token, (chosen, top) in zip(tokens, logprobs, strict=True):
        entry = _token_entry(tokenizer, token, chosen)
        entry["top_logprobs"] = [_token_entry(tokenizer, t, lp) for t, lp in top]
        content.append(entry)
    return {"content": content}


def _completion_logprobs(logprobs: list, tokens: list[int], tokenizer: Any) -> dict:
    texts = [tokenizer.decode([t]) for t in tokens]
    offsets, at = [], 0
    for text in texts:
        offsets.append(at)
        at += len(text)
    return {
        "tokens": texts,
        "token_logprobs": [chosen for chosen, _ in logprobs],
        "top_logprobs": [{tokenizer.decode([t]): lp for t, lp in top} for _, top in logprobs],
        "text_offset": offsets,
    }


def check_host(host: str, api_key: str | None) -> None:
    """Listening beyond this machine without a key would hand the model to anyone on the network."""
    if host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        raise ConfigError(f"--host {host} listens beyond this machine: give it an --api-key")


def serve(
    loaded: Loaded,
    runner: EngineRunner,
    host: str = "127.0.0.1",
    port: int = 8000,
    served_name: str | None = None,
    api_key: str | None = None,
) -> None:
    """Run the server until interrupted. A host other than loopback needs an API key."""
    import uvicorn

    check_host(host, api_key)
    app = build_app(loaded, runner, served_name or loaded.name, api_key)
    try:
        uvicorn.run(app, host=host, port=port, log_level="warning")
    finally:
        runner.close()
