"""What waits for a slow reader: at most one output per request, the deltas of those it replaced kept."""

import asyncio

from tokenmill.engine.output_collector import OutputCollector
from tokenmill.outputs import CompletionOutput, RequestMetrics, RequestOutput


def output(rid: str, tokens: list[int], new: int, finished: bool = False, samples: int = 1) -> RequestOutput:
    text = "".join(chr(97 + t % 26) for t in tokens)
    outs = [
        CompletionOutput(i, text, list(tokens), delta_text=text[-new:] if new else "", delta_token_ids=tokens[-new:])
        for i in range(samples)
    ]
    return RequestOutput(rid, None, [1, 2], outs, finished, RequestMetrics(0.0))


def test_an_unread_output_is_merged_into_the_next_one() -> None:
    c = OutputCollector()
    tokens: list[int] = []
    for t in range(50):
        tokens.append(t)
        c.put("a", output("a", tokens, 1, finished=t == 49, samples=2))
    assert len(c) == 1  # 50 outputs, one waiting
    got = asyncio.run(c.get())
    assert isinstance(got, RequestOutput) and got.finished
    for o in got.outputs:
        assert o.delta_token_ids == list(range(50)) and o.delta_text == o.text


def test_requests_keep_their_turns_and_an_error_wins() -> None:
    c = OutputCollector()
    c.put("a", output("a", [1], 1))
    c.put("b", output("b", [2], 1))
    c.put("a", output("a", [1, 3], 1))
    c.put("b", RuntimeError("engine failed"))
    c.put("b", output("b", [2, 4], 1))

    async def read() -> list:
        return [await c.get(), await c.get()]

    first, second = asyncio.run(read())
    assert isinstance(first, RequestOutput) and first.request_id == "a"
    assert first.outputs[0].delta_token_ids == [1, 3]
    assert isinstance(second, RuntimeError)
    assert c.take_all() == [] and len(c) == 0


def test_a_reader_waits_for_the_next_output() -> None:
    async def main() -> RequestOutput:
        c = OutputCollector()
        loop = asyncio.get_running_loop()
        loop.call_later(0.05, c.put, "a", output("a", [7], 1))
        item = await asyncio.wait_for(c.get(), 5)
        assert isinstance(item, RequestOutput)
        return item

    assert asyncio.run(main()).outputs[0].delta_token_ids == [7]
