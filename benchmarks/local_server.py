"""What the benchmarks that start a `tokenmill serve` of their own share: a free port, and the wait until it is
healthy. Imported by the scripts beside it (they run as `python benchmarks/<script>.py`, so this directory is on
sys.path)."""

import socket
import subprocess
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(process: subprocess.Popen, url: str, timeout_s: float = 120) -> None:
    """Until `url`/health answers 200; kills the process and raises when it exits or `timeout_s` passes first."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"the server at {url} did not become healthy")
        time.sleep(0.02)
