"""The load generator: sends requests on their arrival times and records every streamed chunk.

Two backends speak the same `stream(request)` interface:

- `GrpcBackend`: pdcluster's `pdcluster.v1.Generate` over one `grpc.aio` channel (no
  threads; every stream is a coroutine). Prompts go as token ids (or text from a trace).
- `OpenAIBackend`: any OpenAI-compatible server (pdcluster, vLLM, SGLang) through streaming
  `POST /v1/completions` with httpx. Token-id prompts go as a list of ids, which the
  completions API accepts, so both backends send identical prompts; `ignore_eos` (a vLLM
  extension) and `max_tokens` make output lengths exact, and `stream_options.include_usage`
  gives the exact token counts. The completions stream does not say how many tokens a chunk
  holds, so each chunk with text counts as one (as in vLLM's benchmark).

Every request is greedy with EOS ignored. Times are seconds on `time.perf_counter` from the
start of the run.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import aclosing, contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import grpc
import httpx
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from bench.traces import TraceRequest
from router.proto.pdcluster.v1 import pdcluster_pb2 as pb
from router.proto.pdcluster.v1 import pdcluster_pb2_grpc as pb_grpc
from router.proto_convert import output_from_proto


@dataclass
class RequestRecord:
    """What happened to one request; times in seconds since the run started.

    Args:
        index: position in the run's request list.
        arrival: when the request was scheduled to arrive.
        max_tokens: output tokens asked for.
        prompt_tokens: prompt tokens (the server's count when it reports usage).
        send: when it was sent (later than `arrival` when `max_concurrency` held it back).
        chunks: `[time, num_tokens]` of each streamed chunk that carried tokens.
        finish: when the stream ended.
        output_tokens: tokens received (the server's count when it reports usage).
        finish_reason: `stop`, `length`, `abort` or `error`; None when the stream broke.
        error: what went wrong, or None.
        server: the server's own clocks for the request, in seconds from its arrival at the
            router (`queue`, `prefill`, `transfer`, `ttft`, `e2e`: pdcluster's gRPC API sends
            them on the last message); None where the server does not report them.
    """

    index: int
    arrival: float
    max_tokens: int
    prompt_tokens: int = 0
    send: float = 0.0
    chunks: list[tuple[float, int]] = field(default_factory=list)
    finish: float = 0.0
    output_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None
    server: dict[str, float] | None = None


@dataclass(frozen=True)
class StreamEvent:
    """One message of a backend's stream, reduced to what the benchmark measures."""

    num_tokens: int = 0
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    error: str | None = None
    server: dict[str, float] | None = None


class Backend(Protocol):
    """A server under test."""

    def stream(self, request: TraceRequest) -> AsyncIterator[StreamEvent]:
        """Send one request and yield its stream's events as they arrive."""
        ...


@dataclass(frozen=True)
class LoadOptions:
    """How to drive the load.

    Args:
        max_concurrency: at most this many requests in flight (later arrivals wait); None
            for no limit.
        duration: no request is sent after this many seconds; those in flight finish.
        request_timeout: a request still streaming after this many seconds fails.
        progress: show a progress bar.
    """

    max_concurrency: int | None = None
    duration: float | None = None
    request_timeout: float = 600.0
    progress: bool = True

    def __post_init__(self) -> None:
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if self.duration is not None and not self.duration > 0:
            raise ValueError(f"duration must be > 0 seconds, got {self.duration}")
        if not self.request_timeout > 0:
            raise ValueError(f"request_timeout must be > 0 seconds, got {self.request_timeout}")


@dataclass(frozen=True)
class LoadResult:
    """The records of the requests sent, and the run's length in seconds."""

    records: list[RequestRecord]
    duration: float


async def run_load(backend: Backend, requests: Sequence[TraceRequest],
                   options: LoadOptions) -> LoadResult:
    """Send each request at its timestamp and wait for every one to end.

    Args:
        backend: the server under test.
        requests: sorted by timestamp.
        options: concurrency limit, duration cap, timeout, progress bar.

    Returns:
        One record per request sent (those arriving after `options.duration` are not), and
        the seconds from the start until the last request ended.
    """
    start = time.perf_counter()

    def clock() -> float:
        return time.perf_counter() - start

    limit = asyncio.Semaphore(options.max_concurrency) if options.max_concurrency else None
    planned = [r for r in requests if options.duration is None or r.timestamp <= options.duration]
    records = [RequestRecord(i, r.timestamp, r.output_len, r.prompt_len or 0)
               for i, r in enumerate(planned)]
    with _progress_bar(len(planned), options.progress) as advance:
        async with asyncio.TaskGroup() as tasks:
            for request, record in zip(planned, records, strict=True):
                await asyncio.sleep(request.timestamp - clock())
                tasks.create_task(_send(backend, request, record, clock, limit,
                                        options.request_timeout, advance))
    return LoadResult(records, clock())


async def _send(backend: Backend, request: TraceRequest, record: RequestRecord,
                clock: Callable[[], float], limit: asyncio.Semaphore | None, timeout: float,
                on_done: Callable[[], None]) -> None:
    async with limit or nullcontext():
        record.send = clock()
        try:
            async with asyncio.timeout(timeout), aclosing(backend.stream(request)) as events:
                async for event in events:
                    _apply(record, event, clock())
        except TimeoutError:
            record.error = f"timed out after {timeout:g} s"
        except Exception as e:  # a benchmark records a failed request and goes on
            record.error = f"{type(e).__name__}: {e}"
        record.finish = clock()
    on_done()


def _apply(record: RequestRecord, event: StreamEvent, now: float) -> None:
    if event.num_tokens:
        record.chunks.append((now, event.num_tokens))
        record.output_tokens += event.num_tokens
    if event.output_tokens is not None:
        record.output_tokens = event.output_tokens
    if event.prompt_tokens is not None:
        record.prompt_tokens = event.prompt_tokens
    record.finish_reason = event.finish_reason or record.finish_reason
    record.error = event.error or record.error
    record.server = event.server or record.server


@contextmanager
def _progress_bar(total: int, enabled: bool) -> Iterator[Callable[[], None]]:
    """Yields a function that counts one finished request."""
    columns = (TextColumn("requests"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, disable=not enabled) as progress:
        task = progress.add_task("requests", total=total)
        yield lambda: progress.advance(task)


class GrpcBackend:
    """pdcluster's gRPC front door over one `grpc.aio` channel; create it inside the loop.

    Args:
        address: `host:port`.
        api_key: sent as `authorization: Bearer <key>` when the server requires one.
    """

    def __init__(self, address: str, api_key: str | None = None) -> None:
        self._channel = grpc.aio.insecure_channel(address)
        self._stub = pb_grpc.PdClusterStub(self._channel)
        self._metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None

    async def stream(self, request: TraceRequest) -> AsyncIterator[StreamEvent]:
        """Send one request and yield its stream's events as they arrive."""
        call = self._stub.Generate(_grpc_request(request), metadata=self._metadata)
        try:
            async for msg in call:
                out = output_from_proto(msg)
                usage = out.usage
                yield StreamEvent(len(out.token_ids), out.finish_reason,
                                  usage.prompt_tokens if usage else None,
                                  usage.completion_tokens if usage else None, out.error,
                                  asdict(out.timings) if out.timings else None)
        except grpc.aio.AioRpcError as e:
            yield StreamEvent(error=f"{e.code().name}: {e.details()}")
        finally:
            call.cancel()

    async def aclose(self) -> None:
        """Close the channel (cancelling any stream still open)."""
        await self._channel.close()


def _grpc_request(request: TraceRequest) -> pb.GenerateRequest:
    params = pb.SamplingParams(max_tokens=request.output_len, temperature=0.0, ignore_eos=True)
    message = pb.GenerateRequest(sampling_params=params)
    if request.prompt is not None:
        message.prompt = request.prompt
    else:
        message.prompt_token_ids.CopyFrom(pb.TokenIds(ids=request.prompt_token_ids))
    return message


class OpenAIBackend:
    """An OpenAI-compatible server's streaming `/completions`; create it inside the loop.

    Args:
        base_url: e.g. `http://127.0.0.1:8000/v1`.
        model: the `model` field of every request.
        api_key: sent as a bearer token when given.
    """

    def __init__(self, base_url: str, model: str, api_key: str | None = None) -> None:
        self.model = model
        self._client = _http_client(base_url, api_key)

    async def stream(self, request: TraceRequest) -> AsyncIterator[StreamEvent]:
        """Send one request and yield its stream's events as they arrive."""
        body = {"model": self.model, "max_tokens": request.output_len, "temperature": 0.0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
                "prompt": request.prompt if request.prompt is not None
                else request.prompt_token_ids}
        async with self._client.stream("POST", "completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                yield StreamEvent(error=f"HTTP {response.status_code}: {_http_error(response)}")
                return
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line.removeprefix("data:").strip()
                if data == "[DONE]":
                    return
                if data:
                    yield _openai_event(json.loads(data))

    async def aclose(self) -> None:
        """Close the HTTP connections."""
        await self._client.aclose()


async def served_model(base_url: str, api_key: str | None = None) -> str:
    """The first model an OpenAI-compatible server lists at `/models`.

    Args:
        base_url: e.g. `http://127.0.0.1:8000/v1`.
        api_key: sent as a bearer token when given.

    Returns:
        Its id.
    """
    async with _http_client(base_url, api_key) as client:
        response = await client.get("models")
        response.raise_for_status()
        models = response.json().get("data") or []
    if not models:
        raise ValueError(f"{base_url}/models lists no model; pass --model")
    return str(models[0]["id"])


def _http_client(base_url: str, api_key: str | None) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    # No pool limit: a request waiting for a connection would count as server latency.
    return httpx.AsyncClient(base_url=base_url.rstrip("/") + "/", headers=headers,
                             timeout=httpx.Timeout(None, connect=30.0),
                             limits=httpx.Limits(max_connections=None,
                                                 max_keepalive_connections=None))


def _openai_event(chunk: dict[str, Any]) -> StreamEvent:
    if "error" in chunk:
        error = chunk["error"]
        return StreamEvent(error=str(error.get("message", error) if isinstance(error, dict)
                                     else error))
    choice = (chunk.get("choices") or [{}])[0]
    usage = chunk.get("usage") or {}
    return StreamEvent(1 if choice.get("text") else 0, choice.get("finish_reason"),
                       usage.get("prompt_tokens"), usage.get("completion_tokens"))


def _http_error(response: httpx.Response) -> str:
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return response.text[:200]
