"""A peer that does not hold the cluster's key, for the internal-socket security tests.

It connects to an internal socket, queues a message, and waits (on the socket's own
monitor events, not a sleep) until the ZMTP handshake has either succeeded or failed.
A failed handshake means nothing it sent was or can be delivered.
"""

from __future__ import annotations

import time

import zmq
from zmq.utils.monitor import recv_monitor_message

FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
          zmq.EVENT_HANDSHAKE_FAILED_AUTH)
HANDSHAKE_EVENTS = (zmq.EVENT_HANDSHAKE_SUCCEEDED, *FAILED)


class Rogue:
    """One socket of `sock_type` connected to `endpoint`.

    Args:
        endpoint: the internal socket to attack.
        sock_type: `zmq.PUSH` for a PULL server, `zmq.DEALER` for the KV ROUTER.
        server_public: None: no keys at all (plain NULL mechanism); else a CURVE client
            with a keypair of its own and this server key (public keys are advertised).
    """

    def __init__(self, endpoint: str, sock_type: int, server_public: bytes | None) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(sock_type)
        self.sock.setsockopt(zmq.LINGER, 0)
        self._monitor = self.sock.get_monitor_socket()
        if server_public is not None:
            public, secret = zmq.curve_keypair()
            self.sock.setsockopt(zmq.CURVE_SERVERKEY, server_public)
            self.sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
            self.sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
        self.sock.connect(endpoint)

    def send(self, data: bytes) -> bool:
        """Queue one message without blocking (it leaves only if the handshake succeeds).

        Returns False when it could not be queued: after a failed handshake libzmq may leave
        the socket with no peer to queue for, for good (here after up to 7 % of failed
        handshakes of a PUSH socket and 13-33 % of a DEALER's), and a blocking send would
        then wait forever.
        """
        try:
            self.sock.send(data, zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

    def handshake(self, timeout_s: float = 30.0) -> int:
        """Wait for the handshake's outcome: a `zmq.EVENT_HANDSHAKE_*` code."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0 and self._monitor.poll(left * 1000):
            event = recv_monitor_message(self._monitor)["event"]
            if event in HANDSHAKE_EVENTS:
                return event
        raise TimeoutError("no handshake outcome")

    def close(self) -> None:
        """Drop whatever is still queued (linger 0) and end the context."""
        self.sock.disable_monitor()
        self._monitor.close(linger=0)
        self.sock.close(linger=0)
        self.ctx.term()

    def __enter__(self) -> Rogue:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
