"""A load generator for a running server: the offline workload sent over the OpenAI API with streaming.

Each request is a /v1/completions stream of token-id prompts, greedy, with EOS banned through logit_bias so it
makes exactly its max_tokens (as ../shared/bench/ANCHORS.md measured the peers). `concurrency` clients send
requests back to back; we time each one's first token, the gaps between tokens and its end.
"""

import asyncio
import json
import time
from typing import Any

import httpx
import numpy as np

from tokenmill.entrypoints.bench.workload import make_workload


def _percentiles(values: list[float], scale: float = 1.0) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None}
    arr = np.array(values) * scale
    return {f"p{q}": round(float(np.percentile(arr, q)), 3) for q in (50, 90, 99)}


async def _one(client: httpx.AsyncClient, url: str, body: dict, record: list) -> None:
    start = time.monotonic()
    token_times: list[float] = []
    usage = None
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {await response.aread()!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            if chunk.get("usage"):
                usage = chunk["usage"]
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                token_times.append(time.monotonic())
    end = time.monotonic()
    record.append({"start": start, "token_times": token_times, "end": end, "usage": usage})


async def _run(url: str, concurrency: int, requests: list[dict], timeout: float) -> tuple[list[dict], float]:
    records: list[dict] = []
    queue: asyncio.Queue = asyncio.Queue()
    for body in requests:
        queue.put_nowait(body)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:

        async def worker() -> None:
            while not queue.empty():
                await _one(client, url, queue.get_nowait(), records)

        start = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.monotonic() - start
    return records, wall


def run_serve_bench(
    url: str,
    concurrency: int,
    num_prompts: int,
    input_len: tuple[int, int],
    output_len: tuple[int, int],
    seed: int,
    timeout: float = 600.0,
) -> dict[str, Any]:
    url = url.rstrip("/")
    info = httpx.get(f"{url}/tokenizer_info", timeout=30).json()
    model = info.get("model")
    eos = info.get("eos_token_id")
    workload = make_workload(num_prompts, input_len, output_len, seed)
    requests = [
        {
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "logit_bias": {str(eos): -100} if eos is not None else None,
        }
        for prompt, max_tokens in workload
    ]
    records, wall = asyncio.run(_run(url, concurrency, requests, timeout))
    ttft = [r["token_times"][0] - r["start"] for r in records if r["token_times"]]
    itl = [b - a for r in records for a, b in zip(r["token_times"], r["token_times"][1:], strict=False)]
    e2e = [r["end"] - r["start"] for r in records]
    output_tokens = sum(r["usage"]["completion_tokens"] for r in records if r["usage"])
    prompt_tokens = sum(r["usage"]["prompt_tokens"] for r in records if r["usage"])
    return {
        "bench": "serve",
        "url": url,
        "concurrency": concurrency,
        "num_prompts": num_prompts,
        "wall_s": round(wall, 3),
        "request_throughput": round(len(records) / wall, 3),
        "output_tok_s": round(output_tokens / wall, 2),
        "total_tok_s": round((prompt_tokens + output_tokens) / wall, 2),
        "ttft_ms": _percentiles(ttft, 1000),
        "itl_ms": _percentiles(itl, 1000),
        "e2e_s": _percentiles(e2e),
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
    }
