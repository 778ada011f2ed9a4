"""Inter-token latency of a running stream on model A while model B loads in the same server (issue 40), and without a
load for comparison: does a load stall the others' streams?

    PYTHONPATH=src .venv/bin/python benchmarks/several_models.py [--a smollm2-135m] [--b gemma3-270m] [--rounds 2]

Starts `tokenmill serve --model A --model B` on a free port of 127.0.0.1, loads A, then per round: streams from A
(greedy, ignore_eos) for --baseline-s seconds with nothing else going on, then streams again and asks for B in the
middle (B loads: its own process starts, imports torch, reads its file, builds its engine and answers 4 tokens),
then unloads B (keep_alive 0). Prints one JSON object: the gaps between A's tokens (ms: p50, p99, max, count) with
no load and while B loaded, B's load seconds as the client waited for them, and the machine's load average.
"""

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.server_utils import start_server  # noqa: E402


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summary(gaps_s: list[float]) -> dict:
    ms = [g * 1000 for g in gaps_s]
    if not ms:
        return {"count": 0}
    return {
        "count": len(ms),
        "p50_ms": round(statistics.median(ms), 1),
        "p99_ms": round(percentile(ms, 0.99), 1),
        "max_ms": round(max(ms), 1),
    }


class Stream:
    """A's stream in a thread: each token's arrival time, until stopped."""

    def __init__(self, url: str, model: str):
        self.arrivals: list[float] = []
        self._stop = threading.Event()
        body = {"model": model, "prompt": "Once upon a time", "max_tokens": 8000, "temperature": 0}
        body |= {"stream": True, "ignore_eos": True}
        self._thread = threading.Thread(target=self._run, args=(url, body), daemon=True)
        self._thread.start()
        while len(self.arrivals) < 5:  # past its prefill
            time.sleep(0.01)

    def _run(self, url: str, body: dict) -> None:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as response:
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    self.arrivals.append(time.monotonic())
                if self._stop.is_set():
                    return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=60)

    def gaps(self, start: float, end: float) -> list[float]:
        inside = [t for t in self.arrivals if start <= t <= end]
        return [b - a for a, b in zip(inside, inside[1:], strict=False)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--a", default="smollm2-135m", help="the streaming model")
    parser.add_argument("--b", default="gemma3-270m", help="the model that loads")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--baseline-s", type=float, default=10.0, help="seconds of A's stream with no load")
    args = parser.parse_args()
    server = start_server("--model", args.a, "--model", args.b, "--disable-log-requests")
    try:
        url = server.url
        names = [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]]
        a, b = names
        httpx.post(f"{url}/api/generate", json={"model": a, "prompt": ""}, timeout=600)  # A loaded
        idle, loading, load_s = [], [], []
        for _ in range(args.rounds):
            stream = Stream(url, a)
            start = time.monotonic()
            time.sleep(args.baseline_s)
            idle += stream.gaps(start, time.monotonic())
            stream.stop()
            stream = Stream(url, a)
            start = time.monotonic()
            body = {"model": b, "prompt": "The sky is", "raw": True, "stream": False, "options": {"num_predict": 4}}
            assert httpx.post(f"{url}/api/generate", json=body, timeout=600).status_code == 200
            end = time.monotonic()
            loading += stream.gaps(start, end)
            load_s.append(round(end - start, 2))
            stream.stop()
            httpx.post(f"{url}/api/generate", json={"model": b, "prompt": "", "keep_alive": 0}, timeout=600)
        print(
            json.dumps(
                {
                    "a": a,
                    "b": b,
                    "rounds": args.rounds,
                    "itl_no_load": summary(idle),
                    "itl_while_b_loads": summary(loading),
                    "b_load_and_answer_s": load_s,
                    "loadavg_1m": round(os.getloadavg()[0], 2),
                    "cpus": os.cpu_count(),
                }
            )
        )
    finally:
        server.stop()


if __name__ == "__main__":
    main()
