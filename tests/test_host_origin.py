"""Host and Origin checks, in process (no model: a request that passes them gets /health's or /v1's 503 "loading").

A page on any site must not drive a server on the user's machine: cross-origin calls are refused unless their
origin is allowed (local pages, --allowed-origins), and a Host that is no name of the server (DNS rebinding) is
refused under every flag combination. The browser itself is driven against a real server in
tests/test_server_safety.py."""

import socket

import pytest
from fastapi.testclient import TestClient

from tokenmill.server.app import create_app
from tokenmill.server.origins import OriginPolicy
from tokenmill.server.state import ServerSettings, ServerState

PORT = 8000
LOCAL = f"http://127.0.0.1:{PORT}"
EVIL_HOST = f"evil.example:{PORT}"
PREFLIGHT = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"}

FLAG_COMBINATIONS = [
    {},
    {"allowed_origins": ["https://a.example"]},
    {"allowed_origins": ["*"]},
    {"allowed_origins": [f"http://{EVIL_HOST}"]},  # even the attacker's own origin: its Host still gives it away
    {"host": "0.0.0.0"},
    {"host": "::"},
    {"host": "myhost.lan", "allowed_hosts": ["other.lan"]},
    {"api_key": "k"},
    {"api_key": "k", "allowed_origins": ["*"], "host": "0.0.0.0"},
]


def client(**settings) -> TestClient:
    return TestClient(create_app(ServerState(ServerSettings(**settings)), load_in_background=False), base_url=LOCAL)


def refused(r, code: str) -> None:
    assert r.status_code == 403, r.text
    error = r.json()["error"]
    if isinstance(error, str):  # Ollama's shape, under /api/
        assert ("DNS rebinding" if code == "host_not_allowed" else "may not call this server") in error
    else:
        assert error["code"] == code


@pytest.mark.parametrize("flags", FLAG_COMBINATIONS, ids=lambda f: ",".join(f"{k}={v}" for k, v in f.items()) or "-")
def test_a_rebinding_host_is_refused_under_every_flag_combination(flags: dict) -> None:
    c = client(**flags)
    for path in ("/health", "/v1/models", "/"):
        refused(c.get(path, headers={"Host": EVIL_HOST}), "host_not_allowed")
    # what a rebinding page sends: its own name as Host and as Origin (same-origin to the browser)
    body = '{"messages": [{"role": "user", "content": "Hi"}]}'
    headers = {"Host": EVIL_HOST, "Origin": f"http://{EVIL_HOST}", "Content-Type": "text/plain"}
    refused(c.post("/v1/chat/completions", content=body, headers=headers), "host_not_allowed")
    refused(c.post("/api/chat", content=body, headers=headers), "host_not_allowed")
    for host in (f"127.0.0.1:{PORT}", f"localhost:{PORT}", f"[::1]:{PORT}", "127.0.0.1", f"192.168.1.5:{PORT}"):
        assert c.get("/health", headers={"Host": host}).status_code == 503  # past the guard: still loading


def test_the_names_the_server_listens_as_are_answered() -> None:
    assert client(host="myhost.lan").get("/health", headers={"Host": "MyHost.lan:8000"}).status_code == 503
    c = client(allowed_hosts=["proxy.example"])
    assert c.get("/health", headers={"Host": "proxy.example"}).status_code == 503
    refused(c.get("/health", headers={"Host": "other.example"}), "host_not_allowed")
    assert client(allowed_hosts=["*"]).get("/health", headers={"Host": EVIL_HOST}).status_code == 503


def not_allowed_preflight(r) -> None:
    """A disallowed page's preflight: 200 without CORS headers (as llama-server answers it): the browser sends
    nothing after it."""
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers, r.headers


