"""Hostile but fair clients against a real server: no request may hang it, crash it, or stall the others.

One server for the module, with the guards an operator turns on: an API key that /metrics needs too, no request
explorer, 4 sequences at a time and at most 2 waiting.
"""

import json
import random
import threading
import time

import httpx
import openai
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from tests.server_utils import ServerProcess, start_server

pytestmark = [pytest.mark.slow, pytest.mark.server]
KEY = "sekret"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def server():
    proc = start_server(
        "--api-key", KEY, "--metrics-require-key", "--no-explorer", "--max-num-seqs", "4", "--max-queue", "2"
    )
    yield proc
    assert proc.stop() == 0


def post(server: ServerProcess, path: str, body: dict | None = None, timeout: float = 60, **kwargs) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers={**AUTH, **kwargs.pop("headers", {})},
                      timeout=timeout, **kwargs)  # fmt: skip


def assert_openai_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def wait_idle(server: ServerProcess, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = httpx.get(f"{server.url}/metrics", headers=AUTH).text
        if "tokenmill:num_requests_running 0.0" in text and "tokenmill:num_requests_waiting 0.0" in text:
            return
        time.sleep(0.1)
    raise AssertionError("the server did not become idle")


def test_n_above_max_num_seqs_is_refused_and_blocks_nobody(server: ServerProcess) -> None:
    """n samples run together: more than max_num_seqs could never be scheduled, and used to wait forever in front
    of every later request."""
    bodies = [{"prompt": "Hi", "n": 5, "max_tokens": 2}, {"prompt": "Hi", "n": 128, "logprobs": 20, "max_tokens": 8}]
    for body in bodies:
        error = assert_openai_error(post(server, "/v1/completions", body, timeout=10), 400)
        assert error["param"] == "n" and "max_num_seqs" in error["message"]
    error = assert_openai_error(
        post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "n": 9}, timeout=10),
        400,
    )
    assert error["param"] == "n"
    codes: list[int] = []

    def ordinary(i: int) -> None:
        codes.append(post(server, "/v1/completions", {"prompt": f"{i}:", "max_tokens": 8}).status_code)

    start = time.monotonic()
    threads = [threading.Thread(target=ordinary, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert codes == [200] * 4 and time.monotonic() - start < 30
    four = post(server, "/v1/completions", {"prompt": "Hi", "n": 4, "max_tokens": 3, "temperature": 1, "seed": 1})
    assert len(four.json()["choices"]) == 4


def test_a_burst_is_held_to_the_queue_limit(server: ServerProcess) -> None:
    """40 requests at once with 4 running and at most 2 waiting: 6 are served, 34 get 503 with Retry-After (the
    limit used to read a waiting count refreshed only after engine steps, and took all 40)."""
    wait_idle(server)
    results: list[httpx.Response] = []
    ready = threading.Barrier(40)

    def one(i: int) -> None:
        ready.wait()
        body = {"prompt": f"Story {i}:", "max_tokens": 120, "ignore_eos": True}
        results.append(post(server, "/v1/completions", body, headers={"X-Request-Id": f"burst-{i}"}))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(40)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    served = [r for r in results if r.status_code == 200]
    refused = [r for r in results if r.status_code == 503]
    assert len(served) == 6 and len(refused) == 34, sorted(r.status_code for r in results)
    assert all(r.json()["usage"]["completion_tokens"] == 120 for r in served)
    for r in refused:
        assert r.headers["retry-after"] == "1" and assert_openai_error(r, 503)["code"] == "overloaded"
    # every refused call has its line in the request log, as the served ones have theirs
    lines = server.log_lines(" /v1/completions 503: the server is busy", count=34)
    assert len(lines) == 34 and all(line.split("tokenmill.requests: ")[1].startswith("burst-") for line in lines)
    assert len(server.log_lines("cmpl-burst-", count=6)) == 6
    wait_idle(server)


def test_the_api_key_guards_everything_but_health(server: ServerProcess) -> None:
    url = server.url
    for method, path in [
        ("POST", "/v1/completions"),
        ("POST", "/v1/chat/completions"),
        ("GET", "/v1/models"),
        ("POST", "/tokenize"),
        ("POST", "/detokenize"),
        ("GET", "/tokenizer_info"),
        ("GET", "/metrics"),  # --metrics-require-key
    ]:
        r = httpx.request(method, url + path, json={"prompt": "x"})
        missing = assert_openai_error(r, 401)
        # a missing key is said to be missing (as OpenAI says it), not to be incorrect
        assert missing["code"] == "missing_api_key" and "didn't provide an API key" in missing["message"], path
        assert "Incorrect" not in missing["message"]
        wrong = httpx.request(method, url + path, json={"prompt": "x"}, headers={"Authorization": "Bearer nope"})
        assert assert_openai_error(wrong, 401)["code"] == "invalid_api_key", path
    assert httpx.get(url + "/health").status_code == 200
    # each refusal leaves its line in the request log
    httpx.get(url + "/v1/models", headers={"X-Request-Id": "no-key"})
    assert " /v1/models 401: You didn't provide an API key" in server.log_lines("no-key ")[0]
    assert "tokenmill:generation_tokens_total" in httpx.get(url + "/metrics", headers=AUTH).text
    good = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    assert good.completions.create(model=MODEL, prompt="x", max_tokens=2).usage.completion_tokens == 2
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
    # --no-explorer: the page and its data are not served at all
    for path in ("/", "/explorer/info", "/explorer/events", "/static/app.js"):
        assert httpx.get(url + path, headers=AUTH).status_code == 404, path


BAD_TEXT = "a\ud800b"  # a lone surrogate: half of a UTF-16 pair, no character (json.dumps writes it "\\ud800")


@pytest.mark.parametrize(
    "path,body",
    [
        ("/v1/completions", {"prompt": BAD_TEXT, "max_tokens": 2}),
        ("/v1/completions", {"prompt": ["fine", BAD_TEXT], "max_tokens": 2}),
        ("/v1/completions", {"prompt": "Hi", "stop": BAD_TEXT, "max_tokens": 2}),
        ("/v1/completions", {"prompt": "Hi", "model": BAD_TEXT}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": BAD_TEXT}]}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": BAD_TEXT}]}]}),
        ("/tokenize", {"prompt": BAD_TEXT}),
        ("/tokenize", {"messages": [{"role": "user", "content": BAD_TEXT}]}),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a\xed\xa0\x80b"}]}'),  # CESU-8
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a\xff\xfeb"}]}'),  # not UTF-8
        ("/v1/completions", b'{"prompt": "\xc3"}'),  # a truncated character
    ],
)
def test_text_that_is_not_unicode_gets_a_400(server: ServerProcess, path: str, body: dict | bytes) -> None:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    assert_openai_error(post(server, path, content=raw, headers={"content-type": "application/json"}), 400)


