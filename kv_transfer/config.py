"""Transfer settings shared by both ends, validated where built."""

from __future__ import annotations

from dataclasses import dataclass

from protocol.secure import ClusterKey

TRANSPORTS = ("shm", "zmq", "torch_dist", "mooncake")
MOONCAKE_PROTOCOLS = ("auto", "tcp", "rdma")


@dataclass(frozen=True)
class TransferConfig:
    """How a `KVReceiver` / `KVSender` talks to its peers.

    Args:
        transports: what a receiver offers: "zmq" (TCP, any host), "shm" (same host; needs
            the pool in a `SharedKVPool`), "torch_dist" (gloo on CPU, NCCL on CUDA),
            "mooncake" (Mooncake's Transfer Engine over TCP or RDMA; the `mooncake` extra).
            A sender ignores it and picks per peer (see `KVSender.connect`).
        host: address this endpoint binds and advertises (ZMQ control socket, rendezvous
            store, gloo device); the default only reaches the same host.
        verify_checksums: a receiver with this set asks senders for an xxh3_64 per block and
            layer and fails a request whose received bytes differ.
        request_timeout_s: default deadline of one request, from `expect` / `begin`.
        heartbeat_s: interval of the liveness pings between connected peers.
        peer_timeout_s: a peer silent this long is declared lost (its requests fail); also
            bounds one torch.distributed operation and the wait for a cancel to be
            acknowledged.
        connect_timeout_s: how long `connect` waits for the handshake.
        cluster_key: the cluster's CURVE keypair: the control socket (and the zmq
            transport's KV bytes on it) is encrypted and admits only holders of this key;
            None: plain TCP. Both ends must agree.
        mooncake_protocol: what the mooncake transport's engine speaks: "tcp", "rdma", or
            "auto" (rdma where the kernel lists an RDMA device, else tcp); both ends must
            end up alike. The engine picks the RDMA NICs itself.
    """

    transports: tuple[str, ...] = ("zmq",)
    host: str = "127.0.0.1"
    verify_checksums: bool = False
    request_timeout_s: float = 30.0
    heartbeat_s: float = 0.5
    peer_timeout_s: float = 5.0
    connect_timeout_s: float = 10.0
    cluster_key: ClusterKey | None = None
    mooncake_protocol: str = "auto"

    def __post_init__(self) -> None:
        unknown = [t for t in self.transports if t not in TRANSPORTS]
        if not self.transports or unknown:
            raise ValueError(f"transports must be a non-empty subset of {TRANSPORTS}, "
                             f"got {self.transports!r}")
        if self.mooncake_protocol not in MOONCAKE_PROTOCOLS:
            raise ValueError(f"mooncake_protocol must be one of {MOONCAKE_PROTOCOLS}, "
                             f"got {self.mooncake_protocol!r}")
        for name in ("request_timeout_s", "heartbeat_s", "peer_timeout_s", "connect_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.peer_timeout_s <= self.heartbeat_s:
            raise ValueError(f"peer_timeout_s ({self.peer_timeout_s}) must exceed heartbeat_s "
                             f"({self.heartbeat_s}), or idle peers are declared lost")
