"""A soak of a running server: mixed traffic for a while, the server's memory sampled all along.

`concurrency` clients send requests back to back, each drawn from a fixed mix: completions and chat, streamed or
not, several samples with a seed, log-probabilities, streams the client leaves early, tokenize calls, and
requests that must fail (an unknown model, a bad parameter, text that is not Unicode). Every answer is checked:
a good request must succeed (or be refused with 503 when the server is full), a bad one must get its 4xx in
OpenAI's shape. The server's resident memory comes from its /metrics (process_resident_memory_bytes), sampled
every `sample_s` seconds.
"""

import asyncio
import json
import random
import time
from collections import Counter
from typing import Any

import httpx

WORDS = (
    "the a river mountain light engine token cache block green small quickly under over because story model "
    "answer question number seven blue train window garden code memory step batch prefix"
).split()


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def _request(rng: random.Random, model: str, max_len: int) -> tuple[str, str, dict | bytes, bool]:
    """(kind, path, body, must_succeed) of one request of the mix."""
    words = rng.randint(3, max(4, max_len // 6))
    max_tokens = rng.randint(4, max(5, max_len // 6))
    prompt = _text(rng, words)
    kind = rng.choices(
        ["completion", "completion_stream", "chat", "chat_stream", "samples", "logprobs", "leave_early",
         "tokenize", "bad_parameter", "unknown_model", "not_unicode"],
        weights=[4, 4, 3, 3, 2, 2, 2, 1, 1, 1, 1],
    )[0]  # fmt: skip
    chat = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens}
    completion = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    if kind == "completion":
        return kind, "/v1/completions", completion, True
    if kind == "completion_stream":
        return kind, "/v1/completions", {**completion, "stream": True, "stream_options": {"include_usage": True}}, True
    if kind == "chat":
        return kind, "/v1/chat/completions", chat, True
    if kind == "chat_stream":
        return kind, "/v1/chat/completions", {**chat, "stream": True, "temperature": 0.7}, True
    if kind == "samples":
        return kind, "/v1/completions", {**completion, "n": 3, "temperature": 1.0, "seed": rng.randint(0, 999)}, True
    if kind == "logprobs":
        return kind, "/v1/chat/completions", {**chat, "logprobs": True, "top_logprobs": 5}, True
    if kind == "leave_early":
        return kind, "/v1/completions", {**completion, "max_tokens": max_len // 2, "stream": True}, True
    if kind == "tokenize":
        return kind, "/tokenize", {"model": model, "prompt": prompt}, True
    if kind == "bad_parameter":
        return kind, "/v1/completions", {**completion, "temperature": -1}, False
    if kind == "unknown_model":
        return kind, "/v1/chat/completions", {**chat, "model": "no-such-model"}, False
    return kind, "/v1/completions", b'{"prompt": "a\\ud800", "max_tokens": 2}', False


async def _send(client: httpx.AsyncClient, path: str, body: dict | bytes, leave_early: bool) -> tuple[int, bool]:
    """(HTTP status, whether the answer was well formed)."""
    kwargs: dict[str, Any] = {"content": body, "headers": {"content-type": "application/json"}}
    if isinstance(body, dict):
        kwargs = {"json": body}
    streaming = isinstance(body, dict) and body.get("stream")
    async with client.stream("POST", path, **kwargs) as response:
        if response.status_code != 200 or not streaming:
            data = json.loads(await response.aread())
            ok = "error" in data if response.status_code >= 400 else "error" not in data
            return response.status_code, ok
        events = 0
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return 200, True
            if "error" in json.loads(line[6:]):
                return 200, False
            events += 1
            if leave_early and events == 3:
                return 200, True  # leaving the block closes the connection: the server must abort the request
        return 200, False  # the stream ended without [DONE]


async def _metrics(client: httpx.AsyncClient) -> dict[str, float]:
    values = {}
    for line in (await client.get("/metrics")).text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


async def _soak(
    url: str, duration_s: float, warmup_s: float, concurrency: int, sample_s: float, seed: int, headers: dict
) -> dict:
    limits = httpx.Limits(max_connections=concurrency + 2, max_keepalive_connections=concurrency + 2)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits, headers=headers) as client:
        info = (await client.get("/tokenizer_info")).json()
        model, max_len = info["model"], min(info["model_max_length"], 512)
        outcomes: Counter = Counter()
        unexpected: list[str] = []
        samples: list[tuple[float, dict[str, float]]] = []
        start = time.monotonic()
        deadline = start + duration_s

        async def client_loop(index: int) -> None:
            rng = random.Random(seed * 1000 + index)
            while time.monotonic() < deadline:
                kind, path, body, must_succeed = _request(rng, model, max_len)
                try:
                    status, well_formed = await _send(client, path, body, kind == "leave_early")
                except (httpx.HTTPError, json.JSONDecodeError) as exc:
                    status, well_formed = -1, False
                    unexpected.append(f"{kind}: {exc!r}")
                expected = (status == 200 or status == 503) if must_succeed else 400 <= status < 500
                outcomes[f"{kind} {status}"] += 1
                if not (expected and well_formed) and status != -1:
                    unexpected.append(f"{kind}: HTTP {status}")

        async def sampler() -> None:
            while time.monotonic() < deadline:
                samples.append((time.monotonic() - start, await _metrics(client)))
                await asyncio.sleep(sample_s)

        samples.append((0.0, await _metrics(client)))
        await asyncio.gather(sampler(), *(client_loop(i) for i in range(concurrency)))
        wall = time.monotonic() - start
        await asyncio.sleep(1.0)  # let the engine drop what the last clients left
        samples.append((time.monotonic() - start, await _metrics(client)))
    rss = [(t, m.get("process_resident_memory_bytes", 0) / 2**20) for t, m in samples]
    warm = next((r for t, r in rss if t >= warmup_s), rss[-1][1])
    end = samples[-1][1]
    return {
        "bench": "soak",
        "url": url,
        "duration_s": round(wall, 1),
        "concurrency": concurrency,
        "requests": sum(outcomes.values()),
        "outcomes": dict(sorted(outcomes.items())),
        "unexpected": len(unexpected),
        "unexpected_examples": unexpected[:10],
        "warmup_s": warmup_s,
        "rss_mib": {
            "start": round(rss[0][1], 1),
            "after_warmup": round(warm, 1),
            "end": round(rss[-1][1], 1),
            "max": round(max(r for _, r in rss), 1),
        },
        "rss_drift_pct": round((rss[-1][1] - warm) / warm * 100, 2) if warm else None,
        "rss_samples_mib": [[round(t), round(r, 1)] for t, r in rss],
        "internal_errors": end.get("tokenmill:internal_errors_total", 0),
        "end_running": end.get("tokenmill:num_requests_running"),
        "end_kv_cache_usage": end.get("tokenmill:kv_cache_usage_perc"),
    }


def run_soak(
    url: str,
    duration_s: float,
    concurrency: int = 8,
    sample_s: float = 5.0,
    seed: int = 0,
    api_key: str | None = None,
    warmup_s: float | None = None,
) -> dict[str, Any]:
    """`rss_drift_pct` compares the memory at the end with the memory after `warmup_s` (default: a tenth of the
    run, at most a minute), when the first requests have brought in what every later one reuses."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    warmup = min(60.0, duration_s / 10) if warmup_s is None else warmup_s
    return asyncio.run(_soak(url.rstrip("/"), duration_s, warmup, concurrency, sample_s, seed, headers))
