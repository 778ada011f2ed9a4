"""Which models are loaded, Ollama's way: a model loads on the first request that names it (that request, and any
other for it meanwhile, waits; one load at a time), stays loaded for its keep_alive after its last request ends
(0: unloaded at once; None: for good), and the least recently used idle model is unloaded first when a load would
pass --max-loaded-models or --memory-budget. A model with requests in flight is never unloaded: a load that needs
room waits for one to go idle (at most the load timeout).

Runs on the event loop; a load's work happens in the model's own process (model_process.py)."""

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tokenmill.config.server import ServerSettings
from tokenmill.server.model_router.catalog import ServableModel
from tokenmill.server.model_router.model_process import ModelLoadError, ModelProcess

logger = logging.getLogger("tokenmill.server")

LOAD_TIMEOUT_S = 600.0  # a load (and a wait for room) longer than this fails (Ollama's OLLAMA_LOAD_TIMEOUT: 5 min)
PROCESS_OVERHEAD_BYTES = 512 * 2**20  # a model never loaded yet is expected to take its file and this much


@dataclass
class Slot:
    """A servable model's life in this server."""

    model: ServableModel
    process: ModelProcess | None = None
    loading: asyncio.Future | None = None  # the load in progress (every request for the model awaits it)
    active: int = 0  # requests in flight (a model with any is never unloaded)
    last_used: float = field(default_factory=time.monotonic)
    keep_alive_s: float | None = 300.0  # after the last request ends; None: forever
    expires_at: float | None = None  # wall-clock time it unloads, once idle (None: never, or busy)
    last_rss_bytes: int | None = None  # as measured when last loaded (the next load's estimate)
    unload_pending: bool = False  # asked to unload (keep_alive 0, no prompt) while busy: unloads once idle
    _idle_timer: asyncio.TimerHandle | None = None

    @property
    def loaded(self) -> bool:
        return self.process is not None and self.process.alive