def test_a_huge_body_is_refused_before_parsing_and_stalls_nobody(server: ServerProcess) -> None:
    """A 20 MB body used to be tokenized for 20-45 s (on the event loop for chat) before it was refused."""
    wait_idle(server)
    gaps: list[float] = []

    def stream() -> None:
        body = {"prompt": "Count:", "max_tokens": 150, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=60) as r:
            last = time.monotonic()
            for line in r.iter_lines():
                if line:
                    now = time.monotonic()
                    gaps.append(now - last)
                    last = now

    streamer = threading.Thread(target=stream)
    streamer.start()
    time.sleep(0.3)
    huge = json.dumps({"messages": [{"role": "user", "content": "a" * 20_000_000}]}).encode()
    outcome: list[object] = []

    def send_huge() -> None:
        try:
            outcome.append(post(server, "/v1/chat/completions", content=huge, timeout=60,
                                headers={"content-type": "application/json"}))  # fmt: skip
        except httpx.TransportError as exc:  # the server may close before the client has sent it all
            outcome.append(exc)

    sender = threading.Thread(target=send_huge)
    sender.start()
    time.sleep(0.2)
    start = time.monotonic()
    small = post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 4}, timeout=10)
    assert small.status_code == 200 and time.monotonic() - start < 2
    sender.join(30)
    streamer.join(60)
    if isinstance(outcome[0], httpx.Response):
        assert assert_openai_error(outcome[0], 413)["code"] == "request_too_large"
    assert max(gaps[1:]) < 2, f"the stream stalled for {max(gaps[1:]):.1f} s"
    # a chunked body is counted as it arrives
    chunks = (b"x" * 1_000_000 for _ in range(10))
    r = post(server, "/tokenize", content=chunks, headers={"content-type": "application/json"})
    assert_openai_error(r, 413)


