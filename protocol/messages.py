"""Every message between the router and the workers, as typed structs over msgpack.

Router -> worker (`Command`): `Generate` (to a decode or mixed worker), `Prefill` (to a
prefill worker, after the decode worker `Reserved` its blocks), `Abort`. Both requests carry
their sampling parameters as `WireSamplingParams`, and `Prefill` the decode worker's
`protocol.kv.KVPeerInfo`.
Worker -> router (`Reply`): `Reserved` / `Rejected` (answers to a remote-prefill
`Generate`), `Step` (one per engine step: every request's new tokens), `Failed` (a request
ended outside a step), `Stats` (pushed load figures).

Request ids on the wire are the router's *attempt* ids (`attempt_id`: `<request id>@<n>`):
a request placed again (its worker died, its KV transfer failed) gets a new one, so a late
message about an earlier attempt is recognised and dropped rather than confused with the
current one.

A message that does not decode raises `msgspec.DecodeError` (or its `ValidationError`
subclass); receivers log and drop it, they never crash on it.

`WorkerInfo` travels over Ray, not these sockets: what a worker says of itself when it
starts or changes role.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import TYPE_CHECKING

import msgspec

from protocol.kv import KVPeerInfo
from protocol.status import WorkerStats

if TYPE_CHECKING:
    from engine import SamplingParams


class Role(enum.StrEnum):
    """What a worker's engine does: prefill only, decode only, or both (colocated)."""

    PREFILL = "prefill"
    DECODE = "decode"
    MIXED = "mixed"

    @property
    def decodes(self) -> bool:
        """True for the roles that stream tokens (decode and mixed)."""
        return self is not Role.PREFILL


def attempt_id(request_id: str, attempt: int) -> str:
    """The id the workers know the `attempt`-th placement of a request by."""
    return f"{request_id}@{attempt}"


def split_attempt_id(attempt: str) -> tuple[str, int | None]:
    """The client's request id and the attempt number of an `attempt_id`; an id that is
    not one is its own request id, with no attempt."""
    request_id, at, number = attempt.rpartition("@")
    return (request_id, int(number)) if at and number.isdigit() else (attempt, None)


class _Message(msgspec.Struct, kw_only=True, tag_field="type"):
    pass


class WireSamplingParams(msgspec.Struct, kw_only=True, frozen=True,
                         forbid_unknown_fields=True):
    """`engine.SamplingParams` on the wire: the same fields, the same types, no defaults of
    its own (the engine's are the only ones), so a request means the same on every worker.

    The engine cannot import msgspec, so this struct mirrors the dataclass and converts
    both ways exactly; a field on one side only fails the conversion at once (`TypeError`),
    and a field of the wrong type, or one this version does not know, fails the decode of
    the message that carries it (`msgspec.ValidationError`). Values are checked where the
    worker builds `SamplingParams` (`ValueError`, answered as `Failed`).
    """

    max_tokens: int
    min_tokens: int
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int | None
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    logprobs: int | None
    skip_special_tokens: bool
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: tuple[tuple[int, float], ...]
    json_schema: str | None

    @classmethod
    def from_params(cls, params: SamplingParams) -> WireSamplingParams:
        """The wire form of `params`.

        Raises:
            TypeError: `SamplingParams` has a field this struct lacks.
        """
        return cls(**{f.name: getattr(params, f.name) for f in dataclasses.fields(params)})

    def to_params(self) -> SamplingParams:
        """The engine's `SamplingParams` again, checked as any request's are.

        Raises:
            ValueError: a value the engine refuses (out of range, a bad JSON schema).
            TypeError: this struct has a field `SamplingParams` lacks.
        """
        from engine import SamplingParams  # the engine's sampler loads torch: not at import

        return SamplingParams(**msgspec.structs.asdict(self))


# ---- router -> worker ----------------------------------------------------------------

class _Work(_Message):
    """A request a worker computes for; `ttft_budget_s` as in `Generate`."""

    ttft_budget_s: float | None = None

    def ttft_deadline(self, received: float) -> float | None:
        """The request's first-token deadline on this worker's `time.monotonic()` clock,
        given when the command arrived; None: no objective."""
        return None if self.ttft_budget_s is None else received + self.ttft_budget_s


class Generate(_Work, tag="generate", kw_only=True):
    """Start a request on a decode (or mixed) worker.

    Args:
        request_id: the attempt id.
        prompt_token_ids: the prompt.
        params: how to sample.
        remote_prefill: reserve blocks and wait for a prefill worker's KV (answered with
            `Reserved` or `Rejected`) instead of prefilling here.
        output_token_ids: tokens already streamed to the client (a migrated request): the
            worker recomputes them with the prompt and counts them as output (`max_tokens`,
            penalties, grammar), so the stream continues where it stopped. Always prefilled
            locally.
        traceparent: the W3C `traceparent` of the router's request span when tracing is
            on (the worker's spans for the request are its children), else the client's;
            its trace id is on the worker's log lines about the request.
        tracestate: the W3C `tracestate` that came with `traceparent`: the worker's spans
            keep it in their context.
        ttft_budget_s: seconds left, when the router sent this, of the request's TTFT
            objective (`serve --slo`; negative once past it); the worker's scheduler puts
            waiting prompts that can still make theirs first. None: no objective (a
            migrated request, whose first token is out, has none).
    """

    request_id: str
    prompt_token_ids: list[int]
    params: WireSamplingParams
    remote_prefill: bool = False
    output_token_ids: list[int] = []
    traceparent: str | None = None
    tracestate: str | None = None


