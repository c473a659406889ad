"""Prefill policy on top of the engine's `prefill` role and a `KVSender`.

Messages in (from the router, as dicts): `prefill` and `abort`. Messages out: `prefilled`
(first token, timings) and `error`. All engine calls happen on the engine loop thread.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from engine import EngineOutput, LLMEngine, SamplingParams
from engine.scheduler import SchedulerOutput
from kv_transfer import KVSender, TransferDone, TransferEvent


@dataclass
class _Job:
    peer_id: str
    dst_block_ids: list[int]
    skip_blocks: int  # the decode side's prefix-cache hits: never sent
    started: float = field(default_factory=time.monotonic)
    begun: bool = False
    prefill_done: float = 0.0


class PrefillRole:
    """Runs prompts to their first token and ships the KV into reserved decode blocks.

    Args:
        engine: an engine with scheduler role `prefill`.
        sender: the KV sender over this engine's pool.
    """

    def __init__(self, engine: LLMEngine, sender: KVSender) -> None:
        self.engine = engine
        self.sender = sender
        self.block_size = engine.cache_config.block_size
        self._jobs: dict[str, _Job] = {}
        self._peers: dict[str, str] = {}  # receiver id -> sender peer id

    def connect(self, peer_info: dict[str, Any]) -> str:
        """Handshake with a decode worker once; safe to call from any thread."""
        receiver_id = peer_info["receiver_id"]
        if receiver_id not in self._peers:
            self._peers[receiver_id] = self.sender.connect(peer_info)
        return self._peers[receiver_id]

    def start(self, engine: LLMEngine, msg: dict[str, Any], peer_id: str) -> None:
        """Queue a prompt whose KV goes to `msg["dst_block_ids"]` on the decode worker."""
        rid = msg["request_id"]
        engine.add_request(rid, msg["prompt_token_ids"], SamplingParams(**msg["params"]))
        self._jobs[rid] = _Job(peer_id, msg["dst_block_ids"],
                               msg["num_cached_tokens"] // self.block_size)

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
            self.sender.send_layer(item.request.request_id, layer)

    def on_outputs(self, outputs: list[EngineOutput]) -> list[dict[str, Any]]:
        """First tokens are out: finish the transfers (the token rides along).

        A request the engine ended without a token (a failed step) is reported as an
        error, so the router ends the stream and the decode side frees its reservation.
        """
        messages = []
        for out in outputs:
            job = self._jobs.get(out.request_id)
            if job is None:
                continue
            if not out.new_token_ids:
                self._jobs.pop(out.request_id)
                if job.begun:
                    self.sender.abort(out.request_id)
                messages.append({"type": "error", "request_id": out.request_id,
                                 "error": f"prefill ended with {out.finish_reason}"})
                continue
            job.prefill_done = time.monotonic()
            logprobs = out.new_logprobs[0] if out.new_logprobs else None
            self.sender.finish(out.request_id, {"first_token": out.new_token_ids[0],
                                                "logprobs": logprobs})
            messages.append({"type": "prefilled", "request_id": out.request_id,
                             "prefill_s": job.prefill_done - job.started,
                             "prefill_end": job.prefill_done,
                             "num_cached_tokens": out.num_cached_tokens})
        return messages

    def on_events(self, engine: LLMEngine, events: list[TransferEvent]) -> list[dict[str, Any]]:
        """Transfers ended: the KV is no longer needed here either way."""
        messages = []
        for event in events:
            job = self._jobs.pop(event.request_id, None)
            engine.release(event.request_id)
            if job is None:
                continue
            message = {"type": "transferred", "request_id": event.request_id,
                       "transfer_s": time.monotonic() - (job.prefill_done or job.started),
                       "num_blocks": len(job.dst_block_ids)}
            if not isinstance(event, TransferDone):
                message = {"type": "error", "request_id": event.request_id,
                           "error": f"KV transfer failed: {event.reason}"}
            messages.append(message)
        return messages

    def abort(self, engine: LLMEngine, request_id: str) -> None:
        """Drop a request; a transfer in flight is aborted (its event then frees the KV)."""
        job = self._jobs.get(request_id)
        if job is not None and job.begun:
            self.sender.abort(request_id)
            return
        self._jobs.pop(request_id, None)
        engine.abort_request(request_id)

    def load(self) -> dict[str, float]:
        """Queued prefill work, for placement."""
        sched = self.engine.scheduler
        queued = sum(r.num_tokens - r.num_computed_tokens
                     for r in (*sched.waiting, *sched.running))
        return {"queued_prefill_tokens": queued, "num_jobs": len(self._jobs)}
