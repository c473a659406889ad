"""Prefill policy on top of the engine's `prefill` role and a `KVSender`.

Commands in: `Prefill` and aborts. Replies out: `Failed` only; the first token and the
prefill's timing travel with the KV to the decode worker (a `protocol.kv.FirstToken`),
which reports them with the token. All engine calls happen on the engine loop thread. With
tracing on, each request gets a `prefill` span (command to first token) and a
`kv_transfer` span (first layer sent to the decode side's acknowledgement: transport,
blocks, bytes), children of the router's request span. Its log lines about a request
(`protocol.logs.request_log`): WARNING when one fails, DEBUG when it is queued and shipped.

A request's life here, and what holds it in each state (the decode worker has already
reserved its destination blocks):

- connecting: on the command reader's thread, `prepare` opens a KV connection to the
  decode worker's receiver the first time one is named (`KVSender.connect`) and keeps it
  in `_peers` (receiver id -> peer id); a connection lost meanwhile is opened again.
- queued: `handle` adds it to the engine (the scheduler's `waiting` queue, with its TTFT
  deadline when the router sent a budget: `Scheduler.order_waiting` then takes first the
  prompts still in time); from here to its end `_jobs[request id]` holds its `_Job` (peer,
  destination blocks, the decode side's cached blocks to skip, spans).
- prefilling: in the scheduler's `running` list, one chunk per step; a long prompt's
  earlier chunks stay in this engine's cache.
- transferring: in the step that computes its last chunk, `layer_hook` begins the transfer
  (`_Job.begun`; the sender's `_requests` holds it) and ships each layer as soon as it is
  written. After the step the scheduler parks it (`parked`, `PREFILLED`: its blocks stay)
  and `on_outputs` finishes the transfer with the first token. A step that ended it with
  no token fails it instead (`Failed`; a begun transfer is aborted).
- shipped or failed: the transfer's event (`on_events`) releases the engine's blocks (into
  its prefix cache) and ends the job; on `TransferFailed` the router hears `Failed` with
  `transfer_failed` (it retries once elsewhere), on `TransferDone` nothing (the decode
  worker reports the token).
- aborted: before the transfer began, the job ends and the engine frees the blocks at
  once; after, the transfer is aborted (`_Job.aborted`) and its `TransferFailed` frees
  them, with no reply.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from engine import EngineOutput, LLMEngine
from engine.scheduler import SchedulerOutput
from kv_transfer import KVSender, TransferDone, TransferEvent
from protocol import Command, Failed, FirstToken, Prefill, Reply, Role
from protocol.logs import request_log
from protocol.tracing import NO_SPAN, Span, Tracer
from protocol.worker_role import RoleLoad, WorkerRole

log = logging.getLogger(__name__)


@dataclass
class _Job:
    peer_id: str
    dst_block_ids: list[int]
    skip_blocks: int  # the decode side's prefix-cache hits: never sent
    traceparent: str | None = None
    tracestate: str | None = None
    started: float = field(default_factory=time.monotonic)  # the command's arrival
    begun: bool = False
    aborted: bool = False
    span: Span = NO_SPAN  # prefill: the command to the first token
    transfer_span: Span = NO_SPAN  # the first layer sent to the transfer's end


class PrefillRole(WorkerRole):
    """Runs prompts to their first token and ships the KV into reserved decode blocks.

    Args:
        worker_id: the worker's name.
        engine: an engine with scheduler role `prefill`.
        sender: the KV sender over this engine's pool.
        tracer: the worker's spans; None: no tracing.
    """

    role = Role.PREFILL

    def __init__(self, worker_id: str, engine: LLMEngine, sender: KVSender,
                 tracer: Tracer | None = None) -> None:
        super().__init__(worker_id)
        self.endpoint = self.sender = sender
        self.block_size = engine.cache_config.block_size
        self.tracer = tracer or Tracer(None, str(self.role))
        # one block's KV over all layers, as a transfer moves it
        self.block_bytes = engine.kv_cache.block_bytes * engine.model_config.num_layers
        self._jobs: dict[str, _Job] = {}
        self._peers: dict[str, str] = {}  # receiver id -> sender peer id
        self._unreachable: dict[str, str] = {}  # request id -> why its handshake failed
        # request id -> when its command arrived (the reader thread): a command can wait
        # for the engine thread behind a long prefill step, and that wait is the prefill's
        self._received: dict[str, float] = {}

    def prepare(self, command: Command) -> None:
        """Handshake with the command's decode worker (may block on the network); again
        if the connection was lost, e.g. while that worker was stalled. A handshake that
        fails (no answer in time, the peer lost) is that request's transfer failing:
        `handle` reports it so, and the router prefills it again elsewhere."""
        if isinstance(command, Prefill):
            self._received[command.request_id] = time.monotonic()
            receiver_id = command.peer_info.receiver_id
            peer_id = self._peers.get(receiver_id)
            if peer_id is None or not self.sender.is_connected(peer_id):
                try:
                    self._peers[receiver_id] = self.sender.connect(command.peer_info)
                except ConnectionError as e:
                    self._unreachable[command.request_id] = str(e)

    def handle(self, engine: LLMEngine, command: Command) -> list[Reply]:
        """Queue a prompt whose KV goes to `command.dst_block_ids` on the decode worker."""
        if not isinstance(command, Prefill):
            raise ValueError(f"a prefill worker cannot handle {type(command).__name__}")
        rid = command.request_id
        received = self._received.pop(rid, time.monotonic())
        if rid in self._unreachable:
            return [self._failed(rid, f"KV transfer failed: {self._unreachable.pop(rid)}",
                                 transfer_failed=True)]
        engine.add_request(rid, command.prompt_token_ids, command.params.to_params(),
                           ttft_deadline=command.ttft_deadline(received))
        job = self._jobs[rid] = _Job(self._peers[command.peer_info.receiver_id],
                                     command.dst_block_ids,
                                     command.num_cached_tokens // self.block_size,
                                     command.traceparent, command.tracestate, started=received)
        log.debug("queued: %d prompt tokens, %d cached on the decode side",
                  len(command.prompt_token_ids), command.num_cached_tokens,
                  extra=request_log(rid))
        job.span = self.tracer.start(
            "prefill", command.traceparent, tracestate=command.tracestate,
            **{"pdcluster.request_id": rid, "pdcluster.worker_id": self.worker_id,
               "gen_ai.usage.prompt_tokens": len(command.prompt_token_ids),
               "pdcluster.cached_tokens": command.num_cached_tokens})
        return []

    def layer_hook(self, layer: int, schedule: SchedulerOutput) -> None:
        """After layer `layer` wrote its KV: ship it for prompts finishing this step.

        Earlier chunks of a long prompt are already in this engine's cache, so shipping
        every block at the final chunk sends each block exactly once.
        """
        for item in schedule.scheduled:
            job = self._jobs.get(item.request.request_id)
            if job is None or not item.samples:
                continue
            if not job.begun:
                src = item.request.block_ids[job.skip_blocks:]
                self.sender.begin(item.request.request_id, job.peer_id, src, job.dst_block_ids)
                job.begun = True
                job.transfer_span = self.tracer.start(
                    "kv_transfer", job.traceparent, tracestate=job.tracestate,
                    **{"pdcluster.request_id": item.request.request_id,
                       "pdcluster.worker_id": self.worker_id,
                       "pdcluster.kv.transport": self.sender.peer_transports.get(job.peer_id),
                       "pdcluster.kv.blocks": len(src),
                       "pdcluster.kv.bytes": len(src) * self.block_bytes})
            self.sender.send_layer(item.request.request_id, layer)

    def on_outputs(self, outputs: list[EngineOutput]) -> list[Reply]:
        """First tokens are out: finish the transfers (the token and timing ride along).

        A request the engine ended without a token (a failed step) is reported as failed,
        so the router ends the stream and the decode side frees its reservation.
        """
        replies: list[Reply] = []
        for out in outputs:
            job = self._jobs.get(out.request_id)
            if job is None:
                continue
            if not out.new_token_ids:
                self._jobs.pop(out.request_id)
                if job.begun:
                    self.sender.abort(out.request_id)
                error = f"prefill ended with {out.finish_reason}"
                job.span.end(error)
                job.transfer_span.end(error)
                replies.append(self._failed(out.request_id, error))
                continue
            job.span.end()
            logprobs = out.new_logprobs[0] if out.new_logprobs else None
            self.sender.finish(out.request_id, FirstToken(
                token_id=out.new_token_ids[0], logprobs=logprobs,
                prefill_s=time.monotonic() - job.started))
        return replies

    def on_events(self, engine: LLMEngine, events: list[TransferEvent]) -> list[Reply]:
        """Transfers ended: the KV is no longer needed here either way."""
        replies: list[Reply] = []
        for event in events:
            job = self._jobs.pop(event.request_id, None)
            engine.release(event.request_id)
            if job is None:
                continue
            failed = None if isinstance(event, TransferDone) else event.reason
            job.span.end(failed)  # still open when the transfer failed before the token
            job.transfer_span.end(failed)
            if failed is None:
                log.debug("KV shipped", extra=request_log(event.request_id))
            elif not job.aborted:
                replies.append(self._failed(event.request_id,
                                            f"KV transfer failed: {failed}", True))
        return replies

    def abort(self, engine: LLMEngine, request_id: str) -> list[Reply]:
        """Drop a request; a transfer in flight is aborted (its event then frees the KV)."""
        job = self._jobs.get(request_id)
        if job is not None and job.begun:
            job.aborted = True
            self.sender.abort(request_id)
            return []
        job = self._jobs.pop(request_id, None)
        if job is not None:
            job.span.end("aborted")
        engine.abort_request(request_id)
        return []

    def pending(self) -> set[str]:
        return set(self._jobs)

    def load(self, engine: LLMEngine) -> RoleLoad:
        """Queued prefill work, for placement."""
        sched = engine.scheduler
        queued = sum(r.num_tokens - r.num_computed_tokens
                     for r in (*sched.waiting, *sched.running))
        return RoleLoad(queued_prefill_tokens=queued)

    def _failed(self, request_id: str, error: str, transfer_failed: bool = False) -> Failed:
        log.warning("failed: %s", error, extra=request_log(request_id))
        return Failed(worker_id=self.worker_id, request_id=request_id, error=error,
                      transfer_failed=transfer_failed)
