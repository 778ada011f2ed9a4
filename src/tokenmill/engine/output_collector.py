"""Where a request's outputs wait for their reader on the event loop: at most one per request.

The engine makes an output for every request after every step; a reader that falls behind (a client reading its
stream slowly, a loop busy elsewhere) would otherwise pile up one output per step, each holding the whole text and
token list so far. Here an output not yet read is merged with the next one (the newer output, with the deltas of
both: vLLM's RequestOutputCollector), so what waits for a reader is bounded by its requests' outputs, whatever
the pace. One reader per collector; several requests may share one (an API call's prompts).
"""

import asyncio
from dataclasses import replace

from tokenmill.outputs import CompletionOutput, RequestOutput

Item = RequestOutput | BaseException


class OutputCollector:
    def __init__(self) -> None:
        self._pending: dict[str, Item] = {}  # request id -> its output not yet read (oldest request first)
        self._ready = asyncio.Event()

    def put(self, request_id: str, item: Item) -> None:
        """Hand over an output (or the error that ends the request); call on the reader's event loop."""
        before = self._pending.get(request_id)
        if isinstance(before, RequestOutput) and isinstance(item, RequestOutput):
            item = merged(before, item)
        elif isinstance(before, BaseException):
            item = before  # an error ends the request: nothing after it matters
        self._pending[request_id] = item
        self._ready.set()

    async def get(self) -> Item:
        """The next output, from the request that has waited longest."""
        while not self._pending:
            self._ready.clear()
            await self._ready.wait()
        request_id = next(iter(self._pending))
        return self._pending.pop(request_id)

    def take_all(self) -> list[Item]:
        """Every output not yet read (the reader is going away)."""
        items = list(self._pending.values())
        self._pending.clear()
        return items

    def __len__(self) -> int:
        return len(self._pending)


def merged(older: RequestOutput, newer: RequestOutput) -> RequestOutput:
    """`newer` with the deltas `older` carried prepended to its own, sample by sample."""
    deltas = {o.index: o for o in older.outputs}
    return replace(newer, outputs=[_joined(deltas.get(o.index), o) for o in newer.outputs])


def _joined(older: CompletionOutput | None, newer: CompletionOutput) -> CompletionOutput:
    if older is None or not (older.delta_text or older.delta_token_ids):
        return newer
    return replace(
        newer,
        delta_text=older.delta_text + newer.delta_text,
        delta_token_ids=[*older.delta_token_ids, *newer.delta_token_ids],
    )
