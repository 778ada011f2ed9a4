"""The server under generated input, then under sustained mixed traffic, against one real process.

- schemathesis generates requests from /openapi.json (fixed seed, bounded examples) and checks every answer
  against the schema: no 5xx, only documented status codes and content types, bodies as declared, and bodies
  that violate the schema refused;
- hypothesis sends raw bytes, arbitrary JSON and requests with arbitrary field values: every one gets an answer
  or a 4xx in OpenAI's shape;
- a bounded soak (`tokenmill bench soak`'s traffic) keeps every answer right and the memory flat.
Throughout, the handler of last resort (a JSON 500: a bug) is never reached.
"""

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server_utils import ServerProcess, start_server
from tokenmill.entrypoints.bench.soak import run_soak

pytestmark = [pytest.mark.slow, pytest.mark.server]
SCHEMATHESIS_CHECKS = [
    "not_a_server_error",
    "status_code_conformance",
    "content_type_conformance",
    "response_schema_conformance",
    "response_headers_conformance",
    "negative_data_rejection",
]


@pytest.fixture(scope="module")
def server():
    """For fuzzing: bounded work (a request never generates more than 31 tokens, nor more than 8 samples)."""
    proc = start_server("--max-model-len", "32", "--max-num-seqs", "8")
    yield proc
    assert proc.stop() == 0
    assert "Traceback" not in proc.output()


def metric(server: ServerProcess, name: str) -> float:
    for line in httpx.get(f"{server.url}/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(name)


def test_schemathesis_finds_no_failure(server: ServerProcess, tmp_path: Path) -> None:
    command = [
        sys.executable, "-m", "schemathesis.cli", "run", f"{server.url}/openapi.json",
        "--checks", ",".join(SCHEMATHESIS_CHECKS),
        "--seed", "1", "--max-examples", "10", "--generation-database", "none",
        "--exclude-path", "/explorer/events",  # an event stream that never ends
        "--request-timeout", "60", "--no-color",
    ]  # fmt: skip
    out = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-8000:] + out.stderr[-2000:]
    assert "No issues found" in out.stdout or "0 failures" in out.stdout or " passed" in out.stdout
    assert metric(server, "tokenmill:internal_errors_total") == 0


JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_subnormal=False)  # the native library (-ffast-math) flushes subnormals in this process
    | st.text(st.characters(codec=None), max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=10,
)
FIELDS = [
    "model", "prompt", "messages", "max_tokens", "max_completion_tokens", "n", "best_of", "temperature", "top_p",
    "top_k", "min_p", "stop", "stop_token_ids", "seed", "logprobs", "top_logprobs", "echo", "stream",
    "stream_options", "logit_bias", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens",
    "ignore_eos", "return_token_ids", "suffix", "tools", "response_format", "tokens", "add_special_tokens",
    "input", "options", "format", "system", "max_output_tokens", "instructions", "input_prefix", "n_predict",
    "use_beam_search", "length_penalty",
]  # fmt: skip
# requests that mostly parse: a usable prompt or messages, then any value for any other field
ROLES = st.sampled_from(["user", "system", "assistant", "x"])
NEAR_VALID = st.fixed_dictionaries(
    {
        "prompt": st.text(st.characters(codec=None), min_size=1, max_size=16) | st.lists(st.integers(), max_size=4),
        "messages": st.lists(st.fixed_dictionaries({"role": ROLES, "content": JSON_VALUES}), max_size=2),
    },
    optional={name: JSON_VALUES for name in FIELDS if name not in ("prompt", "messages")},
)
BODIES = st.one_of(
    st.binary(max_size=80),
    JSON_VALUES.map(lambda v: json.dumps(v).encode()),
    NEAR_VALID.map(lambda v: json.dumps(v).encode()),  # json.dumps writes a lone surrogate as \\udxxx
)


POSTED = [
    "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize", "/v1/embeddings", "/v1/responses",
    "/v1/messages", "/api/chat", "/api/generate", "/api/embed", "/infill",
]  # fmt: skip
# how each API's stream ends
STREAM_ENDS = {"/v1/messages": "event: message_stop", "/v1/responses": '"type": "response.', "/infill": '"stop": true'}


@settings(max_examples=200, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(path=st.sampled_from(POSTED), body=BODIES)
def test_any_body_gets_an_answer_or_a_4xx_in_its_apis_shape(server: ServerProcess, path: str, body: bytes) -> None:
    r = httpx.post(server.url + path, content=body, headers={"content-type": "application/json"}, timeout=120)
    assert r.status_code < 500, (r.status_code, r.text[:500])
    if r.status_code >= 400:
        assert r.headers["content-type"] == "application/json"
        if path.startswith("/api/"):  # Ollama's
            assert set(r.json()) == {"error"} and r.json()["error"]
        elif path == "/v1/messages":  # Anthropic's
            assert r.json()["type"] == "error" and set(r.json()["error"]) == {"type", "message"}
        else:
            error = r.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["message"]
    elif r.headers["content-type"].startswith("text/event-stream"):
        last = r.text.rstrip().rsplit("\n\n", 1)[-1]
        assert STREAM_ENDS.get(path, "data: [DONE]") in last and '"error"' not in r.text, r.text[-500:]
    elif r.headers["content-type"].startswith("application/x-ndjson"):
        lines = r.text.strip().splitlines()
        assert json.loads(lines[-1])["done"] and '"error"' not in r.text
    else:
        assert "error" not in r.json()


def test_the_handler_of_last_resort_was_never_reached(server: ServerProcess) -> None:
    assert metric(server, "tokenmill:internal_errors_total") == 0


def test_a_bounded_soak_keeps_every_answer_right_and_memory_flat(default_server: ServerProcess) -> None:
    """`tokenmill bench soak` for 15 s (benchmarks/README.md has the 30-minute one) against `tokenmill serve` as a
    user starts it (conftest.py's shared server): memory within 5% of what it was after the first 7 s, when the
    first requests have brought in what the later ones reuse; no traceback in the server's log meanwhile."""
    logged = len(default_server.lines)  # the shared server's log before the soak: other modules' lines
    result = run_soak(default_server.url, duration_s=15, concurrency=6, sample_s=1.0, warmup_s=7)
    assert result["unexpected"] == 0, result["unexpected_examples"]
    assert result["requests"] > 30 and result["internal_errors"] == 0  # (40 while it ran 20 s)
    assert abs(result["rss_drift_pct"]) <= 5, result["rss_samples_mib"]
    server = default_server
    deadline = time.monotonic() + 30
    while metric(server, "tokenmill:num_requests_running") or metric(server, "tokenmill:kv_cache_usage_perc"):
        assert time.monotonic() < deadline, "requests or KV blocks left behind"
        time.sleep(0.1)
    assert "Traceback" not in "".join(default_server.lines[logged:])
