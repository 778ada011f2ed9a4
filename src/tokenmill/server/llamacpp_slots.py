"""llama-server's slots, over tokenmill's shared prefix cache: one slot per sequence the engine batches
(--max-num-seqs, llama.cpp's --parallel). A /completion runs in a slot (its id_slot, else the idle slot whose last
tokens share the longest start with the prompt, else the least recently used); a slot remembers the tokens its KV
holds (its last prompt and output, the last token not yet computed), which /slots shows and its save, restore
and erase actions act on. The K/V themselves live in the engine's prefix cache, shared by every slot: a slot's
tokens are what finds them there."""

import asyncio
import itertools
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from tokenmill.server.errors import APIError

HELD = -1  # a slot's task while a save, restore or erase acts on it


@dataclass
class Slot:
    id: int
    n_ctx: int
    tokens: list[int] = field(default_factory=list)  # what its KV holds
    task: int | None = None  # the task running in it (None: idle)
    last_task: int | None = None
    last_used: float = 0.0
    n_prompt_tokens: int = 0
    n_prompt_processed: int = 0
    n_prompt_cache: int = 0
    n_decoded: int = 0
    params: dict[str, Any] | None = None

    @property
    def is_processing(self) -> bool:
        return self.task is not None

    def as_json(self) -> dict[str, Any]:
        """As llama-server's GET /slots shows a slot (its params only while it is processing)."""
        out: dict[str, Any] = {"id": self.id, "n_ctx": self.n_ctx, "speculative": False}
        out["is_processing"] = self.is_processing
        task = self.task if self.task not in (None, HELD) else self.last_task
        if task is None:
            return out
        out |= {
            "id_task": task,
            "n_prompt_tokens": self.n_prompt_tokens,
            "n_prompt_tokens_processed": self.n_prompt_processed,
            "n_prompt_tokens_cache": self.n_prompt_cache,
            "next_token": [
                {
                    "has_next_token": self.is_processing,
                    "has_new_line": False,
                    "n_remain": -1,
                    "n_decoded": self.n_decoded if self.is_processing else 0,
                }
            ],
        }
        if self.task not in (None, HELD) and self.params is not None:
            out["params"] = self.params
        return out


class SlotTable:
    def __init__(self, n_slots: int, n_ctx: int):
        self.slots = [Slot(i, n_ctx) for i in range(n_slots)]
        self._tasks = itertools.count()
        self._waiters: list[asyncio.Future] = []  # calls waiting for a slot, woken whenever one is freed

    def check_id(self, id_slot: int) -> Slot:
        if not 0 <= id_slot < len(self.slots):
            raise APIError(
                400, f"id_slot {id_slot} is not a slot of this server (0..{len(self.slots) - 1})", param="id_slot"
            )
        return self.slots[id_slot]

    async def acquire(self, id_slot: int, prompts: list[list[int]]) -> list[Slot]:
        """One idle slot per prompt (waiting for them as llama-server's queue does), marked busy."""
        if len(prompts) > len(self.slots):
            raise APIError(
                400, f"{len(prompts)} prompts in one call, but this server has {len(self.slots)} slots", param="prompt"
            )
        if id_slot >= 0 and len(prompts) > 1:
            raise APIError(400, "id_slot names one slot: send one prompt with it", param="id_slot")
        if id_slot >= 0:
            self.check_id(id_slot)
        await self._wait(lambda: self._available(id_slot, len(prompts)))
        return [self._choose(id_slot, prompt) for prompt in prompts]

    @asynccontextmanager
    async def hold(self, id_slot: int) -> AsyncIterator[Slot]:
        """The slot, idle, kept from tasks while the block runs (a save, restore or erase waits for the slot's task
        to end, as llama-server defers it); its task counters stay as they were."""
        slot = self.check_id(id_slot)
        await self._wait(lambda: not slot.is_processing)
        slot.task = HELD
        try:
            yield slot
        finally:
            slot.task = None
            self._wake()

    async def _wait(self, ready) -> None:
        while not ready():
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            finally:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)

    def _wake(self) -> None:
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    def _available(self, id_slot: int, count: int) -> bool:
        if id_slot >= 0:
            return not self.slots[id_slot].is_processing
        return sum(not s.is_processing for s in self.slots) >= count

    def _choose(self, id_slot: int, prompt: list[int]) -> Slot:
        if id_slot >= 0:
            slot = self.slots[id_slot]
        else:
            idle = [s for s in self.slots if not s.is_processing]
            slot = max(idle, key=lambda s: (_common_prefix(s.tokens, prompt), -s.last_used))
        slot.task = next(self._tasks)
        slot.n_decoded = 0
        return slot

    def release(self, slot: Slot, tokens: list[int] | None) -> None:
        """The slot's task ended; `tokens`: what its KV now holds (None: unchanged, e.g. it never ran)."""
        if tokens is not None:
            slot.tokens = tokens
        slot.last_task, slot.task = slot.task, None
        slot.last_used = time.monotonic()
        self._wake()


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
