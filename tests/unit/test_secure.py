"""The cluster key, the internal-auth setting, and `SocketGuard` on real sockets."""

from __future__ import annotations

import pytest
import ray
import zmq

from cluster.config import ClusterConfig, uses_curve
from protocol.secure import ClusterKey, SocketGuard


def test_cluster_key_is_checked_and_never_shows_its_secret() -> None:
    key = ClusterKey.generate()
    assert len(key.public) == len(key.secret) == 40
    assert key.secret.decode() not in repr(key)
    with pytest.raises(ValueError, match="secret: a Z85-encoded CURVE key is 40 bytes"):
        ClusterKey(key.public, b"short")


def test_internal_auth_is_validated_where_built() -> None:
    with pytest.raises(ValueError, match="internal_auth must be one of"):
        ClusterConfig(internal_auth="tls")


@pytest.mark.parametrize(("mode", "host", "alive_nodes", "curve"), [
    ("curve", "127.0.0.1", 1, True),
    ("off", "10.0.0.7", 2, False),
    ("auto", "10.0.0.7", 1, True),     # reachable from other machines
    ("auto", "127.0.0.1", 1, False),   # loopback of one node: only local processes
    ("auto", "localhost", 2, True),    # several nodes (a misconfiguration, but never open)
])
def test_auto_picks_curve_unless_loopback_on_one_node(monkeypatch, mode, host, alive_nodes,
                                                      curve) -> None:
    # A multi-node Ray cluster cannot be built on this machine: its node list is faked.
    nodes = [{"Alive": True}] * alive_nodes + [{"Alive": False}]
    monkeypatch.setattr(ray, "nodes", lambda: nodes)
    assert uses_curve(mode, host) is curve


@pytest.mark.parametrize("keyed", [False, True])
def test_guarded_sockets_talk_and_stop_cleanly(keyed: bool) -> None:
    key = ClusterKey.generate() if keyed else None
    server_ctx, client_ctx = zmq.Context(), zmq.Context()
    server, client = SocketGuard(server_ctx, key), SocketGuard(client_ctx, key)
    pull, push = server_ctx.socket(zmq.PULL), client_ctx.socket(zmq.PUSH)
    try:
        client.connect(push, server.bind(pull, "tcp://127.0.0.1:0"))
        push.send(b"step")
        assert pull.poll(30_000)
        assert pull.recv() == b"step"
        assert server.decisions == ({"allowed": 1} if keyed else {})
        assert pull.getsockopt(zmq.MECHANISM) == (zmq.CURVE if keyed else zmq.NULL)
    finally:
        for guard, ctx, sock in ((server, server_ctx, pull), (client, client_ctx, push)):
            sock.close(linger=0)
            guard.close()
            guard.close()  # idempotent
            ctx.term()
