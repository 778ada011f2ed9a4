"""Start-up liveness (executor/heartbeat.py) on a real TCPStore in this process: a worker's heartbeat keeps
rank 0's watch quiet, a heartbeat that stops fails it after the timeout, and a stopped child process is seen in
/proc before any beat."""

import datetime
import signal
import subprocess
import sys
import time

import torch.distributed as dist

from tokenmill.executor.heartbeat import BEAT_S, WATCH_S, Heartbeat, StartupWatch, process_stopped


def store_pair() -> tuple[dist.TCPStore, dist.TCPStore]:
    timeout = datetime.timedelta(seconds=10)
    server = dist.TCPStore("127.0.0.1", 0, 2, True, timeout, wait_for_workers=False)
    return server, dist.TCPStore("127.0.0.1", server.port, 2, False, timeout, wait_for_workers=False)


def wait_for_failure(watch: StartupWatch, seconds: float) -> float:
    start = time.monotonic()
    while watch.failure is None and time.monotonic() - start < seconds:
        time.sleep(0.02)
    return time.monotonic() - start


def test_a_beating_rank_passes_and_a_silent_one_fails_after_the_timeout() -> None:
    server, client = store_pair()
    failed: list[int] = []
    heartbeat = Heartbeat(client, 1)
    watch = StartupWatch(server, 2, 0.6, {}, failed.append)
    try:
        assert wait_for_failure(watch, 1.5) >= 1.5 and watch.failure is None  # beating: 2.5 timeouts, no alarm
        heartbeat.stop()
        took = wait_for_failure(watch, 5)  # from the last beat, up to BEAT_S before stop() returned
        assert watch.failure is not None and 0.6 - BEAT_S - WATCH_S < took < 2.0, (took, watch.failure)
        assert "rank 1 did not answer within the collective timeout (0.6 s)" in watch.failure
        assert "heartbeat stopped" in watch.failure and failed == [1]
    finally:
        heartbeat.stop()
        watch.stop()


def test_a_rank_still_starting_is_waited_for_unless_its_process_is_stopped() -> None:
    server, _ = store_pair()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    watch = StartupWatch(server, 2, 0.5, {1: child.pid})
    try:
        assert wait_for_failure(watch, 1.2) >= 1.2 and watch.failure is None  # running, not beating yet: fine
        child.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while not process_stopped(child.pid):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        took = wait_for_failure(watch, 5)
        assert watch.failure is not None and took < 2.0 and "its process is stopped" in watch.failure
    finally:
        watch.stop()
        child.kill()
        child.wait()
    assert not process_stopped(child.pid)  # gone: not stopped
