"""Safe by default on a user's own machine, through the clients that would hit each finding: a browser on another
site (and one rebinding its DNS), the openai, anthropic and ollama clients, curl.

One server for the module, as a user starts it but for two flags the tests need: a web origin allowed beside the
local ones (good.example, a page the test serves) and a small Responses store (200 kB), so eviction shows.
"""

import http.server
import json
import re
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
from playwright.sync_api import sync_playwright

from tests.server_utils import ServerProcess, free_port, start_server

pytestmark = [pytest.mark.slow, pytest.mark.server]
MODEL = "SmolLM2-135M-Instruct"
PAGE_PORT = free_port()
GOOD_ORIGIN = f"http://good.example:{PAGE_PORT}"
STORE_BYTES = 200_000
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
# the browser resolves every *.example name to this machine: a page on "another site" that is served here, and a
# DNS-rebinding attack (the attacker's name pointing at 127.0.0.1) without any DNS server
BROWSER_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--host-resolver-rules=MAP *.example 127.0.0.1"]
SENTENCE = "Sentence number {} tells about the weather, the sea and the mountains near the town of Bergen."


@pytest.fixture(scope="module")
def server():
    proc = start_server("--allowed-origins", GOOD_ORIGIN, "--responses-store-bytes", str(STORE_BYTES))
    yield proc
    assert proc.stop() == 0


def metric(server: ServerProcess, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    values = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " ")]
    assert values, f"{name} is not on /metrics"
    return values[0]


