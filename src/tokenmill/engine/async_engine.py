"""The asyncio front of the engine: `generate()` streams RequestOutputs while a background thread runs steps.

The step loop runs in its own thread, so a forward pass never blocks the event loop. Every engine mutation
(add, abort, step) happens on that thread: callers send commands through a queue and get results back through
futures; outputs go to each request's OutputCollector with loop.call_soon_threadsafe (at most one output per
request waits there: a slow reader never piles them up). An API call's requests are added, and aborted, in one
command each, so a call of 2,048 prompts costs one round trip to the engine thread, not one per prompt.
"""

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future
from typing import Any

from tokenmill.engine.kv_snapshot import PrefixFile, restore_prefix, save_prefix
from tokenmill.engine.llm_engine import LLMEngine, PromptInput
from tokenmill.engine.lora_registry import LoadedLoRA
from tokenmill.engine.output_collector import OutputCollector
from tokenmill.errors import TokenmillError
from tokenmill.loader.lora_file import read_lora
from tokenmill.outputs import RequestOutput
from tokenmill.pooling_params import PoolingParams
from tokenmill.runner.memory import MemoryTrimmer
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

RANK_CHECK_INTERVAL_S = 1.0  # while idle, how often every tensor-parallel rank must answer
STATS_LOG_INTERVAL_S = 10.0  # while busy, a throughput line this often (as vLLM's engine logs)
IDLE_LOG_AFTER_S = 0.5  # and one when it has been idle this long after work


class EngineDeadError(TokenmillError):
    """The engine thread failed; no request can be served any more."""


