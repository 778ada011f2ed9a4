"""Scale-out through an existing router: two `tokenmill serve` replicas behind the SGLang model gateway
(`sglang-router launch --worker-urls A B --policy cache_aware`). It finds the served model's name on each replica
(/server_info), sends requests that share a long prefix to one replica (where they hit its prefix cache), and
routes around a replica that was killed."""

import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.server_utils import ServerProcess, free_port, start_server

pytestmark = [pytest.mark.slow, pytest.mark.server]

DOCUMENT = "Read this report and answer. " + "The quarterly figures rose in every region but one. " * 50


def counters(server: ServerProcess) -> dict[str, float]:
    values = {}
    for line in httpx.get(f"{server.url}/metrics", timeout=10).text.splitlines():
        name, _, value = line.partition(" ")
        if name.startswith(("tokenmill:prefix_cache", "tokenmill:request_success_total")):
            values[name] = values.get(name, 0.0) + float(value)
    return values


def served(server: ServerProcess) -> float:
    return sum(v for k, v in counters(server).items() if k.startswith("tokenmill:request_success_total"))


@pytest.fixture(scope="module")
def replicas():
    pair = [start_server(), start_server()]
    yield pair
    for replica in pair:
        if replica.process.poll() is None:
            replica.stop()


@pytest.fixture(scope="module")
def router(replicas: list[ServerProcess], tmp_path_factory):
    port = free_port()
    log = (tmp_path_factory.mktemp("router") / "router.log").open("w")
    command = [
        str(Path(sys.executable).with_name("sglang-router")), "launch", "--host", "127.0.0.1", "--port", str(port),
        "--worker-urls", *[r.url for r in replicas], "--policy", "cache_aware",
        "--health-check-interval-secs", "1", "--health-failure-threshold", "1",
    ]  # fmt: skip
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        assert process.poll() is None, "the router exited"
        try:
            if httpx.get(f"{url}/v1/models", timeout=2).json()["data"][0]["id"] != "unknown":
                break
        except (httpx.HTTPError, KeyError, IndexError, ValueError):
            pass
        assert time.monotonic() < deadline, "the router did not register the replicas' model"
        time.sleep(0.2)
    yield url
    process.send_signal(signal.SIGTERM)
    process.wait(timeout=30)


def test_requests_sharing_a_prefix_land_on_one_replica_and_a_killed_one_is_routed_around(
    replicas: list[ServerProcess], router: str
) -> None:
    client = openai.OpenAI(base_url=f"{router}/v1", api_key="unused", max_retries=0, timeout=120)
    (model,) = [m.id for m in client.models.list().data]
    assert model == httpx.get(f"{replicas[0].url}/v1/models").json()["data"][0]["id"]  # from /server_info
    for i in range(6):
        reply = client.completions.create(model=model, prompt=f"{DOCUMENT} Question {i}: which region?", max_tokens=3)
        assert reply.choices[0].text is not None
    counts = [served(r) for r in replicas]
    assert sorted(counts) == [0, 6], counts  # every request on the replica that holds the prefix
    busy = replicas[counts.index(6)]
    c = counters(busy)
    assert c["tokenmill:prefix_cache_hits_total"] / c["tokenmill:prefix_cache_queries_total"] > 0.7, c
    load = httpx.get(f"{busy.url}/get_load").json()
    assert load[0]["num_reqs"] == 0 and "num_tokens" in load[0]
    # the replica holding the prefix is killed: the router's health checks take it out, the other answers
    busy.process.kill()
    busy.process.wait()
    other = replicas[1 - counts.index(6)]
    answered = 0
    deadline = time.monotonic() + 30
    while answered < 3:
        assert time.monotonic() < deadline, "the router kept sending to the killed replica"
        try:
            client.completions.create(model=model, prompt=f"{DOCUMENT} Question again?", max_tokens=3)
            answered += 1
        except openai.APIError:
            time.sleep(0.5)
    assert served(other) >= 3
