"""Starting the other ranks when torchrun did not: `tokenmill serve --tensor-parallel-size N` and
`LLM(..., tensor_parallel_size=N)` run rank 0 in their own process and start N-1 worker processes on this host.

The workers meet rank 0 through a TCPStore it opens on 127.0.0.1 (a free port). Each worker watches its parent
and exits when it is gone, so a killed server leaves no worker behind; `stop` ends them on shutdown (and at
interpreter exit), killing any that do not leave within a few seconds.
"""

import atexit
import json
import logging
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch.distributed as dist

from tokenmill.config import EngineConfig
from tokenmill.distributed.group import STARTUP_TIMEOUT
from tokenmill.errors import TokenmillError

logger = logging.getLogger(__name__)

STOP_GRACE_S = 5.0


class RankStartupError(TokenmillError):
    """A rank could not start or load its shard; the message names the rank."""


def wait_for_keys(store: dist.Store, keys: list[str], check_alive: Callable[[], None], what: str) -> None:
    """Until every key is in the store, within the start-up timeout ("not {what} within the start-up timeout"
    else); `check_alive` raises for a rank that exited or stopped answering first."""
    deadline = time.monotonic() + STARTUP_TIMEOUT.total_seconds()
    while not store.check(keys):
        check_alive()
        if time.monotonic() > deadline:
            raise RankStartupError(f"{what} within the start-up timeout")
        time.sleep(0.02)


@dataclass(frozen=True)
class RankSpec:
    """What every rank needs to build its shard (the same on every rank)."""

    model: str | None  # the GGUF file (as `--model` takes it; None: the bundled model)
    dtype: str
    quantization: str | None
    block_size: int
    device: str | None
    tensor_parallel_size: int
    collective_timeout_s: float
    kv_cache_dtype: str = "auto"
    weight_cache: bool = False

    @classmethod
    def for_engine(cls, model: str | None, dtype: str, quantization: str | None, config: EngineConfig) -> "RankSpec":
        c = config
        return cls(
            model,
            dtype,
            quantization,
            c.block_size,
            c.device,
            c.tensor_parallel_size,
            c.collective_timeout_s,
            c.kv_cache_dtype,
            c.weight_cache,
        )

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "RankSpec":
        return cls(**json.loads(text))


class WorkerProcesses:
    """Ranks 1..N-1 as child processes of this one."""

    def __init__(self, spec: RankSpec):
        self.spec = spec
        self.store = dist.TCPStore("127.0.0.1", 0, spec.tensor_parallel_size, True, STARTUP_TIMEOUT, False)
        self.processes: dict[int, subprocess.Popen] = {}
        for rank in range(1, spec.tensor_parallel_size):
            command = [sys.executable, "-m", "tokenmill.executor.worker", "--spec", spec.to_json()]
            command += ["--rank", str(rank), "--store-port", str(self.store.port)]
            self.processes[rank] = subprocess.Popen(command)
        atexit.register(self.stop)

    def wait_joined(self, check_alive: Callable[[], None]) -> None:
        """Until every worker has reached the process group's rendezvous; `check_alive` raises for a worker that
        exited or stopped answering first."""
        keys = [f"joined/{rank}" for rank in self.processes]
        wait_for_keys(self.store, keys, check_alive, "the worker ranks did not start")

    def check_alive(self) -> None:
        for rank, process in self.processes.items():
            code = process.poll()
            if code is not None:
                raise RankStartupError(f"rank {rank} (pid {process.pid}) exited with status {code} during start-up")

    def pids(self) -> list[int]:
        return [p.pid for p in self.processes.values()]

    def stop(self, grace_s: float = 0.0) -> None:
        """Give the workers `grace_s` to leave by themselves (after a SHUTDOWN), then SIGTERM, then SIGKILL
        those still there after STOP_GRACE_S."""
        self._wait_all(grace_s)
        for action in ("terminate", "kill"):
            alive = [p for p in self.processes.values() if p.poll() is None]
            if not alive:
                break
            for process in alive:
                getattr(process, action)()
            self._wait_all(STOP_GRACE_S)
        atexit.unregister(self.stop)

    def _wait_all(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        for process in self.processes.values():
            try:
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
