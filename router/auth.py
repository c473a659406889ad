"""Who may call the front doors: API keys, an admin key for pool resizing, TLS / mTLS.

One policy for both servers. A request presents a key (HTTP `Authorization: Bearer <key>`,
gRPC metadata `authorization: Bearer <key>`); keys are compared in constant time.

| presented key | generate, abort, status, models | ScalePool |
|---|---|---|
| no key configured at all | allowed | allowed (a local, open cluster) |
| the admin key | allowed | allowed |
| the API key | allowed | PERMISSION_DENIED |
| none or a wrong one, an API key is set | UNAUTHENTICATED / 401 | UNAUTHENTICATED |
| none or a wrong one, only an admin key is set | allowed | PERMISSION_DENIED |

Health checks (`grpc.health.v1`, `/health`) and reflection stay open, for load balancers.
"""

from __future__ import annotations

import enum
import hmac
import ipaddress
import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc


class Access(enum.IntEnum):
    """What a caller may do."""

    NONE = 0
    USER = 1
    ADMIN = 2


@dataclass(frozen=True)
class SecurityConfig:
    """Keys and TLS material for both front doors.

    Args:
        api_key: required on every inference and status call; None leaves them open.
        admin_key: required for `ScalePool`; None leaves it open only when `api_key` is
            None too.
        tls_cert: server certificate chain (PEM) for TLS on both front doors.
        tls_key: its private key (PEM).
        tls_client_ca: CA bundle (PEM) that client certificates must chain to (mutual TLS).
    """

    api_key: str | None = None
    admin_key: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_client_ca: str | None = None

    def __post_init__(self) -> None:
        for name in ("api_key", "admin_key"):
            if getattr(self, name) == "":
                raise ValueError(f"{name}: must not be empty when given")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("tls_cert and tls_key: give both or neither")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError("tls_client_ca: mutual TLS needs tls_cert and tls_key too")
        for name in ("tls_cert", "tls_key", "tls_client_ca"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ValueError(f"{name}: no such file {path!r}")

    @property
    def authenticated(self) -> bool:
        """True when requests need a key (an API key is set)."""
        return self.api_key is not None

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None

    def access(self, presented: str | None) -> Access:
        """What the presented key (None: none) allows."""
        if self.admin_key is not None and _same(presented, self.admin_key):
            return Access.ADMIN
        if self.api_key is None:  # requests are open; resizing only if no admin key is set
            return Access.USER if self.admin_key is not None else Access.ADMIN
        return Access.USER if _same(presented, self.api_key) else Access.NONE

    def grpc_credentials(self) -> grpc.ServerCredentials:
        """Server credentials for `add_secure_port` (requires `tls`)."""
        ca = Path(self.tls_client_ca).read_bytes() if self.tls_client_ca else None
        pair = (Path(self.tls_key).read_bytes(), Path(self.tls_cert).read_bytes())
        return grpc.ssl_server_credentials([pair], root_certificates=ca,
                                           require_client_auth=ca is not None)

    def uvicorn_ssl(self) -> dict[str, object]:
        """uvicorn.Config keyword arguments for TLS (empty without it)."""
        if not self.tls:
            return {}
        options: dict[str, object] = {"ssl_certfile": self.tls_cert, "ssl_keyfile": self.tls_key}
        if self.tls_client_ca:
            options.update(ssl_ca_certs=self.tls_client_ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
        return options


def bearer_token(header: str | None) -> str | None:
    """The key in an `Authorization: Bearer <key>` value (None when absent or malformed)."""
    if not header:
        return None
    scheme, _, token = header.strip().partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


def check_bind(host: str, security: SecurityConfig, allow_unauthenticated: bool) -> None:
    """Refuse to expose unauthenticated front doors beyond this machine by accident.

    Raises:
        ValueError: `host` is not a loopback address, no key is set, and
            `allow_unauthenticated` is False.
    """
    if security.authenticated or allow_unauthenticated or is_loopback(host):
        return
    raise ValueError(f"host: binding {host!r} without --api-key would let anyone who can reach "
                     "it run requests and resize pools; set --api-key (and --admin-key), or "
                     "pass --allow-unauthenticated")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _same(presented: str | None, expected: str) -> bool:
    return presented is not None and hmac.compare_digest(presented.encode(), expected.encode())
