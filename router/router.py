"""`Router`: the core both servers share — validation, tokenization, admission, streaming."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Mapping
from contextlib import aclosing, suppress
from dataclasses import dataclass, field, replace
from typing import Any

from engine import (
    IncrementalDetokenizer,
    SamplingParams,
    check_generation_config,
    check_request,
    fit_context,
    load_generation_defaults,
    load_tokenizer,
)
from protocol import defaults
from protocol.logs import request_log
from protocol.tracing import NO_SPAN, Span, Tracer
from router.admission import AdmissionQueue
from router.backend import Backend, GenerateRequest, TokenDelta
from router.chat import ChatTemplate
from router.errors import (
    DeadlineExceededError,
    InvalidRequestError,
    ModelNotFoundError,
    RequestNotFoundError,
    RouterError,
    UnavailableError,
)
from router.logs import log_request
from router.metrics import RouterMetrics
from router.outputs import GenerateOutput, Timings, TokenLogprob, Usage

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RouterConfig:
    """Admission limits and request defaults.

    Args:
        max_running: most requests inside the backend at once.
        max_queue: most requests waiting for admission; beyond it requests are refused at once.
        queue_timeout_s: longest wait for admission (a shorter client deadline wins);
            None waits as long as it takes.
        served_model_name: the model's name in the API (`model` fields, `/v1/models`, the
            metrics' `model_name` label); None: the name the backend loaded it by.
        request_timeout_s: longest a request may take, queue included (a shorter client
            deadline wins); past it the request is aborted everywhere. None: no limit.
        sse_keepalive_s: an HTTP stream that has sent nothing for this long sends an SSE
            comment (`: keep-alive`), e.g. while a long prompt waits for its first token;
            None sends none.
        log_prompts: the request log line also carries the prompt and the output text
            (`--log-prompts`); off, it never does.
        generation_config: where the sampling defaults of the fields a request omits come
            from (`--generation-config`, as vLLM's): `auto`, the model folder's
            generation_config.json; `vllm`, none; else a folder holding that file.
        override_generation_config: generation_config.json keys over what was read
            (`--override-generation-config`; `max_new_tokens` is max_tokens; null removes).
        chat_template: a Jinja chat template used in place of the tokenizer's
            (`--chat-template`); None: the tokenizer's.
    """

    max_running: int = defaults.MAX_RUNNING
    max_queue: int = defaults.MAX_QUEUE
    queue_timeout_s: float | None = 60.0
    served_model_name: str | None = None
    request_timeout_s: float | None = None
    sse_keepalive_s: float | None = 15.0
    log_prompts: bool = False
    generation_config: str = "auto"
    override_generation_config: Mapping[str, Any] = field(default_factory=dict)
    chat_template: str | None = None

    def __post_init__(self) -> None:
        if self.max_running < 1:
            raise ValueError(f"max_running must be >= 1, got {self.max_running}")
        if self.max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {self.max_queue}")
        for name in ("queue_timeout_s", "request_timeout_s", "sse_keepalive_s"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be > 0 or None, got {value}")
        # A plain dict: the config travels to a detached front door by pickle.
        object.__setattr__(self, "override_generation_config",
                           dict(self.override_generation_config))
        # Here, at start, rather than when the first request needs the defaults; the model
        # folder's own file (`auto`) is read once the model is known (`Router`).
        check_generation_config(self.generation_config, self.override_generation_config)


class Router:
    """Turns client requests into backend requests and backend deltas into text.

    Args:
        backend: what serves the requests (the cluster, or one in-process engine).
        config: admission limits and request defaults.
        tracer: spans for each request (`request`, `admission`, `response`); None: none.

    Raises:
        ValueError: the model folder's generation_config.json (`auto`) is unusable.
    """

    def __init__(self, backend: Backend, config: RouterConfig | None = None,
                 tracer: Tracer | None = None) -> None:
        self.backend = backend
        self.config = config or RouterConfig()
        self.tracer = tracer or Tracer(None, "router")
        self.model_info = backend.model_info()
        if self.config.served_model_name:
            self.model_info = replace(self.model_info, name=self.config.served_model_name)
        self.tokenizer = load_tokenizer(self.model_info.model_dir)
        if self.config.chat_template is not None:
            self.tokenizer.chat_template = self.config.chat_template
        self.generation = load_generation_defaults(self.config.generation_config,
                                                   self.model_info.model_dir,
                                                   self.config.override_generation_config)
        self.chat_template = ChatTemplate(self.tokenizer)
        self.admission = AdmissionQueue(self.config.max_running, self.config.max_queue)
        self.metrics = RouterMetrics(self.admission, self.model_info.name,
                                     self.model_info.max_model_len)
        self._active: dict[str, _Stream] = {}
        self.draining = False
        self._idle = asyncio.Event()
        self._idle.set()

    # ---- admission -------------------------------------------------------------------

    def prepare(self, *, prompt: str | None = None, prompt_token_ids: list[int] | None = None,
                messages: list[dict[str, Any]] | None = None,
                params: dict[str, Any] | None = None, model: str | None = None,
                request_id: str | None = None,
                tools: list[dict[str, Any]] | None = None,
                traceparent: str | None = None,
                tracestate: str | None = None,
                default_max_tokens: int | None = None) -> GenerateRequest:
        """Validate and tokenize a request; exactly one of prompt, prompt_token_ids, messages.

        Args:
            prompt: text.
            prompt_token_ids: token ids.
            messages: a chat, rendered with the model's chat template (see `router.chat`).
            params: SamplingParams fields; a missing or None field takes the generation
                config's default (`RouterConfig.generation_config`), else SamplingParams'.
            model: the model asked for; None or empty for the served one.
            request_id: the client's id; None to have one made.
            tools: OpenAI tool definitions, rendered into a chat's prompt.
            traceparent: the client's W3C `traceparent` (HTTP header or gRPC metadata):
                with tracing on, the request's span is its child; either way its trace id
                is on the request's log lines.
            tracestate: the client's W3C `tracestate`, kept in the request's spans' context.
            default_max_tokens: an omitted max_tokens when the generation config sets none
                (chat: the context's length); None: SamplingParams' (16). A max_tokens from
                either default is cut to what fits after the prompt.

        Returns:
            The request, ready for `generate`.

        Raises:
            InvalidRequestError: the message names the field and the limit.
            ModelNotFoundError: `model` is not the served model.
        """
        arrival = time.monotonic()
        try:
            self._check_model(model)
            params = params or {}
            filled = self._with_defaults(params, default_max_tokens)
            sampling = _sampling_params(filled)
            token_ids = self._prompt_token_ids(prompt, prompt_token_ids, messages, sampling,
                                               tools)
            defaulted = params.get("max_tokens") is None and "max_tokens" in filled
            sampling = self._fit_context(len(token_ids), sampling, defaulted)
            rid = _request_id(request_id)
        except RouterError as e:
            self.metrics.rejected.labels(e.code).inc()
            raise
        return GenerateRequest(rid, token_ids, sampling, arrival, traceparent, tracestate)

    def check_model(self, model: str | None) -> None:
        """Raises ModelNotFoundError unless `model` is None, empty or the served model."""
        try:
            self._check_model(model)
        except RouterError as e:
            self.metrics.rejected.labels(e.code).inc()
            raise

    def detokenize(self, token_ids: list[int]) -> str:
        """The text of `token_ids` (special tokens kept).

        Raises:
            InvalidRequestError: an id outside the vocabulary.
        """
        vocab_size = self.model_info.vocab_size
        bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(f"tokens: {bad} is not a token id (the vocabulary has "
                                      f"ids 0..{vocab_size - 1})", "tokens")
        return self.tokenizer.decode(token_ids)

    def _check_model(self, model: str | None) -> None:
        if model and model != self.model_info.name:
            raise ModelNotFoundError(f"model: {model!r} is not served here; the model is "
                                     f"{self.model_info.name!r}", "model")

    def _prompt_token_ids(self, prompt: str | None, prompt_token_ids: list[int] | None,
                          messages: list[dict[str, Any]] | None,
                          sampling: SamplingParams,
                          tools: list[dict[str, Any]] | None) -> list[int]:
        inputs = {"prompt": prompt, "prompt_token_ids": prompt_token_ids, "messages": messages}
        given = [name for name, value in inputs.items() if value is not None]
        if len(given) != 1:
            raise InvalidRequestError("prompt: give exactly one of prompt, prompt_token_ids or "
                                      f"messages (got {', '.join(given) or 'none'})")
        if prompt is not None:
            if not isinstance(prompt, str) or not prompt:
                raise InvalidRequestError("prompt: must be a non-empty string")
            _check_unicode("prompt", prompt)
            ids = self.tokenizer.encode(prompt)
        elif messages is not None:
            for i, message in enumerate(messages):
                if isinstance(message, dict):
                    for key, value in message.items():
                        _check_unicode(f"messages[{i}].{key}", value)
            ids = self.chat_template.render(messages, tools)
        else:
            ids = list(prompt_token_ids or [])
        info = self.model_info
        try:
            check_request(ids, sampling, info.vocab_size, info.max_model_len, given[0])
        except ValueError as e:
            raise InvalidRequestError(str(e)) from None
        return ids

    def _with_defaults(self, params: dict[str, Any],
                       default_max_tokens: int | None) -> dict[str, Any]:
        """`params` with the generation config's defaults, then `default_max_tokens`; a
        field still missing takes SamplingParams' default."""
        filled = {k: v for k, v in self.generation.apply(params).items() if v is not None}
        if "max_tokens" not in filled and default_max_tokens is not None:
            filled["max_tokens"] = default_max_tokens
        return filled

    def _fit_context(self, num_prompt_tokens: int, params: SamplingParams,
                     defaulted: bool) -> SamplingParams:
        """Raises InvalidRequestError when the request's own max_tokens does not fit (a
        default is cut to fit: `fit_context`)."""
        try:
            return fit_context(num_prompt_tokens, params, self.model_info.max_model_len,
                               defaulted)
        except ValueError as e:
            raise InvalidRequestError(str(e)) from None

    # ---- streaming -------------------------------------------------------------------

    async def generate(self, request: GenerateRequest,
                       timeout: float | None = None
                       ) -> AsyncGenerator[GenerateOutput, None]:
        """Admit the request and stream its outputs; the last one has a finish_reason.

        Closing the iterator early (client gone) aborts the request in the backend.

        Args:
            request: from `prepare`.
            timeout: seconds the caller will wait (e.g. a gRPC deadline); the whole request
                (admission included) is bounded by the smaller of it and
                `config.request_timeout_s`, the admission wait also by
                `config.queue_timeout_s`.

        Raises:
            InvalidRequestError: the request id is already in use.
            UnavailableError: the server is draining.
            QueueFullError: the admission queue is full.
            QueueTimeoutError: the request was not admitted in time.
            DeadlineExceededError: the request ran past its deadline (it was aborted).
        """
        limits = [t for t in (timeout, self.config.request_timeout_s) if t is not None]
        deadline = min(limits) + time.monotonic() if limits else None
        stream = self._register(request)
        try:
            if not await self._admit_traced(stream, _remaining(deadline)):
                yield stream.finish("abort")
                return
            try:
                async with aclosing(self._run(stream, deadline)) as outs:
                    async for out in outs:
                        yield out
            finally:
                self.admission.release()
                if stream.finish_reason is None:  # the consumer left early: client disconnect
                    self.metrics.aborted.labels("disconnect").inc()
                    stream.finish("abort")
        except BaseException as e:
            stream.end_trace(f"{type(e).__name__}: {e}")
            raise
        finally:
            stream.end_trace()
            del self._active[request.request_id]
            if not self._active:
                self._idle.set()

    def _register(self, request: GenerateRequest) -> _Stream:
        if self.draining:
            self.metrics.rejected.labels(UnavailableError.code).inc()
            raise UnavailableError("the server is draining (shutting down) and takes no new "
                                   "requests; retry on another replica")
        if request.request_id in self._active:
            self.metrics.rejected.labels(InvalidRequestError.code).inc()
            raise InvalidRequestError(f"request_id: {request.request_id!r} is already in use")
        stream = _Stream(self, request)
        self._active[request.request_id] = stream
        self._idle.clear()
        return stream

    async def _admit_traced(self, stream: _Stream, timeout: float | None) -> bool:
        """Open the request's span (its `traceparent` goes on to the workers) and admit
        the request inside an `admission` span."""
        request = stream.request
        stream.span = self.tracer.start(
            "request", request.traceparent, server=True, tracestate=request.tracestate,
            **{"gen_ai.request.id": request.request_id,
               "gen_ai.request.model": self.model_info.name,
               "gen_ai.request.max_tokens": request.params.max_tokens,
               "gen_ai.usage.prompt_tokens": len(request.prompt_token_ids)})
        if not self.tracer.enabled:
            return await self._admit(request, timeout)
        request.traceparent = stream.span.traceparent
        request.tracestate = stream.span.tracestate
        span = self.tracer.start("admission", request.traceparent,
                                 tracestate=request.tracestate)
        try:
            admitted = await self._admit(request, timeout)
        except RouterError as e:
            span.end(error=e.code)
            raise
        span.end(**{"pdcluster.admitted": admitted})
        return admitted

    async def _admit(self, request: GenerateRequest, timeout: float | None) -> bool:
        limits = [t for t in (timeout, self.config.queue_timeout_s) if t is not None]
        try:
            admitted = await self.admission.acquire(request.request_id, min(limits, default=None))
        except RouterError as e:
            self.metrics.rejected.labels(e.code).inc()
            raise
        self.metrics.queue_time.observe(time.monotonic() - request.arrival_time)
        return admitted

    async def _run(self, stream: _Stream, deadline: float | None
                   ) -> AsyncGenerator[GenerateOutput, None]:
        stream.admitted = time.monotonic()
        self.metrics.prompt_tokens.inc(len(stream.request.prompt_token_ids))
        try:
            async with aclosing(self.backend.generate(stream.request)) as deltas:
                while True:
                    delta = await _next_before(deltas, deadline)
                    if delta is None:
                        break
                    out = stream.take(delta)
                    if stream.stop_matched:
                        # A stop string ended the text; the backend would go on otherwise.
                        await self.backend.abort(stream.request.request_id)
                    if out is not None:
                        yield out
                    if stream.finish_reason is not None:
                        return
        except TimeoutError:
            self.metrics.aborted.labels("deadline").inc()
            stream.finish("abort")
            raise DeadlineExceededError(
                f"the request ran past its deadline after {stream.num_tokens} tokens; it was "
                "aborted") from None
        except Exception as e:
            log.exception("backend failed on the request",
                          extra=request_log(stream.request.request_id,
                                            stream.request.traceparent))
            yield stream.finish("error", f"backend failed: {e}")
            return
        yield stream.finish("error", "backend stream ended without a finish_reason")

    # ---- control ---------------------------------------------------------------------

    async def abort(self, request_id: str) -> None:
        """End a queued or running request; its stream ends with finish_reason `abort`.

        Raises:
            RequestNotFoundError: no queued or running request has this id.
        """
        stream = self._active.get(request_id)
        if stream is None:
            raise RequestNotFoundError(f"request_id: no queued or running request "
                                       f"{request_id!r}", "request_id")
        self.metrics.aborted.labels("api").inc()
        stream.abort_requested = True
        if not self.admission.cancel(request_id):
            await self.backend.abort(request_id)

    def has(self, request_id: str) -> bool:
        """Whether `request_id` is queued or running here."""
        return request_id in self._active

    async def status(self) -> dict[str, Any]:
        """The backend's status plus `model`, the router's own queue (`router`) and the
        sampling defaults in force (`generation_config`)."""
        status = await self.backend.status()
        queue = self.admission
        return {**status, "model": self.model_info.name,
                "router": {"num_running": queue.num_running, "num_waiting": queue.num_waiting,
                           "max_running": queue.max_running, "max_queue": queue.max_queue},
                "generation_config": self.generation.status()}

    async def scale(self, prefill: int | None, decode: int | None) -> dict[str, Any]:
        """Resize the pools; None leaves a pool as it is.

        Returns:
            The new status.

        Raises:
            InvalidRequestError: a size is negative or beyond what the backend allows, or
                neither is given.
            NotImplementedError: the backend cannot be resized.
        """
        if prefill is None and decode is None:
            raise InvalidRequestError("prefill: give prefill and/or decode")
        for name, size in (("prefill", prefill), ("decode", decode)):
            if size is not None and (not isinstance(size, int) or size < 0):
                raise InvalidRequestError(f"{name}: must be an integer >= 0, got {size!r}")
        try:
            await self.backend.scale(prefill, decode)
        except ValueError as e:  # the backend's own limits, e.g. "decode: must be >= 1"
            raise InvalidRequestError(str(e)) from None
        return await self.status()

    def healthy(self) -> bool:
        """False while draining or when the backend cannot take requests."""
        return not self.draining and self.backend.healthy()

    async def drain(self, timeout_s: float) -> int:
        """Take no new requests; wait up to `timeout_s` for the running ones to finish.

        Returns:
            How many requests were still running at the timeout.
        """
        self.draining = True
        with suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        return len(self._active)


class _Stream:
    """One admitted request's progress: detokenizer, counts and clocks."""

    def __init__(self, router: Router, request: GenerateRequest) -> None:
        self.router = router
        self.request = request
        self.detok = IncrementalDetokenizer(router.tokenizer, request.prompt_token_ids,
                                            request.params)
        self.admitted = request.arrival_time
        self.first_token: float | None = None
        self.last_token = 0.0
        self.num_tokens = 0
        self.num_cached_tokens = 0
        self.backend_timings: dict[str, float] = {}
        self.workers: list[str] = []
        self.abort_requested = False
        self.stop_matched = False
        self.finish_reason: str | None = None
        self.span: Span = NO_SPAN  # the request's, opened at admission
        self.response_span: Span = NO_SPAN  # first token to the last output
        self.output_text: list[str] | None = [] if router.config.log_prompts else None

    def take(self, delta: TokenDelta) -> GenerateOutput | None:
        """Fold in one backend delta; the output to send, if any."""
        taken = self.detok.num_tokens
        text = self.detok.add(delta.token_ids)
        if self.output_text is not None:
            self.output_text.append(text)
        # Fewer when a stop string ended the text within a step of several tokens.
        taken = self.detok.num_tokens - taken
        if taken < len(delta.token_ids):
            delta = replace(delta, token_ids=delta.token_ids[:taken], finish_reason=None,
                            logprobs=None if delta.logprobs is None else delta.logprobs[:taken])
        self._clock(len(delta.token_ids))
        self.num_cached_tokens = delta.num_cached_tokens
        self.backend_timings.update(delta.timings)
        self.workers += [w for w in delta.workers if w not in self.workers]
        reason = delta.finish_reason
        if reason is None and self.detok.stopped:
            reason, self.stop_matched = "stop", True
        elif reason is None and self.abort_requested:
            reason = "abort"
        out = GenerateOutput(self.request.request_id, text, list(delta.token_ids),
                             self._logprobs(delta))
        if reason is not None:
            return self.finish(reason, delta.error, out)
        return out if out.text or out.token_ids else None

    def _clock(self, num_new: int) -> None:
        if not num_new:
            return
        now = time.monotonic()
        metrics = self.router.metrics
        if self.first_token is None:
            self.first_token = now
            metrics.ttft.observe(now - self.request.arrival_time)
            self.response_span = self.router.tracer.start("response", self.request.traceparent,
                                                         tracestate=self.request.tracestate)
        else:
            metrics.itl.observe((now - self.last_token) / num_new)
        self.last_token = now
        self.num_tokens += num_new
        metrics.generation_tokens.inc(num_new)

    def _logprobs(self, delta: TokenDelta) -> list[TokenLogprob] | None:
        if delta.logprobs is None:
            return None
        top_n = self.request.params.logprobs or 0
        return [TokenLogprob(t, lp[t], dict(sorted(lp.items(), key=lambda kv: -kv[1])[:top_n]))
                for t, lp in zip(delta.token_ids, delta.logprobs, strict=True)]

    def finish(self, reason: str, error: str | None = None,
               out: GenerateOutput | None = None) -> GenerateOutput:
        """The last output: what was held back, usage and timings; records the metrics."""
        self.finish_reason = reason
        now = time.monotonic()
        arrival = self.request.arrival_time
        metrics = self.router.metrics
        metrics.finished.labels(reason).inc()
        metrics.e2e.observe(now - arrival)
        tpot = None
        if self.first_token is not None:
            metrics.prefill_time.observe(self.first_token - self.admitted)
            metrics.decode_time.observe(self.last_token - self.first_token)
            if self.num_tokens > 1:
                tpot = (self.last_token - self.first_token) / (self.num_tokens - 1)
                metrics.tpot.observe(tpot)
        last = now if self.first_token is None else self.last_token
        metrics.observe_finished(len(self.request.prompt_token_ids), self.num_tokens,
                                 last - self.admitted)
        out = out or GenerateOutput(self.request.request_id)
        timings = Timings(queue=self.admitted - arrival,
                          prefill=self.backend_timings.get("prefill", 0.0),
                          transfer=self.backend_timings.get("transfer", 0.0),
                          ttft=0.0 if self.first_token is None else self.first_token - arrival,
                          e2e=now - arrival)
        usage = Usage(len(self.request.prompt_token_ids), self.num_tokens, self.num_cached_tokens)
        flushed = self.detok.flush()
        text = out.text + flushed
        # `request_id`, and `trace_id` when the request has a trace
        fields = request_log(self.request.request_id, self.request.traceparent)["request"]
        fields |= {"model": self.router.model_info.name, "status": reason,
                   "prompt_tokens": usage.prompt_tokens,
                   "output_tokens": usage.completion_tokens,
                   "cached_tokens": usage.cached_tokens, "queue_s": timings.queue,
                   "ttft_s": None if self.first_token is None else timings.ttft,
                   "tpot_s": tpot, "e2e_s": timings.e2e, "workers": list(self.workers)}
        if self.output_text is not None:
            fields["prompt"] = self.router.tokenizer.decode(self.request.prompt_token_ids)
            fields["output"] = "".join(self.output_text) + flushed
        log_request(fields)
        error = error if reason == "error" else None
        attributes = {"gen_ai.response.finish_reasons": (reason,),
                      "gen_ai.usage.completion_tokens": usage.completion_tokens,
                      "gen_ai.usage.cached_tokens": usage.cached_tokens,
                      "pdcluster.workers": tuple(self.workers),
                      "pdcluster.ttft_s": fields["ttft_s"]}
        self.end_trace(error, **attributes)
        return GenerateOutput(out.request_id, text, out.token_ids, out.logprobs, reason, usage,
                              timings, error)

    def end_trace(self, error: str | None = None, **attributes: Any) -> None:
        """End the response and request spans (once; later calls do nothing)."""
        span, response = self.span, self.response_span
        self.span = self.response_span = NO_SPAN
        response.end(error)
        span.end(error, **attributes)


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(deadline - time.monotonic(), 0.0)


async def _next_before(deltas: AsyncGenerator[TokenDelta, None],
                       deadline: float | None) -> TokenDelta | None:
    """The next delta (None at the end); TimeoutError past `deadline` (the backend's stream
    is then cancelled, which aborts the request there)."""
    return await asyncio.wait_for(anext(deltas, None), _remaining(deadline))


def _check_unicode(field: str, value: object) -> None:
    """Text must be encodable (a lone surrogate such as "\\ud800" is not)."""
    if not isinstance(value, str):
        return
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidRequestError(f"{field}: not valid Unicode text (a lone surrogate at "
                                  f"character {e.start})", field.split("[")[0]) from None


def _sampling_params(params: dict[str, Any]) -> SamplingParams:
    try:
        return SamplingParams(**{k: v for k, v in params.items() if v is not None})
    except (TypeError, ValueError) as e:
        raise InvalidRequestError(str(e)) from None


def _request_id(request_id: str | None) -> str:
    if request_id is None:
        return f"req-{uuid.uuid4().hex}"
    if not request_id:
        raise InvalidRequestError("request_id: must not be empty when given")
    return request_id
