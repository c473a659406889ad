"""The OpenAI-compatible HTTP front door (FastAPI, served by uvicorn in the caller's loop)."""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import socket
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing, nullcontext, suppress
from dataclasses import replace
from typing import Any, TypeVar

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from protocol.tracing import TRACEPARENT, TRACESTATE
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
from router.models import Routers
from router.openai_protocol import (
    ChatCompletionRequest,
    Choice,
    CompletionRequest,
    DetokenizeRequest,
    ResponseBuilder,
    TokenizeRequest,
    error_body,
    total_usage,
)
from router.outputs import GenerateOutput
from router.router import Router
from router.tool_calls import ToolCalling

T = TypeVar("T")

try:
    VERSION = importlib.metadata.version("pdcluster")
except importlib.metadata.PackageNotFoundError:  # run from a source tree, not installed
    VERSION = "unknown"

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

# Seconds a refused client should wait before trying again (`retry-after`, which the OpenAI
# SDKs honour): a full queue frees as requests finish; a draining server is replaced.
_RETRY_AFTER_S: dict[type[RouterError], int] = {QueueFullError: 1, UnavailableError: 5}

# A client's own id for its request (as vLLM's `X-Request-Id`): the gRPC `Abort` takes it.
_REQUEST_ID = "x-request-id"

# The paths that need a key when keys are set.
_KEYED = ("/v1/", "/tokenize", "/detokenize")

# Router finish reasons that are not OpenAI's: the request ends with an error instead.
_FAILED = ("abort", "error")