def wait_idle(server: ServerProcess, timeout: float = 60) -> float:
    """Seconds until nothing runs or waits."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if metric(server, "tokenmill:num_requests_running") + metric(server, "tokenmill:num_requests_waiting") == 0:
            return time.monotonic() - start
        time.sleep(0.05)
    raise AssertionError("the server did not become idle")


def log_lines(server: ServerProcess, needle: str) -> list[str]:
    return [line for line in server.output().splitlines() if needle in line]


# ---- a web page on another site, in a real browser ----------------------------------------------------------

PAGE = """<!doctype html><title>a page</title><script>
async function ask(url) {
  try {
    const r = await fetch(url, {method: "POST", headers: {"Content-Type": "application/json"},
      body: JSON.stringify({messages: [{role: "user", content: "Hi"}], max_tokens: 2})});
    return {status: r.status, body: await r.text()};
  } catch (e) { return {error: String(e)}; }
}
async function sendBlind(url) {  // a "simple" request: no preflight, the answer unreadable, the work still done
  await fetch(url, {method: "POST", mode: "no-cors", headers: {"Content-Type": "text/plain"},
    body: JSON.stringify({model: "MODEL", messages: [{role: "user", content: "blind"}], stream: false})});
}
</script>""".replace("MODEL", MODEL)


@pytest.fixture(scope="module")
def page_server():
    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            body = PAGE.encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", PAGE_PORT), Page)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield
    httpd.shutdown()


@pytest.fixture(scope="module")
def browser():
    assert Path(CHROMIUM).exists(), "Debian's chromium is installed by `make test-deps` (which `make test` runs)"
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=BROWSER_ARGS)
        yield b
        b.close()


def test_a_page_on_another_site_cannot_call_the_server_unless_allowed(server, page_server, browser) -> None:
    api = f"http://127.0.0.1:{server.port}/v1/chat/completions"
    page = browser.new_page()
    page.goto(f"http://evil.example:{PAGE_PORT}/")
    answer = page.evaluate("url => ask(url)", api)
    assert "error" in answer, answer  # the preflight got no CORS headers: the browser refuses to send the call
    before = len(log_lines(server, "/v1/chat/completions 200"))
    page.evaluate("url => sendBlind(url)", f"http://127.0.0.1:{server.port}/api/chat")
    page.evaluate("url => sendBlind(url)", api)
    time.sleep(1.0)
    assert len(log_lines(server, "/v1/chat/completions 200")) == before and not log_lines(server, "/api/chat 200")
    page.close()
    allowed = browser.new_page()  # --allowed-origins names this one
    allowed.goto(f"{GOOD_ORIGIN}/")
    answer = allowed.evaluate("url => ask(url)", api)
    assert answer.get("status") == 200, answer
    assert json.loads(answer["body"])["choices"][0]["message"]["role"] == "assistant"
    allowed.close()


def test_dns_rebinding_is_refused(server, browser) -> None:
    """The attacker's name resolves to 127.0.0.1, so its page is the server's origin; its Host gives it away."""
    page = browser.new_page()
    response = page.goto(f"http://evil.example:{server.port}/")
    assert response is not None and response.status == 403
    answer = page.evaluate("() => fetch('/v1/models').then(r => r.status)")
    assert answer == 403
    page.close()


def test_paths_on_the_machine_are_not_shown_without_a_key(server, client) -> None:
    root = client.models.list().data[0].model_dump()["root"]
    assert root.endswith(".gguf") and "/" not in root
    info = httpx.get(f"{server.url}/server_info").json()
    assert "/" not in info["model_path"]
    show = httpx.post(f"{server.url}/api/show", json={"model": MODEL}).json()
    assert re.search(r"^FROM [^/\s]+$", show["modelfile"], re.M), show["modelfile"]


def test_ollamas_curl_form_is_read_as_json(server) -> None:
    """`curl URL -d '{...}'` (Ollama's documented calls) sends application/x-www-form-urlencoded."""
    assert shutil.which("curl"), "curl is part of the machine's image"
    body = json.dumps({"model": MODEL, "prompt": "Hi", "stream": False, "options": {"num_predict": 2}})
    out = subprocess.run(["curl", "-s", f"{server.url}/api/generate", "-d", body], capture_output=True, text=True)
    assert json.loads(out.stdout)["done"] is True, out.stdout


# ---- work follows its client ---------------------------------------------------------------------------------


def test_a_huge_embedding_call_neither_starves_a_chat_nor_outlives_its_client(server, client) -> None:
    """2,048 inputs, about 50,000 tokens (minutes of work here): a 4-token chat sent meanwhile is answered while
    the call still runs, and once its client leaves the call stops within a step."""
    wait_idle(server)
    body = json.dumps({"model": MODEL, "input": [SENTENCE.format(i) for i in range(2048)]}).encode()
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(
        b"POST /v1/embeddings HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    deadline = time.monotonic() + 30
    while metric(server, "tokenmill:num_requests_running") == 0:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(1.0)
    start = time.monotonic()
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0
    )
    seconds = time.monotonic() - start
    assert reply.usage.completion_tokens == 4
    waiting = metric(server, "tokenmill:num_requests_waiting")
    assert waiting > 1000  # the call is far from done: the chat did not wait for it
    assert seconds < 6, f"a 4-token chat took {seconds:.1f} s beside the embedding call"  # FCFS: minutes
    steps = metric(server, "tokenmill:engine_steps_total")
    sock.close()  # the client leaves
    wait_idle(server, timeout=30)
    assert metric(server, "tokenmill:engine_steps_total") - steps <= 2  # the step running as it left, at most
    time.sleep(0.5)
    (line,) = log_lines(server, "/v1/embeddings aborted")
    done = re.search(r"aborted: (\d+) prompt \+ 0 output tokens, finish (\S+),", line)
    assert done is not None and int(done.group(1)) > 0 and "abort" in done.group(2).split("/"), line


def test_embedding_calls_are_capped_on_every_api(server, client) -> None:
    import ollama

    with pytest.raises(ollama.ResponseError) as refused:
        ollama.Client(host=server.url, timeout=60).embed(model=MODEL, input=["word"] * 20_000)
    assert refused.value.status_code == 400 and "2,048" in refused.value.error
    with pytest.raises(openai.BadRequestError) as too_many:
        client.embeddings.create(model=MODEL, input=["word"] * 2049)
    assert "2048" in str(too_many.value.body)  # type: ignore[arg-type]
    assert len(ollama.Client(host=server.url, timeout=60).embed(model=MODEL, input=["word"] * 3).embeddings) == 3


# ---- bounded state: the Responses store ---------------------------------------------------------------------


def test_oversized_metadata_is_refused_and_memory_stays_flat(server, client) -> None:
    """1,000 responses asking to store 200 kB of metadata each: refused (OpenAI's limits), the process's memory
    within 100 MiB of where it started."""
    rss = metric(server, "process_resident_memory_bytes")
    oversized = [
        {"note": "x" * 200_000},  # a value over 512 characters
        {f"k{i}": "x" * 12_000 for i in range(17)},  # 17 pairs
        {"k" * 65: "x", "y": "z" * 190_000},  # a key over 64 characters
    ]
    for i in range(1000):
        with pytest.raises(openai.BadRequestError) as refused:
            client.responses.create(model=MODEL, input="Hi", max_output_tokens=1, metadata=oversized[i % 3])
        assert refused.value.body["param"] == "metadata"  # type: ignore[index]
    grown = metric(server, "process_resident_memory_bytes") - rss
    assert grown < 100 * 2**20, f"RSS grew by {grown / 2**20:.0f} MiB"


def test_the_store_keeps_within_its_bytes_and_drops_the_oldest(server, client) -> None:
    metadata = {f"key{i}": "v" * 512 for i in range(16)}  # OpenAI's most: about 8.5 kB a response
    ids = [
        client.responses.create(model=MODEL, input=f"Hi {i}", max_output_tokens=1, metadata=metadata).id
        for i in range(40)
    ]
    with pytest.raises(openai.NotFoundError) as gone:
        client.responses.retrieve(ids[0])
    assert gone.value.body["param"] is None  # type: ignore[index]  # it names no request field
    assert client.responses.retrieve(ids[-1]).metadata == metadata
    kept = sum(1 for i in ids if _stored(client, i))
    assert 10 <= kept < 40  # 200 kB hold about 20 of them


def _stored(client: openai.OpenAI, response_id: str) -> bool:
    try:
        client.responses.retrieve(response_id)
    except openai.NotFoundError:
        return False
    return True


def test_a_response_being_made_is_in_progress_then_completed_or_cancelled(server, client) -> None:
    with client.responses.create(model=MODEL, input="Tell me a long story.", max_output_tokens=64, stream=True) as s:
        events = iter(s)
        created = next(events)
        assert created.type == "response.created"
        response_id = created.response.id
        assert client.responses.retrieve(response_id).status == "in_progress"
        for _ in events:
            pass
    assert client.responses.retrieve(response_id).status in ("completed", "incomplete")
    # a stream its client leaves: the response is cancelled, and the log counts what it made
    with httpx.stream(
        "POST",
        f"{server.url}/v1/responses",
        json={"model": MODEL, "input": "Count to a thousand.", "max_output_tokens": 2000, "stream": True},
        timeout=60,
    ) as r:
        deltas = 0
        left_id = None
        for line in r.iter_lines():
            if line.startswith("data: "):
                event = json.loads(line[6:])
                left_id = left_id or event.get("response", {}).get("id")
                deltas += event["type"] == "response.output_text.delta"
            if deltas >= 30:
                break
    assert left_id is not None
    wait_idle(server)
    time.sleep(0.3)
    assert client.responses.retrieve(left_id).status == "cancelled"
    with pytest.raises(openai.BadRequestError) as not_finished:
        client.responses.create(model=MODEL, input="Go on", previous_response_id=left_id, max_output_tokens=1)
    assert not_finished.value.body["param"] == "previous_response_id"  # type: ignore[index]
    (line,) = [line for line in log_lines(server, "/v1/responses aborted")]
    counts = re.search(r"(\d+) prompt \+ (\d+) output tokens, finish abort", line)
    assert counts is not None and int(counts.group(1)) > 0 and int(counts.group(2)) >= 30, line


def test_unknown_ids_and_empty_input_say_what_is_wrong(client) -> None:
    with pytest.raises(openai.NotFoundError) as unknown:
        client.responses.retrieve("resp_nosuchthing")
    assert unknown.value.body["param"] is None  # type: ignore[index]
    with pytest.raises(openai.NotFoundError) as previous:
        client.responses.create(model=MODEL, input="Hi", previous_response_id="resp_nosuchthing")
    assert previous.value.body["param"] == "previous_response_id"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as empty:
        client.responses.create(model=MODEL, input=[])
    message = empty.value.body["message"]  # type: ignore[index]
    assert "empty" in message and "input.str" not in message and empty.value.body["param"] == "input"  # type: ignore[index]


# ---- count_tokens: one rule however the prompt is made up ---------------------------------------------------


def test_count_tokens_refuses_what_cannot_fit_however_it_is_made_up(server) -> None:
    claude = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
    assert claude.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "Hi"}]).input_tokens > 0
    many = [{"role": "user" if i % 2 == 0 else "assistant", "content": "hi there"} for i in range(20_000)]
    huge = [{"role": "user", "content": "word " * 780_000}]  # 3.9 MB
    for messages in (many, huge):
        with pytest.raises(anthropic.BadRequestError) as refused:
            claude.messages.count_tokens(model=MODEL, messages=messages)
        assert "tokens" in refused.value.message
