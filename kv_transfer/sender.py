"""The prefill side: streams each layer's KV to the decode worker as soon as it is written."""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import msgspec
import zmq

from engine.kv_cache import KVCache
from kv_transfer import wire
from kv_transfer.blocks import Run, block_runs, block_sums, check_block_ids
from kv_transfer.compat import CompatRecord, KVCompatibilityError, check_compat
from kv_transfer.config import TransferConfig
from kv_transfer.endpoint import _MAX_BATCH, Endpoint
from kv_transfer.events import TransferDone, TransferEvent, TransferFailed
from kv_transfer.transports import locality, open_send_channel
from kv_transfer.transports.base import SendChannel
from protocol.kv import FirstToken, KVPeerInfo

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Peer:
    peer_id: str
    sock: zmq.Socket
    verify: bool
    last_seen: float
    last_ping: float
    welcome: Future
    channel: SendChannel | None = None  # set once the handshake and transport setup are done
    alive: bool = True


@dataclass(eq=False)
class _Outgoing:
    request_id: str
    peer_id: str
    src: list[int]
    dst: list[int]
    runs: list[Run]
    timeout_s: float
    deadline: float
    peer: _Peer | None = None
    accepted: bool = False  # the receiver answered begin_ok; bytes may move
    queued: list[int] = field(default_factory=list)  # layers ready before begin_ok
    finishing: bool = False
    payload: FirstToken | None = None


