"""A loaded model: its child process (entrypoints/model_process.py, today's one-model server on a port of
127.0.0.1), started and waited for until its /health answers 200, measured (resident memory), and stopped.

A process per model, as Ollama's runners and llama.cpp's router children: its load never stalls this process's
event loop nor another model's engine thread (they share only the CPU), and stopping it gives every byte back."""

import asyncio
import dataclasses
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path

import httpx

from tokenmill.config.server import ServerSettings
from tokenmill.server.model_router.catalog import ServableModel

CHILD_MODULE = "tokenmill.entrypoints.model_process"


class ModelLoadError(Exception):
    """The model's process exited (or never answered) before it was ready."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ModelProcess:
    def __init__(self, model: ServableModel, process: asyncio.subprocess.Process, port: int):
        self.model = model
        self.process = process
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.load_seconds = 0.0

    @classmethod
    async def start(cls, model: ServableModel, settings: ServerSettings, timeout_s: float) -> "ModelProcess":
        """Start the model's server and wait until it is ready; ModelLoadError when it exits first or times out
        (the process is stopped then)."""
        started = time.monotonic()
        port = _free_port()
        child = dataclasses.replace(
            settings,
            model=model.path,
            served_model_name=model.name,
            served_model_aliases=list(model.aliases),
            host="127.0.0.1",
            port=port,
            models_dir=None,
            allowed_origins=[],  # this process checked the origin; the child sees none
        )
        env = {**os.environ, "TOKENMILL_ROUTER_PID": str(os.getpid())}
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", CHILD_MODULE, stdin=asyncio.subprocess.PIPE, env=env
        )
        assert process.stdin is not None
        process.stdin.write(json.dumps({"settings": dataclasses.asdict(child)}).encode())
        await process.stdin.drain()
        process.stdin.close()
        loaded = cls(model, process, port)
        try:
            await loaded._wait_ready(started + timeout_s)
        except BaseException:
            await loaded.stop(grace_s=2.0)
            raise
        loaded.load_seconds = time.monotonic() - started
        return loaded

    async def _wait_ready(self, deadline: float) -> None:
        async with httpx.AsyncClient(timeout=2.0) as client:
            while time.monotonic() < deadline:
                if self.process.returncode is not None:
                    raise ModelLoadError(
                        f"the model {self.model.name!r} failed to load (its process exited with "
                        f"{self.process.returncode}; the server's log says why)"
                    )
                try:
                    if (await client.get(f"{self.url}/health")).status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                await asyncio.sleep(0.05)
        raise ModelLoadError(f"the model {self.model.name!r} did not load in time")

    @property
    def alive(self) -> bool:
        return self.process.returncode is None

    def rss_bytes(self) -> int:
        """Resident memory of the model's process and its own children (tensor-parallel ranks), 0 once gone."""
        return sum(_rss(pid) for pid in _tree(self.process.pid))

    async def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM (the child finishes what it runs within its --shutdown-grace), then SIGKILL after grace_s."""
        if self.process.returncode is None:
            try:
                self.process.send_signal(signal.SIGTERM)
                await asyncio.wait_for(self.process.wait(), grace_s)
            except TimeoutError:
                self.process.kill()
            except ProcessLookupError:
                pass
        await self.process.wait()


def _tree(pid: int) -> list[int]:
    """`pid` and its descendants (Linux's /proc/PID/task/*/children)."""
    pids, i = [pid], 0
    while i < len(pids):
        for task in Path(f"/proc/{pids[i]}/task").glob("*/children"):
            try:
                pids += [int(p) for p in task.read_text().split()]
            except OSError:
                pass
        i += 1
    return pids


def _rss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
