"""Any host, through Mooncake's Transfer Engine: the sender writes each layer's runs straight
into the receiver's pool (TCP, or RDMA where NICs exist), then sends the header.

Each process runs one engine (`P2PHANDSHAKE`: peers exchange segment descriptors directly,
no metadata server). A receiver advertises its engine's session (`host:rpc_port`) and its
pool's base address; a sender turns destination block ids into remote addresses and issues
one batch write per layer, one entry per run, from its own pool (registered once). The
writes are submitted asynchronously, so the layers queued in one turn of the sender's IO
loop are in flight together (1.45x one at a time for 8 x 2 MiB over loopback TCP); the
channel's `flush`, before any other message to the peer and at the end of each turn, waits
for them in order and only then sends their "layer" headers. So, as with `shm`, a header
leaves only after its bytes are in the receiver's memory, and once the sender acknowledges
a failed request no write of it is still on its way.

A sender that is lost cannot acknowledge, and a write of its may still be on its way: over
TCP a write blocked by a cut link lands when the link returns, even one the sender's
engine already reported as failed. So the receiver registers only the destination slices
of each request, from its begin to its end (`MooncakePool.admit` / `revoke`), and the engine
refuses anything later.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import torch
import zmq

from kv_transfer.blocks import Run
from kv_transfer.transports.base import Landed
from kv_transfer.wire import Layer, encode
from protocol.kv import MooncakeHandle

INSTALL_HINT = ("pip install 'pdcluster[mooncake]' (mooncake-transfer-engine) and "
                "apt-get install -y libibverbs1")
# How long a write may stay blocked (a cut link, a silent host) before the engine fails it,
# in seconds; Mooncake's default is 30, all that time holding the sender's IO thread and
# every transfer behind it. The environment's MC_TRANSFER_TIMEOUT wins.
WRITE_TIMEOUT_S = 5


def default_protocol() -> str:
    """`rdma` where the kernel lists an RDMA device (`/sys/class/infiniband`), else `tcp`."""
    devices = Path("/sys/class/infiniband")
    return "rdma" if devices.is_dir() and any(devices.iterdir()) else "tcp"


def check_installed() -> None:
    """Raise `RuntimeError` naming what to install when the engine cannot be imported."""
    _engine_class()


def _engine_class() -> Any:
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")  # glog: no INFO line per connection
    os.environ.setdefault("MC_TRANSFER_TIMEOUT", str(WRITE_TIMEOUT_S))
    try:
        from mooncake.engine import TransferEngine
    except ImportError as exc:
        raise RuntimeError(f"the mooncake transport needs {INSTALL_HINT} ({exc})") from exc
    return TransferEngine


class _Engine:
    """The process's Transfer Engine and the pools registered with it (counted; endpoints
    register from their callers' threads and unregister from their IO threads)."""

    def __init__(self, host: str, protocol: str) -> None:
        self.host, self.protocol = host, protocol
        self.te = _engine_class()()
        # "" as the device: the engine discovers the RDMA NICs (and their topology) itself.
        if self.te.initialize(host, "P2PHANDSHAKE", protocol, "") != 0:
            raise RuntimeError(f"mooncake: initializing the transfer engine on {host} over "
                               f"{protocol} failed (see its log above)")
        self.session = f"{host}:{self.te.get_rpc_port()}"
        self._registered: dict[tuple[int, int], int] = {}
        self._lock = threading.Lock()

    def register(self, addr: int, nbytes: int) -> tuple[int, int]:
        key = (addr, nbytes)
        with self._lock:
            if key not in self._registered and self.te.register_memory(*key) != 0:
                raise RuntimeError(f"mooncake: registering {key[1]} bytes at {key[0]:#x} "
                                   "failed")
            self._registered[key] = self._registered.get(key, 0) + 1
        return key

    def unregister(self, key: tuple[int, int]) -> None:
        with self._lock:
            self._registered[key] -= 1
            if not self._registered[key]:
                del self._registered[key]
                self.te.unregister_memory(key[0])


_lock = threading.Lock()
_engine: _Engine | None = None


def engine(host: str, protocol: str) -> _Engine:
    """The process's engine, started on first use; every later user must agree on both.

    Raises:
        RuntimeError: the extra is missing, the engine did not start, or it runs with
            another host or protocol.
    """
    global _engine
    with _lock:
        if _engine is None:
            _engine = _Engine(host, protocol)
        elif (_engine.host, _engine.protocol) != (host, protocol):
            raise RuntimeError(f"this process's mooncake engine runs on {_engine.host} over "
                               f"{_engine.protocol}, not {host} over {protocol}")
        return _engine


