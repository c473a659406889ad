"""Decode policy on top of the engine's `decode` (or `mixed`) role and a `KVReceiver`.

Messages in (from the router, as dicts): `generate` (local or remote prefill) and `abort`.
Messages out: `reserved` / `rejected` (remote prefill), `step` (one per engine step with
every request's new tokens) and per-request errors inside `step`.
"""

from __future__ import annotations

from typing import Any

from engine import EngineOutput, KVCacheFullError, LLMEngine, SamplingParams
from kv_transfer import KVReceiver, TransferDone, TransferEvent


def output_record(out: EngineOutput, error: str | None = None) -> dict[str, Any]:
    """One request's part of a `step` message."""
    record = {"request_id": out.request_id, "token_ids": out.new_token_ids,
              "finish_reason": out.finish_reason, "num_cached_tokens": out.num_cached_tokens}
    if out.new_logprobs:
        record["logprobs"] = out.new_logprobs
    if error is None and out.finish_reason == "error":
        error = "the decode worker's engine step failed"
    if error:
        record["error"] = error
    return record


class DecodeRole:
    """Admits requests (prefilling short ones locally), receives remote KV, decodes.

    Args:
        engine: an engine with scheduler role `decode` (or `mixed` when colocated).
        receiver: the KV receiver over this engine's pool; None when colocated.
        kv_wait_timeout_s: how long a reservation waits for its KV, from the reservation:
            it covers the prompt's wait in the prefill worker's queue, not just the bytes.
    """

    def __init__(self, engine: LLMEngine, receiver: KVReceiver | None,
                 kv_wait_timeout_s: float = 600.0) -> None:
        self.engine = engine
        self.receiver = receiver
        self.kv_wait_timeout_s = kv_wait_timeout_s
        self.block_size = engine.cache_config.block_size
        self._expecting: set[str] = set()
        self._aborting: set[str] = set()

    def generate(self, engine: LLMEngine, msg: dict[str, Any]) -> dict[str, Any] | None:
        """Take a request: prefill locally, or reserve blocks for a remote prefill.

        Returns:
            The reply for a remote prefill (`reserved` with the destination blocks, or
            `rejected` when the pool is full); None for a local prefill.
        """
        rid = msg["request_id"]
        params = SamplingParams(**msg["params"])
        if not msg.get("remote_prefill") or self.receiver is None:
            engine.add_request(rid, msg["prompt_token_ids"], params)
            return None
        try:
            request = engine.reserve_remote(rid, msg["prompt_token_ids"], params)
        except KVCacheFullError as e:
            return {"type": "rejected", "request_id": rid, "reason": str(e)}
        skip = request.num_computed_tokens // self.block_size
        dst = request.block_ids[skip:]
        self.receiver.expect(rid, dst, timeout_s=self.kv_wait_timeout_s)
        self._expecting.add(rid)
        return {"type": "reserved", "request_id": rid, "dst_block_ids": dst,
                "num_cached_tokens": request.num_computed_tokens}

    def on_events(self, engine: LLMEngine, events: list[TransferEvent]) -> list[dict[str, Any]]:
        """KV landed (the request joins the batch) or failed (the request ends)."""
        records = []
        for event in events:
            rid = event.request_id
            self._expecting.discard(rid)
            if rid in self._aborting:
                self._aborting.discard(rid)
                out = engine.abort_request(rid, "abort")
                records.extend([output_record(out)] if out else [])
            elif isinstance(event, TransferDone):
                out = engine.complete_remote(rid, event.payload["first_token"])
                if event.payload.get("logprobs"):
                    out.new_logprobs = [event.payload["logprobs"]]
                records.append(output_record(out))
            else:
                out = engine.abort_request(rid, "error")
                if out is not None:
                    records.append(output_record(out, f"KV transfer failed: {event.reason}"))
        return records

    def abort(self, engine: LLMEngine, request_id: str) -> dict[str, Any] | None:
        """End a request; blocks still being written are freed once the transfer stops."""
        if request_id in self._expecting and self.receiver is not None:
            self._aborting.add(request_id)
            self.receiver.cancel(request_id)
            return None
        out = engine.abort_request(request_id, "abort")
        return output_record(out) if out else None