def build_app(routers: Routers, security: SecurityConfig | None = None) -> FastAPI:
    """The FastAPI app: `/v1/completions`, `/v1/chat/completions`, `/v1/models`, vLLM's
    `/tokenize`, `/detokenize` and `/version`, `/health`, `/metrics`.

    Args:
        routers: one per served model; each request goes to its `model`'s.
        security: the keys `/v1/*` requires (see `router.auth`); None for none.

    Returns:
        The app, ready for any ASGI server.
    """
    app = FastAPI(title="pdcluster", version=VERSION)
    app.state.router = routers.default
    add_auth(app, security or SecurityConfig())
    app.add_exception_handler(RouterError, _router_error)
    app.add_exception_handler(RequestValidationError, _validation_error)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        params = body.params()
        prompts = body.prompts()
        if len(prompts) > 1 and raw.headers.get(_REQUEST_ID):
            raise InvalidRequestError(f"{_REQUEST_ID}: one id cannot name {len(prompts)} "
                                      "prompts; send one prompt per request", "prompt")
        router = routers.get(body.model)
        prompts = [router.prepare(**prompt, params=params, model=body.model,
                                  request_id=raw.headers.get(_REQUEST_ID),
                                  traceparent=raw.headers.get(TRACEPARENT),
                                  tracestate=raw.headers.get(TRACESTATE))
                   for prompt in prompts]
        echo = None
        if body.echo:
            texts = [router.tokenizer.decode(r.prompt_token_ids) for r in prompts]
            echo = [text for text in texts for _ in range(body.n)]
        return await _respond(router, _fan_out(prompts, body.n), body, chat=False, raw=raw,
                              echo=echo)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        router = routers.get(body.model)
        calling = _checked(router, lambda: body.tool_calling(router.chat_template))
        messages = _checked(router, body.message_dicts)
        try:
            request = router.prepare(messages=messages, params=body.params(calling),
                                     model=body.model, request_id=raw.headers.get(_REQUEST_ID),
                                     tools=body.tool_dicts(),
                                     traceparent=raw.headers.get(TRACEPARENT),
                                     tracestate=raw.headers.get(TRACESTATE),
                                     default_max_tokens=router.model_info.max_model_len)
        except InvalidRequestError as e:
            if calling is None or e.param != "json_schema":
                raise
            raise InvalidRequestError(f"tools: a function's parameters cannot be enforced as "
                                      f"a grammar ({e})", "tools") from None
        return await _respond(router, _fan_out([request], body.n), body, chat=True, raw=raw,
                              calling=calling)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        router = routers.get(body.model)
        ids = _checked(router, lambda: body.token_ids(router.chat_template))
        strs = router.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": router.model_info.max_model_len, "tokens": ids,
                "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        router = routers.get(body.model)
        return {"prompt": _checked(router, lambda: router.detokenize(body.tokens))}

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": VERSION}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [
            {"id": r.model_info.name, "object": "model", "created": 0, "owned_by": "pdcluster",
             "max_model_len": r.model_info.max_model_len} for r in routers]}

    @app.get("/health")
    async def health() -> Response:
        ok = routers.healthy()
        return JSONResponse({"status": "ok" if ok else "unhealthy"}, 200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(routers.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def _fan_out(prompts: list[GenerateRequest], n: int) -> list[GenerateRequest]:
    """n engine requests per prompt (the copies share the prompt's prefix cache); a seeded
    request's copy j draws with seed + j, so the choices differ but stay reproducible."""
    if n == 1:
        return prompts
    out = []
    for request in prompts:
        seed = request.params.seed
        for j in range(n):
            params = request.params if seed is None else replace(request.params, seed=seed + j)
            out.append(replace(request, request_id=f"{request.request_id}-{j}", params=params))
    return out


def _checked(router: Router, check: Callable[[], T]) -> T:
    """`check()`, counting the bad requests it refuses in the rejection metric."""
    try:
        return check()
    except RouterError as e:
        router.metrics.rejected.labels(e.code).inc()
        raise


async def _respond(router: Router, requests: list[GenerateRequest],
                   body: CompletionRequest | ChatCompletionRequest, chat: bool, raw: Request,
                   echo: list[str] | None = None, calling: ToolCalling | None = None
                   ) -> Response:
    """Run the choices' requests and answer with one response (or one SSE stream)."""
    if body.return_tokens_as_token_ids:
        def name(token_id: int) -> str:
            return f"token_id:{token_id}"
    else:
        def name(token_id: int) -> str:
            return router.tokenizer.decode([token_id])
    builder = ResponseBuilder(chat, requests[0].request_id, router.model_info.name, name,
                              calling)
    keepalive = router.config.sse_keepalive_s
    outputs = await _admitted(router, requests, keepalive if body.stream else None)
    n = body.n
    if body.stream:
        return StreamingResponse(_sse(builder, outputs, body.include_usage, n, echo, keepalive),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})
    collected = await _collect_unless_disconnected(outputs, raw)
    if collected is None:  # the client left: the requests were aborted, nobody reads this
        return Response(status_code=499)
    finals = [outs[-1] for outs in collected]
    failed = next((final for final in finals if final.finish_reason in _FAILED), None)
    if failed is not None:
        status, error = _failure(failed)
        # An abort was meant (the operator's `Abort`): the OpenAI SDKs honour this header
        # rather than sending the request again.
        headers = {"x-should-retry": "false"} if failed.finish_reason == "abort" else None
        return JSONResponse(error, status, headers=headers)
    choices = []
    for index, outs in enumerate(collected):
        logprobs = None if requests[index].params.logprobs is None else \
            [lp for out in outs for lp in out.logprobs or []]
        text = (echo[index] if echo else "") + "".join(o.text for o in outs)
        choices.append(Choice(text, logprobs, outs[-1].finish_reason))
    return JSONResponse(builder.response(choices, total_usage(finals, n)))


async def _admitted(router: Router, requests: list[GenerateRequest], patience: float | None
                    ) -> list[AsyncGenerator[GenerateOutput, None]]:
    """Start every request and wait for their first outputs, up to `patience` seconds (None:
    as long as it takes). Errors that come by then (queue full, queue timeout, deadline)
    surface here, before any byte is sent, and end the requests already started; a stream
    still waiting after `patience` goes on in the response (its errors become error events),
    so a long admission or prefill wait does not hold back the headers and keep-alives."""
    streams = [router.generate(request) for request in requests]
    firsts = [asyncio.ensure_future(anext(stream)) for stream in streams]
    try:
        await asyncio.wait(firsts, timeout=patience)
        error = next((f.exception() for f in firsts if f.done() and f.exception()), None)
        if error is not None:
            raise error
    except BaseException:
        for first, stream in zip(firsts, streams, strict=True):
            await _close(first, stream)
        raise
    return [_chain(first, stream) for first, stream in zip(firsts, streams, strict=True)]


async def _close(first: asyncio.Future[GenerateOutput],
                 stream: AsyncGenerator[GenerateOutput, None]) -> None:
    """End a stream whose first output may still be pending (which aborts its request)."""
    first.cancel()
    await asyncio.gather(first, return_exceptions=True)
    await stream.aclose()


async def _collect(outputs: AsyncGenerator[GenerateOutput, None]) -> list[GenerateOutput]:
    async with aclosing(outputs):
        return [out async for out in outputs]


async def _collect_unless_disconnected(streams: list[AsyncGenerator[GenerateOutput, None]],
                                       raw: Request) -> list[list[GenerateOutput]] | None:
    """Every choice's outputs, or None if the client disconnected first (the requests are
    aborted)."""
    async def collect() -> list[list[GenerateOutput]]:
        results = await asyncio.gather(*(_collect(stream) for stream in streams),
                                       return_exceptions=True)
        error = next((r for r in results if isinstance(r, BaseException)), None)
        if error is not None:
            raise error
        return [r for r in results if not isinstance(r, BaseException)]

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
    collecting.cancel()  # closes the outputs: the router aborts the requests
    with suppress(asyncio.CancelledError):
        await collecting
    return None


async def _chain(first: asyncio.Future[GenerateOutput],
                 rest: AsyncGenerator[GenerateOutput, None]
                 ) -> AsyncGenerator[GenerateOutput, None]:
    try:
        yield await first
        async for out in rest:
            yield out
    finally:
        await _close(first, rest)


async def _merged(streams: list[AsyncGenerator[GenerateOutput, None]], idle: float | None
                  ) -> AsyncGenerator[tuple[int, GenerateOutput] | None, None]:
    """The choices' outputs as they come, tagged with the choice's index, and None after each
    `idle` seconds without one; closing it closes (and so aborts) every choice still
    running."""
    queue: asyncio.Queue[tuple[int, GenerateOutput | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncGenerator[GenerateOutput, None]) -> None:
        try:
            async with aclosing(stream):
                async for out in stream:
                    queue.put_nowait((index, out))
        except Exception as e:
            queue.put_nowait((index, e))
        finally:
            queue.put_nowait((index, None))

    tasks = [asyncio.create_task(pump(i, stream)) for i, stream in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            try:
                index, item = await asyncio.wait_for(queue.get(), idle)
            except TimeoutError:
                yield None
                continue
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _sse(builder: ResponseBuilder, streams: list[AsyncGenerator[GenerateOutput, None]],
               include_usage: bool, n: int, echo: list[str] | None, keepalive: float | None
               ) -> AsyncGenerator[str, None]:
    finals: dict[int, GenerateOutput] = {}
    async with aclosing(_merged(streams, keepalive)) as outputs:
        if builder.chat:
            for index in range(len(streams)):
                yield _event(builder.chunk(index, None, include_usage))
        pending_echo = dict(enumerate(echo or []))
        try:
            async for item in outputs:
                if item is None:  # an SSE comment, so proxies and clients see a live stream
                    yield ": keep-alive\n\n"
                    continue
                index, out = item
                if out.finish_reason in _FAILED:
                    yield _event(_failure(out)[1])
                    break
                yield _event(builder.chunk(index, out, include_usage,
                                           pending_echo.pop(index, "")))
                if out.finished:
                    finals[index] = out
            else:
                if include_usage:
                    ordered = [finals[i] for i in range(len(streams))]
                    yield _event(builder.usage_chunk(total_usage(ordered, n)))
        except RouterError as e:  # e.g. the deadline passed mid-stream
            _, type_, code = _HTTP_ERRORS.get(type(e), (500, "server_error", None))
            yield _event(error_body(str(e), type_, e.param, code))
    yield "data: [DONE]\n\n"


def _event(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body)}\n\n"


def _failure(out: GenerateOutput) -> tuple[int, dict[str, Any]]:
    """The HTTP status and OpenAI error body of a request that ended without an answer: an
    abort (the `Abort` API, or a backend that gave the request up) or a backend error.
    OpenAI has no finish_reason for either."""
    if out.finish_reason == "abort":
        tokens = out.usage.completion_tokens if out.usage else 0
        return 503, error_body(f"request {out.request_id!r} was aborted after {tokens} tokens",
                               "server_error", None, "request_aborted")
    return 500, error_body(out.error or "generation failed", "server_error")


async def _router_error(request: Request, exc: Exception) -> Response:
    error = exc if isinstance(exc, RouterError) else RouterError(str(exc))
    status, type_, code = _HTTP_ERRORS.get(type(error), (500, "server_error", None))
    retry = _RETRY_AFTER_S.get(type(error))
    return JSONResponse(error_body(str(error), type_, error.param, code), status,
                        headers=None if retry is None else {"retry-after": str(retry)})


async def _validation_error(request: Request, exc: Exception) -> Response:
    """FastAPI answers 422; OpenAI clients expect 400 with the offending field named."""
    request.app.state.router.metrics.rejected.labels(InvalidRequestError.code).inc()
    errors = exc.errors() if isinstance(exc, RequestValidationError) else []
    error = errors[0] if errors else {"loc": (), "msg": str(exc), "type": ""}
    fields = [str(part) for part in error["loc"][1:]]  # loc starts with "body"
    if error["type"] == "json_invalid":
        message, param = f"body: malformed JSON ({error['ctx']['error']})", None
    elif error["type"] == "extra_forbidden":
        param = fields[0] if fields else None
        message = f"{'.'.join(fields)}: not supported by this server"
    else:
        param = fields[0] if fields else None
        message = f"{'.'.join(fields) or 'body'}: {error['msg']}"
    return JSONResponse(error_body(message, "invalid_request_error", param), 400)


def add_auth(app: FastAPI, security: SecurityConfig) -> None:
    """Require a key (`Authorization: Bearer <key>`) on `/v1/*`, `/tokenize` and
    `/detokenize`; 401 without a valid one.

    `/health`, `/metrics` and `/version` stay open, for load balancers and scrapers.
    """
    if not security.authenticated:
        return

    @app.middleware("http")
    async def require_key(request: Request, call_next: Any) -> Response:
        if request.url.path.startswith(_KEYED):
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
    """Uvicorn serving `build_app(routers)` in the running event loop.

    The socket is bound (and listening) at construction, so `port` is known at once and
    early clients wait in the backlog rather than being refused.

    Args:
        routers: the served models' routers.
        host: interface to bind.
        port: port to bind; 0 picks a free one (see `port`).
        security: keys and TLS; None for neither.
    """

    def __init__(self, routers: Routers, host: str = "127.0.0.1", port: int = 0,
                 security: SecurityConfig | None = None) -> None:
        security = security or SecurityConfig()
        self.app = build_app(routers, security)
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
