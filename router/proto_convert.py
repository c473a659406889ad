"""Mapping between `pdcluster.v1` messages and the router's Python types, both directions.

Kept free of engine imports so the client stays light.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

from router.outputs import GenerateOutput, Timings, TokenLogprob, Usage
from router.proto.pdcluster.v1 import pdcluster_pb2 as pb

_OPTIONAL_PARAMS = ("max_tokens", "min_tokens", "temperature", "top_k", "top_p", "min_p",
                    "seed", "ignore_eos", "logprobs", "skip_special_tokens",
                    "presence_penalty", "frequency_penalty", "repetition_penalty",
                    "json_schema")
_REPEATED_PARAMS = ("stop", "stop_token_ids")
# Worker fields carried as typed proto fields; any other key travels in `extra_json`.
_WORKER_FIELDS = {"worker_id": str, "role": str, "state": str, "num_running": int,
                  "num_waiting": int, "num_blocks": int, "num_free_blocks": int,
                  "kv_usage": float, "prefix_hit_rate": float}
_STATUS_FIELDS = ("model", "mode", "pools", "router")
_ROUTER_FIELDS = ("num_running", "num_waiting", "max_running", "max_queue")


def params_from_proto(params: pb.SamplingParams) -> dict[str, Any]:
    """The SamplingParams fields a request set (unset ones take the router's defaults:
    the generation config's, else SamplingParams')."""
    fields = {name: getattr(params, name) for name in _OPTIONAL_PARAMS if params.HasField(name)}
    fields.update({name: list(getattr(params, name)) for name in _REPEATED_PARAMS
                   if getattr(params, name)})
    if params.logit_bias:
        fields["logit_bias"] = dict(params.logit_bias)
    return fields


def output_to_proto(out: GenerateOutput) -> pb.GenerateResponse:
    """One stream message; usage and timings only on the last."""
    msg = pb.GenerateResponse(request_id=out.request_id, text=out.text, token_ids=out.token_ids,
                              logprobs=[pb.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob,
                                                        top_logprobs=lp.top_logprobs)
                                        for lp in out.logprobs or []])
    if out.finish_reason is not None:
        msg.finish_reason = out.finish_reason
        msg.usage.CopyFrom(pb.Usage(**asdict(out.usage or Usage())))
        msg.timings.CopyFrom(pb.Timings(**asdict(out.timings or Timings())))
        msg.error = out.error or ""
    return msg


def output_from_proto(msg: pb.GenerateResponse) -> GenerateOutput:
    """The client's view of one stream message."""
    logprobs = [TokenLogprob(lp.token_id, lp.logprob, dict(lp.top_logprobs))
                for lp in msg.logprobs] or None
    if not msg.HasField("finish_reason"):
        return GenerateOutput(msg.request_id, msg.text, list(msg.token_ids), logprobs)
    usage = Usage(msg.usage.prompt_tokens, msg.usage.completion_tokens, msg.usage.cached_tokens)
    t = msg.timings
    timings = Timings(t.queue, t.prefill, t.transfer, t.ttft, t.e2e)
    return GenerateOutput(msg.request_id, msg.text, list(msg.token_ids), logprobs,
                          msg.finish_reason, usage, timings, msg.error or None)


def status_to_proto(status: dict[str, Any]) -> pb.StatusResponse:
    """Typed fields where the shape is stable; everything else as JSON."""
    pools = [pb.Pool(role=role, workers=[_worker_to_proto(role, w) for w in workers])
             for role, workers in status.get("pools", {}).items()]
    router = {k: int(v) for k, v in status.get("router", {}).items() if k in _ROUTER_FIELDS}
    rest = {k: v for k, v in status.items() if k not in _STATUS_FIELDS}
    return pb.StatusResponse(model=status.get("model", ""), mode=status.get("mode", ""),
                             pools=pools, router=pb.RouterStatus(**router),
                             extra_json=json.dumps(rest, default=str))


def _worker_to_proto(role: str, worker: dict[str, Any]) -> pb.Worker:
    typed = {k: cast(worker[k]) for k, cast in _WORKER_FIELDS.items() if k in worker}
    typed.setdefault("role", role)
    extra = {k: v for k, v in worker.items() if k not in _WORKER_FIELDS}
    return pb.Worker(**typed, extra_json=json.dumps(extra, default=str))


def status_from_proto(msg: pb.StatusResponse) -> dict[str, Any]:
    """The status dict as the router built it (extra fields merged back)."""
    pools = {pool.role: [{**json.loads(w.extra_json or "{}"),
                          **{k: getattr(w, k) for k in _WORKER_FIELDS}} for w in pool.workers]
             for pool in msg.pools}
    router = {k: getattr(msg.router, k) for k in _ROUTER_FIELDS}
    return {**json.loads(msg.extra_json or "{}"), "model": msg.model, "mode": msg.mode,
            "pools": pools, "router": router}
