"""The OpenAI-compatible HTTP front door (FastAPI, served by uvicorn in the caller's loop)."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncGenerator
from contextlib import aclosing, nullcontext, suppress
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from router.auth import Access, SecurityConfig, bearer_token
from router.backend import GenerateRequest
from router.errors import (
    DeadlineExceededError,
    InvalidRequestError,
    ModelNotFoundError,
    QueueFullError,
    QueueTimeoutError,
    RequestNotFoundError,
    RouterError,
    UnavailableError,
)
from router.frontend import Router
from router.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ResponseBuilder,
    error_body,
)
from router.outputs import GenerateOutput

# Router error -> (HTTP status, OpenAI error type, OpenAI error code).
_HTTP_ERRORS: dict[type[RouterError], tuple[int, str, str | None]] = {
    InvalidRequestError: (400, "invalid_request_error", None),
    ModelNotFoundError: (404, "invalid_request_error", "model_not_found"),
    RequestNotFoundError: (404, "invalid_request_error", "request_not_found"),
    QueueFullError: (429, "rate_limit_error", "queue_full"),
    QueueTimeoutError: (504, "timeout_error", "queue_timeout"),
    DeadlineExceededError: (504, "timeout_error", "deadline_exceeded"),
    UnavailableError: (503, "server_error", "draining"),
}


def build_app(router: Router, security: SecurityConfig | None = None) -> FastAPI:
    """The FastAPI app: `/v1/completions`, `/v1/chat/completions`, `/v1/models`, `/health`,
    `/metrics`.

    Args:
        router: the shared router.
        security: the keys `/v1/*` requires (see `router.auth`); None for none.

    Returns:
        The app, ready for any ASGI server.
    """
    app = FastAPI(title="pdcluster", version="0.1.0")
    app.state.router = router
    add_auth(app, security or SecurityConfig())
    app.add_exception_handler(RouterError, _router_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    info = router.model_info

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        prompt = ({"prompt": body.prompt} if isinstance(body.prompt, str)
                  else {"prompt_token_ids": body.prompt})
        request = router.prepare(**prompt, params=body.params(), model=body.model)
        return await _respond(router, request, body.stream, body.include_usage, chat=False,
                              raw=raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        request = router.prepare(messages=body.message_dicts(),
                                 params=body.params(info.max_model_len), model=body.model)
        return await _respond(router, request, body.stream, body.include_usage, chat=True,
                              raw=raw)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": info.name, "object": "model", "created": 0,
                                            "owned_by": "pdcluster",
                                            "max_model_len": info.max_model_len}]}

    @app.get("/health")
    async def health() -> Response:
        ok = router.healthy()
        return JSONResponse({"status": "ok" if ok else "unhealthy"}, 200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(router.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


async def _respond(router: Router, request: GenerateRequest, stream: bool, include_usage: bool,
                   chat: bool, raw: Request) -> Response:
    builder = ResponseBuilder(chat, request.request_id, router.model_info.name,
                              lambda token_id: router.tokenizer.decode([token_id]))
    outs = router.generate(request)
    # Admission errors (queue full, deadline) surface here, before any byte is sent.
    first = await anext(outs)
    outputs = _chain(first, outs)
    if stream:
        return StreamingResponse(_sse(builder, outputs, include_usage),
                                 media_type="text/event-stream")
    collected = await _collect_unless_disconnected(outputs, raw)
    if collected is None:  # the client left: the request was aborted, nobody reads this
        return Response(status_code=499)
    final = collected[-1]
    if final.finish_reason == "error":
        return JSONResponse(error_body(final.error or "generation failed", "server_error"), 500)
    logprobs = None if request.params.logprobs is None else \
        [lp for out in collected for lp in out.logprobs or []]
    return JSONResponse(builder.response("".join(o.text for o in collected), logprobs, final))


async def _collect_unless_disconnected(outputs: AsyncGenerator[GenerateOutput, None],
                                       raw: Request) -> list[GenerateOutput] | None:
    """Every output, or None if the client disconnected first (the request is aborted)."""
    async def collect() -> list[GenerateOutput]:
        async with aclosing(outputs):
            return [out async for out in outputs]

    async def disconnected() -> None:
        while (await raw.receive())["type"] != "http.disconnect":
            pass

    collecting = asyncio.ensure_future(collect())
    watching = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({collecting, watching}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watching.cancel()
    if collecting.done():
        return collecting.result()
    collecting.cancel()  # closes the outputs: the router aborts the request
    with suppress(asyncio.CancelledError):
        await collecting
    return None


async def _chain(first: GenerateOutput, rest: AsyncGenerator[GenerateOutput, None]
                 ) -> AsyncGenerator[GenerateOutput, None]:
    async with aclosing(rest):
        yield first
        async for out in rest:
            yield out


async def _sse(builder: ResponseBuilder, outputs: AsyncGenerator[GenerateOutput, None],
               include_usage: bool) -> AsyncGenerator[str, None]:
    async with aclosing(outputs):
        if builder.chat:
            yield _event(builder.chunk(None, include_usage))
        try:
            async for out in outputs:
                if out.finish_reason == "error":
                    yield _event(error_body(out.error or "generation failed", "server_error"))
                    break
                yield _event(builder.chunk(out, include_usage))
                if out.finished and include_usage and out.usage is not None:
                    yield _event(builder.usage_chunk(out.usage))
        except RouterError as e:  # e.g. the deadline passed mid-stream
            _, type_, code = _HTTP_ERRORS.get(type(e), (500, "server_error", None))
            yield _event(error_body(str(e), type_, e.param, code))
    yield "data: [DONE]\n\n"


def _event(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body)}\n\n"


async def _router_error(request: Request, exc: Exception) -> Response:
    error = exc if isinstance(exc, RouterError) else RouterError(str(exc))
    status, type_, code = _HTTP_ERRORS.get(type(error), (500, "server_error", None))
    return JSONResponse(error_body(str(error), type_, error.param, code), status)


async def _validation_error(request: Request, exc: Exception) -> Response:
    """FastAPI answers 422; OpenAI clients expect 400 with the offending field named."""
    request.app.state.router.metrics.rejected.labels(InvalidRequestError.code).inc()
    errors = exc.errors() if isinstance(exc, RequestValidationError) else []
    error = errors[0] if errors else {"loc": (), "msg": str(exc), "type": ""}
    fields = [str(part) for part in error["loc"][1:]]  # loc starts with "body"
    if error["type"] == "json_invalid":
        message, param = f"body: malformed JSON ({error['ctx']['error']})", None
    else:
        param = fields[0] if fields else None
        message = f"{'.'.join(fields) or 'body'}: {error['msg']}"
    return JSONResponse(error_body(message, "invalid_request_error", param), 400)


def add_auth(app: FastAPI, security: SecurityConfig) -> None:
    """Require a key (`Authorization: Bearer <key>`) on `/v1/*`; 401 without a valid one.

    `/health` and `/metrics` stay open, for load balancers and scrapers.
    """
    if not security.authenticated:
        return

    @app.middleware("http")
    async def require_key(request: Request, call_next: Any) -> Response:
        if request.url.path.startswith("/v1/"):
            key = bearer_token(request.headers.get("authorization"))
            if security.access(key) < Access.USER:
                return JSONResponse(error_body(
                    "a valid API key is required: header 'Authorization: Bearer <key>'",
                    "invalid_request_error", None, "invalid_api_key"), 401,
                    headers={"WWW-Authenticate": "Bearer"})
        return await call_next(request)


class _EmbeddedUvicorn(uvicorn.Server):
    """Leaves signal handling to the program that also runs the gRPC server."""

    def capture_signals(self) -> nullcontext[None]:  # type: ignore[override]
        return nullcontext()


class HttpServer:
    """Uvicorn serving `build_app(router)` in the running event loop.

    The socket is bound (and listening) at construction, so `port` is known at once and
    early clients wait in the backlog rather than being refused.

    Args:
        router: the shared router.
        host: interface to bind.
        port: port to bind; 0 picks a free one (see `port`).
        security: keys and TLS; None for neither.
    """

    def __init__(self, router: Router, host: str = "127.0.0.1", port: int = 0,
                 security: SecurityConfig | None = None) -> None:
        security = security or SecurityConfig()
        self.app = build_app(router, security)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._socket = socket.create_server((host, port), family=family)
        self.port: int = self._socket.getsockname()[1]
        config = uvicorn.Config(self.app, lifespan="off", log_config=None, access_log=False,
                                **security.uvicorn_ssl())
        config.load()  # now, so a bad certificate fails here rather than in the serving task
        self._server = _EmbeddedUvicorn(config)
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._server.serve(sockets=[self._socket]))

    async def stop(self, grace: float = 1.0) -> None:
        """Stop accepting, let open responses finish for `grace` seconds, then cancel them."""
        self._server.config.timeout_graceful_shutdown = max(grace, 0.001)
        self._server.should_exit = True
        if self._task is not None:
            await self._task
        self._socket.close()