def test_a_long_prompt_is_refused_by_its_length_and_tokenized_off_the_event_loop(server: ServerProcess) -> None:
    # 3 MB of text cannot fit 8,192 tokens (no token covers more than 81 characters): refused without tokenizing
    start = time.monotonic()
    r = post(server, "/v1/completions", {"prompt": "word " * 600_000, "max_tokens": 1})
    assert assert_openai_error(r, 400)["code"] == "context_length_exceeded" and time.monotonic() - start < 1.5
    # 650,000 characters might fit by that bound (random digits: one token each, about 1 s to tokenize): tokenized
    # in a worker thread while /health keeps answering
    digits = "".join(random.Random(0).choice("0123456789 ") for _ in range(650_000))
    latencies: list[float] = []
    done = threading.Event()

    def long_prompts() -> None:
        for path, body in [
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": digits}]}),
            ("/v1/completions", {"prompt": digits}),
        ]:
            error = assert_openai_error(post(server, path, body), 400)
            assert error["code"] == "context_length_exceeded" and "tokens" in error["message"]
        done.set()

    worker = threading.Thread(target=long_prompts)
    worker.start()
    while not done.is_set():
        start = time.monotonic()
        assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
        latencies.append(time.monotonic() - start)
        time.sleep(0.02)
    worker.join()
    assert max(latencies) < 0.5, f"/health took {max(latencies):.2f} s while a long prompt was tokenized"


def test_the_handler_of_last_resort_answers_json_with_an_error_id() -> None:
    """An unexpected exception becomes a JSON 500 that names an id the log has with the traceback (the fuzzing
    tests assert no input gets here)."""
    from tokenmill.server.app import create_app
    from tokenmill.server.state import ServerSettings, ServerState

    state = ServerState(ServerSettings())
    app: FastAPI = create_app(state, load_in_background=False)

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("a bug")

    with TestClient(app, raise_server_exceptions=False, base_url="http://127.0.0.1") as client:
        r = client.get("/boom")
    error = assert_openai_error(r, 500)
    assert error["code"] == "internal_error" and r.headers["x-error-id"] in error["message"]
    assert state.metrics.internal_errors._value.get() == 1


def test_output_length_default_and_limit() -> None:
    """--max-tokens-default fills in a request that names none; --max-tokens-limit refuses more (400) and caps the
    default: a chat request with no max_tokens can no longer run to the end of the context."""
    from tokenmill.server.errors import APIError
    from tokenmill.server.neutral_request import OutputLength
    from tokenmill.server.state import ServerSettings, ServerState

    def settled(settings: ServerSettings, asked: int | None, api_default: int | None) -> int | None:
        return ServerState(settings).output_limits().settle(OutputLength(asked, api_default))

    plain = ServerSettings()
    assert settled(plain, None, None) is None and settled(plain, None, 16) == 16
    assert settled(plain, 5000, 16) == 5000
    bounded = ServerSettings(max_tokens_default=256, max_tokens_limit=1024)
    assert settled(bounded, None, None) == 256 and settled(bounded, None, 16) == 256
    assert settled(bounded, 1024, None) == 1024
    with pytest.raises(APIError, match="above this server's limit of 1024"):
        settled(bounded, 1025, None)
    assert settled(ServerSettings(max_tokens_limit=100), None, None) == 100


