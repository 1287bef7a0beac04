"""An OpenAI-compatible HTTP API over the engine (FastAPI + uvicorn): /v1/models, /v1/chat/completions,
/v1/completions (streamed as server-sent events or whole), /health and /metrics (Prometheus). Concurrent
requests are batched together by the engine; errors are OpenAI-shaped JSON, never a 5xx for a client's input,
and never stop the server. A client that leaves (streaming or not) aborts its request; SIGTERM stops
accepting, gives what is in flight a bounded grace, aborts the rest and exits 0."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import jinja2
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import generate_latest
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from shardforge.data.templates import resolve_template
from shardforge.errors import ConfigError
from shardforge.infer.engine_types import RequestError, TooLong, Update
from shardforge.infer.http import APIError, ClientGone, Guard, until_disconnected, uvicorn_server
from shardforge.infer.load import Loaded
from shardforge.infer.lora_routes import adapter_cards, adapter_names, add_lora_routes
from shardforge.infer.metrics import Metrics
from shardforge.infer.offline import chat_text, token_ids
from shardforge.infer.protocol import ChatRequest, CompletionRequest, validation_message
from shardforge.infer.request_images import request_images
from shardforge.infer.runner import EngineRunner, QueueFull, RequestStream, Unavailable
from shardforge.infer.sampling import SamplingError
from shardforge.infer.tools import CallStream, Tooling, detect, tool_call_json


def build_app(
    loaded: Loaded,
    runner: EngineRunner,
    served_name: str,
    api_key: str | None = None,
    image_root: Path | None = None,
    lora_root: Path | None = None,
) -> FastAPI:
    """`image_root`: where a request's local image paths may be read (infer/request_images.py);
    `lora_root`: where adapters may be loaded from at run time (infer/lora_routes.py; None: not at all)."""
    app = FastAPI(title="shardforge", docs_url=None, redoc_url=None)
    app.add_middleware(Guard, api_key=api_key)
    tokenizer = loaded.tokenizer
    context = runner.engine.context
    # A token covers at most `longest` characters of its vocabulary entry, and an entry has at least the
    # characters of the text it stands for; 4x covers normalizers. A longer text cannot fit: refused as is.
    longest = max(map(len, tokenizer.get_vocab()), default=1)
    max_chars = 4 * longest * context
    metrics = Metrics(runner)
    runner.on_finish = metrics.finished
    call_format = detect(resolve_template(tokenizer, "auto").jinja)
    created = int(time.time())
    add_lora_routes(app, runner, served_name, lora_root)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        """Routing errors (no such route, a method it does not take) in the API's shape too."""
        return APIError(
            exc.status_code, str(exc.detail), "invalid_request_error", headers=exc.headers
        ).response()

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Any:
        if runner.error is not None:
            return JSONResponse({"status": "error", "error": repr(runner.error)}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics_text() -> PlainTextResponse:
        return PlainTextResponse(
            generate_latest(metrics.registry).decode(), media_type="text/plain; version=0.0.4"
        )

    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    async def models() -> dict:
        adapters = adapter_cards(runner, served_name, created)
        return {"object": "list", "data": [_model_card(served_name, created), *adapters]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> Any:
        if model in adapter_names(runner):
            return next(c for c in adapter_cards(runner, served_name, created) if c["id"] == model)
        if model != served_name:
            return APIError(
                404,
                f"the model {model!r} does not exist; this server serves {served_name!r}",
                "invalid_request_error",
                param="model",
                code="model_not_found",
            ).response()
        return _model_card(served_name, created)

    async def parse(request: Request, kind: type) -> Any:
        try:
            parsed = await asyncio.to_thread(kind.model_validate_json, await request.body())
        except ValidationError as exc:
            message, where = validation_message(exc)
            raise APIError(400, message, "invalid_request_error", param=where) from None
        if parsed.model != served_name and parsed.model not in adapter_names(runner):
            raise APIError(
                404,
                f"the model {parsed.model!r} does not exist; this server serves {served_name!r}",
                "invalid_request_error",
                param="model",
                code="model_not_found",
            )
        return parsed

    def tokens_of(text: str, special: bool, field: str) -> list[int]:
        """A text's token ids, off the event loop (the tokenizer lets other threads run meanwhile)."""
        if len(text) > max_chars:
            raise APIError(
                400,
                f"the prompt has {len(text)} characters: more tokens than the model's context of {context}",
                "invalid_request_error",
                param=field,
                code="context_length_exceeded",
            )
        return token_ids(tokenizer, text, special)

    def chat_prompt(messages: list[dict], tools: list[dict]) -> list[int]:
        try:
            text = chat_text(tokenizer, messages, tools)
            shown = not tools or text != chat_text(tokenizer, messages)
        except (jinja2.TemplateError, TypeError, ValueError) as exc:
            raise APIError(
                400,
                f"messages: the model's chat template refused them: {exc}",
                "invalid_request_error",
                param="messages",
            ) from None
        if not shown:  # the model would never see them: a silently different request
            raise APIError(
                400,
                f"tools: {served_name}'s chat template does not show tools to the model (no tool format)",
                "invalid_request_error",
                param="tools",
            )
        return tokens_of(text, False, "messages")

    def tooling(body: ChatRequest) -> Tooling:
        choice = body.tool_choice_name()
        if choice == "auto" and call_format is None:
            raise APIError(
                400,
                f"tools: {served_name}'s chat template shows no tool-call format this server reads (hermes "
                "<tool_call>, llama3_json, mistral [TOOL_CALLS]); use tool_choice required or a function",
                "invalid_request_error",
                param="tools",
            )
        return Tooling(choice, call_format)

    def submit(
        request_id: str, prompt: list[int], params: Any, body: Any, field: str, images: Any = None
    ) -> RequestStream:
        """Queue a request; `field`: the request's prompt field (messages or prompt), for errors."""
        try:
            adapter = None if body.model == served_name else body.model  # a LoRA adapter's name
            stream = runner.submit(request_id, prompt, params, asyncio.get_running_loop(), images, adapter)
        except QueueFull as exc:
            metrics.requests.labels("rejected").inc()
            raise APIError(
                429, str(exc), "rate_limit_exceeded", code="queue_full", headers={"Retry-After": "1"}
            ) from None
        except Unavailable as exc:
            raise APIError(503, str(exc), "service_unavailable", headers={"Retry-After": "5"}) from None
        except SamplingError as exc:
            metrics.requests.labels("rejected").inc()
            raise APIError(400, str(exc), "invalid_request_error", param=exc.param) from None
        except RequestError as exc:
            metrics.requests.labels("rejected").inc()
            code = "context_length_exceeded" if isinstance(exc, TooLong) else None
            param = {"prompt": field, "max_tokens": body.limit_field}.get(exc.param or "", exc.param)
            raise APIError(400, str(exc), "invalid_request_error", param=param, code=code) from None
        metrics.prompt_tokens.inc(len(prompt))
        return stream

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        try:
            body = await parse(request, ChatRequest)
            params = body.params()
            tools = tooling(body)
            messages, images = await asyncio.to_thread(
                request_images, body.messages, loaded.images, image_root, served_name
            )
            prompt = await asyncio.to_thread(chat_prompt, messages, body.template_tools())
            rid = f"chatcmpl-{uuid.uuid4().hex}"
            stream = submit(rid, prompt, params, body, "messages", images)
        except SamplingError as exc:
            return APIError(400, str(exc), "invalid_request_error", param=exc.param).response()
        except APIError as exc:
            return exc.response()
        head = {"id": rid, "created": int(time.time()), "model": body.model}
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            chunks = _chat_chunks(head, stream, params.n, len(prompt), usage, tokenizer, tools)
            return _sse(chunks, [stream])
        try:
            choices, completion_tokens = await until_disconnected(request, _collect(stream, params.n))
        except ClientGone:
            return None
        except asyncio.CancelledError:  # the shutdown grace is over
            return _shutting_down()
        finally:
            stream.close()
        out = []
        for index, c in choices.items():
            said = c["tokens"][:-1] if c["stop_token"] else c["tokens"]
            content, calls = tools.answer(c["text"], tokenizer.decode(said, skip_special_tokens=False))
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if calls:
                message["tool_calls"] = [tool_call_json(call) for call in calls]
            choice = {
                "index": index,
                "message": message,
                "finish_reason": tools.finish_reason(calls, c["finish"]),
                "logprobs": _chat_logprobs(c["logprobs"], c["tokens"], tokenizer) if body.logprobs else None,
            }
            out.append(choice)
        return {
            **head,
            "object": "chat.completion",
            "choices": out,
            "usage": _usage(len(prompt), completion_tokens),
        }

    def encode(prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, list):
            if any(not 0 <= t < len(tokenizer) for t in prompt):
                raise APIError(
                    400, "prompt: a token id is out of the vocabulary", "invalid_request_error", "prompt"
                )
            return prompt
        return tokens_of(prompt, True, "prompt")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        streams: list[RequestStream] = []
        try:
            body = await parse(request, CompletionRequest)
            params = body.params()
            texts = body.prompts()
            if len(texts) > runner.max_waiting:
                raise APIError(
                    400,
                    f"prompt: {len(texts)} prompts in one request; this server queues at most "
                    f"{runner.max_waiting} (--max-waiting)",
                    "invalid_request_error",
                    param="prompt",
                )
            if body.stream and len(texts) > 1:
                raise APIError(
                    400,
                    "stream with several prompts is not supported",
                    "invalid_request_error",
                    param="prompt",
                )
            prompts = await asyncio.to_thread(lambda: [encode(p) for p in texts])
            rid = f"cmpl-{uuid.uuid4().hex}"
            for i, p in enumerate(prompts):
                streams.append(submit(f"{rid}-{i}", p, params, body, "prompt"))
        except (SamplingError, APIError) as exc:
            for stream in streams:
                stream.close()
            if isinstance(exc, SamplingError):
                return APIError(400, str(exc), "invalid_request_error", param=exc.param).response()
            return exc.response()
        head = {"id": rid, "created": int(time.time()), "model": body.model}
        prompt_tokens = sum(map(len, prompts))
        if body.stream:
            usage = body.stream_options is not None and body.stream_options.include_usage
            echo = tokenizer.decode(prompts[0]) if body.echo else ""
            chunks = _completion_chunks(
                head, streams[0], prompt_tokens, usage, echo, body.logprobs, tokenizer
            )
            return _sse(chunks, streams)

        async def collect_all() -> list[tuple[dict[int, dict], int]]:
            return [await _collect(stream, params.n) for stream in streams]

        try:
            collected = await until_disconnected(request, collect_all())
        except ClientGone:
            return None
        except asyncio.CancelledError:  # the shutdown grace is over
            return _shutting_down()
        finally:
            for stream in streams:
                stream.close()
        out, completion_tokens = [], 0
        for i, (choices, made) in enumerate(collected):
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


def _shutting_down() -> JSONResponse:
    return APIError(
        503, "the server is shutting down: the request was aborted", "service_unavailable"
    ).response()


def _model_card(name: str, created: int) -> dict:
    return {"id": name, "object": "model", "created": created, "owned_by": "shardforge"}


def _usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


async def _collect(updates: AsyncIterator[Update], n: int) -> tuple[dict[int, dict], int]:
    choices = {
        i: {"text": "", "tokens": [], "logprobs": [], "finish": None, "stop_token": False} for i in range(n)
    }
    made = 0
    async for u in updates:
        c = choices[u.index]
        c["text"] += u.text
        c["tokens"] += u.tokens
        c["logprobs"] += u.logprobs
        c["finish"] = u.finish_reason or c["finish"]
        c["stop_token"] = c["stop_token"] or u.stop_token
        made += len(u.tokens)
    return choices, made


def _sse(chunks: AsyncIterator[dict], streams: list[RequestStream]) -> StreamingResponse:
    """Server-sent events; when the client leaves, the response is cancelled and the requests aborted (a
    synchronous close: an await in a cancelled task would never run)."""

    async def body() -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            for stream in streams:
                stream.close()

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _chat_chunks(
    head: dict,
    updates: AsyncIterator[Update],
    n: int,
    prompt_tokens: int,
    usage: bool,
    tokenizer: Any,
    tools: Tooling,
) -> AsyncIterator[dict]:
    """The chunks of a streamed chat; with tools, each choice's text goes through a CallStream (content until
    a call may begin, the calls as one delta each at the end)."""
    base = {**head, "object": "chat.completion.chunk"}
    calls = {index: CallStream(tools, tokenizer) for index in range(n)} if tools.choice != "none" else {}
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
        finish = u.finish_reason
        text = calls[u.index].update(u.tokens, u.text, u.stop_token) if calls else u.text
        delta: dict[str, Any] = {"content": text} if text else {}
        if finish is not None and calls:
            rest, made_calls = calls[u.index].finish()
            if rest:
                delta["content"] = delta.get("content", "") + rest
            if made_calls:
                delta["tool_calls"] = [tool_call_json(call, i) for i, call in enumerate(made_calls)]
            finish = tools.finish_reason(made_calls, finish)
        logprobs = _chat_logprobs(u.logprobs, u.tokens, tokenizer) if u.logprobs else None
        if delta or finish or logprobs:
            choice = {"index": u.index, "delta": delta, "finish_reason": finish, "logprobs": logprobs}
            yield {**base, "choices": [choice]}
    if usage:
        yield {**base, "choices": [], "usage": _usage(prompt_tokens, made)}


async def _completion_chunks(
    head: dict,
    updates: AsyncIterator[Update],
    prompt_tokens: int,
    usage: bool,
    echo: str,
    logprobs: int | None,
    tokenizer: Any,
) -> AsyncIterator[dict]:
    base = {**head, "object": "text_completion"}
    made = 0
    sent: dict[int, int] = {}  # characters of each completion sent so far
    async for u in updates:
        made += len(u.tokens)
        text = u.text
        if echo and u.index not in sent:  # each completion's first piece starts with the prompt
            text = echo + text
        at = sent.get(u.index, 0)
        sent[u.index] = at + len(text)
        if text or u.finish_reason or logprobs is not None:
            scores = (
                _completion_logprobs(u.logprobs, u.tokens, tokenizer, at) if logprobs is not None else None
            )
            yield {
                **base,
                "choices": [
                    {"index": u.index, "text": text, "finish_reason": u.finish_reason, "logprobs": scores}
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


def _completion_logprobs(logprobs: list, tokens: list[int], tokenizer: Any, start: int = 0) -> dict:
    """The completions API's logprobs; `start`: the text's offset in the whole completion."""
    texts = [tokenizer.decode([t]) for t in tokens]
    offsets, at = [], start
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
    grace: float = 5.0,
    image_root: Path | None = None,
    lora_root: Path | None = None,
) -> None:
    """Run the server until SIGINT or SIGTERM: then stop accepting, let what is in flight finish for up to
    `grace` seconds, abort the rest and return. A host other than loopback needs an API key."""
    import uvicorn

    check_host(host, api_key)
    app = build_app(loaded, runner, served_name or loaded.name, api_key, image_root, lora_root)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=grace)
    try:
        uvicorn_server(config).run()
    finally:
        runner.close()
