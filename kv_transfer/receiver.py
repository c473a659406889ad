"""The decode side: lands KV in blocks it reserved, for requests it was told to expect."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial

import msgspec
import torch.distributed as dist
import zmq

from engine.kv_cache import KVCache
from kv_transfer import wire
from kv_transfer.blocks import block_sums, check_block_ids, dst_runs
from kv_transfer.compat import CompatRecord, KVCompatibilityError, check_compat
from kv_transfer.config import TransferConfig
from kv_transfer.endpoint import _MAX_BATCH, Endpoint
from kv_transfer.events import TransferDone, TransferEvent, TransferFailed
from kv_transfer.transports import locality, mooncake_protocol, open_recv_channel
from kv_transfer.transports.base import RecvChannel
from kv_transfer.transports.mooncake import MooncakePool
from kv_transfer.transports.shm import SharedKVPool
from protocol.kv import FirstToken, KVPeerInfo, StoreAddress

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Sender:
    ident: bytes
    channel: RecvChannel
    transport: str
    last_seen: float
    last_ping: float = 0.0
    alive: bool = True


@dataclass(eq=False)
class _Incoming:
    request_id: str
    dst: list[int]
    timeout_s: float
    deadline: float
    sender: _Sender | None = None
    runs: list[tuple[int, int]] = field(default_factory=list)  # (dst_start, num_blocks)
    arrived: set[int] = field(default_factory=set)  # layers in place
    sums: dict[int, list[int] | None] = field(default_factory=dict)  # layer -> its xxh3_64s
    pending: int = 0  # layers whose bytes are still moving (torch_dist)
    finished: bool = False
    payload: FirstToken | None = None
    failure: str | None = None
    acked: bool = False  # the sender confirmed it stopped writing
    admitted: list[tuple[int, int]] = field(default_factory=list)  # mooncake registrations
    grace_deadline: float = 0.0


class KVReceiver(Endpoint):
    """Receives KV into reserved blocks; each expected request ends in one event.

    Blocks are only written for a request registered with `expect`, by the one sender that
    began it, into exactly the blocks registered. A failed request's blocks are free to
    reuse once its `TransferFailed` is out: if a sender was writing, the event waits until
    it confirmed it stopped, died, or stayed silent for `peer_timeout_s`.

    Args:
        kv_cache: the decode engine's pool.
        compat: this engine's compatibility record.
        config: settings; `transports` lists what is offered.
        shm_pool: the `SharedKVPool` that allocated `kv_cache`; required exactly when "shm"
            is offered.
    """

    def __init__(self, kv_cache: KVCache, compat: CompatRecord,
                 config: TransferConfig | None = None,
                 shm_pool: SharedKVPool | None = None) -> None:
        config = config or TransferConfig()
        if ("shm" in config.transports) != (shm_pool is not None):
            raise ValueError("pass shm_pool exactly when config.transports offers 'shm'")
        if shm_pool is not None and shm_pool.nbytes != kv_cache.buffer.nbytes:
            raise ValueError("shm_pool did not allocate this KV cache")
        # First, so that a missing or failing engine leaves nothing else open.
        self._mooncake = MooncakePool(kv_cache.buffer, config.host, mooncake_protocol(config)) \
            if "mooncake" in config.transports else None
        super().__init__(kv_cache, compat, config, "receiver")
        self._shm = shm_pool
        self._id = uuid.uuid4().hex
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.RCVHWM, 0)
        self._sock.setsockopt(zmq.SNDHWM, 0)
        self._endpoint = self._sockets.bind(self._sock, f"tcp://{config.host}:0")
        self._locality = locality()
        self._poller.register(self._sock, zmq.POLLIN)
        self._store: dist.TCPStore | None = None
        self._store_addr: StoreAddress | None = None
        if "torch_dist" in config.transports:
            self._store = dist.TCPStore(config.host, 0, is_master=True, wait_for_workers=False)
            self._store_addr = StoreAddress(host=config.host, port=self._store.port)
        self._senders: dict[bytes, _Sender] = {}
        self._requests: dict[str, _Incoming] = {}
        self._thread.start()

    def peer_info(self) -> KVPeerInfo:
        """What a sender needs to connect (a `protocol` struct; send it through the router).

        Returns:
            Control endpoint, compatibility record, pool size, offered transports, and the
            shared-memory handle / rendezvous store / registered mooncake pool when those
            are offered.
        """
        return KVPeerInfo(
            receiver_id=self._id, endpoint=self._endpoint, compat=self.compat,
            num_blocks=self.kv.num_blocks, transports=tuple(self.config.transports),
            verify_checksums=self.config.verify_checksums, locality=self._locality,
            shm=self._shm.handle() if self._shm is not None else None,
            store=self._store_addr,
            mooncake=self._mooncake.handle() if self._mooncake is not None else None)

    def expect(self, request_id: str, dst_block_ids: Sequence[int],
               timeout_s: float | None = None) -> None:
        """Register that KV for `request_id` will land in `dst_block_ids`.

        Call before the sender is told to start. Pass only the blocks still missing (not
        the prefix-cache hits), in the order the sender will pass them; every layer of
        the pool is transferred.

        Args:
            request_id: the request.
            dst_block_ids: reserved destination blocks.
            timeout_s: deadline for the whole transfer; `config.request_timeout_s` if None.

        Raises:
            ValueError: a block id is out of range or repeated, or the id is in flight.
        """
        dst = check_block_ids(dst_block_ids, self.kv.num_blocks, "dst_block_ids")
        timeout_s = timeout_s or self.config.request_timeout_s
        self._claim(request_id)
        req = _Incoming(request_id, dst, timeout_s, time.monotonic() + timeout_s)
        self._call_soon(self._register, req)

    def cancel(self, request_id: str) -> None:
        """Give up on a request; its `TransferFailed` follows (free the blocks then).

        Args:
            request_id: the request; unknown or ended ids are ignored.
        """
        self._call_soon(self._cancel, request_id)

    # ---- IO thread ----

    def _register(self, req: _Incoming) -> None:
        self._requests[req.request_id] = req

    def _cancel(self, request_id: str) -> None:
        req = self._requests.get(request_id)
        if req is not None:
            self._fail(req, "cancelled by the decode side")

    def _on_readable(self, sock: zmq.Socket) -> None:
        for _ in range(_MAX_BATCH):
            try:
                ident = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            if sock.get(zmq.RCVMORE):
                self._guarded(self._dispatch, ident, sock)
            while sock.get(zmq.RCVMORE):  # frames of a message we did not consume
                sock.recv(copy=False)

    def _dispatch(self, ident: bytes, sock: zmq.Socket) -> None:
        data = sock.recv(zmq.NOBLOCK)
        sender = self._senders.get(ident)
        try:
            msg = wire.decode_from_sender(data)
        except msgspec.DecodeError as exc:
            log.warning("kv_transfer: dropped an undecodable message (%d bytes) from %s: %s",
                        len(data), ident.hex(), exc)
            if sender is None:  # a hello of another version: say why it gets no welcome
                self._reply(ident, wire.Welcome(ok=False, kind="protocol",
                                                error=f"undecodable hello: {exc}"))
            return
        if isinstance(msg, wire.Hello):
            self._on_hello(ident, msg)
            return
        if sender is None:
            if isinstance(msg, wire.Begin):
                self._reply(ident, wire.Fail(rid=msg.rid, reason="not connected"))
            return
        sender.last_seen = time.monotonic()
        match msg:
            case wire.Begin():
                self._on_begin(sender, msg)
            case wire.Layer():
                self._on_layer(sender, msg, sock)
            case wire.Finish():
                self._on_finish(sender, msg)
            case wire.Abort():
                self._on_abort(sender, msg)
            case wire.Bye():
                self._drop_sender(sender, "the sender closed")

    def _on_hello(self, ident: bytes, msg: wire.Hello) -> None:
        try:
            check_compat(self.compat, msg.compat)
        except KVCompatibilityError as exc:
            log.warning("kv_transfer: refused sender %s: %s", ident.hex(), exc)
            self._reply(ident, wire.Welcome(ok=False, kind="compat", error=str(exc)))
            return
        transport = msg.transport
        if transport not in self.config.transports:
            error = f"transport {transport!r} not offered (offered: {self.config.transports})"
            self._reply(ident, wire.Welcome(ok=False, kind="transport", error=error))
            return
        channel = open_recv_channel(transport, self._store_addr, self.kv, self.config,
                                    f"{self._id}/{ident.hex()}", self._call_soon)
        now = time.monotonic()
        self._senders[ident] = _Sender(ident, channel, transport, last_seen=now, last_ping=now)
        self._reply(ident, wire.Welcome(ok=True))

    def _on_begin(self, sender: _Sender, msg: wire.Begin) -> None:
        rid = msg.rid
        if rid not in self._requests:
            self._run_calls()  # an expect() made before this begin may still be queued
        req = self._requests.get(rid)
        if req is None or req.sender is not None or req.failure is not None:
            reason = "the decode side does not expect this request (unknown, begun or ended)"
            self._reply(sender.ident, wire.Fail(rid=rid, reason=reason))
            return
        req.sender = sender
        try:
            if msg.dst != req.dst:
                raise ValueError(f"destination blocks {msg.dst} != reserved {req.dst}")
            req.runs = dst_runs(req.dst, msg.runs)
        except (ValueError, TypeError) as exc:
            self._fail(req, f"begin does not match the reservation: {exc}")
            return
        if sender.transport == "mooncake":  # its writes are accepted from here to _end
            try:
                req.admitted = self._mooncake.admit(req.runs)
            except RuntimeError as exc:
                self._fail(req, str(exc))
                return
        self._reply(sender.ident, wire.BeginOk(rid=rid))

    def _on_layer(self, sender: _Sender, msg: wire.Layer, sock: zmq.Socket) -> None:
        req = self._requests.get(msg.rid)
        if req is None or req.sender is not sender:
            # Only a sender that ignored our "fail" gets here; its bytes (possibly already
            # bound for our memory on torch_dist) cannot be trusted.
            self._drop_sender(sender, f"sent a layer for {msg.rid!r}, which it does not own")
            return
        layer = msg.layer
        if not 0 <= layer < self.kv.num_layers:
            self._fail(req, f"layer {layer!r} is out of range")
            return
        req.sums[layer] = msg.sums
        req.pending += 1
        try:
            sender.channel.recv_layer(sock, msg, self.kv.layers[layer], req.runs,
                                      partial(self._landed, req, layer))
        except Exception as exc:
            req.pending -= 1
            self._drop_sender(sender, f"transport error: {exc}")

    def _landed(self, req: _Incoming, layer: int, error: str | None) -> None:
        req.pending -= 1
        if error is None:
            req.arrived.add(layer)
            self._settle(req)
        else:
            self._fail(req, error)

    def _on_finish(self, sender: _Sender, msg: wire.Finish) -> None:
        req = self._requests.get(msg.rid)
        if req is not None and req.sender is sender:
            req.finished = True
            req.payload = msg.payload
            self._settle(req)

    def _on_abort(self, sender: _Sender, msg: wire.Abort) -> None:
        req = self._requests.get(msg.rid)
        if req is not None and req.sender is sender:
            req.acked = True
            self._fail(req, f"aborted by the sender: {msg.reason}")

    def _fail(self, req: _Incoming, reason: str) -> None:
        if req.failure is None:
            req.failure = reason
            req.grace_deadline = time.monotonic() + self.config.peer_timeout_s
            if req.sender is not None and req.sender.alive and not req.acked:
                self._reply(req.sender.ident, wire.Fail(rid=req.request_id, reason=reason))
        self._settle(req)

    def _settle(self, req: _Incoming) -> None:
        """End the request if nothing can write into its blocks any more."""
        if req.pending or self._requests.get(req.request_id) is not req:
            return
        if req.failure is not None:
            quiet = req.sender is None or req.acked or req.finished or not req.sender.alive
            if quiet or time.monotonic() >= req.grace_deadline:
                self._end(req, TransferFailed(req.request_id, req.failure))
        elif req.finished:
            error = self._check_complete(req)
            if error is not None:
                self._fail(req, error)
                return
            self._end(req, TransferDone(req.request_id, req.payload, req.sender.transport))
            self._reply(req.sender.ident, wire.Done(rid=req.request_id))

    def _check_complete(self, req: _Incoming) -> str | None:
        missing = [layer for layer in range(self.kv.num_layers) if layer not in req.arrived]
        if missing:
            return f"the sender finished without layers {missing}"
        if not self.config.verify_checksums:
            return None
        for layer in range(self.kv.num_layers):
            sent = req.sums.get(layer)
            if sent is None or len(sent) != len(req.dst):
                return f"the sender sent no checksums for layer {layer}"
            got = block_sums(self.kv.layers[layer], req.dst)
            for block, want, have in zip(req.dst, sent, got, strict=True):
                if want != have:
                    return (f"checksum mismatch in layer {layer}, block {block}: "
                            f"xxh3_64 {want:#018x} sent, {have:#018x} received")
        return None

    def _end(self, req: _Incoming, event: TransferEvent) -> None:
        if req.admitted:
            self._mooncake.revoke(req.admitted)  # the engine refuses late writes from now on
        del self._requests[req.request_id]
        self._emit(event)

    def _drop_sender(self, sender: _Sender, reason: str) -> None:
        sender.alive = False
        self._senders.pop(sender.ident, None)
        self._reply(sender.ident, wire.Bye(reason=reason))
        sender.channel.close()
        for req in list(self._requests.values()):
            if req.sender is sender:
                self._fail(req, f"lost the sender: {reason}")

    def _end_turn(self) -> None:
        """Nothing is left to finish: a layer is landed when its header is handled."""

    def _on_tick(self, now: float) -> None:
        for req in list(self._requests.values()):
            if req.failure is None and now >= req.deadline:
                self._fail(req, f"timed out after {req.timeout_s:g}s with {len(req.arrived)} "
                                f"of {self.kv.num_layers} layers received")
            elif req.failure is not None:
                self._settle(req)
        for sender in list(self._senders.values()):
            if now - sender.last_seen > self.config.peer_timeout_s:
                self._drop_sender(sender, f"silent for {self.config.peer_timeout_s:g}s")
            elif now - sender.last_ping >= self.config.heartbeat_s:
                sender.last_ping = now
                self._reply(sender.ident, wire.Ping())

    def _on_close(self) -> None:
        for req in list(self._requests.values()):
            self._end(req, TransferFailed(req.request_id, "the receiver closed"))
        for sender in list(self._senders.values()):
            self._reply(sender.ident, wire.Bye(reason="the receiver closed"))
            sender.channel.close()
        self._senders.clear()
        self._store = None

    def _reply(self, ident: bytes, msg: wire.ReceiverMessage) -> None:
        self._sock.send_multipart([ident, wire.encode(msg)])
