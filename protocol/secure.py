"""Who may talk to the cluster's internal ZMQ sockets: CURVE with one cluster keypair.

The router generates the cluster's keypair when it starts and hands it to every worker it
creates through Ray (`WorkerSpec.cluster_key`, then `TransferConfig.cluster_key`). Every
bound socket is a CURVE server with the cluster's secret key; every connecting socket is a
CURVE client holding the cluster's keypair. A CURVE server alone lets in any client that
knows its (advertised) public key, so each context also runs a ZAP handler (pyzmq's
`ThreadAuthenticator`) that admits exactly one client key: the cluster's. A peer without
keys fails the mechanism handshake, one with another keypair is refused by ZAP; neither
ever delivers a message.

Every internal socket is set up through a `SocketGuard`, with or without a key, so this is
the one place that decides a socket's security.
"""

from __future__ import annotations

import hmac
import logging
from collections import Counter
from dataclasses import dataclass, field

import zmq
from zmq.auth.thread import ThreadAuthenticator

log = logging.getLogger(__name__)
ZAP_DOMAIN = "pdcluster"


@dataclass(frozen=True)
class ClusterKey:
    """The cluster's CURVE keypair, Z85-encoded (40 bytes each).

    Args:
        public: the public key every server and client presents.
        secret: the secret key; never logged, never sent outside Ray.
    """

    public: bytes
    secret: bytes = field(repr=False)

    def __post_init__(self) -> None:
        for name in ("public", "secret"):
            value = getattr(self, name)
            if not isinstance(value, bytes) or len(value) != 40:
                raise ValueError(f"{name}: a Z85-encoded CURVE key is 40 bytes")

    @classmethod
    def generate(cls) -> ClusterKey:
        """A fresh keypair (one per cluster start)."""
        public, secret = zmq.curve_keypair()
        return cls(public, secret)


class SocketGuard:
    """Binds and connects one context's sockets, with CURVE when a key is given.

    With a key, a ZAP handler thread runs on the context until `close`; it must stop
    before the context is destroyed.

    Args:
        context: the context whose sockets this guard sets up (sync or asyncio).
        key: the cluster's keypair, or None for plain TCP.
    """

    def __init__(self, context: zmq.Context, key: ClusterKey | None) -> None:
        self.key = key
        self.decisions: Counter[str] = Counter()  # ZAP verdicts: "allowed" / "denied"
        self._auth: ThreadAuthenticator | None = None
        if key is not None:
            self._auth = ThreadAuthenticator(context, log=log)
            self._auth.start()
            self._auth.configure_curve_callback(ZAP_DOMAIN, credentials_provider=self)

    def bind(self, sock: zmq.Socket, address: str) -> str:
        """Bind `sock` (a CURVE server when keyed) and return the endpoint it bound.

        Args:
            sock: a fresh socket of this guard's context.
            address: e.g. `tcp://127.0.0.1:0`.
        """
        if self.key is not None:
            sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())
            sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)  # no ZAP handler: refuse, never admit
            sock.setsockopt(zmq.CURVE_SECRETKEY, self.key.secret)
            sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.bind(address)
        return sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def connect(self, sock: zmq.Socket, endpoint: str) -> None:
        """Connect `sock` to a cluster server (a CURVE client when keyed).

        Args:
            sock: a fresh socket of this guard's context.
            endpoint: a server's endpoint, as it reported it.
        """
        if self.key is not None:
            sock.setsockopt(zmq.CURVE_SERVERKEY, self.key.public)
            sock.setsockopt(zmq.CURVE_PUBLICKEY, self.key.public)
            sock.setsockopt(zmq.CURVE_SECRETKEY, self.key.secret)
        sock.connect(endpoint)

    def callback(self, domain: str, client_key: bytes) -> bool:
        """ZAP: admit only the cluster's key (called on the authenticator's thread)."""
        allowed = self.key is not None and hmac.compare_digest(client_key, self.key.public)
        if not allowed:
            log.warning("refused an internal connection: unknown CURVE key %s", client_key)
        self.decisions["allowed" if allowed else "denied"] += 1
        return allowed

    def close(self) -> None:
        """Stop the ZAP handler (before the context is destroyed); idempotent."""
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