class MooncakePool:
    """A receiver's KV pool as the process's engine exposes it: only the destination slices
    of requests in flight are registered, so a write that arrives after its request ended
    (one held up by a cut link, say) is refused by the engine instead of landing in blocks
    already given to another request.

    Args:
        buffer: the whole pool, `[num_layers, num_blocks, 2, block_size, H, D]`, CPU.
        host: address the engine binds and advertises.
        protocol: "tcp" or "rdma".
    """

    def __init__(self, buffer: torch.Tensor, host: str, protocol: str) -> None:
        if buffer.device.type != "cpu" or not buffer.is_contiguous():
            raise ValueError("the mooncake transport needs a contiguous CPU KV pool")
        self._engine = engine(host, protocol)
        self._base, self._nbytes = buffer.data_ptr(), buffer.nbytes
        self._num_layers = buffer.shape[0]
        self._layer_bytes, self._block_bytes = buffer[0].nbytes, buffer[0, 0].nbytes

    def handle(self) -> MooncakeHandle:
        """What a sender needs: engine session, protocol, pool base address and size."""
        return MooncakeHandle(session=self._engine.session, protocol=self._engine.protocol,
                              base=self._base, nbytes=self._nbytes)

    def admit(self, runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """Register a request's destination: each `(dst_start, num_blocks)` run, every layer.

        Returns:
            The registrations, for `revoke`.
        """
        keys: list[tuple[int, int]] = []
        try:
            for layer in range(self._num_layers):
                for start, n in runs:
                    keys.append(self._engine.register(
                        self._base + layer * self._layer_bytes + start * self._block_bytes,
                        n * self._block_bytes))
        except RuntimeError:
            self.revoke(keys)
            raise
        return keys

    def revoke(self, keys: list[tuple[int, int]]) -> None:
        """Unregister what `admit` registered: the engine refuses writes there from now on
        (one it had already accepted may still complete)."""
        for key in keys:
            self._engine.unregister(key)


class MooncakeSendChannel:
    """Batch-writes each layer's runs into the receiver's reserved blocks; `flush` sends the
    headers once the writes landed.

    Args:
        src: the sender's whole pool (registered here for the channel's lifetime).
        peer: the receiver's `MooncakePool.handle()`.
        peer_blocks: blocks in the receiver's pool.
        host: address this process's engine binds.
        protocol: this side's protocol; must equal the receiver's.

    Raises:
        ValueError: the protocols differ, or the advertised pool does not fit the layout.
    """

    def __init__(self, src: torch.Tensor, peer: MooncakeHandle, peer_blocks: int,
                 host: str, protocol: str) -> None:
        if peer.protocol != protocol:
            raise ValueError(f"the decode side's mooncake engine speaks {peer.protocol}, "
                             f"this one {protocol} (set --mooncake-protocol alike)")
        num_layers = src.shape[0]
        self._block_bytes = src[0, 0].nbytes
        self._layer_bytes = peer_blocks * self._block_bytes
        if num_layers * self._layer_bytes != peer.nbytes:
            raise ValueError(f"the peer's pool of {peer.nbytes} bytes is not "
                             f"{num_layers} layers of {peer_blocks} blocks")
        self._session, self._base = peer.session, peer.base
        self._engine = engine(host, protocol)
        self._key: tuple[int, int] | None = self._engine.register(src.data_ptr(), src.nbytes)
        # Submitted writes (batch id; None for a layer with no runs) and their headers.
        self._in_flight: list[tuple[int | None, Layer]] = []

    def send_layer(self, sock: zmq.Socket, header: Layer, src: torch.Tensor,
                   runs: list[Run]) -> None:
        if self._key is None:
            raise RuntimeError("mooncake channel already closed")
        batch = None
        if runs:
            size, base = self._block_bytes, self._base + header.layer * self._layer_bytes
            here = src.data_ptr()
            batch = self._engine.te.batch_transfer_async_write(
                self._session, [here + s * size for s, _, _ in runs],
                [base + d * size for _, d, _ in runs], [n * size for _, _, n in runs])
            if not batch:
                self._wait()  # what was submitted before ends before the peer is dropped
                raise ConnectionError(f"mooncake: a write to {self._session} could not be "
                                      "submitted (see its log)")
        self._in_flight.append((batch, header))

    def flush(self, sock: zmq.Socket) -> None:
        if not self._in_flight:
            return
        headers, failed = self._wait()
        if failed:
            raise ConnectionError(f"mooncake write to {self._session} failed (see its log)")
        for header in headers:
            sock.send(encode(header), zmq.NOBLOCK)  # Again: no connection left (peer dropped)

    def _wait(self) -> tuple[list[Layer], bool]:
        """Wait for every write in flight; their headers, and whether any failed."""
        in_flight, self._in_flight = self._in_flight, []
        failed = False
        for batch, _ in in_flight:
            if batch is not None and self._engine.te.get_batch_transfer_status([batch]) != 0:
                failed = True
        return [header for _, header in in_flight], failed

    def close(self) -> None:
        if self._key is not None:
            self._wait()
            self._engine.unregister(self._key)
            self._key = None


class MooncakeRecvChannel:
    """Nothing to do: the "layer" header arrives after the sender's write completed."""

    def recv_layer(self, sock: zmq.Socket, header: Layer, dst: torch.Tensor,
                   runs: list[tuple[int, int]], landed: Landed) -> None:
        landed(None)

    def close(self) -> None:
        """Nothing to release: the registrations belong to the receiver's requests."""