def test_another_origin_is_refused_by_default_and_local_pages_are_not() -> None:
    c = client()
    not_allowed_preflight(c.options("/v1/chat/completions", headers={"Origin": "https://evil.example", **PREFLIGHT}))
    # a "simple" request (a form's content type) needs no preflight: it must be refused by the server itself
    simple = {"Origin": "https://evil.example", "Content-Type": "text/plain"}
    refused(c.post("/api/generate", content='{"prompt": "Hi"}', headers=simple), "origin_not_allowed")
    refused(c.get("/v1/models", headers={"Origin": "null"}), "origin_not_allowed")  # a sandboxed frame, file://
    r = c.options("/v1/chat/completions", headers={"Origin": "http://localhost:3000", **PREFLIGHT})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://localhost:3000"
    r = c.get("/v1/models", headers={"Origin": "http://127.0.0.1:5173"})
    assert r.status_code == 503 and r.headers["access-control-allow-origin"] == "http://127.0.0.1:5173"
    # the server's own page opened over the network (the request explorer): its Origin is the Host it came from
    lan = {"Host": f"192.168.1.5:{PORT}", "Origin": f"http://192.168.1.5:{PORT}"}
    assert c.get("/v1/models", headers=lan).status_code == 503


def test_allowed_origins_widen_the_local_ones() -> None:
    c = client(allowed_origins=["https://a.example"])
    r = c.options("/v1/chat/completions", headers={"Origin": "https://a.example", **PREFLIGHT})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://a.example"
    assert c.get("/v1/models", headers={"Origin": "http://localhost:8080"}).status_code == 503
    not_allowed_preflight(c.options("/v1/chat/completions", headers={"Origin": "https://b.example", **PREFLIGHT}))
    refused(c.get("/v1/models", headers={"Origin": "https://b.example"}), "origin_not_allowed")
    anywhere = client(allowed_origins=["*"])
    r = anywhere.options("/v1/chat/completions", headers={"Origin": "https://b.example", **PREFLIGHT})
    # the origin echoed, as llama-server does, since the answer allows credentials (a browser refuses "*" with them)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://b.example"
    assert r.headers["access-control-allow-credentials"] == "true"


def test_with_an_api_key_pages_of_any_origin_may_call_with_it() -> None:
    """The key guards the API (a browser never sends it by itself): any origin's preflight is answered and its
    calls pass the origin check, to meet the key check (as llama-server's default); a rebinding Host still not."""
    c = client(api_key="k")
    r = c.options("/v1/chat/completions", headers={"Origin": "https://app.example", **PREFLIGHT})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
    r = c.get("/v1/models", headers={"Origin": "https://app.example"})
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "https://app.example"
    keyed = c.get("/v1/models", headers={"Origin": "https://app.example", "Authorization": "Bearer k"})
    assert keyed.status_code == 503  # past both checks: still loading
    refused(c.get("/v1/models", headers={"Host": EVIL_HOST, "Authorization": "Bearer k"}), "host_not_allowed")


def test_several_listening_addresses_are_names_of_the_server() -> None:
    policy = OriginPolicy("myhost.lan,192.168.1.5, otherhost.lan")
    assert policy.host_allowed("myhost.lan:8000") and policy.host_allowed("otherhost.lan")
    assert not policy.host_allowed("evil.example")
    assert OriginPolicy("127.0.0.1,::").host_allowed(socket.gethostname())


def test_host_names_are_read_as_browsers_send_them() -> None:
    policy = OriginPolicy()
    assert policy.host_allowed("[::1]:8000") and policy.host_allowed("LOCALHOST.") and policy.host_allowed(None)
    assert policy.host_allowed("app.localhost:3000") and policy.host_allowed("10.0.0.7")
    assert not policy.host_allowed("localhost.evil.example") and not policy.host_allowed("127.0.0.1.nip.io")
    assert policy.origin_allowed("http://[::1]:9000", None) and policy.origin_allowed("https://127.0.0.2", None)
    assert not policy.origin_allowed("http://localhost:notaport", None)
    assert not policy.origin_allowed("ftp://localhost", None)
    assert not policy.origin_allowed("http://localhost.evil.example", None)
