"""The asyncio front: streaming, many requests at once, aborts on disconnect, a responsive event loop."""

import asyncio
import threading
import time

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.errors import InvalidParameterError


@pytest.fixture(scope="module")
def async_engine():
    engine = AsyncEngine(LLM().engine)  # its own engine: the engine thread owns it
    yield engine
    engine.shutdown()


def run(coro):
    return asyncio.run(coro)


def test_stream_matches_offline_generate(llm: LLM, async_engine: AsyncEngine) -> None:
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)

    async def collect():
        return [out async for out in async_engine.generate("Once upon a time", params)]

    outs = run(collect())
    assert outs[-1].finished and not any(o.finished for o in outs[:-1])
    assert "".join(o.outputs[0].delta_text for o in outs) == outs[-1].outputs[0].text
    assert (
        outs[-1].outputs[0].token_ids
        == llm.generate("Once upon a time", params, use_tqdm=False)[0].outputs[0].token_ids
    )


def test_concurrent_requests_and_a_responsive_loop(async_engine: AsyncEngine) -> None:
    async def main():
        lags = []
        stop = asyncio.Event()

        async def ticker():
            while not stop.is_set():
                t = time.monotonic()
                await asyncio.sleep(0.01)
                lags.append(time.monotonic() - t - 0.01)

        async def one(i: int):
            n = 0
            async for out in async_engine.generate(f"Fact {i}:", SamplingParams(max_tokens=12, ignore_eos=True)):
                n = len(out.outputs[0].token_ids)
            return n

        tick = asyncio.create_task(ticker())
        counts = await asyncio.gather(*(one(i) for i in range(8)))
        stop.set()
        await tick
        return counts, lags

    counts, lags = run(main())
    assert counts == [12] * 8
    assert max(lags) < 0.25, f"the event loop stalled for {max(lags):.3f} s"


def test_leaving_the_stream_aborts_and_frees_blocks(async_engine: AsyncEngine) -> None:
    async def main():
        agen = async_engine.generate("A very long story:", SamplingParams(max_tokens=500, ignore_eos=True))
        async for out in agen:
            if len(out.outputs[0].token_ids) >= 3:
                break
        await agen.aclose()
        for _ in range(100):
            stats = await async_engine.run_on_engine(lambda e: e.stats())
            if stats["num_running"] == 0 and stats["kv_blocks_in_use"] == 0:
                return stats
            await asyncio.sleep(0.02)
        return stats

    stats = run(main())
    assert stats["num_running"] == 0 and stats["kv_blocks_in_use"] == 0
    run(async_engine.run_on_engine(lambda e: e.check_integrity()))


def test_validation_errors_reach_the_caller(async_engine: AsyncEngine) -> None:
    async def main():
        async for _ in async_engine.generate({"prompt_token_ids": [-1]}, SamplingParams()):
            pass

    with pytest.raises(InvalidParameterError):
        run(main())
    assert async_engine.is_alive


def test_abort_by_id(async_engine: AsyncEngine) -> None:
    async def main():
        outs = []
        async for out in async_engine.generate("Count:", SamplingParams(max_tokens=400, ignore_eos=True), "abort-me"):
            outs.append(out)
            if len(outs) == 2:
                await async_engine.abort("abort-me")
        return outs

    outs = run(main())
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
    assert len(outs[-1].outputs[0].token_ids) < 400


class StallingEngine:
    """An engine with work that schedules nothing for a while after one real step (a request waiting for blocks):
    its last_step stays the one step's description."""

    def __init__(self) -> None:
        self.last_step: dict | None = None
        self.steps = 0
        self.go = threading.Event()  # set once the test's listener is attached

    def has_unfinished_requests(self) -> bool:
        return True

    def step(self) -> list:
        if not self.go.is_set():
            return []
        self.steps += 1
        if self.steps == 1:
            self.last_step = {"step": 1, "batch": []}
        return []

    def stats(self) -> dict:
        return {}

    def close(self) -> None:
        pass


