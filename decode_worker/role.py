"""Decode policy on top of the engine's `decode` (or `mixed`) role and a `KVReceiver`.

Commands in: `Generate` (local or remote prefill) and aborts. Replies out: `Reserved` /
`Rejected` (remote prefill) and `Step` (one per engine step with every request's new
tokens; per-request errors ride inside it). All engine calls happen on the engine thread.
With tracing on, each request gets a `decode` span, a child of the router's request span:
from the moment it joins the batch (its remote KV landed, or it was added to prefill
here) to its finish. Its log lines about a request (`protocol.logs.request_log`): WARNING
when one fails (a failed KV transfer included), INFO when a moved one arrives, DEBUG for
each reservation and landing.

A request's life here, and what holds it in each state:

- queued (prefilled here: a short prompt, a colocated worker, or a migrated request that
  recomputes its streamed tokens): `handle` adds it to the engine, in the scheduler's
  `waiting` queue.
- reserved (a remote prefill): `handle` has the engine allocate its prompt's blocks
  (prefix-cache hits reused) and park it (the scheduler's `parked`,
  `WAITING_FOR_REMOTE_KV`); the receiver `expect`s KV into the missing blocks (its
  `_requests`) and `_expecting` holds when they were reserved; the router gets
  `Reserved`. A full pool answers `Rejected` and holds nothing.
- transferring: the prefill worker writes into exactly those blocks; the request stays
  parked until the receiver's event (`on_events`).
- decoding: in the scheduler's `running` list. A remote prefill gets there on
  `TransferDone` (`engine.complete_remote` with the `FirstToken` that rode with the KV;
  its first record carries the prefill's timings and the transport); a local one after
  its prefill steps. Each step's tokens leave in one `Step` (`on_outputs`).
- finished: the engine frees the blocks into its prefix cache; the last record has the
  finish reason.
- failed: a `TransferFailed` (timeout, peer lost, checksum) ends it with `error` and
  `transfer_failed` (the router retries once); its blocks are free, since the receiver
  reports a failure only once nothing can write into them.
- aborted: a request in the engine ends at once; a reservation is cancelled first
  (`_aborting`) and ends, with `abort`, when its `TransferFailed` arrives.
"""

from __future__ import annotations

import logging
import time

from engine import EngineOutput, KVCacheFullError, LLMEngine
from kv_transfer import KVReceiver, TransferDone, TransferEvent, TransferFailed
from protocol import (
    Command,
    FirstToken,
    Generate,
    Rejected,
    Reply,
    Reserved,
    Role,
    Step,
    TokenRecord,
)
from protocol.logs import request_log
from protocol.tracing import Span, Tracer
from protocol.worker_role import WorkerRole

log = logging.getLogger(__name__)


def token_record(out: EngineOutput, error: str | None = None, transfer_failed: bool = False,
                 timings: dict[str, float] | None = None,
                 transport: str | None = None) -> TokenRecord:
    """One request's part of a `Step`."""
    if error is None and out.finish_reason == "error":
        error = "the decode worker's engine step failed"
    return TokenRecord(request_id=out.request_id, token_ids=list(out.new_token_ids),
                       finish_reason=out.finish_reason, num_cached_tokens=out.num_cached_tokens,
                       logprobs=out.new_logprobs or None, error=error,
                       transfer_failed=transfer_failed, timings=timings, transport=transport)


