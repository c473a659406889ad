"""Request dispatch: where each request runs, and where it goes when that place fails.

`Dispatcher` places a request on a decode worker (and a prefill worker unless it is
prefilled locally), follows its attempts, streams its tokens back, and places it again
(`migrate`) when its worker dies or is drained, when its KV transfer fails (once), or to
even the load when a worker joins the decode pool (`spread_onto`). It reaches the workers
only through a `Pool` (send a command, wait for a worker to be ready), and hears from them
only through `on_message`, so it runs as well over Ray actors as over the fake pools of
its unit tests.

Every request's stream is one `RequestState`; the workers know each placement of it by
its attempt id (`<request id>@<attempt>`), so a late message about an earlier attempt is
recognised and dropped.

A request's life here, and what holds it in each state. Before it, the router's
`AdmissionQueue` holds it (queued); from `generate` to its end `requests` holds its
`RequestState` by the client's id and `_attempts` by the current attempt id.

- placing: `_place_attempt` takes a new attempt id and picks a decode worker (and a
  prefill worker for a first attempt whose uncached prompt is long). With a TTFT objective
  (`DispatchConfig.ttft_slo_s`) each command of a request with no token out yet carries
  the time left of it (`ttft_budget_s`), which orders the workers' waiting prompts.
  With no decode worker ready it waits for one being started (`Pool.wait_for_worker`),
  up to `reserve_timeout_s`.
- placed, prefilled on the decode worker: `Generate` goes to it; its handle's `in_flight`
  holds the request (`RequestState.decode`).
- reserving: for a remote prefill, `Generate(remote_prefill=True)` goes to the decode
  worker and `RequestState.reply` waits for `Reserved`, `Rejected` (asked again every
  `RESERVE_RETRY_S` until `reserve_timeout_s`), or None (that worker died: placed again).
- prefilling and transferring: on `Reserved`, `Prefill` (with the decode worker's
  `KVPeerInfo` and the reserved blocks) goes to the prefill worker, whose handle's
  `in_flight` holds it too (`RequestState.prefill`, `num_kv_blocks`).
- decoding: each `Step` record of the decode worker goes to `RequestState.queue` (the
  client's stream) and its tokens to `generated`; the first record of a remote prefill
  carries its timings and lets go of the prefill worker.
- finished: a record with a finish reason sets `finished`; the stream ends and the
  request leaves `requests`, `_attempts` and its workers' `in_flight`.
- failed: a `Failed` that is not a transfer's, a second failed transfer, or no placement
  in time ends the stream with `error`.
- migrated: its worker died or was drained (`migrate_off`), its KV transfer failed (once,
  `_retry_transfer`), or a joining worker evens the load (`spread_onto`): `migrate` aborts
  the attempt and places the request again, prefilled on the new decode worker with the
  tokens already streamed (`Generate.output_token_ids`).
- aborted: the client's abort (or its stream closing) sends `Abort` to its workers; the
  decode worker's last record ends it with `abort`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass, field
from typing import Any, Protocol

from cluster.handle import WorkerHandle
from cluster.metrics import ClusterMetrics
from engine import defaults
from protocol import (
    Abort,
    Command,
    Failed,
    Generate,
    Prefill,
    Rejected,
    Reply,
    Reserved,
    Role,
    Step,
    TokenRecord,
    WireSamplingParams,
    attempt_id,
)
from protocol.defaults import RESERVE_RETRY_S
from protocol.logs import request_log
from protocol.tracing import Tracer
from router.backend import GenerateRequest, TokenDelta
from router.placement import Placement, PrefixIndex, place_request, spread_onto

log = logging.getLogger(__name__)
# The least output a running request must have left to be moved onto a worker that joined
# the pool: a move costs the recompute of its context there and a step's wait.
MIN_TOKENS_LEFT_TO_MOVE = 32


class Pool(Protocol):
    """What dispatch needs of the worker pool."""

    workers: dict[str, WorkerHandle]

    async def send(self, handle: WorkerHandle, command: Command) -> None:
        """Send one command to the worker."""

    async def wait_for_worker(self, deadline: float) -> None:
        """Return when a worker being started is ready.

        Raises:
            RuntimeError: none is being started, or none is ready by `deadline`.
        """


@dataclass(frozen=True)
class DispatchConfig:
    """The dispatch policy.

    Args:
        local_prefill_threshold: uncached prompts this short are prefilled on the decode
            worker.
        reserve_timeout_s: how long a request may wait for decode KV to free up.
        migrate: place a dead or drained worker's requests again (else they end in error).
        block_size: tokens per KV block (the prefix index hashes whole blocks).
        ttft_slo_s: the TTFT objective (`serve --slo`): each first placement tells its
            workers how much of it is left (`ttft_budget_s`), and they serve waiting
            prompts that can still make theirs first. None: arrival order.
    """

    local_prefill_threshold: int
    reserve_timeout_s: float
    migrate: bool = True
    block_size: int = defaults.BLOCK_SIZE
    ttft_slo_s: float | None = None


@dataclass
class RequestState:
    """One request's life in the cluster, across the attempts that serve it."""

    request: GenerateRequest
    queue: asyncio.Queue[TokenDelta] = field(default_factory=asyncio.Queue)
    attempt: int = 0
    attempt_id: str = ""  # the request id the workers know (one per placement)
    generated: list[int] = field(default_factory=list)  # tokens streamed to the client
    reply: asyncio.Future[Reserved | Rejected | None] | None = None  # a reservation's answer
    decode: str | None = None
    prefill: str | None = None
    placement: Placement | None = None  # the current attempt's
    num_kv_blocks: int = 0
    timings: dict[str, float] = field(default_factory=dict)
    transfer_retries: int = 0
    finished: bool = False
    workers: list[str] = field(default_factory=list)  # every worker that served it, in order

    def served_by(self, worker_id: str) -> None:
        if worker_id not in self.workers:
            self.workers.append(worker_id)

    @property
    def tokens_left(self) -> int:
        return self.request.params.max_tokens - len(self.generated)

    def movable_from(self, worker_id: str) -> bool:
        """Decoding on `worker_id` (a token streamed: no reservation can be pending, a
        placement after the first token prefills locally) with enough left, and not a
        seeded sample: a move recomputes its context, whose logits can differ from the
        incremental ones in the last bits, enough to flip a draw that falls near a
        boundary; an undisturbed seeded run must stay reproducible."""
        params = self.request.params
        return (self.decode == worker_id and bool(self.generated) and not self.finished
                and self.tokens_left >= MIN_TOKENS_LEFT_TO_MOVE
                and (params.seed is None or params.temperature == 0))


