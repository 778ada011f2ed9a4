"""How long a stopped tensor-parallel rank goes unnoticed (issue 24, finding 4).

Starts `tokenmill serve -tp 2 --collective-timeout T` and SIGSTOPs its worker rank: mid-stream (the stream's end
and /health's 503 are timed from the stop), and during start-up, before the worker's first heartbeat (it is still
importing) and while it loads its shard (the server's exit is timed). `--busy N` runs N Python busy loops beside
it, as a loaded machine. Prints one JSON line per case.

    .venv/bin/python benchmarks/stopped_rank.py [--timeout 5] [--busy 0] [--model PATH]
"""

import argparse
import json
import subprocess
import sys
import time

import httpx
import psutil
from local_server import free_port, wait_healthy


def serve(port: int, args: argparse.Namespace) -> subprocess.Popen:
    command = [sys.executable, "-m", "tokenmill", "serve", "--port", str(port), "-tp", "2"]
    command += ["--collective-timeout", str(args.timeout)] + (["--model", args.model] if args.model else [])
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)


def worker_of(server: subprocess.Popen) -> psutil.Process:
    while True:
        for child in psutil.Process(server.pid).children(recursive=True):
            try:
                if "tokenmill.executor.worker" in " ".join(child.cmdline()):
                    return child
            except psutil.Error:
                pass
        if server.poll() is not None:
            raise RuntimeError("the server exited before its worker started")
        time.sleep(0.01)


def mid_stream(args: argparse.Namespace) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = serve(port, args)
    try:
        wait_healthy(server, url)
        worker = worker_of(server)
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        body = {"model": model, "prompt": "Once upon a time", "max_tokens": 4000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as response:
            lines = (line for line in response.iter_lines() if line.startswith("data: "))
            for _ in range(5):
                next(lines)
            worker.suspend()
            stopped = time.monotonic()
            last = list(lines)[-2:]
        ended = time.monotonic() - stopped
        while httpx.get(f"{url}/health", timeout=5).status_code != 503:
            time.sleep(0.05)
        unhealthy = time.monotonic() - stopped
        worker.resume()
        return {"case": "mid-stream", "stream_ended_s": round(ended, 2), "health_503_s": round(unhealthy, 2),
                "error_event": '"error"' in last[0]}  # fmt: skip
    finally:
        server.kill()
        server.wait()


def start_up(args: argparse.Namespace, phase: str) -> dict:
    server = serve(free_port(), args)
    try:
        worker = worker_of(server)
        if phase == "loading":  # the shard's file is mapped once loading has begun
            while not any(m.path.endswith(".gguf") for m in worker.memory_maps()):
                time.sleep(0.01)
        worker.suspend()
        stopped = time.monotonic()
        code = server.wait(timeout=max(120, 10 * args.timeout))
        return {"case": f"start-up, {phase}", "exit_s": round(time.monotonic() - stopped, 2), "exit_code": code}
    finally:
        server.kill()
        server.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--timeout", type=float, default=5.0, help="--collective-timeout, seconds")
    parser.add_argument("--busy", type=int, default=0, help="Python busy loops beside the server")
    parser.add_argument("--model", default=None)
    args = parser.parse_args()
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
    try:
        for case in (lambda: mid_stream(args), lambda: start_up(args, "importing"), lambda: start_up(args, "loading")):
            print(json.dumps({**case(), "collective_timeout_s": args.timeout, "busy": args.busy}), flush=True)
    finally:
        for process in busy:
            process.kill()


if __name__ == "__main__":
    main()