class DecodeRole(WorkerRole):
    """Admits requests (prefilling short ones locally), receives remote KV, decodes.

    Args:
        worker_id: the worker's name.
        engine: an engine with scheduler role `decode` (or `mixed` when colocated).
        receiver: the KV receiver over this engine's pool; None when colocated.
        kv_wait_timeout_s: how long a reservation waits for its KV, from the reservation:
            it covers the prompt's wait in the prefill worker's queue, not just the bytes.
        tracer: the worker's spans; None: no tracing.
    """

    def __init__(self, worker_id: str, engine: LLMEngine, receiver: KVReceiver | None,
                 kv_wait_timeout_s: float = 600.0, tracer: Tracer | None = None) -> None:
        super().__init__(worker_id)
        self.tracer = tracer or Tracer(None, "decode")
        # a reservation's traceparent, tracestate and prompt length, until its KV lands
        self._traces: dict[str, tuple[str | None, str | None, int]] = {}
        self._spans: dict[str, Span] = {}  # decode spans, until the request finishes
        self.role = Role.DECODE if receiver is not None else Role.MIXED
        self.endpoint = receiver
        self.receiver = receiver
        self.kv_wait_timeout_s = kv_wait_timeout_s
        self.block_size = engine.cache_config.block_size
        self._expecting: dict[str, float] = {}  # request id -> when its blocks were reserved
        self._aborting: set[str] = set()

    def handle(self, engine: LLMEngine, command: Command) -> list[Reply]:
        """Take a `Generate`: prefill locally, or reserve blocks for a remote prefill.

        Returns:
            For a remote prefill, `Reserved` with the destination blocks (or `Rejected`
            when the pool is full); nothing for a local prefill.
        """
        if not isinstance(command, Generate):
            raise ValueError(f"a {self.role} worker cannot handle {type(command).__name__}")
        rid = command.request_id
        params = command.params.to_params()
        if not command.remote_prefill or self.receiver is None:
            engine.add_request(rid, command.prompt_token_ids, params, command.output_token_ids,
                               command.ttft_deadline(time.monotonic()))
            if command.output_token_ids:
                log.info("moved here: recomputing its %d prompt and %d streamed tokens",
                         len(command.prompt_token_ids), len(command.output_token_ids),
                         extra=request_log(rid))
            else:
                log.debug("queued to prefill its %d prompt tokens here",
                          len(command.prompt_token_ids), extra=request_log(rid))
            self._start_span(rid, command.traceparent, command.tracestate, local_prefill=True,
                             prompt_tokens=len(command.prompt_token_ids))
            return []
        try:
            request = engine.reserve_remote(rid, command.prompt_token_ids, params)
        except KVCacheFullError as e:
            log.debug("no blocks for a remote prefill: %s", e, extra=request_log(rid))
            return [Rejected(worker_id=self.worker_id, request_id=rid, reason=str(e))]
        skip = request.num_computed_tokens // self.block_size
        dst = request.block_ids[skip:]
        self.receiver.expect(rid, dst, timeout_s=self.kv_wait_timeout_s)
        self._expecting[rid] = time.monotonic()
        log.debug("reserved %d blocks (%d prompt tokens cached) for a remote prefill", len(dst),
                  request.num_computed_tokens, extra=request_log(rid))
        if self.tracer.enabled:
            self._traces[rid] = (command.traceparent, command.tracestate,
                                 len(command.prompt_token_ids))
        return [Reserved(worker_id=self.worker_id, request_id=rid, dst_block_ids=dst,
                         num_cached_tokens=request.num_computed_tokens)]

    def on_outputs(self, outputs: list[EngineOutput]) -> list[Reply]:
        return [self._step([token_record(out) for out in outputs])]

    def on_events(self, engine: LLMEngine, events: list[TransferEvent]) -> list[Reply]:
        """KV landed (the request joins the batch) or failed (the request ends)."""
        records = []
        for event in events:
            rid = event.request_id
            reserved = self._expecting.pop(rid, time.monotonic())
            trace = self._traces.pop(rid, (None, None, None))  # whatever the ending
            if rid in self._aborting:
                self._aborting.discard(rid)
                out = engine.abort_request(rid, "abort")
                records.extend([token_record(out)] if out else [])
            elif isinstance(event, TransferDone) and event.payload is not None:
                records.append(self._landed(engine, rid, event.payload, event.transport,
                                            reserved, trace))
            else:
                # A sender that is not a prefill worker may finish without the first token.
                reason = event.reason if isinstance(event, TransferFailed) \
                    else "the KV arrived without the first token"
                out = engine.abort_request(rid, "error")
                if out is not None:
                    records.append(token_record(out, f"KV transfer failed: {reason}",
                                                transfer_failed=True))
        return [self._step(records)] if records else []

    def _landed(self, engine: LLMEngine, rid: str, first: FirstToken, transport: str,
                reserved: float, trace: tuple[str | None, str | None, int | None]
                ) -> TokenRecord:
        """The request joins the batch; its first record carries the prefill's timings.

        Timings travel with the token, so they can never arrive after the stream ended.
        `transfer` is the time the reserved blocks waited beyond the prefill itself.
        """
        out = engine.complete_remote(rid, first.token_id)
        traceparent, tracestate, prompt_tokens = trace
        self._start_span(rid, traceparent, tracestate, local_prefill=False,
                         prompt_tokens=prompt_tokens, transport=transport)
        if first.logprobs:
            out.new_logprobs = [first.logprobs]
        prefill_s = first.prefill_s
        transfer_s = max(time.monotonic() - reserved - prefill_s, 0.0)
        log.debug("KV landed over %s (prefill %.3fs, transfer wait %.3fs)", transport,
                  prefill_s, transfer_s, extra=request_log(rid))
        return token_record(out, timings={"prefill": prefill_s, "transfer": transfer_s},
                            transport=transport)

    def abort(self, engine: LLMEngine, request_id: str) -> list[Reply]:
        """End a request; blocks still being written are freed once the transfer stops."""
        if request_id in self._expecting and self.receiver is not None:
            self._aborting.add(request_id)
            self.receiver.cancel(request_id)
            return []
        out = engine.abort_request(request_id, "abort")
        return [self._step([token_record(out)])] if out else []

    def pending(self) -> set[str]:
        return set(self._expecting)

    def _step(self, records: list[TokenRecord]) -> Step:
        for record in records:
            if record.finish_reason == "error":
                log.warning("failed: %s", record.error,
                            extra=request_log(record.request_id))
            if record.finish_reason is not None and self.tracer.enabled:
                self._end_span(record)
        return Step(worker_id=self.worker_id, outputs=records)

    def _start_span(self, rid: str, traceparent: str | None, tracestate: str | None,
                    local_prefill: bool, prompt_tokens: int | None,
                    transport: str | None = None) -> None:
        if not self.tracer.enabled:
            return
        self._spans[rid] = self.tracer.start(
            "decode", traceparent, tracestate=tracestate,
            **{"pdcluster.request_id": rid, "pdcluster.worker_id": self.worker_id,
               "pdcluster.local_prefill": local_prefill,
               "gen_ai.usage.prompt_tokens": prompt_tokens, "pdcluster.kv.transport": transport})

    def _end_span(self, record: TokenRecord) -> None:
        """Every ending of a request that joined the batch passes here: finished, aborted,
        failed (a reservation's trace is dropped when its transfer ends, `on_events`)."""
        span = self._spans.pop(record.request_id, None)
        if span is not None:
            span.end(record.error if record.finish_reason == "error" else None,
                     **{"gen_ai.response.finish_reasons": (record.finish_reason,)})
