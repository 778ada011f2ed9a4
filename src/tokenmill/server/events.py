"""Engine step events for the request explorer: published on the engine thread, fanned out to every browser
subscribed to GET /explorer/events (server-sent events). A slow subscriber loses events, never the engine time."""

import asyncio
import threading
from collections.abc import AsyncIterator
from typing import Any

from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.server.served_model import ServedModel

QUEUE_LIMIT = 256


def engine_snapshot(engine: AsyncEngine, model: ServedModel) -> dict[str, Any]:
    """The engine's stats now and its last step's summary (None before its first step): what the explorer's
    engine panel shows before (and between) step events."""
    return {**engine.stats(), "last_step": model.last_step_summary}


class EventHub:
    def __init__(self) -> None:
        self._subscribers: set[tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = set()
        self._lock = threading.Lock()
        self._engine: AsyncEngine | None = None
        self._model: ServedModel | None = None

    def attach(self, engine: AsyncEngine, model: ServedModel) -> None:
        self._engine, self._model = engine, model
        engine.step_listeners.append(self.publish)
        self._update_recording()

    def _update_recording(self) -> None:
        if self._model is not None:
            self._model.record_steps(bool(self._subscribers))

    def publish(self, event: dict[str, Any]) -> None:
        """Called on the engine thread when a step starts ("running") and when it is done ("step")."""
        with self._lock:
            targets = list(self._subscribers)
        for loop, queue in targets:
            loop.call_soon_threadsafe(_offer, queue, event)

    async def subscribe(self, heartbeat_s: float = 1.0) -> AsyncIterator[dict[str, Any]]:
        """Step events as they happen ("running" when a step starts, "step" when it is done); a {"type": "stats"}
        event every heartbeat while the engine is idle."""
        queue: asyncio.Queue = asyncio.Queue()
        entry = (asyncio.get_running_loop(), queue)
        with self._lock:
            self._subscribers.add(entry)
        self._update_recording()
        try:
            while True:
                try:
                    event = await asyncio.wait_for(queue.get(), timeout=heartbeat_s)
                    yield event
                except TimeoutError:
                    if self._engine is not None and self._model is not None:
                        yield {"type": "stats", **engine_snapshot(self._engine, self._model)}
        finally:
            with self._lock:
                self._subscribers.discard(entry)
            self._update_recording()


def _offer(queue: asyncio.Queue, event: dict[str, Any]) -> None:
    if queue.qsize() < QUEUE_LIMIT:
        queue.put_nowait(event)
