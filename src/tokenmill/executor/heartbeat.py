"""Liveness while the ranks meet and load: a rank that stops answering is found within the collective timeout.

During a step a silent rank fails the step's collective after `collective_timeout_s` (shm.py, gloo), and while the
engine is idle rank 0 pings the ranks; start-up has neither, and waits up to STARTUP_TIMEOUT (a big model loads
slowly). So from the moment a worker rank reaches the store until rank 0's verdict, it beats: a thread of its own
bumps a counter in the store every BEAT_S. Rank 0 watches the counters from a thread; a counter that does not move
for the collective timeout (a process stopped by SIGSTOP, a frozen machine, a hung node) fails start-up, naming
the rank. Before a worker's first beat (it is still importing) rank 0 can only look at its own workers' process
state: one stopped ("T" in /proc) for the collective timeout fails start-up too.
"""

import logging
import threading
import time
from collections.abc import Callable

import torch.distributed as dist

logger = logging.getLogger(__name__)

BEAT_S = 0.25  # a worker's beat interval
WATCH_S = 0.1  # how often rank 0 reads the counters


def beat_key(rank: int) -> str:
    return f"heartbeat/{rank}"


class Heartbeat:
    """A worker rank: bump heartbeat/<rank> every BEAT_S until stop(). The store is a client of its own: the main
    thread's blocks in waits (the verdict, gloo's rendezvous), which would hold the beat back."""

    def __init__(self, store: dist.Store, rank: int):
        self._store, self._rank = store, rank
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tokenmill-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._store.add(beat_key(self._rank), 1)
            except Exception as exc:  # noqa: BLE001 - rank 0 gone: the worker's own waits fail and it exits
                logger.debug("heartbeat stopped: %s", exc)
                return
            self._stop.wait(BEAT_S)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def process_stopped(pid: int) -> bool:
    """Whether the process is stopped (SIGSTOP, or traced): its state in /proc/PID/stat (False where there is no
    /proc, or no such process)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read()
    except OSError:
        return False
    state = text[text.rfind(b")") + 2 :][:1]  # "pid (comm) S ...": the state follows the command's name
    return state in (b"T", b"t")


class StartupWatch:
    """Rank 0: watch ranks 1..N-1 from a thread until stop(). A rank silent for `timeout_s` is recorded in
    `failure` (start-up's waits raise it) and given to `on_failure` (tokenmill's own workers: the process is
    killed, which ends a wait for it that nothing else would end). `pids`: the workers' process ids where they
    are children of this process (their state is watched before their first beat), else empty."""

    def __init__(
        self,
        store: dist.Store,
        world_size: int,
        timeout_s: float,
        pids: dict[int, int],
        on_failure: Callable[[int], None] = lambda rank: None,
    ):
        self._store, self._timeout_s, self._pids, self._on_failure = store, timeout_s, pids, on_failure
        self._ranks = range(1, world_size)
        self.failure: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tokenmill-startup-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        now = time.monotonic()
        seen = {rank: (0, now) for rank in self._ranks}  # rank -> (its last count, when it last moved)
        while not self._stop.wait(WATCH_S):
            now = time.monotonic()
            for rank in self._ranks:
                try:
                    count = self._store.add(beat_key(rank), 0)
                except Exception as exc:  # noqa: BLE001 - the store is going away with start-up itself
                    logger.debug("start-up watch stopped: %s", exc)
                    return
                last, since = seen[rank]
                stopped = rank in self._pids and process_stopped(self._pids[rank])
                if count != last or (count == 0 and not stopped):
                    seen[rank] = (count, now)  # beating, or still starting and running
                elif now - since > self._timeout_s:
                    what = "its process is stopped" if stopped else "its heartbeat stopped"
                    self.failure = (
                        f"rank {rank} did not answer within the collective timeout ({self._timeout_s:g} s) "
                        f"during start-up: {what}"
                    )
                    logger.error("%s", self.failure)
                    self._on_failure(rank)
                    return

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