def test_listeners_get_each_step_once() -> None:
    engine = StallingEngine()
    front = AsyncEngine(engine, stats_log_interval_s=None)  # type: ignore[arg-type]
    seen: list[int] = []
    front.step_listeners.append(lambda event: seen.append(event["step"]))
    engine.go.set()
    deadline = time.monotonic() + 5
    while engine.steps < 50 and time.monotonic() < deadline:
        time.sleep(0.01)
    front.shutdown()
    assert engine.steps >= 50 and seen == [1]


def test_listeners_hear_a_step_start_before_it_is_done(async_engine: AsyncEngine) -> None:
    """With steps recorded (the explorer listening), each step is announced when its forward pass starts
    ("running": the explorer shows a prefill while it happens), then reported when done ("step"), with the same
    number and batch."""
    events: list[dict] = []
    async_engine.step_listeners.append(events.append)
    async_engine.engine.record_steps = True
    try:

        async def collect():
            return [out async for out in async_engine.generate("x " * 600, SamplingParams(max_tokens=3))]

        run(collect())
    finally:
        async_engine.engine.record_steps = False
        async_engine.step_listeners.remove(events.append)
    kinds = [(e["type"], e["step"]) for e in events]
    assert kinds[0][0] == "running" and len(kinds) >= 6  # a prompt of 2 chunks, then 2 decode steps at least
    for (kind, number), (next_kind, next_number) in zip(kinds[::2], kinds[1::2], strict=True):
        assert (kind, next_kind, number) == ("running", "step", next_number)
    first_running, first_done = events[0], events[1]
    assert first_running["batch"][0]["kind"] == "prefill" and first_running["batch"][0]["prefill_chunk"] == 1
    assert "duration_ms" not in first_running and first_done["duration_ms"] > 0
    assert [b["tokens"] for b in first_running["batch"]] == [b["tokens"] for b in first_done["batch"]]


def test_a_reader_that_falls_behind_holds_one_output_per_request(async_engine: AsyncEngine) -> None:
    """40 steps' outputs for a reader that reads none until the end: one waits, the deltas of all of them in it."""
    from tokenmill.engine.output_collector import OutputCollector

    async def main():
        collector = OutputCollector()
        params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        await async_engine.add_request("Once upon a time", params, None, collector)
        while await async_engine.run_on_engine(lambda e: e.has_unfinished_requests()):
            await asyncio.sleep(0.05)
        waiting = len(collector)
        return waiting, await collector.get()

    waiting, out = run(main())
    assert waiting == 1 and out.finished
    o = out.outputs[0]
    assert len(o.token_ids) == 40 and o.delta_token_ids == o.token_ids and o.delta_text == o.text


def test_a_calls_requests_enter_in_one_command_all_or_none(async_engine: AsyncEngine) -> None:
    from tokenmill.engine.output_collector import OutputCollector
    from tokenmill.pooling_params import PoolingParams

    async def main():
        collector = OutputCollector()
        good = [{"prompt_token_ids": [1, 2, 3 + i]} for i in range(5)]
        bad = {"prompt_token_ids": [1, 10**9]}
        with pytest.raises(InvalidParameterError):
            await async_engine.add_requests([*good, bad], PoolingParams(), [f"x-{i}" for i in range(6)], collector)
        left = await async_engine.run_on_engine(lambda e: (len(e.requests), len(collector)))
        rids = await async_engine.add_requests(good, PoolingParams(), [f"y-{i}" for i in range(5)], collector, "y")
        outs = [await collector.get() for _ in rids]
        return left, rids, outs

    left, rids, outs = run(main())
    assert left == (0, 0)
    assert rids == [f"y-{i}" for i in range(5)]
    assert sorted(o.request_id for o in outs) == rids and all(o.finished and o.embedding for o in outs)
