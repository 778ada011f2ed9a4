"""Start a real `tokenmill serve` process on a free port of 127.0.0.1 for tests."""

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    """A server process whose output (stdout and stderr) a thread reads as it comes, so that a server that logs
    a line per request never blocks on a full pipe."""

    process: subprocess.Popen
    port: int
    group: bool = False  # the process leads a process group of its own (signals go to the whole group)
    health_codes: list[int] = field(default_factory=list)  # /health answers seen while starting
    lines: list[str] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)  # about when the process started

    def __post_init__(self) -> None:
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        if self.process.stdout is not None:
            for line in self.process.stdout:
                self.lines.append(line)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if self.process.poll() is None:
            self._signal(sig)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                self.process.wait()
        return self.process.returncode

    def _signal(self, sig: int) -> None:
        if self.group:
            os.killpg(self.process.pid, sig)
        else:
            self.process.send_signal(sig)

    def output(self) -> str:
        """Everything the server wrote so far (all of it once it has exited)."""
        if self.process.poll() is not None:
            self._reader.join(timeout=10)
        return "".join(self.lines)

    def log_lines(self, text: str, count: int = 1, timeout: float = 10) -> list[str]:
        """The lines of the output that hold `text`, once there are `count` of them (or `timeout` passed: the
        server writes a call's line as it ends, and this process reads it a moment later)."""
        deadline = time.monotonic() + timeout
        while True:
            found = [line for line in self.output().splitlines() if text in line]
            if len(found) >= count or time.monotonic() > deadline:
                return found
            time.sleep(0.05)


def start_server(*args: str, timeout: float = 120) -> ServerProcess:
    port = free_port()
    command = [sys.executable, "-m", "tokenmill.entrypoints.cli", "serve", "--port", str(port), *args]
    return start_command(command, port, timeout)


def start_command(command: list[str], port: int, timeout: float = 120, group: bool = False, **popen) -> ServerProcess:
    """Run `command` (a server that will listen on `port`) until its /health answers 200. `group`: in a process
    group of its own, which stop() signals as a whole (a command that starts the server as its child: make)."""
    env = {**os.environ, "TOKENMILL_LOG_LEVEL": "INFO"}
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=group, **popen
    )
    server = ServerProcess(process, port, group)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}:\n{server.output()}")
        try:
            code = httpx.get(f"{server.url}/health", timeout=2).status_code
            server.health_codes.append(code)
            if code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.02)
    server.stop(signal.SIGKILL)
    raise RuntimeError(f"server did not become healthy in time:\n{server.output()}")
