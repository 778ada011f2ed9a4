"""How long constraints take to compile, and whether a large one stalls other clients of a real server (issue 24,
findings 1-2).

First, in this process, how long the engine's constraint compiler (compile, dry run, matcher) takes for some
constraints, and what it answers. Then it starts `tokenmill serve` on a free port of 127.0.0.1 and, for each
choice size: one client streams a free completion, another polls /health every 20 ms, and a third sends the
constrained request. Reports the constrained request's answer and time, /health's worst latency and the stream's
worst gap meanwhile; first the same for a request without a constraint (what the machine's own load gives).

    PYTHONPATH=src .venv/bin/python benchmarks/constraint_stall.py [--options 30000 100000]
"""

import argparse
import json
import os
import subprocess
import sys
import threading
import time

import httpx
from local_server import free_port, wait_healthy


def start(port: int, extra: list[str]) -> subprocess.Popen:
    command = [sys.executable, "-m", "tokenmill.entrypoints.cli", "serve", "--port", str(port), *extra]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=dict(os.environ))
    wait_healthy(proc, f"http://127.0.0.1:{port}")
    return proc


def measure(url: str, body: dict) -> dict:
    health: list[float] = []
    gaps: list[float] = []
    done = threading.Event()

    def poll() -> None:
        while not done.is_set():
            t = time.monotonic()
            httpx.get(f"{url}/health", timeout=120)
            health.append(time.monotonic() - t)
            time.sleep(0.02)

    def stream() -> None:
        free = {"prompt": "Count:", "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=free, timeout=120) as r:
            last = time.monotonic()
            for line in r.iter_lines():
                if done.is_set():
                    break
                if line:
                    now = time.monotonic()
                    gaps.append(now - last)
                    last = now

    threads = [threading.Thread(target=poll), threading.Thread(target=stream)]
    for t in threads:
        t.start()
    time.sleep(1.0)  # the stream is decoding
    start = time.monotonic()
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
    seconds = time.monotonic() - start
    time.sleep(0.3)
    done.set()
    for t in threads:
        t.join()
    answer = r.json()
    summary = answer["choices"][0] if r.status_code == 200 else answer["error"]["message"][:160]
    return {
        "status": r.status_code,
        "answer": summary if r.status_code != 200 else {"text": summary["text"], "finish": summary["finish_reason"]},
        "request_s": round(seconds, 2),
        "health_max_s": round(max(health), 3),
        "stream_max_gap_s": round(max(gaps[1:], default=float("nan")), 3),
        "stream_events": len(gaps),
    }


def compile_times() -> None:
    from tokenmill.loader.model_path import bundled_model_path
    from tokenmill.loader.model_source import open_model_source
    from tokenmill.structured import StructuredOutputsParams as S
    from tokenmill.structured.grammars import GrammarCompiler
    from tokenmill.tokenizer.from_source import load_tokenizer

    tokenizer = load_tokenizer(open_model_source(bundled_model_path()))
    compiler = GrammarCompiler(tokenizer, 49152)
    rules = 20_000
    lark = (
        "start: " + " | ".join(f"r{i}" for i in range(rules)) + "\n" + "\n".join(f'r{i}: "t{i}"' for i in range(rules))
    )
    person = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}}
    cases = {
        "json schema (2 properties)": S(json=person),
        "choice of 2,500": S(choice=[f"option{i}" for i in range(2_500)]),
        "choice of 30,000": S(choice=[f"option{i}" for i in range(30_000)]),
        "choice of 100,000": S(choice=[f"option{i}" for i in range(100_000)]),
        "regex a{1000000}": S(regex="a{1000000}"),
        "regex [^\\x00-\\U0010FFFF]": S(regex="[^\\x00-\\U0010FFFF]"),
        "$ref cycle": S(json={"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}),
        "Lark, 20,000 rules": S(grammar=lark),
        "Lark, 66,000 symbols": S(grammar="start: " + " ".join('"t"' for _ in range(66_000))),
    }
    for name, params in cases.items():
        for attempt in ("first", "cached"):
            start = time.monotonic()
            try:
                compiler.compile(params)
                outcome = "compiled"
            except Exception as exc:  # noqa: BLE001 - what it answers is the point
                outcome = str(exc)[:150]
            seconds = time.monotonic() - start
            print(
                json.dumps({"constraint": name, "attempt": attempt, "seconds": round(seconds, 4), "outcome": outcome})
            )
    compiler.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--options", type=int, nargs="+", default=[30_000, 100_000])
    parser.add_argument("--server-args", default="", help="extra `tokenmill serve` options")
    args = parser.parse_args()
    compile_times()
    port = free_port()
    proc = start(port, args.server_args.split())
    try:
        control = {"prompt": "Pick one:", "max_tokens": 8}  # the same request without a constraint: the machine's noise
        print(json.dumps({"options": 0, "attempt": "control", **measure(f"http://127.0.0.1:{port}", control)}))
        for n in args.options:
            choices = [f"option{i}" for i in range(n)]
            body = {"prompt": "Pick one:", "max_tokens": 8, "structured_outputs": {"choice": choices}}
            size = len(json.dumps(body))
            for attempt in ("first", "again"):  # the second shows whether the outcome was cached
                result = measure(f"http://127.0.0.1:{port}", body)
                print(json.dumps({"options": n, "body_bytes": size, "attempt": attempt, **result}), flush=True)
    finally:
        proc.terminate()
        proc.wait(30)


if __name__ == "__main__":
    main()
