"""The server's LoRA adapters (infer/multi_lora.py) as vLLM exposes them: each listed by /v1/models with
`parent` = the base's served name, chosen by a request's `model`, and loaded or unloaded at run time:

    POST /v1/load_lora_adapter    {"lora_name": "sql", "lora_path": "sql-adapter"}
    POST /v1/unload_lora_adapter  {"lora_name": "sql"}

Loading reads a folder on the server, so it is off unless the server was started with --lora-root DIR: then
only folders under DIR are read (a relative lora_path is taken from DIR), never outside it, as
request_images.py does for images. Errors are OpenAI-shaped 400 / 404s naming the field; the factors go
into the layers on the engine's thread, between two steps."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse
from safetensors import SafetensorError

from shardforge.errors import ShardforgeError
from shardforge.infer.http import APIError
from shardforge.infer.runner import EngineRunner, Unavailable


def adapter_names(runner: EngineRunner) -> list[str]:
    lora = runner.engine.lora
    return [] if lora is None else list(lora.adapters)


def adapter_cards(runner: EngineRunner, served_name: str, created: int) -> list[dict]:
    return [
        {"id": name, "object": "model", "created": created, "owned_by": "shardforge", "parent": served_name,
         "root": str(runner.engine.lora.adapters[name].path)}
        for name in adapter_names(runner)
    ]  # fmt: skip


def _bad(message: str, param: str, status: int = 400, code: str | None = None) -> APIError:
    return APIError(status, message, "invalid_request_error", param=param, code=code)


async def _body(request: Request, fields: tuple[str, ...]) -> dict[str, str]:
    try:
        body = json.loads(await request.body() or b"{}")
    except json.JSONDecodeError as exc:
        raise _bad(f"the body is not JSON: {exc}", fields[0]) from None
    if not isinstance(body, dict):
        raise _bad("the body must be a JSON object", fields[0])
    for name in fields:
        value = body.get(name)
        if not isinstance(value, str) or not value:
            raise _bad(f"{name}: a non-empty string is required", name)
    return body


def lora_folder(path: str, root: Path | None) -> Path:
    """A load request's lora_path as a folder under `root`, or a 400 naming lora_path."""
    if root is None:
        raise _bad(
            "loading adapters at run time is off: start the server with --lora-root DIR to read adapter "
            "folders under DIR",
            "lora_path",
        )
    given = Path(path).expanduser()
    resolved = (given if given.is_absolute() else root / given).resolve()
    if not resolved.is_relative_to(root.resolve()):
        raise _bad(f"lora_path {path!r} is outside the server's --lora-root", "lora_path")
    if not (resolved / "adapter_config.json").is_file():
        raise _bad(f"lora_path {path!r}: no PEFT adapter folder (adapter_config.json) there", "lora_path")
    return resolved


def add_lora_routes(app: FastAPI, runner: EngineRunner, served_name: str, root: Path | None) -> None:
    """The load / unload endpoints on `app`."""

    async def on_engine(fn: Any) -> Any:
        try:
            return await asyncio.wrap_future(runner.call(fn))
        except Unavailable as exc:
            raise APIError(503, str(exc), "service_unavailable") from None

    @app.post("/v1/load_lora_adapter")
    async def load(request: Request) -> Any:
        try:
            body = await _body(request, ("lora_name", "lora_path"))
            name = body["lora_name"]
            if runner.engine.lora is None:
                raise _bad(
                    "this server serves no adapters (start it with --lora or --lora-root)", "lora_name"
                )
            if name == served_name or name in adapter_names(runner):
                raise _bad(f"lora_name {name!r} is served already", "lora_name")
            folder = lora_folder(body["lora_path"], root)
            lora = runner.engine.lora
            try:
                factors = await asyncio.to_thread(lora.read, name, folder)
                await on_engine(lambda: lora.install(name, folder, *factors))
            except (
                ShardforgeError,
                OSError,
                ValueError,
                SafetensorError,
            ) as exc:  # a bad folder: the client's
                raise _bad(f"{exc}", "lora_path") from None
        except APIError as exc:
            return exc.response()
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload(request: Request) -> Any:
        try:
            body = await _body(request, ("lora_name",))
            name = body["lora_name"]
            if name not in adapter_names(runner):
                raise _bad(f"no LoRA adapter named {name!r} is loaded", "lora_name", 404, "model_not_found")

            def drop() -> None:  # on the engine's thread: no step runs, the requests are as they are
                engine = runner.engine
                adapter = engine.lora.adapters.get(name)
                if adapter is None:  # unloaded meanwhile
                    raise _bad(
                        f"no LoRA adapter named {name!r} is loaded", "lora_name", 404, "model_not_found"
                    )
                busy = sum(1 for r in engine.requests.values() if r.adapter[0] == adapter.slot)
                if busy:
                    raise _bad(
                        f"lora_name {name!r} is serving {busy} request(s); unload it once they end",
                        "lora_name",
                    )
                engine.lora.unload(name)

            await on_engine(drop)
        except APIError as exc:
            return exc.response()
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