class Prefill(_Work, tag="prefill", kw_only=True):
    """Prefill a prompt on a prefill worker and ship its KV into reserved decode blocks.

    Args:
        request_id: the attempt id (the same as the decode worker's reservation).
        prompt_token_ids: the prompt.
        params: how to sample (the first token is sampled here).
        peer_info: the decode worker's KV receiver (`KVReceiver.peer_info`).
        dst_block_ids: the reserved blocks, prefix-cache hits left out.
        num_cached_tokens: prompt tokens the decode side already holds.
        traceparent: as in `Generate`.
        tracestate: as in `Generate`.
        ttft_budget_s: as in `Generate`, when the prefill was sent.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: WireSamplingParams
    peer_info: KVPeerInfo
    dst_block_ids: list[int]
    num_cached_tokens: int = 0
    traceparent: str | None = None
    tracestate: str | None = None


class Abort(_Message, tag="abort"):
    """End a request and free its blocks; unknown ids are ignored."""

    request_id: str


Command = Generate | Prefill | Abort


# ---- worker -> router ----------------------------------------------------------------

class TokenRecord(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One request's part of a `Step`.

    Args:
        request_id: the attempt id.
        token_ids: tokens produced this step.
        finish_reason: `stop`, `length`, `abort`, `error`, or None while running.
        num_cached_tokens: prompt tokens found in a prefix cache.
        logprobs: one map per new token when asked for.
        error: what went wrong when `finish_reason` is `error`.
        transfer_failed: the error is a failed KV transfer (the router may retry).
        timings: seconds, on the record that brings a remote prefill's first token:
            `prefill` (on the prefill worker) and `transfer` (KV wait beyond it).
        transport: on that record, the KV transport the blocks came over.
    """

    request_id: str
    token_ids: list[int] = []
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    logprobs: list[dict[int, float]] | None = None
    error: str | None = None
    transfer_failed: bool = False
    timings: dict[str, float] | None = None
    transport: str | None = None


class Reserved(_Message, tag="reserved"):
    """The decode worker holds blocks for a remote prefill."""

    worker_id: str
    request_id: str
    dst_block_ids: list[int]
    num_cached_tokens: int


class Rejected(_Message, tag="rejected"):
    """The decode worker cannot hold the prompt's KV now."""

    worker_id: str
    request_id: str
    reason: str


class Step(_Message, tag="step"):
    """One engine step's news for every request that changed."""

    worker_id: str
    outputs: list[TokenRecord]


class Failed(_Message, tag="failed"):
    """A request ended outside an engine step (a bad command, a failed prefill or transfer).

    Args:
        transfer_failed: the KV transfer failed (the router may retry elsewhere).
    """

    worker_id: str
    request_id: str
    error: str
    transfer_failed: bool = False


class Stats(_Message, tag="stats"):
    """Load, memory and utilization figures, read on the engine thread and pushed every
    `protocol.defaults.STATS_INTERVAL_S`."""

    worker_id: str
    stats: WorkerStats


Reply = Reserved | Rejected | Step | Failed | Stats
WorkerMessage = Command | Reply


# ---- worker -> cluster, over Ray ------------------------------------------------------

class WorkerInfo(msgspec.Struct, kw_only=True, frozen=True):
    """What a worker says of itself when it starts, changes role or is adopted.

    Args:
        worker_id: its name.
        role: its role now.
        endpoint: its command socket (the router pushes to it), `tcp://host:port`.
        host: the address it binds.
        pid: its process id.
        node_id: its Ray node id ("" outside Ray).
        model_dir: the model it serves, resolved to a local directory.
        max_model_len: longest prompt + output it takes.
        vocab_size: the model's vocabulary.
        block_size: tokens per KV block.
        num_blocks: blocks in its KV pool.
        block_bytes: one block's KV over all layers, as a transfer moves it.
        torch_threads: its compute threads when it started.
        tensor_parallel_size: the ranks its model is split over.
        rank_pids: the process ids of ranks 1 to N-1 (none at size 1).
        peer_info: its KV receiver (decode workers only).
    """

    worker_id: str
    role: Role
    endpoint: str
    host: str
    pid: int
    node_id: str = ""
    model_dir: str
    max_model_len: int
    vocab_size: int
    block_size: int
    num_blocks: int
    block_bytes: int
    torch_threads: int
    tensor_parallel_size: int = 1
    rank_pids: list[int] = msgspec.field(default_factory=list)
    peer_info: KVPeerInfo | None = None

_encoder = msgspec.msgpack.Encoder()
_commands = msgspec.msgpack.Decoder(Command)
_replies = msgspec.msgpack.Decoder(Reply)


def encode(message: WorkerMessage) -> bytes:
    """The message as msgpack bytes (its `type` tag included)."""
    return _encoder.encode(message)


def decode_command(data: bytes) -> Command:
    """A router -> worker message.

    Raises:
        msgspec.DecodeError: not a well-formed command.
    """
    return _commands.decode(data)


def decode_reply(data: bytes) -> Reply:
    """A worker -> router message.

    Raises:
        msgspec.DecodeError: not a well-formed reply.
    """
    return _replies.decode(data)