class AsyncEngine:
    def __init__(self, engine: LLMEngine, stats_log_interval_s: float | None = STATS_LOG_INTERVAL_S):
        """`stats_log_interval_s`: log a throughput line this often while there is work (None: never)."""
        self.engine = engine
        self.stats_log_interval_s = stats_log_interval_s
        self._logged_stats: tuple[float, dict[str, Any]] = (time.monotonic(), engine.stats())
        self._commands: queue.Queue[Callable[[], None]] = queue.Queue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, OutputCollector]] = {}
        self._stats: dict[str, Any] = engine.stats()
        self.error: BaseException | None = None
        # called on the engine thread (must not block) with {"type": "running", **the step's description, **stats}
        # when a step starts its forward pass, and {"type": "step", **engine.last_step, **stats} when it is done
        self.step_listeners: list[Callable[[dict[str, Any]], None]] = []
        engine.on_step_start = self._publish_step_start
        self._thread = threading.Thread(target=self._run, name="tokenmill-engine", daemon=True)
        self._thread.start()

    # ---- engine thread ------------------------------------------------------------------------------------------

    def _run(self) -> None:
        trimmer = MemoryTrimmer()  # a long-running server gives freed memory back (runner/memory.py)
        last_check = time.monotonic()
        published = None  # the number of the last step the listeners were given
        try:
            while not self._stop.is_set():
                self._drain_commands()
                trimmer.maybe_release()
                if not self.engine.has_unfinished_requests():
                    self._stats = self.engine.stats()
                    self._wake.clear()
                    # a command queued after this check sets _wake: no lost wake-up. The idle line once nothing
                    # came for a while (a beam search leaves the engine idle for a moment between its rounds)
                    if self._commands.empty() and not self._wake.wait(timeout=IDLE_LOG_AFTER_S):
                        self._maybe_log_stats(idle=True)
                    if time.monotonic() - last_check >= RANK_CHECK_INTERVAL_S:
                        self.engine.check_ranks()  # a tensor-parallel rank lost while idle fails the engine now
                        last_check = time.monotonic()
                    continue
                outputs = self.engine.step()
                self._stats = self.engine.stats()
                self._maybe_log_stats()
                step = self.engine.last_step
                # a step that scheduled nothing leaves the previous description: publish each step once, before
                # its outputs go out (a caller that stops listening once its request ends has heard its last step)
                if self.step_listeners and step is not None and step["step"] != published:
                    published = step["step"]
                    self._publish({"type": "step", **step, **self._stats})
                for out in outputs:
                    self._deliver(out.request_id, out)
        except BaseException as exc:  # the engine is broken: fail every stream, refuse new work
            logger.exception("engine step loop failed")
            self.error = exc
            # every request it held ends here with the error: none runs or waits any more (the gauges say so)
            self._stats = {**self._stats, "num_running": 0, "num_waiting": 0}
            for request_id in list(self._streams):
                self._deliver(request_id, EngineDeadError(f"the engine failed: {exc!r}"))
            self._drain_commands()

    def _publish(self, event: dict[str, Any]) -> None:
        for listener in list(self.step_listeners):
            listener(event)

    def _publish_step_start(self, step: dict[str, Any]) -> None:
        # the counts as this step scheduled them: a long first prefill's own request shows as running while it
        # runs (the explorer), and so do the stats heartbeats meanwhile, not the idle engine's zeros
        self._stats = self.engine.stats()
        self._publish({"type": "running", **step, **self._stats})

    def _maybe_log_stats(self, idle: bool = False) -> None:
        """One line of throughput since the last one, and the engine's state now: every stats_log_interval_s
        while busy, and once when the engine has gone idle after work, IDLE_LOG_AFTER_S later (the next busy
        period counts from then)."""
        if self.stats_log_interval_s is None:
            return
        then, before = self._logged_stats
        now = time.monotonic()
        s = self._stats
        if idle:
            if s["num_steps"] == before["num_steps"]:
                self._logged_stats = (now, s)  # nothing happened: the next line starts from here
                return
        elif now - then < self.stats_log_interval_s:
            return
        seconds = now - then
        queried = s["prefix_cache_query_tokens"] - before["prefix_cache_query_tokens"]
        hits = s["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"]
        logger.info(
            "engine: prompt %.1f tok/s, generation %.1f tok/s, running %d, waiting %d, KV cache %.1f%%, "
            "prefix-cache hit rate %.1f%%",
            (s["prompt_tokens_total"] - before["prompt_tokens_total"]) / seconds,
            (s["generation_tokens_total"] - before["generation_tokens_total"]) / seconds,
            s["num_running"],
            s["num_waiting"],
            100 * s["kv_cache_usage"],
            100 * hits / queried if queried else 0.0,
        )
        self._logged_stats = (now, s)

    def _drain_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            command()

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        target = self._streams.get(request_id)
        if target is None:
            return
        loop, collector = target
        if isinstance(item, BaseException) or item.finished:
            self._streams.pop(request_id, None)
        loop.call_soon_threadsafe(collector.put, request_id, item)

    def _call(self, fn: Callable[[], Any]) -> Future:
        """Run fn on the engine thread; the future carries its result or exception."""
        future: Future = Future()

        def command() -> None:
            if not future.set_running_or_notify_cancel():
                return  # its caller stopped waiting before it ran (a cancelled task): do nothing
            if self.error is not None:
                future.set_exception(EngineDeadError(f"the engine failed: {self.error!r}"))
                return
            try:
                future.set_result(fn())
            except BaseException as exc:
                future.set_exception(exc)

        self._commands.put(command)
        self._wake.set()
        return future

    # ---- event loop side ----------------------------------------------------------------------------------------

    @property
    def is_alive(self) -> bool:
        return self.error is None and self._thread.is_alive()

    def stats(self) -> dict[str, Any]:
        """The engine's stats as of the last step (a snapshot; safe from any thread)."""
        return dict(self._stats)

    async def add_request(
        self,
        prompt: PromptInput,
        params: SamplingParams | PoolingParams | None = None,
        request_id: str | None = None,
        collector: OutputCollector | None = None,
    ) -> tuple[str, OutputCollector]:
        """Queue a request; raises its validation error here. Returns its id and the collector its outputs go to
        (`collector` lets several requests share one; outputs carry their request_id)."""
        collector = collector if collector is not None else OutputCollector()
        (rid,) = await self.add_requests([prompt], params, [request_id], collector)
        return rid, collector

    async def add_requests(
        self,
        prompts: Sequence[PromptInput],
        params: SamplingParams | PoolingParams | None,
        request_ids: Sequence[str | None],
        collector: OutputCollector,
        group: str | None = None,
    ) -> list[str]:
        """Queue one call's requests in one command on the engine thread: all of them, or (the first validation
        error raised here) none. `group`: they take their turns at admission together (one call, one group)."""
        if self.error is not None:
            raise EngineDeadError(f"the engine failed: {self.error!r}")
        loop = asyncio.get_running_loop()

        def add() -> list[str]:
            added: list[str] = []
            try:
                for prompt, request_id in zip(prompts, request_ids, strict=True):
                    rid = self.engine.add_request(request_id, prompt, params, group=group)
                    self._streams[rid] = (loop, collector)
                    added.append(rid)
            except BaseException:
                for rid in added:  # all or nothing: a bad prompt leaves none of the call running
                    self._streams.pop(rid, None)
                    self.engine.abort(rid)
                raise
            return added

        return await asyncio.wrap_future(self._call(add))

    async def generate(
        self, prompt: PromptInput, params: SamplingParams | None = None, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's output after every step that changed it; the last one has finished=True.

        Leaving the loop early (or a cancelled task) aborts the request and frees its blocks.
        """
        rid, collector = await self.add_request(prompt, params, request_id)
        finished = False
        try:
            while not finished:
                item = await collector.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.abort_nowait(rid)

    async def run_requests(
        self,
        prompts: Sequence[PromptInput],
        params: SamplingParams,
        request_ids: Sequence[str],
        group: str | None = None,
    ) -> list[RequestOutput]:
        """Run requests to their end together (added in one command, so they share their steps): their final
        outputs, in order (a beam search's round). Leaving early (a cancelled task) aborts those still running."""
        collector = OutputCollector()
        finals: dict[str, RequestOutput] = {}
        try:
            await self.add_requests(prompts, params, request_ids, collector, group)
            while len(finals) < len(request_ids):
                item = await collector.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finished:
                    finals[item.request_id] = item
        finally:
            if len(finals) < len(request_ids):  # an add on its way to the engine thread runs before this abort
                self.abort_nowait(*(rid for rid in request_ids if rid not in finals))
        return [finals[rid] for rid in request_ids]

    def _abort_command(self, request_ids: tuple[str, ...]) -> Callable[[], None]:
        def abort() -> None:
            for request_id in request_ids:
                out = self.engine.abort(request_id)
                if out is not None:
                    self._deliver(request_id, out)

        return abort

    def abort_nowait(self, *request_ids: str) -> None:
        """Abort from any thread (several requests in one command); the engine frees their blocks before its next
        step. Ids the engine does not hold (finished, never added) are no-ops."""
        if request_ids:
            self._call(self._abort_command(request_ids))

    async def abort(self, request_id: str) -> None:
        await asyncio.wrap_future(self._call(self._abort_command((request_id,))))

    async def run_on_engine(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run fn(engine) on the engine thread between steps (for consistent reads such as integrity checks)."""
        return await asyncio.wrap_future(self._call(lambda: fn(self.engine)))

    async def load_lora(self, name: str, path: str) -> LoadedLoRA:
        """Serve a LoRA adapter as `name`: its file read in a worker thread, then held by the engine between steps
        (LoRAError for a bad path or adapter, LoRAExistsError for a name in use)."""
        lora = await asyncio.to_thread(read_lora, path)
        return await self.run_on_engine(lambda engine: engine.load_lora(name, lora))

    async def unload_lora(self, name: str) -> LoadedLoRA:
        """Stop serving adapter `name` (LoRANotFoundError); sequences using it finish with it."""
        return await self.run_on_engine(lambda engine: engine.unload_lora(name))

    async def forget_prefix(self, token_ids: list[int]) -> int:
        """The prefix cache forgets these tokens' unused full blocks, between steps (llama.cpp's slot erase)."""
        return await self.run_on_engine(lambda engine: engine.kv.forget_prefix(token_ids))

    async def save_prefix(self, token_ids: list[int]) -> PrefixFile:
        """The K/V the prefix cache holds for these tokens, copied between steps (kv_snapshot.py: a slot's save)."""
        return await self.run_on_engine(lambda engine: save_prefix(engine, token_ids))

    async def restore_prefix(self, snapshot: PrefixFile) -> int:
        """A saved prefix's blocks entered in the prefix cache between steps; returns the tokens they cover."""
        return await self.run_on_engine(lambda engine: restore_prefix(engine, snapshot))

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout)
        self.engine.close()  # the other ranks of a tensor-parallel model stop too
