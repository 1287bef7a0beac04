"""The HTTP plumbing under the OpenAI API: errors in the API's JSON shape, the guard every /v1 request passes
(key, body size counted while read), watching a connection for the client leaving, and uvicorn with this
command's own signal handling."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse

MAX_BODY_BYTES = 8 << 20
T = TypeVar("T")


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        kind: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code
        self.headers = headers

    def response(self) -> JSONResponse:
        body = {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}
        return JSONResponse({"error": body}, status_code=self.status, headers=self.headers)


class ClientGone(Exception):
    """The client closed its connection before the answer was ready."""


class Guard:
    """ASGI middleware for every /v1 route: the API key, and the body's size counted while it is read (a
    chunked body has no Content-Length); the body is then handed on whole. Errors are the API's JSON."""

    def __init__(self, app: Any, api_key: str | None, max_body: int = MAX_BODY_BYTES) -> None:
        self.app, self.api_key, self.max_body = app, api_key, max_body

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        scheme, _, key = headers.get("authorization", "").partition(" ")
        if self.api_key is not None and (scheme.lower() != "bearer" or key != self.api_key):
            error = APIError(401, "missing or wrong API key", "authentication_error", code="invalid_api_key")
            return await error.response()(scope, receive, send)
        declared = headers.get("content-length", "0")
        too_big = APIError(413, f"the body is larger than {self.max_body} bytes", "invalid_request_error")
        if not declared.isdigit() or int(declared) > self.max_body:
            return await too_big.response()(scope, receive, send)
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            body += message.get("body", b"")
            if len(body) > self.max_body:
                return await too_big.response()(scope, receive, send)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()  # after the body: the disconnect, when it comes

        try:
            return await self.app(scope, replay, send)
        except asyncio.CancelledError:  # the shutdown grace is over: the request was aborted as it stopped
            return None


async def until_disconnected(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result, or ClientGone (with `work` cancelled) as soon as the client closes the connection."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if not task.done() or task.cancelled():
        raise ClientGone
    return task.result()


def uvicorn_server(config: Any) -> Any:
    """uvicorn's server with this command's own SIGINT/SIGTERM handling: the first signal stops accepting
    and starts the grace, a second one ends it at once, and the process then exits 0 (uvicorn's own handling
    re-raises the signal after shutting down, which kills the process with it)."""
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):  # type: ignore[no-untyped-def]
            if threading.current_thread() is not threading.main_thread():
                yield
                return

            def stop(_sig: int, _frame: Any) -> None:
                self.force_exit = self.should_exit
                self.should_exit = True

            previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    return Server(config)
