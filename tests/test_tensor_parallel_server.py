"""`tokenmill serve` split over several ranks on 127.0.0.1 (gloo): launched by torchrun on one "node" and on two,
and by tokenmill itself; a worker killed mid-generation; start-up failures; no process left behind."""

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import psutil
import pytest
from openai import OpenAI

from tests.server_utils import ServerProcess, free_port, start_command, start_server

pytestmark = [pytest.mark.slow, pytest.mark.server]

PROMPT = "The capital of France is"


def torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *args]


def serve_args(http_port: int, *extra: str) -> list[str]:
    return ["-m", "tokenmill", "serve", "--port", str(http_port), *extra]


def family(pid: int) -> list[psutil.Process]:
    """The process and all its descendants."""
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def is_worker(process: psutil.Process) -> bool:
    try:
        return "tokenmill.executor.worker" in " ".join(process.cmdline())
    except psutil.Error:  # gone, or a zombie, since it was listed
        return False


def assert_all_gone(processes: list[psutil.Process], timeout: float = 15) -> None:
    _, alive = psutil.wait_procs(processes, timeout=timeout)
    alive = [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"left behind: {[(p.pid, p.cmdline()[-6:]) for p in alive]}"


@contextmanager
def cleaned_up(server: ServerProcess) -> Iterator[list[psutil.Process]]:
    """The server's processes; whatever is left of them is killed when the block ends, passed or failed."""
    processes = family(server.process.pid)
    try:
        yield processes
    finally:
        for process in processes:
            try:
                process.kill()
            except psutil.NoSuchProcess:
                pass


def streamed_text(url: str, max_tokens: int = 8) -> str:
    client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    stream = client.completions.create(model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=0, stream=True)
    return "".join(chunk.choices[0].text for chunk in stream if chunk.choices)


@pytest.fixture(scope="module")
def one_rank_text(default_server: ServerProcess) -> str:
    return streamed_text(default_server.url)  # one process (conftest.py's shared server)


def stop_and_check(server: ServerProcess, others: list[subprocess.Popen] = (), torchrun: bool = True) -> None:
    """SIGTERM: tokenmill's server exits 0 after draining; torchrun passes the signal on to its ranks and exits 1
    (its SignalException). Either way nothing is left."""
    processes = family(server.process.pid) + [p for o in others for p in family(o.pid)]
    code = server.stop()
    assert code == (1 if torchrun else 0), server.output()
    for other in others:
        other.wait(30)
    assert_all_gone(processes)


def test_torchrun_three_ranks_on_one_host(one_rank_text: str) -> None:
    port = free_port()
    command = torchrun("--nproc-per-node", "3", "--master-addr", "127.0.0.1", "--master-port", str(free_port()))
    server = start_command(command + serve_args(port, "--tensor-parallel-size", "3"), port)
    try:
        assert len(family(server.process.pid)) == 4  # torchrun and its 3 ranks
        assert streamed_text(server.url) == one_rank_text
        metrics = httpx.get(f"{server.url}/metrics").text
        assert "tokenmill:tensor_parallel_size 3.0" in metrics and "tokenmill:collective_seconds_total" in metrics
        assert httpx.get(f"{server.url}/explorer/info").json()["tensor_parallel_size"] == 3  # the explorer shows it
    finally:
        stop_and_check(server)


def test_torchrun_two_nodes_on_one_host(one_rank_text: str) -> None:
    """Two torchrun processes as two machines with one rank each, meeting at a rendezvous endpoint."""
    port, endpoint = free_port(), f"127.0.0.1:{free_port()}"

    def node(rank: int) -> list[str]:
        return torchrun("--nnodes", "2", "--node-rank", str(rank), "--nproc-per-node", "1", "--rdzv-endpoint", endpoint)

    second = subprocess.Popen(
        node(1) + serve_args(port, "-tp", "2"), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        server = start_command(node(0) + serve_args(port, "-tp", "2"), port)
    except BaseException:
        second.kill()
        raise
    try:
        assert streamed_text(server.url) == one_rank_text
    finally:
        stop_and_check(server, [second])


def test_a_killed_worker_fails_requests_and_health_quickly() -> None:
    """tokenmill starts its own workers; SIGKILL one mid-stream: the stream ends with an error event and /health
    turns 503 within 10 s; SIGTERM then leaves no process behind. (Three ranks on fewer cores: the log says
    they will be slow.)"""
    server = start_server("--tensor-parallel-size", "3")
    # it listened at once and said 503 while its ranks started and loaded, then 200
    assert 503 in server.health_codes and server.health_codes[-1] == 200
    oversubscribed = "tensor parallelism over 3 ranks on" in server.output()
    assert oversubscribed == (3 > (os.cpu_count() or 1)), server.output()
    with cleaned_up(server) as processes:
        workers = [p for p in processes if is_worker(p)]
        assert len(workers) == 2
        killed_rank = workers[1].cmdline()[workers[1].cmdline().index("--rank") + 1]
        body = {"model": "x", "prompt": PROMPT, "max_tokens": 4000, "ignore_eos": True, "stream": True}
        body["model"] = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
        events = []
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as response:
            lines = response.iter_lines()
            for line in lines:
                if line.startswith("data: "):
                    events.append(line)
                if len(events) == 5:
                    break
            workers[1].kill()
            killed = time.monotonic()
            events += [line for line in lines if line.startswith("data: ")]
        ended = time.monotonic() - killed
        assert ended < 10, f"the stream ended {ended:.1f} s after the kill"
        assert '"error"' in events[-1] or '"error"' in events[-2], events[-2:]
        while httpx.get(f"{server.url}/health").status_code != 503:
            assert time.monotonic() - killed < 10, "health still 200"
            time.sleep(0.1)
        health = httpx.get(f"{server.url}/health").json()
        assert "engine failed" in health["status"] and f"rank {killed_rank}" in health["status"], health
        assert running_gauge(server.url) == 0  # the failed request is not counted as running any more
        assert server.stop() == 0
        assert_all_gone(processes)


def test_a_stopped_worker_fails_requests_after_the_collective_timeout() -> None:
    """SIGSTOP (alive, not answering): the step fails after --collective-timeout, not never."""
    server = start_server("--tensor-parallel-size", "2", "--collective-timeout", "2")
    with cleaned_up(server) as processes:
        worker = next(p for p in processes if is_worker(p))
        worker.suspend()
        stopped = time.monotonic()
        try:
            while httpx.get(f"{server.url}/health").status_code != 503:
                assert time.monotonic() - stopped < 10, "health still 200"
                time.sleep(0.1)
            assert time.monotonic() - stopped > 1.5  # the timeout, not an early false alarm
            assert "rank 1" in httpx.get(f"{server.url}/health").json()["status"]
        finally:
            worker.resume()
        assert server.stop() == 0
        assert_all_gone(processes)


def running_gauge(url: str) -> float:
    metrics = httpx.get(f"{url}/metrics").text
    lines = metrics.splitlines()
    return float(next(line.split()[-1] for line in lines if line.startswith("tokenmill:num_requests_running")))


def test_a_worker_stopped_mid_stream_ends_it_and_the_running_count() -> None:
    """SIGSTOP mid-generation: the stream ends with an error after --collective-timeout, /health turns 503 and
    the running gauge returns to 0 (it stayed at 1)."""
    server = start_server("--tensor-parallel-size", "2", "--collective-timeout", "2")
    with cleaned_up(server) as processes:
        worker = next(p for p in processes if is_worker(p))
        body = {"prompt": PROMPT, "max_tokens": 4000, "ignore_eos": True, "stream": True}
        body["model"] = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
        try:
            with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
                lines = (line for line in response.iter_lines() if line.startswith("data: "))
                assert [next(lines) for _ in range(3)]
                assert running_gauge(server.url) == 1
                worker.suspend()
                stopped = time.monotonic()
                events = list(lines)
            assert time.monotonic() - stopped < 15, "the stream went on"
            assert '"error"' in events[-2] and "collective timeout" in events[-2], events[-2:]
            assert httpx.get(f"{server.url}/health").status_code == 503
            assert running_gauge(server.url) == 0
        finally:
            worker.resume()
        assert server.stop() == 0
        assert_all_gone(processes)


@pytest.mark.parametrize("phase", ["importing", "loading"])
def test_a_worker_stopped_during_start_up_fails_it(phase: str) -> None:
    """SIGSTOP of a worker before its first heartbeat (still importing) or while it loads its shard: start-up
    fails naming the rank within --collective-timeout (it waited for the 30-minute start-up timeout), the server
    exits, and the stopped worker is not left behind."""
    port = free_port()
    command = [sys.executable, "-m", "tokenmill", "serve", "--port", str(port), "-tp", "2", "--collective-timeout", "2"]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        worker = None
        while worker is None:
            assert server.poll() is None, server.communicate()[0]
            worker = next((c for c in psutil.Process(server.pid).children(recursive=True) if is_worker(c)), None)
            time.sleep(0.01)  # not a busy loop: it took one of CI's two cores from the start-up it watches
        if phase == "loading":  # the shard's file is mapped once loading has begun
            while not any(m.path.endswith(".gguf") for m in worker.memory_maps()):
                assert server.poll() is None, server.communicate()[0]
                time.sleep(0.01)
        worker.suspend()
        stopped = time.monotonic()
        out, _ = server.communicate(timeout=60)
        took = time.monotonic() - stopped
    finally:
        server.kill()
    assert server.returncode != 0
    assert "rank 1 did not answer within the collective timeout (2 s) during start-up: its process is stopped" in out
    assert took < 20, f"start-up failed {took:.1f} s after the stop"
    assert_all_gone([worker])


def exit_output(command: list[str], timeout: float = 120) -> tuple[int, str]:
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    return done.returncode, done.stdout + done.stderr


def test_sizes_that_do_not_divide_exit_with_a_message() -> None:
    code, out = exit_output([sys.executable, "-m", "tokenmill", "serve", "--port", str(free_port()), "-tp", "4"])
    assert code != 0
    assert "tensor_parallel_size 4 cannot split 9 attention heads over 3 KV heads" in out


def test_a_port_in_use_exits_before_any_rank_starts() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code, out = exit_output([sys.executable, "-m", "tokenmill", "serve", "--port", str(port), "-tp", "2"])
    assert code == 1 and f"cannot listen on 127.0.0.1:{port}" in out and "in use" in out


def test_a_rank_that_cannot_load_is_named() -> None:
    """Two torchrun "nodes"; the second is given a model file that does not exist: both exit with an error, and
    rank 0's names rank 1."""
    port, endpoint = free_port(), f"127.0.0.1:{free_port()}"

    def node(rank: int, *extra: str) -> list[str]:
        args = ["--nnodes", "2", "--node-rank", str(rank), "--nproc-per-node", "1", "--rdzv-endpoint", endpoint]
        return torchrun(*args) + serve_args(port, "-tp", "2", *extra)

    second = subprocess.Popen(node(1, "--model", "/nonexistent/model.gguf"), stdout=subprocess.PIPE, text=True)
    code, out = exit_output(node(0))
    assert second.wait(60) != 0
    assert code != 0
    assert "rank 1 could not load its shard" in out and "/nonexistent/model.gguf" in out, out[-3000:]


def test_sigterm_to_a_self_launched_server_leaves_no_process() -> None:
    server = start_server("--tensor-parallel-size", "2")
    with cleaned_up(server) as processes:
        assert len(processes) == 2
        assert streamed_text(server.url, 4)
        stop_and_check(server, torchrun=False)