class Dispatcher:
    """Places, streams and re-places requests over a pool of workers.

    Args:
        pool: the workers and how to reach them.
        config: the dispatch policy.
        metrics: where migrations, transfer retries, spread moves and KV transfers count.
        tracer: a `placement` span per attempt, and the `traceparent` the workers get;
            None: no tracing.
    """

    def __init__(self, pool: Pool, config: DispatchConfig, metrics: ClusterMetrics,
                 tracer: Tracer | None = None) -> None:
        self.pool = pool
        self.config = config
        self.metrics = metrics
        self.tracer = tracer or Tracer(None, "router")
        self.requests: dict[str, RequestState] = {}  # by the client's request id
        self._attempts: dict[str, RequestState] = {}  # by the attempt id the workers know
        self._prefix = PrefixIndex(config.block_size)
        self._tasks: set[asyncio.Task] = set()

    # ---- the stream a client reads ----

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenDelta]:
        """Place the request and stream its deltas; the last has a finish reason."""
        state = RequestState(request)
        self.requests[request.request_id] = state
        try:
            try:
                await self._place(state)
            except RuntimeError as e:
                yield TokenDelta(request.request_id, [], "error", error=str(e))
                return
            while True:
                delta = await state.queue.get()
                if delta.finish_reason is not None:
                    state.finished = True
                    delta.timings.update(state.timings)
                yield delta
                if delta.finish_reason is not None:
                    return
        finally:
            self.requests.pop(request.request_id, None)
            self._attempts.pop(state.attempt_id, None)
            if state.reply is not None and not state.reply.done():
                state.reply.cancel()  # a migration waiting on a reservation gives up
            if not state.finished:
                self._send_abort(state)
            self._release(state)

    def abort(self, request_id: str) -> bool:
        """Ask the request's workers to end it (its stream then ends `abort`); False if
        unknown."""
        state = self.requests.get(request_id)
        if state is None:
            return False
        self._send_abort(state)
        return True

    # ---- placement ----

    async def _place(self, state: RequestState, exclude: frozenset[str] = frozenset()) -> None:
        """`_place_attempt` inside a `placement` span (until the decode worker has the
        request, and for a remote prefill its blocks reserved and the prefill sent)."""
        span = self.tracer.start("placement", state.request.traceparent,
                                 tracestate=state.request.tracestate,
                                 **{"pdcluster.attempt": state.attempt + 1})
        try:
            await self._place_attempt(state, exclude)
        except BaseException as e:
            span.end(f"{type(e).__name__}: {e}")
            raise
        span.end(**{"pdcluster.decode_worker": state.decode,
                    "pdcluster.prefill_worker": state.prefill,
                    "pdcluster.remote_prefill": state.prefill is not None})

    async def _place_attempt(self, state: RequestState,
                             exclude: frozenset[str] = frozenset()) -> None:
        """Place the request's next attempt on a live decode worker.

        A first attempt may prefill remotely; a migrated one (tokens already streamed) is
        recomputed on its decode worker, which counts those tokens as output, so penalties,
        the grammar and `max_tokens` continue exactly where the last worker stopped.

        Raises:
            RuntimeError: no decode worker can take it (none alive, or no KV in time).
        """
        request = state.request
        self._attempts.pop(state.attempt_id, None)
        state.attempt += 1
        state.attempt_id = attempt_id(request.request_id, state.attempt)
        self._attempts[state.attempt_id] = state
        prompt = request.prompt_token_ids
        generated = list(state.generated)
        params = WireSamplingParams.from_params(request.params)
        deadline = time.monotonic() + self.config.reserve_timeout_s
        while True:
            placement = self._choose(prompt + generated, exclude, remote_prefill=not generated)
            if placement is None:
                await self.pool.wait_for_worker(deadline)
                continue
            decode = self.pool.workers[placement.decode_worker]
            state.decode, state.prefill, state.placement = decode.worker_id, None, placement
            state.served_by(decode.worker_id)
            decode.add(request.request_id)
            command = Generate(request_id=state.attempt_id, prompt_token_ids=prompt,
                               params=params, remote_prefill=placement.prefill_worker is not None,
                               output_token_ids=generated, traceparent=request.traceparent,
                               tracestate=request.tracestate,
                               ttft_budget_s=None if generated else self._ttft_budget(state))
            if not command.remote_prefill:
                await self.pool.send(decode, command)
                return
            state.reply = asyncio.get_running_loop().create_future()
            await self.pool.send(decode, command)
            reply = await state.reply
            if isinstance(reply, Reserved):
                assert placement.prefill_worker is not None
                self._start_prefill(state, placement.prefill_worker, decode, reply, params)
                return
            decode.discard(request.request_id)
            if reply is None:  # the decode worker died before answering: place again
                continue
            if time.monotonic() > deadline:
                raise RuntimeError(f"no decode KV blocks freed up in time: {reply.reason}")
            await asyncio.sleep(RESERVE_RETRY_S)

    def _choose(self, prompt: list[int], exclude: frozenset[str],
                remote_prefill: bool) -> Placement | None:
        ready = [h for h in self.pool.workers.values()
                 if h.state == "ready" and h.worker_id not in exclude]
        decode = [h.load() for h in ready if h.role.decodes]
        prefill = [h.load() for h in ready if h.role == Role.PREFILL and remote_prefill]
        return place_request(self._prefix, prompt, decode, prefill,
                             self.config.local_prefill_threshold)

    def _start_prefill(self, state: RequestState, prefill_id: str, decode: WorkerHandle,
                       reply: Reserved, params: WireSamplingParams) -> None:
        prefill = self.pool.workers.get(prefill_id)
        peer_info = decode.info.peer_info
        if prefill is None or prefill.state != "ready" or prefill.role != Role.PREFILL \
                or peer_info is None:
            # Gone, draining or changing its role since the placement (the decode worker
            # too: no KV receiver left): the decode worker prefills instead.
            self._send_nowait(decode, Abort(request_id=state.attempt_id))
            self._spawn(self.migrate(state, "its prefill worker went away", count=False))
            return
        state.prefill = prefill_id
        state.served_by(prefill_id)
        state.num_kv_blocks = len(reply.dst_block_ids)
        prefill.add(state.request.request_id)
        self._send_nowait(prefill, Prefill(
            request_id=state.attempt_id, prompt_token_ids=state.request.prompt_token_ids,
            params=params, peer_info=peer_info,
            dst_block_ids=reply.dst_block_ids, num_cached_tokens=reply.num_cached_tokens,
            traceparent=state.request.traceparent, tracestate=state.request.tracestate,
            ttft_budget_s=self._ttft_budget(state)))

    def _ttft_budget(self, state: RequestState) -> float | None:
        """Seconds left of the request's TTFT objective (since the router took it), or None
        without one."""
        slo = self.config.ttft_slo_s
        return None if slo is None else slo - (time.monotonic() - state.request.arrival_time)

    def forget(self, worker_id: str) -> None:
        """The worker left its pool (stopped, or changing its role): forget its prefixes."""
        self._prefix.forget(worker_id)

    # ---- placing again ----

    async def migrate(self, state: RequestState, why: str,
                      exclude: frozenset[str] = frozenset(), count: bool = True,
                      level: int = logging.WARNING) -> None:
        """End the request's current attempt and place it again; the client sees no seam.

        Args:
            state: the request.
            why: for the log (and the error, if it cannot be placed again).
            exclude: workers not to place it on.
            count: a migration (`pdcluster:migrations_total`); retries and spread moves
                count elsewhere.
            level: the log level.
        """
        self._send_abort(state)
        self._release(state)
        if state.finished or self.requests.get(state.request.request_id) is not state:
            return
        if not self.config.migrate:
            state.queue.put_nowait(TokenDelta(state.request.request_id, [], "error",
                                              error=why))
            return
        log.log(level, "placed again after %d tokens: %s", len(state.generated), why,
                extra=request_log(state.request.request_id, state.request.traceparent))
        if count:
            self.metrics.migrations.inc()
        try:
            await self._place(state, exclude)
        except RuntimeError as e:
            state.queue.put_nowait(TokenDelta(state.request.request_id, [], "error",
                                              error=f"{why}; placing it again failed: {e}"))

    def migrate_off(self, handle: WorkerHandle) -> None:
        """Place every request the worker (dead, or drained) still holds on other workers."""
        for request_id in list(handle.in_flight):
            state = self.requests.get(request_id)
            if state is None:
                continue
            if state.reply is not None and not state.reply.done() \
                    and state.decode == handle.worker_id:
                state.reply.set_result(None)  # `_place` is waiting on it: it places again
            elif handle.worker_id in (state.decode, state.prefill):
                self._spawn(self.migrate(state, f"worker {handle.worker_id} went away"))

    def spread_onto(self, joined: WorkerHandle) -> None:
        """Move running requests from the busier workers of the pool onto `joined`, which
        just joined it, until the pool's counts are even (`router.placement.spread_onto`).

        Without this, the requests placed before the pool grew stay at the batch that made
        it grow until they finish. Each moves like a migration: it is placed again away
        from its worker (onto `joined` unless another is less loaded), which recomputes its
        prompt and the tokens already streamed; the client's stream goes on. Only decoding
        requests move (`RequestState.movable_from`), those with the most output left first.
        """
        if not self.config.migrate or not joined.role.decodes:
            return
        counts = {h.worker_id: len(h.in_flight) for h in self.pool.workers.values()
                  if h.role == joined.role and h.state == "ready"}
        for source, n in spread_onto(counts, joined.worker_id).items():
            states = (self.requests.get(rid) for rid in self.pool.workers[source].in_flight)
            movable = sorted((s for s in states if s is not None and s.movable_from(source)),
                             key=lambda s: s.tokens_left, reverse=True)
            for state in movable[:n]:
                self.metrics.spread_moves.inc()
                self._spawn(self.migrate(state, f"moved to even the load as worker "
                                         f"{joined.worker_id} joined", frozenset({source}),
                                         count=False, level=logging.INFO))

    # ---- what the workers say ----

    def on_message(self, handle: WorkerHandle, message: Reply) -> None:
        """A worker's reply about a request (stats are the pool's)."""
        if isinstance(message, Step):
            for record in message.outputs:
                self._on_record(handle, record)
            return
        state = self._attempts.get(message.request_id)
        if state is None or message.worker_id not in (state.decode, state.prefill):
            if isinstance(message, Reserved):  # nobody waits for these blocks: free them
                self._send_nowait(handle, Abort(request_id=message.request_id))
            return  # about an attempt that was already replaced or ended
        if isinstance(message, Reserved | Rejected):
            if state.reply is not None and not state.reply.done():
                state.reply.set_result(message)
        elif isinstance(message, Failed):
            if message.transfer_failed:
                self._retry_transfer(state, message.error)
            else:
                self._fail(state, message.error)

    def _on_record(self, handle: WorkerHandle, record: TokenRecord) -> None:
        state = self._attempts.get(record.request_id)
        if state is None or state.decode != handle.worker_id:
            return
        if record.timings:  # the remote prefill's KV landed: the prefill worker is done
            state.timings.update(record.timings)
            self.metrics.transfer_seconds.observe(record.timings.get("transfer", 0.0))
            shipped = state.num_kv_blocks * handle.info.block_bytes
            self.metrics.transfer_bytes.labels(record.transport or "unknown").inc(shipped)
            self.metrics.request_transfer_bytes.labels(record.transport or "unknown").observe(
                shipped)
            self._release(state, only_prefill=True)
        if record.transfer_failed:
            self._retry_transfer(state, record.error or "KV transfer failed")
            return
        state.generated.extend(record.token_ids)
        state.queue.put_nowait(TokenDelta(
            state.request.request_id, record.token_ids, record.finish_reason, record.logprobs,
            record.num_cached_tokens, error=record.error,
            workers=tuple(state.workers) if record.finish_reason is not None else ()))
        if record.finish_reason is not None:
            # The worker let go of it. Finished now, not when the client reads this: a move
            # or migration in between would start an attempt past its end.
            state.finished = True

    def _retry_transfer(self, state: RequestState, error: str) -> None:
        """Once per request: prefill again on another prefill worker, or locally."""
        if state.transfer_retries:
            self._fail(state, error)
            return
        state.transfer_retries += 1
        self.metrics.transfer_retries.inc()
        if state.placement is not None:  # the decode worker released the blocks it reserved
            self._prefix.discard(state.request.prompt_token_ids, state.placement)
        exclude = frozenset({state.prefill} if state.prefill else ())
        self._spawn(self.migrate(state, error, exclude, count=False))

    def _fail(self, state: RequestState, error: str) -> None:
        if state.reply is not None and not state.reply.done():
            state.reply.set_exception(RuntimeError(error))
        self._send_abort(state)
        state.queue.put_nowait(TokenDelta(state.request.request_id, [], "error", error=error))

    # ---- plumbing ----

    def _send_nowait(self, handle: WorkerHandle, command: Command) -> None:
        self._spawn(self.pool.send(handle, command))

    def _send_abort(self, state: RequestState) -> None:
        for worker_id in (state.prefill, state.decode):
            handle = self.pool.workers.get(worker_id) if worker_id else None
            if handle is not None and handle.state != "dead":
                self._send_nowait(handle, Abort(request_id=state.attempt_id))

    def _release(self, state: RequestState, only_prefill: bool = False) -> None:
        """Drop the request from its workers' in-flight sets (what draining waits on)."""
        for worker_id in (state.prefill,) if only_prefill else (state.prefill, state.decode):
            handle = self.pool.workers.get(worker_id) if worker_id else None
            if handle is not None:
                handle.discard(state.request.request_id)

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def close(self) -> None:
        """Cancel what is still in flight (sends, migrations)."""
        for task in list(self._tasks):
            task.cancel()