def test_output_length_flags_reach_both_endpoints() -> None:
    server = start_server("--max-tokens-default", "6", "--max-tokens-limit", "40", "--no-explorer")
    try:
        body = {"messages": [{"role": "user", "content": "Count to fifty."}], "ignore_eos": True}
        r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "One", "ignore_eos": True}, timeout=60)
        assert r.json()["usage"]["completion_tokens"] == 6
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "One", "max_tokens": 41}, timeout=60)
        assert assert_openai_error(r, 400)["param"] == "max_tokens"
    finally:
        server.stop()


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_client_that_leaves_before_the_first_byte_frees_everything(server: ServerProcess, path: str) -> None:
    """A streamed call whose client hangs up before any event is sent still ends: its requests stop, it no longer
    counts against --max-queue, and its X-Request-Id is free again."""
    import socket

    wait_idle(server)
    body = {"model": MODEL, "max_tokens": 4000, "ignore_eos": True, "stream": True}  # 20 s and more, unless aborted
    body |= (
        {"prompt": "Once upon a time"}
        if path == "/v1/completions"
        else {"messages": [{"role": "user", "content": "Hi"}]}
    )
    payload = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\nX-Request-Id: leaver\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
    ).encode()
    probe = {**body, "stream": False, "max_tokens": 2}
    for _ in range(3):  # more than --max-queue 2 calls' worth, were they still counted
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            sock.sendall(head + payload)
        deadline = time.monotonic() + 8
        while (r := post(server, path, probe, headers={"X-Request-Id": "leaver"})).status_code == 400:
            assert "already in flight" in r.text and time.monotonic() < deadline, r.text  # the id stays taken
            time.sleep(0.05)
        assert r.status_code == 200, r.text
        wait_idle(server, timeout=8)  # the 4,000 tokens were aborted, not generated


def test_paths_on_the_machine_are_shown_to_a_caller_with_the_key(server: ServerProcess) -> None:
    """Without the key nothing is answered at all here; with it, the model's absolute path (tests/test_server_safety.py:
    without a key set, only the file's name)."""
    card = httpx.get(f"{server.url}/v1/models", headers=AUTH).json()["data"][0]
    assert card["root"].startswith("/") and card["root"].endswith(".gguf")
    assert httpx.get(f"{server.url}/server_info", headers=AUTH).json()["model_path"] == card["root"]


def test_llamacpp_endpoints_need_the_key_and_cors_echoes_the_origin(server: ServerProcess) -> None:
    """llama.cpp's API is behind the key (POST /props above all: it changes the server's defaults); a local page's
    preflight is answered with its origin and credentials allowed, as llama-server's tests expect."""
    for path, body in (("/completion", {"prompt": "hi"}), ("/props", {}), ("/apply-template", {"messages": []})):
        r = httpx.post(f"{server.url}{path}", json=body, timeout=60)
        assert assert_openai_error(r, 401)["type"] == "authentication_error"  # llama-server's type
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi"}, timeout=60)
    assert assert_openai_error(r, 401)["type"] == "invalid_request_error"  # OpenAI's, on OpenAI's paths
    update = {"default_generation_settings": {"params": {"temperature": 0.3}}}
    assert post(server, "/props", update).json() == {"success": True}
    assert httpx.get(f"{server.url}/props", headers=AUTH).json()["default_generation_settings"]["params"][
        "temperature"
    ] == pytest.approx(0.3)
    origin = "http://localhost:5173"
    preflight = {"Origin": origin, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "x"}
    r = httpx.options(f"{server.url}/completion", headers=preflight)
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == origin
    assert r.headers["access-control-allow-credentials"] == "true"
    assert r.headers["access-control-allow-methods"] == "GET, POST, DELETE, OPTIONS"