class ModelRegistry:
    def __init__(
        self,
        settings: ServerSettings,
        default_keep_alive_s: float | None,
        memory_budget_bytes: int | None,
        on_load: Callable[[Slot], None] = lambda slot: None,
    ):
        self.settings = settings
        self.default_keep_alive_s = default_keep_alive_s
        self.max_loaded = max(1, settings.max_loaded_models)
        self.memory_budget_bytes = memory_budget_bytes
        self.on_load = on_load
        self.slots: dict[str, Slot] = {}  # by model id
        self._load_lock = asyncio.Lock()
        self._idle = asyncio.Condition()  # notified when a model goes idle or unloads (room may have come)

    def slot(self, model: ServableModel) -> Slot:
        slot = self.slots.get(model.name)
        # a name that now means another file (pulled again): a new slot, once the old one's process is gone
        if slot is None or (slot.model != model and slot.process is None and slot.active == 0):
            slot = self.slots[model.name] = Slot(model, keep_alive_s=self.default_keep_alive_s)
        return slot

    def loaded(self) -> list[Slot]:
        return [s for s in self.slots.values() if s.loaded]

    # ---- requests ---------------------------------------------------------------------------------------------

    async def acquire(self, model: ServableModel) -> Slot:
        """The model's slot, loaded (waits for its load); counted in flight until release()."""
        slot = self.slot(model)
        slot.active += 1
        slot.expires_at = None
        self._cancel_idle_timer(slot)
        try:
            await self.ensure_loaded(slot)
        except BaseException:
            self.release(slot, None, keep=False)
            raise
        slot.last_used = time.monotonic()
        return slot

    def release(self, slot: Slot, keep_alive_s: float | None, keep: bool = True) -> None:
        """A request for the slot's model ended: its keep_alive (the server's default where it named none, as
        Ollama's) becomes the model's, and starts once no other request runs. keep=False: it never ran."""
        slot.active -= 1
        slot.last_used = time.monotonic()
        if keep:
            slot.keep_alive_s = keep_alive_s
        if slot.active == 0:
            loop = asyncio.get_running_loop()
            if slot.unload_pending:
                loop.create_task(self.unload(slot))
                return
            self._start_idle(slot)
            loop.create_task(self._notify_idle())

    async def ensure_loaded(self, slot: Slot) -> None:
        if slot.loaded:
            return
        if slot.loading is None or slot.loading.done():
            slot.loading = asyncio.ensure_future(self._load(slot))
        await asyncio.shield(slot.loading)

    # ---- loading and unloading --------------------------------------------------------------------------------

    async def _load(self, slot: Slot) -> None:
        deadline = time.monotonic() + LOAD_TIMEOUT_S
        async with self._load_lock:  # one at a time: each sees the room the one before it took
            if slot.loaded:
                return
            if slot.process is not None:  # its process died (the log says why): loaded again
                await self.unload(slot)
            await self._make_room(slot, self._estimate(slot), deadline)
            logger.info("loading model %r (%s)", slot.model.name, slot.model.path)
            process = await ModelProcess.start(slot.model, self.settings, deadline - time.monotonic())
            slot.process = process
            slot.last_rss_bytes = process.rss_bytes()
            logger.info(
                "model %r loaded in %.2f s (%.0f MiB resident)",
                slot.model.name,
                process.load_seconds,
                slot.last_rss_bytes / 2**20,
            )
            self.on_load(slot)
            # measured now: a budget the estimate let through may still be passed
            await self._make_room(slot, 0, time.monotonic(), wait=False)

    def _estimate(self, slot: Slot) -> int:
        if slot.last_rss_bytes:
            return slot.last_rss_bytes
        try:
            return slot.model.disk_bytes() + PROCESS_OVERHEAD_BYTES
        except OSError:
            return PROCESS_OVERHEAD_BYTES

    def _over(self, slot: Slot, extra_bytes: int) -> bool:
        others = [s for s in self.loaded() if s is not slot]
        count = len(others) + 1
        if count > self.max_loaded:
            return True
        if self.memory_budget_bytes is None or not others:  # alone it loads whatever the budget
            return False
        used = sum(s.process.rss_bytes() for s in others if s.process is not None)  # loaded: never None
        used += slot.process.rss_bytes() if slot.process is not None else extra_bytes
        return used > self.memory_budget_bytes

    async def _make_room(self, slot: Slot, extra_bytes: int, deadline: float, wait: bool = True) -> None:
        """Unload least recently used idle models until `slot`'s model fits; wait for one to go idle when all
        are busy (ModelLoadError past the deadline; with wait=False, give up instead)."""
        while self._over(slot, extra_bytes):
            idle = [s for s in self.loaded() if s is not slot and s.active == 0]
            if idle:
                victim = min(idle, key=lambda s: s.last_used)
                logger.info("unloading model %r (least recently used) to make room", victim.model.name)
                await self.unload(victim)
                continue
            if not wait:
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ModelLoadError(
                    f"no room to load {slot.model.name!r}: every loaded model is busy "
                    f"(--max-loaded-models {self.max_loaded}"
                    + (f", --memory-budget {self.settings.memory_budget}" if self.memory_budget_bytes else "")
                    + ")"
                )
            async with self._idle:
                try:
                    await asyncio.wait_for(self._idle.wait(), min(remaining, 1.0))
                except TimeoutError:
                    pass

    async def unload(self, slot: Slot) -> None:
        self._cancel_idle_timer(slot)
        slot.expires_at = None
        slot.unload_pending = False
        process, slot.process = slot.process, None
        if process is not None:
            await process.stop(grace_s=self.settings.shutdown_grace_s + 5)
            logger.info("unloaded model %r", slot.model.name)
        await self._notify_idle()

    async def unload_when_idle(self, slot: Slot) -> None:
        """keep_alive 0 from a request that runs nothing: unloaded now, or as its last request ends."""
        if slot.active == 0:
            await self.unload(slot)
        else:
            slot.unload_pending = True

    async def stop_all(self) -> None:
        await asyncio.gather(*(self.unload(s) for s in list(self.slots.values()) if s.process is not None))

    # ---- keep_alive -------------------------------------------------------------------------------------------

    def _start_idle(self, slot: Slot) -> None:
        self._cancel_idle_timer(slot)
        if not slot.loaded:
            return
        ka = slot.keep_alive_s
        if ka is None:
            slot.expires_at = None
            return
        slot.expires_at = time.time() + ka
        loop = asyncio.get_running_loop()
        slot._idle_timer = loop.call_later(ka, lambda: loop.create_task(self._expire(slot)))

    async def _expire(self, slot: Slot) -> None:
        if slot.active == 0 and slot.loaded:
            logger.info("model %r idle for its keep_alive: unloading", slot.model.name)
            await self.unload(slot)

    @staticmethod
    def _cancel_idle_timer(slot: Slot) -> None:
        if slot._idle_timer is not None:
            slot._idle_timer.cancel()
            slot._idle_timer = None

    async def _notify_idle(self) -> None:
        async with self._idle:
            self._idle.notify_all()
