"""Keys and TLS on both front doors, with real clients (gRPC channel, openai, httpx)."""

from __future__ import annotations

import grpc
import httpx
import openai
import pytest

from router.auth import Access, SecurityConfig, bearer_token, check_bind
from router.client import PdClusterClient
from tests.pki import make_pki, trusting

API_KEY, ADMIN_KEY = "sk-user-0123456789", "sk-admin-9876543210"
GREEDY = {"temperature": 0.0, "ignore_eos": True, "max_tokens": 4}


def test_grpc_keys(make_servers):
    servers = make_servers(SecurityConfig(api_key=API_KEY, admin_key=ADMIN_KEY))
    address = f"127.0.0.1:{servers.grpc_port}"
    with PdClusterClient(address, timeout=30) as anonymous:
        with pytest.raises(grpc.RpcError) as e:
            list(anonymous.generate("hello", **GREEDY))
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as e:
            anonymous.status()
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert anonymous.health() == "SERVING"  # load balancers need no key
    with PdClusterClient(address, timeout=30, api_key="sk-wrong") as wrong:
        with pytest.raises(grpc.RpcError) as e:
            wrong.status()
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with PdClusterClient(address, timeout=30, api_key=API_KEY) as user:
        outs = list(user.generate("hello", **GREEDY))
        assert outs[-1].finish_reason == "length" and outs[-1].usage.completion_tokens == 4
        with pytest.raises(grpc.RpcError) as e:
            user.scale(decode=2)
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
    with PdClusterClient(address, timeout=30, api_key=API_KEY, admin_key=ADMIN_KEY) as admin:
        with pytest.raises(grpc.RpcError) as e:
            admin.scale(decode=2)  # past the key check: the in-process engine cannot resize
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_http_keys(make_servers):
    servers = make_servers(SecurityConfig(api_key=API_KEY))
    base = f"http://127.0.0.1:{servers.http_port}"
    anonymous = openai.OpenAI(base_url=f"{base}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        anonymous.completions.create(model="tiny", prompt="hello", max_tokens=4)
    assert e.value.status_code == 401 and e.value.code == "invalid_api_key"
    assert httpx.post(f"{base}/v1/completions", json={"prompt": "hi"}).status_code == 401
    assert httpx.get(f"{base}/v1/models").status_code == 401
    assert httpx.get(f"{base}/health").status_code == 200
    user = openai.OpenAI(base_url=f"{base}/v1", api_key=API_KEY, max_retries=0)
    resp = user.completions.create(model="tiny", prompt="hello", max_tokens=4,
                                   extra_body={"ignore_eos": True})
    assert resp.usage.completion_tokens == 4


def test_binding_beyond_loopback_needs_a_key_or_an_explicit_opt_out():
    with pytest.raises(ValueError, match="--allow-unauthenticated"):
        check_bind("0.0.0.0", SecurityConfig(), allow_unauthenticated=False)
    check_bind("0.0.0.0", SecurityConfig(), allow_unauthenticated=True)
    check_bind("0.0.0.0", SecurityConfig(api_key=API_KEY), allow_unauthenticated=False)
    check_bind("127.0.0.1", SecurityConfig(), allow_unauthenticated=False)
    check_bind("::1", SecurityConfig(), allow_unauthenticated=False)


# ---- TLS --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, str]:
    """A throwaway CA, a server certificate for 127.0.0.1 and a client certificate."""
    return make_pki(tmp_path_factory.mktemp("pki"))


def test_tls_both_doors(make_servers, pki):
    servers = make_servers(SecurityConfig(tls_cert=pki["server.pem"], tls_key=pki["server.key"]))
    with PdClusterClient(f"127.0.0.1:{servers.grpc_port}", timeout=30,
                         tls_ca=pki["ca.pem"]) as client:
        assert list(client.generate("hello", **GREEDY))[-1].usage.completion_tokens == 4
    # Tried once: refused at the handshake, not after the retries' backoff.
    with PdClusterClient(f"127.0.0.1:{servers.grpc_port}", timeout=30,
                         retries=False) as plaintext:
        with pytest.raises(grpc.RpcError) as e:
            plaintext.status()
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    url = f"https://127.0.0.1:{servers.http_port}/health"
    assert httpx.get(url, verify=trusting(pki)).status_code == 200
    with pytest.raises(httpx.ConnectError):
        httpx.get(url)  # not signed by a CA the client trusts


def test_mutual_tls_refuses_clients_without_a_certificate(make_servers, pki):
    servers = make_servers(SecurityConfig(tls_cert=pki["server.pem"], tls_key=pki["server.key"],
                                   tls_client_ca=pki["ca.pem"]))
    grpc_address = f"127.0.0.1:{servers.grpc_port}"
    with PdClusterClient(grpc_address, timeout=30, tls_ca=pki["ca.pem"],
                         tls_cert=pki["client.pem"], tls_key=pki["client.key"]) as client:
        assert client.status()["mode"] == "engine"
    with PdClusterClient(grpc_address, timeout=30, tls_ca=pki["ca.pem"],
                         retries=False) as no_cert:
        with pytest.raises(grpc.RpcError) as e:
            no_cert.status()
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    url = f"https://127.0.0.1:{servers.http_port}/health"
    assert httpx.get(url, verify=trusting(pki, client_cert=True)).status_code == 200
    with pytest.raises(httpx.TransportError):  # the server drops the handshake
        httpx.get(url, verify=trusting(pki))


@pytest.mark.parametrize(("api_key", "admin_key", "presented", "expected"), [
    (None, None, None, Access.ADMIN),
    (API_KEY, None, None, Access.NONE),
    (API_KEY, None, "sk-wrong", Access.NONE),
    (API_KEY, None, API_KEY, Access.USER),
    (API_KEY, ADMIN_KEY, API_KEY, Access.USER),
    (API_KEY, ADMIN_KEY, ADMIN_KEY, Access.ADMIN),
    (None, ADMIN_KEY, None, Access.USER),
    (None, ADMIN_KEY, ADMIN_KEY, Access.ADMIN),
    (API_KEY, ADMIN_KEY, API_KEY + "x", Access.NONE),
])
def test_access_table(api_key, admin_key, presented, expected):
    assert SecurityConfig(api_key=api_key, admin_key=admin_key).access(presented) == expected


def test_bearer_header_parsing():
    assert bearer_token("Bearer abc") == "abc" and bearer_token("bearer  abc ") == "abc"
    assert bearer_token("Basic abc") is None and bearer_token("Bearer") is None
    assert bearer_token(None) is None and bearer_token("") is None
