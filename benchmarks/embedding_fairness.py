"""Does one huge call starve the others? (issue 35) A 2,048-input embedding call, and 4-token chats meanwhile.

Starts `tokenmill serve` on a free port of 127.0.0.1 for each configuration, sends one /v1/embeddings call of
2,048 sentences (about 25 tokens each: some 50,000 prompt tokens, minutes of work on 2 cores), waits until it
runs, then sends `--chats` chats of 4 output tokens one after another (0.5 s apart) and times each from send to
answer. Then the embedding call's client leaves, and the script times until the engine is idle and counts the
engine steps run after it left. Prints one JSON line per configuration:

- `default`: as a user starts it (waiting calls take turns; shared steps held to --decode-step-ms 250);
- `--decode-step-ms 0`: the turns without the step limit (each shared step may carry 512 prompt tokens).

    PYTHONPATH=src .venv/bin/python benchmarks/embedding_fairness.py [--chats 8] [--configs default no-pacing]
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time

import httpx
from local_server import free_port, wait_healthy

SENTENCE = "Sentence number {} tells about the weather, the sea and the mountains near the town of Bergen."
CONFIGS = {"default": [], "no-pacing": ["--decode-step-ms", "0"]}


def metric(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise KeyError(name)


def busy(url: str) -> float:
    return metric(url, "tokenmill:num_requests_running") + metric(url, "tokenmill:num_requests_waiting")


def run(config: str, chats: int) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "tokenmill.entrypoints.cli", "serve", "--port", str(port), *CONFIGS[config]]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=dict(os.environ))
    try:
        wait_healthy(proc, url)
        body = json.dumps({"input": [SENTENCE.format(i) for i in range(2048)]}).encode()
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(
            b"POST /v1/embeddings HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        while metric(url, "tokenmill:num_requests_running") == 0:
            time.sleep(0.05)
        time.sleep(1.0)
        latencies = []
        for i in range(chats):
            start = time.monotonic()
            r = httpx.post(
                f"{url}/v1/chat/completions",
                json={"messages": [{"role": "user", "content": f"Hi {i}"}], "max_tokens": 4, "temperature": 0},
                timeout=600,
            )
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
            latencies.append(time.monotonic() - start)
            time.sleep(0.5)
        still_waiting = metric(url, "tokenmill:num_requests_waiting")
        steps = metric(url, "tokenmill:engine_steps_total")
        left = time.monotonic()
        sock.close()
        while busy(url) > 0:
            time.sleep(0.02)
        return {
            "bench": "embedding_fairness",
            "config": config,
            "chat_seconds_median": round(statistics.median(latencies), 3),
            "chat_seconds_max": round(max(latencies), 3),
            "chat_seconds": [round(x, 3) for x in latencies],
            "embedding_inputs_waiting_after_chats": int(still_waiting),
            "idle_seconds_after_client_left": round(time.monotonic() - left, 3),
            "steps_after_client_left": int(metric(url, "tokenmill:engine_steps_total") - steps),
        }
    finally:
        proc.terminate()
        proc.wait(60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--chats", type=int, default=8)
    parser.add_argument("--configs", nargs="+", choices=sorted(CONFIGS), default=["default", "no-pacing"])
    args = parser.parse_args()
    for config in args.configs:
        print(json.dumps(run(config, args.chats)), flush=True)


if __name__ == "__main__":
    main()
