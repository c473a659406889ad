"""Transports: `shm` (same host), `zmq` (TCP, any host), `torch_dist` (gloo / NCCL),
`mooncake` (Mooncake's Transfer Engine: TCP or RDMA, any host).

Control messages always travel over ZMQ; a transport only decides how a layer's bytes move.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TypeVar

from engine.kv_cache import KVCache
from kv_transfer.config import TransferConfig
from kv_transfer.transports.base import RecvChannel, SendChannel
from kv_transfer.transports.mooncake import (
    MooncakeRecvChannel,
    MooncakeSendChannel,
    default_protocol,
)
from kv_transfer.transports.shm import ShmRecvChannel, ShmSendChannel, map_peer_pool
from kv_transfer.transports.torch_dist import (
    SENDER_RANK,
    DistRecvChannel,
    DistSendChannel,
    open_pair_group,
)
from kv_transfer.transports.zmq_tcp import ZmqRecvChannel, ZmqSendChannel
from protocol.kv import KVPeerInfo, StoreAddress

_Handle = TypeVar("_Handle")


def locality() -> str:
    """Equal for two processes exactly when one can map the other's `/proc/<pid>/fd`."""
    with open("/proc/sys/kernel/random/boot_id") as f:
        boot_id = f.read().strip()
    return f"{boot_id}/{os.readlink('/proc/self/ns/pid')}"


def mooncake_protocol(config: TransferConfig) -> str:
    """The mooncake protocol `config` asks for, with "auto" resolved for this host."""
    if config.mooncake_protocol == "auto":
        return default_protocol()
    return config.mooncake_protocol


def open_send_channel(transport: str, peer_info: KVPeerInfo, kv: KVCache,
                      config: TransferConfig, pair_name: str) -> SendChannel:
    """Set up the sender's half of a connection (may block: mapping, group rendezvous).

    Args:
        transport: "shm", "zmq", "torch_dist" or "mooncake".
        peer_info: the receiver's `KVReceiver.peer_info()`.
        kv: the sender's pool.
        config: the sender's settings.
        pair_name: unique name of the connection.

    Returns:
        The channel.

    Raises:
        ValueError: the transport does not fit this pool, or the receiver offers it without
            its handle.
    """
    if transport != "torch_dist" and kv.buffer.device.type != "cpu":
        raise ValueError(f"transport {transport!r} needs a CPU KV pool; use torch_dist (NCCL)")
    if transport == "shm":
        shape = (kv.num_layers, peer_info.num_blocks, *kv.buffer.shape[2:])
        return ShmSendChannel(map_peer_pool(_offered(peer_info.shm, transport), shape, kv.dtype))
    if transport == "zmq":
        return ZmqSendChannel()
    if transport == "mooncake":
        return MooncakeSendChannel(kv.buffer, _offered(peer_info.mooncake, transport),
                                   peer_info.num_blocks, config.host, mooncake_protocol(config))
    return DistSendChannel(open_pair_group(_offered(peer_info.store, transport), pair_name,
                                           SENDER_RANK, kv.buffer.device, config.host,
                                           config.peer_timeout_s))


def _offered(handle: _Handle | None, transport: str) -> _Handle:
    if handle is None:
        raise ValueError(f"the receiver offers {transport} but sent no handle for it")
    return handle


def open_recv_channel(transport: str, store: StoreAddress | None, kv: KVCache,
                      config: TransferConfig, pair_name: str,
                      notify: Callable[..., None]) -> RecvChannel:
    """Set up the receiver's half of a connection (never blocks).

    Args:
        transport: "shm", "zmq", "torch_dist" or "mooncake".
        store: the receiver's rendezvous store address (torch_dist only).
        kv: the receiver's pool.
        config: the receiver's settings.
        pair_name: unique name of the connection.
        notify: runs a callback on the receiver's IO thread.

    Returns:
        The channel.
    """
    if transport == "shm":
        return ShmRecvChannel()
    if transport == "zmq":
        return ZmqRecvChannel()
    if transport == "mooncake":
        return MooncakeRecvChannel()
    if store is None:
        raise ValueError("torch_dist needs the receiver's rendezvous store")
    return DistRecvChannel(store, pair_name, kv.buffer.device, config.host,
                           config.peer_timeout_s, notify)