class KVSender(Endpoint):
    """Sends KV blocks layer by layer; each begun request ends in one event.

    `send_layer` only queues: the bytes move on the IO thread while the engine computes the
    next layer. `TransferDone` means the receiver has every layer (and verified checksums if
    it asked); after any event the source blocks may be freed.

    Args:
        kv_cache: the prefill engine's pool.
        compat: this engine's compatibility record.
        config: settings (`host`, timeouts, heartbeats).
    """

    def __init__(self, kv_cache: KVCache, compat: CompatRecord,
                 config: TransferConfig | None = None) -> None:
        super().__init__(kv_cache, compat, config or TransferConfig(), "sender")
        self._peers: dict[str, _Peer] = {}
        self._by_sock: dict[zmq.Socket, _Peer] = {}
        self._peer_blocks: dict[str, int] = {}  # caller-side: pool size of every peer seen
        self.peer_transports: dict[str, str] = {}  # caller-side: transport of every peer seen
        self._requests: dict[str, _Outgoing] = {}
        self._thread.start()

    def connect(self, peer_info: KVPeerInfo, transport: str | None = None) -> str:
        """Handshake with a receiver and set up the transport.

        Args:
            peer_info: the receiver's `KVReceiver.peer_info()`.
            transport: "shm", "zmq", "torch_dist" or "mooncake"; None picks shm when the
                receiver offers it and shares this host, else mooncake, torch_dist, zmq.

        Returns:
            The peer id to pass to `begin`.

        Raises:
            KVCompatibilityError: the caches differ (checked here and by the receiver).
            ConnectionError: no answer within `connect_timeout_s`, or the transport failed.
            ValueError: the transport is not offered or does not fit this pool (shm, zmq
                and mooncake need a CPU pool).
        """
        check_compat(self.compat, peer_info.compat)
        transport = transport or self._pick_transport(peer_info)
        if transport not in peer_info.transports:
            raise ValueError(f"transport {transport!r} not offered: {peer_info.transports}")
        peer_id = uuid.uuid4().hex
        welcome: Future = Future()
        hello = wire.Hello(compat=self.compat, transport=transport)
        self._call_soon(self._open_peer, peer_id, peer_info, hello, welcome)
        try:
            self._check_welcome(welcome.result(timeout=self.config.connect_timeout_s))
            pair_name = f"{peer_info.receiver_id}/{peer_id.encode().hex()}"
            channel = open_send_channel(transport, peer_info, self.kv, self.config, pair_name)
        except Exception as exc:
            self._call_soon(self._close_peer, peer_id, "the handshake failed")
            if isinstance(exc, ValueError | ConnectionError):  # incl. KVCompatibilityError
                raise
            if isinstance(exc, TimeoutError):
                raise ConnectionError(
                    f"connecting to {peer_info.endpoint} over {transport}: no welcome within "
                    f"{self.config.connect_timeout_s:g}s (is the decode side up, and does it "
                    "hold this cluster's key?)") from exc
            raise ConnectionError(f"connecting to {peer_info.endpoint} over {transport} "
                                  f"failed: {type(exc).__name__}: {exc}") from exc
        self._call(self._attach, peer_id, channel).result(timeout=self.config.connect_timeout_s)
        self._peer_blocks[peer_id] = peer_info.num_blocks
        self.peer_transports[peer_id] = transport
        return peer_id

    def is_connected(self, peer_id: str) -> bool:
        """False once the peer was lost (silent past `peer_timeout_s`, left, or refused):
        `connect` again before sending to it."""
        return peer_id in self._peers

    def begin(self, request_id: str, peer_id: str, src_block_ids: Sequence[int],
              dst_block_ids: Sequence[int], timeout_s: float | None = None) -> None:
        """Start a transfer of `src_block_ids` (here) into `dst_block_ids` (on the peer).

        Pass only the blocks the receiver lacks, pairwise: the receiver's prefix-cache hits
        are skipped by leaving them out of both lists. A partly filled last block is sent
        whole (one contiguous slice).

        Args:
            request_id: the request; the receiver must have called `expect` for it.
            peer_id: from `connect`.
            src_block_ids: source blocks in this pool.
            dst_block_ids: the receiver's reserved blocks, same length and order.
            timeout_s: deadline for the acknowledgement; `config.request_timeout_s` if None.

        Raises:
            ValueError: unknown peer, bad or mismatched block ids, or id in flight.
        """
        if peer_id not in self._peer_blocks:
            raise ValueError(f"unknown peer_id {peer_id!r}; call connect first")
        src = check_block_ids(src_block_ids, self.kv.num_blocks, "src_block_ids")
        dst = check_block_ids(dst_block_ids, self._peer_blocks[peer_id], "dst_block_ids")
        if len(src) != len(dst):
            raise ValueError(f"{len(src)} source blocks but {len(dst)} destination blocks")
        timeout_s = timeout_s or self.config.request_timeout_s
        self._claim(request_id)
        self._call_soon(self._start, _Outgoing(request_id, peer_id, src, dst, block_runs(src, dst),
                                               timeout_s, time.monotonic() + timeout_s))

    def send_layer(self, request_id: str, layer: int) -> None:
        """Queue layer `layer` of the request; call right after its KV is written.

        Args:
            request_id: a begun request; ignored if it already ended (see its event).
            layer: layer index.
        """
        if not 0 <= layer < self.kv.num_layers:
            raise ValueError(f"layer {layer} is out of range [0, {self.kv.num_layers})")
        self._call_soon(self._layer_ready, request_id, layer)

    def finish(self, request_id: str, payload: FirstToken | None = None) -> None:
        """Declare all layers sent; the receiver gets `payload` with its `TransferDone`.

        Args:
            request_id: a begun request; ignored if it already ended.
            payload: the prefill's first token, or None.

        Raises:
            TypeError: `payload` is neither a `FirstToken` nor None.
        """
        if payload is not None and not isinstance(payload, FirstToken):
            raise TypeError(f"payload must be a FirstToken or None, not "
                            f"{type(payload).__name__}")
        self._call_soon(self._finish, request_id, payload)

    def abort(self, request_id: str) -> None:
        """Stop a transfer; its `TransferFailed` follows and the receiver is told.

        Args:
            request_id: the request; unknown or ended ids are ignored.
        """
        self._call_soon(self._abort, request_id, "aborted by the prefill side")

    # ---- hooks ----

    def _layer_sums(self, layer: int, block_ids: list[int]) -> list[int]:
        """xxh3_64 per source block of `layer` (a seam for fault-injection tests)."""
        return block_sums(self.kv.layers[layer], block_ids)

    # ---- caller thread helpers ----

    @staticmethod
    def _pick_transport(peer_info: KVPeerInfo) -> str:
        offered = peer_info.transports
        if "shm" in offered and peer_info.locality == locality():
            return "shm"
        for name in ("mooncake", "torch_dist", "zmq"):
            if name in offered:
                return name
        raise ValueError(f"none of {offered} reaches this host; the receiver must offer zmq")

    @staticmethod
    def _check_welcome(welcome: wire.Welcome) -> None:
        if welcome.ok:
            return
        message = f"the decode side refused the handshake: {welcome.error}"
        if welcome.kind == "compat":
            raise KVCompatibilityError(message)
        raise ConnectionError(message)

    # ---- IO thread ----

    def _open_peer(self, peer_id: str, peer_info: KVPeerInfo, hello: wire.Hello,
                   welcome: Future) -> None:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, peer_id.encode())
        sock.setsockopt(zmq.SNDHWM, 0)  # a layer queued behind others must never block
        sock.setsockopt(zmq.RCVHWM, 0)
        self._sockets.connect(sock, peer_info.endpoint)
        self._poller.register(sock, zmq.POLLIN)
        now = time.monotonic()
        peer = _Peer(peer_id, sock, peer_info.verify_checksums, now, now, welcome)
        self._peers[peer_id] = self._by_sock[sock] = peer
        self._send(peer, hello)

    def _attach(self, peer_id: str, channel: SendChannel) -> None:
        peer = self._peers.get(peer_id)
        if peer is None:
            channel.close()
            raise ConnectionError("lost the decode peer during the handshake")
        peer.channel = channel

    def _close_peer(self, peer_id: str, reason: str) -> None:
        if peer_id in self._peers:
            self._drop_peer(self._peers[peer_id], reason)

    def _on_readable(self, sock: zmq.Socket) -> None:
        peer = self._by_sock.get(sock)
        if peer is None:
            return  # dropped earlier in this round of the loop
        for _ in range(_MAX_BATCH):
            try:
                data = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._guarded(self._dispatch, peer, data)
            if not peer.alive:
                return

    def _dispatch(self, peer: _Peer, data: bytes) -> None:
        try:
            msg = wire.decode_from_receiver(data)
        except msgspec.DecodeError as exc:
            log.warning("kv_transfer: dropped an undecodable message (%d bytes) from %s: %s",
                        len(data), peer.peer_id, exc)
            return
        peer.last_seen = time.monotonic()
        match msg:
            case wire.Welcome():
                if not peer.welcome.done():
                    peer.welcome.set_result(msg)
            case wire.BeginOk():
                self._on_begin_ok(peer, msg.rid)
            case wire.Done():
                self._end_owned(peer, msg.rid, TransferDone(msg.rid))
            case wire.Fail():
                self._on_fail(peer, msg.rid, msg.reason)
            case wire.Bye():
                self._drop_peer(peer, f"the decode side left ({msg.reason})")

    def _start(self, req: _Outgoing) -> None:
        peer = self._peers.get(req.peer_id)
        if peer is None or peer.channel is None:
            self._emit(TransferFailed(req.request_id, f"lost the decode peer {req.peer_id}"))
            return
        req.peer = peer
        self._requests[req.request_id] = req
        self._send(peer, wire.Begin(rid=req.request_id, dst=req.dst,
                                    runs=[n for _, _, n in req.runs]))

    def _layer_ready(self, request_id: str, layer: int) -> None:
        req = self._requests.get(request_id)
        if req is None:
            return
        if req.accepted:
            self._transmit(req, layer)
        else:
            req.queued.append(layer)

    def _transmit(self, req: _Outgoing, layer: int) -> None:
        if self._requests.get(req.request_id) is not req:
            return  # ended while its layers were queued
        header = wire.Layer(rid=req.request_id, layer=layer,
                            sums=self._layer_sums(layer, req.src) if req.peer.verify else None)
        try:
            req.peer.channel.send_layer(req.peer.sock, header, self.kv.layers[layer], req.runs)
        except Exception as exc:
            self._drop_peer(req.peer, f"transport error: {exc!r}")

    def _finish(self, request_id: str, payload: FirstToken | None) -> None:
        req = self._requests.get(request_id)
        if req is not None:
            req.finishing, req.payload = True, payload
            if req.accepted:
                self._send_finish(req)

    def _send_finish(self, req: _Outgoing) -> None:
        if self._requests.get(req.request_id) is req:
            self._send(req.peer, wire.Finish(rid=req.request_id, payload=req.payload))

    def _on_begin_ok(self, peer: _Peer, request_id: str) -> None:
        req = self._requests.get(request_id)
        if req is None or req.peer is not peer:
            return
        req.accepted = True
        for layer in req.queued:
            self._transmit(req, layer)
        req.queued.clear()
        if req.finishing:
            self._send_finish(req)

    def _on_fail(self, peer: _Peer, request_id: str, reason: str) -> None:
        req = self._requests.get(request_id)
        if req is None or req.peer is not peer:
            return
        self._end(req, TransferFailed(request_id, f"the decode side failed it: {reason}"))
        # The acknowledgement tells the receiver no byte of ours is still on its way.
        self._send(peer, wire.Abort(rid=request_id, reason="acknowledged"))

    def _abort(self, request_id: str, reason: str) -> None:
        req = self._requests.get(request_id)
        if req is None:
            return
        self._end(req, TransferFailed(request_id, reason))
        if req.peer.alive:
            self._send(req.peer, wire.Abort(rid=request_id, reason=reason))

    def _end_owned(self, peer: _Peer, request_id: str, event: TransferEvent) -> None:
        req = self._requests.get(request_id)
        if req is not None and req.peer is peer:
            self._end(req, event)

    def _end(self, req: _Outgoing, event: TransferEvent) -> None:
        del self._requests[req.request_id]
        self._emit(event)

    def _send(self, peer: _Peer, msg: wire.SenderMessage) -> None:
        """Queue `msg` to `peer` without blocking the IO thread.

        The queue has no bound, so a send finds no room only when the socket has no
        connection left: libzmq can end one whose handshake failed (a decode side without
        the cluster's key) for good, and a blocking send would then stall every transfer.
        That peer is dropped.
        """
        if not self._flush(peer):
            return
        try:
            peer.sock.send(wire.encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            self._drop_peer(peer, "no connection to the decode side (its handshake failed)")

    def _flush(self, peer: _Peer) -> bool:
        """Complete the peer's writes in flight and send their headers: any message to a
        peer leaves after them. False when that failed and the peer was dropped."""
        if peer.channel is None:
            return True
        try:
            peer.channel.flush(peer.sock)
        except Exception as exc:
            self._drop_peer(peer, f"transport error: {exc!r}")
            return False
        return True

    def _end_turn(self) -> None:
        for peer in list(self._peers.values()):
            self._flush(peer)

    def _drop_peer(self, peer: _Peer, reason: str) -> None:
        peer.alive = False
        self._peers.pop(peer.peer_id, None)
        self._by_sock.pop(peer.sock, None)
        self._poller.unregister(peer.sock)
        if peer.channel is not None:
            peer.channel.close()  # shm: unmaps the peer's pool; mooncake: writes end first
        with contextlib.suppress(zmq.Again):  # no connection left: nobody to say it to
            peer.sock.send(wire.encode(wire.Bye(reason=reason)), zmq.NOBLOCK)
        peer.sock.close(linger=100)
        if not peer.welcome.done():
            peer.welcome.set_exception(ConnectionError(f"lost the decode peer: {reason}"))
        for req in list(self._requests.values()):
            if req.peer is peer:
                self._end(req, TransferFailed(req.request_id, f"lost the decode peer: {reason}"))

    def _on_tick(self, now: float) -> None:
        for req in list(self._requests.values()):
            if now >= req.deadline:
                self._abort(req.request_id, f"timed out after {req.timeout_s:g}s")
        for peer in list(self._peers.values()):
            if now - peer.last_seen > self.config.peer_timeout_s:
                self._drop_peer(peer, f"silent for {self.config.peer_timeout_s:g}s")
            elif now - peer.last_ping >= self.config.heartbeat_s:
                peer.last_ping = now
                self._send(peer, wire.Ping())

    def _on_close(self) -> None:
        for request_id in list(self._requests):
            self._abort(request_id, "the prefill side closed")
        for peer in list(self._peers.values()):
            self._drop_peer(peer, "the sender closed")
