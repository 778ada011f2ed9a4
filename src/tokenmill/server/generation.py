"""One API call's engine requests (one per prompt), merged into a single stream of (prompt index, output).

The call is a NeutralRequest, whichever API made it. It is admitted (or refused with 503, --max-queue) before
anything else; text prompts are tokenized in a worker thread, never on the event loop or the engine's thread, so a
long prompt stalls no other client; then its max_tokens is settled, here for every API (output_limits.py). Every
request is added in one engine command before anything is returned, so a bad prompt fails the whole call with a
400 and leaves nothing running; the call's requests form one group, which takes its turns at admission beside the
other calls (scheduler/waiting_queue.py). Work follows its client: a disconnect while the call is being started,
or while it runs, aborts everything it added, and so does leaving the stream early (task cancelled). A call with
BeamSearchParams runs vLLM's beam search (engine/beam_search.py) in a task of its own: its rounds' requests count
as the call's while they run, and its answer, one finished output per prompt, comes as a request's would.
"""

import asyncio
import dataclasses
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from tokenmill.engine.async_engine import AsyncEngine, EngineDeadError
from tokenmill.engine.beam_search import BeamSearch, round_params
from tokenmill.engine.output_collector import OutputCollector
from tokenmill.errors import InvalidParameterError
from tokenmill.outputs import CompletionOutput, RequestOutput
from tokenmill.pooling_params import PoolingParams
from tokenmill.sampling_params import BeamSearchParams, SamplingParams
from tokenmill.server.call_log import mark_logged
from tokenmill.server.errors import APIError, ClientDisconnected
from tokenmill.server.neutral_request import NeutralRequest
from tokenmill.server.served_model import PromptInput, ServedModel
from tokenmill.server.state import ServerState

_call_ids = itertools.count()
logger = logging.getLogger("tokenmill.requests")  # one line per API call (call_log.py: those that fail early)


__all__ = ["ClientDisconnected", "Generation", "GenerationStream"]


class GenerationStream(StreamingResponse):
    """A call's server-sent events that close the call however the response ends: a client that hangs up before
    the first event may leave the event generator never started (so its own cleanup never runs)."""

    def __init__(
        self,
        events: AsyncIterator[str],
        generation: "Generation",
        headers: dict[str, str] | None = None,
        media_type: str = "text/event-stream",  # Ollama's streams: "application/x-ndjson"
        on_close: Callable[[], None] | None = None,  # also run however the response ends (after the call closes)
    ):
        super().__init__(events, media_type=media_type, headers=headers)
        self.generation = generation
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.generation.close()
            if self.on_close is not None:
                self.on_close()


class Generation:
    def __init__(
        self,
        state: ServerState,
        prompts: list[PromptInput],
        request: NeutralRequest,
        api_id: str,
        endpoint: str = "",
    ):
        self.state = state
        self.request = request
        # echo with max_tokens 0, n_predict 0: the one token generated is not output
        self.drop_generated = request.output.prompt_only
        self.endpoint = endpoint  # for the access line
        self.started = time.monotonic()
        self._latest: dict[str, RequestOutput] = {}  # each request's last output seen (the access line's counts)
        self._logged = False
        self.api_id = api_id  # engine request ids are "<api id>-<prompt index>", so step events name the call
        self.prompts = prompts
        self.params = request.engine_params()  # its max_tokens settled once the prompts are tokenized (_settled)
        self.call_id = f"call-{next(_call_ids)}"
        self.request_ids: list[str] = []
        self._index: dict[str, int] = {}
        self._outputs = OutputCollector()
        self._pending: set[str] = set()
        self._entered = False  # whether start() added every request (else close() aborts every id it may have)
        self._claimed = False  # whether this call holds its api id (released when it closes)
        self._beams: asyncio.Future | None = None  # a beam search's rounds
        self._status = "200"  # for the access line
        # the finish reason the API reported for an output, for the access line (chat: "tool_calls" for a call)
        self.reported_finish: Callable[[CompletionOutput], str | None] = lambda o: o.finish_reason

    def _planned_ids(self) -> list[str]:
        return [f"{self.api_id}-{i}" for i in range(len(self.prompts))]

    async def start(self, http_request: Request | None = None) -> None:
        """Admit the call, tokenize its prompts and add them to the engine. Raises the 400s and 503s; raises
        ClientDisconnected (and leaves nothing running) when `http_request`'s client leaves meanwhile."""
        model = self.state.require_model()
        # a request that can never run is a 400, not a 503; in a worker thread, as its constraint may take a while
        # to compile (bounded by max_constraint_compile_seconds), which must stall no other client
        checked = round_params(self.params) if isinstance(self.params, BeamSearchParams) else self.params
        try:
            await asyncio.to_thread(model.check_params, checked)
        except InvalidParameterError as exc:  # named as the user sent it (chat's top_logprobs is the engine's logprobs)
            raise self.request.in_api_terms(exc) from exc.__cause__
        self.state.claim_api_id(self.api_id)
        self._claimed = True
        try:
            self.state.admit(self.call_id, len(self.prompts) * getattr(self.params, "n", 1))
        except BaseException:
            self.close()
            raise
        self.state.in_flight[self.call_id] = self._pending
        entering = asyncio.ensure_future(self._enter())
        try:
            if http_request is None:
                await entering
            else:
                await _unless_disconnected(entering, http_request)
        except InvalidParameterError as exc:
            self.close()
            raise self.request.in_api_terms(exc) from exc.__cause__
        except BaseException:
            entering.cancel()
            self.close()
            raise

    async def _enter(self) -> None:
        engine = self.state.require_engine()
        prompts = await asyncio.to_thread(self._tokenized, self.state.require_model(), self.prompts, self.params)
        self.prompts = prompts  # as they run: tokenized, truncated where the request asks
        self.params = self._settled(prompts)
        if isinstance(self.params, BeamSearchParams):
            return await self._enter_beams(engine, prompts, self.params)
        rids = await engine.add_requests(prompts, self.params, self._planned_ids(), self._outputs, group=self.api_id)
        self.request_ids = rids
        self._index = {rid: i for i, rid in enumerate(rids)}
        self._pending.update(rids)
        self._entered = True

    async def _enter_beams(self, engine: AsyncEngine, prompts: list[PromptInput], params: BeamSearchParams) -> None:
        """Start the beam search of the call's prompts (checked here: a bad one is a 400). Each round's requests
        are in `_pending` while they run, so that an abort (the client leaving, a shutdown's) reaches them."""
        model = self.state.require_model()
        checked = [(p["prompt"], p["prompt_token_ids"]) for p in prompts]  # tokenized and checked by _enter
        search = BeamSearch(checked, params, model.tokenizer, model.max_model_len)
        rids = self._planned_ids()
        rounds = itertools.count()

        async def run_round(beams: list[list[int]], one_token: SamplingParams) -> list[RequestOutput]:
            ids = [f"{self.api_id}-round{next(rounds)}-beam{j}" for j in range(len(beams))]
            self._pending.update(ids)
            try:
                return await engine.run_requests([{"prompt_token_ids": b} for b in beams], one_token, ids, self.api_id)
            finally:
                self._pending.difference_update(ids)

        async def search_all() -> None:
            try:
                await search.run_async(run_round)
            except Exception as exc:  # the engine failed: the call's reader gets the error (cancelled: it left)
                self._outputs.put(rids[0], exc)
                return
            for rid, out in zip(rids, search.request_outputs(rids), strict=True):
                self._outputs.put(rid, out)

        self.request_ids = rids
        self._index = {rid: i for i, rid in enumerate(rids)}
        self._pending.update(rids)
        self._entered = True
        self._beams = asyncio.ensure_future(search_all())

    def _settled(self, prompts: list[dict]) -> SamplingParams | PoolingParams | BeamSearchParams:
        """The call's params with max_tokens as the server's one rule settles it (output_limits.py), for every API
        alike; the rest of the context, where that is what it leaves, is each prompt's (the engine's fit_output)."""
        if isinstance(self.params, PoolingParams):
            return self.params
        longest = max(len(p["prompt_token_ids"]) for p in prompts)
        max_tokens = self.state.output_limits().settle(self.request.output, longest)
        return dataclasses.replace(self.params, max_tokens=max_tokens)

    @staticmethod
    def _tokenized(
        model: ServedModel, prompts: list[PromptInput], params: SamplingParams | PoolingParams | BeamSearchParams
    ) -> list[dict]:
        """The prompts as token ids, truncated where `params` ask (runs in a worker thread)."""
        truncating = None if isinstance(params, BeamSearchParams) else params  # a beam search does not truncate
        return [model.tokenize_prompt(p, truncating) for p in prompts]

    def close(self) -> None:
        """Abort what is still running and stop counting this call (idempotent); log its access line."""
        aborted = bool(self._pending) or not self._entered
        self.abort()
        for item in self._outputs.take_all():  # read too late, but the access line counts them
            if isinstance(item, RequestOutput):
                self._latest[item.request_id] = item
        self.state.in_flight.pop(self.call_id, None)
        self.state.release(self.call_id)
        if self._claimed:
            self._claimed = False
            self.state.api_ids.discard(self.api_id)
        if not self._logged and (self._latest or self._entered) and self.state.settings.log_requests:
            self._logged = True
            self._log_access(self._status if self._status != "200" or not aborted else "aborted")

    def _log_access(self, status: str) -> None:
        """One line for the call: its outputs as last seen (finished or not: an abandoned call counts what it
        made), the finish reasons ("abort" for a request that never finished)."""
        finals = list(self._latest.values())
        outputs = [o for f in finals for o in f.outputs]
        reasons = {self.reported_finish(o) or "abort" for f in finals for o in f.outputs}
        if sum(f.finished for f in finals) < max(len(self.request_ids), 1):  # some never finished: aborted
            reasons.add("abort")
        first = [f.metrics.first_token_time - f.metrics.arrival_time for f in finals if f.metrics.first_token_time]
        mark_logged()
        logger.info(
            "%s %s %s: %d prompt + %d output tokens, finish %s, TTFT %s, %.3f s",
            self.api_id,
            self.endpoint,
            status,
            sum(len(f.prompt_token_ids) for f in finals),
            sum(len(o.token_ids) for o in outputs),
            "/".join(sorted(reasons)),
            f"{min(first):.3f} s" if first else "-",
            time.monotonic() - self.started,
        )

    async def stream(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Outputs as they come, each with the index of its prompt; ends when every request finished."""
        try:
            while self._pending:
                item: Any = await self._outputs.get()
                if isinstance(item, EngineDeadError):
                    raise APIError(500, str(item), "server_error", code="engine_dead")
                if isinstance(item, BaseException):  # a beam search's round failed
                    raise item
                self._latest[item.request_id] = item
                if item.finished:
                    self._pending.discard(item.request_id)
                    self.state.metrics.observe(item, count_generated=not self.drop_generated)
                failed = next((o for o in item.outputs if o.finish_reason == "error"), None)
                if failed is not None:  # its constraint could not be followed: the call fails, never "stop"s
                    self._status = "500"
                    raise APIError(
                        500,
                        f"request {self.api_id} failed after {len(failed.token_ids)} tokens: {failed.error}",
                        "server_error",
                        code="constraint_failed",
                    )
                yield self._index[item.request_id], item
        finally:
            self.close()

    async def collect(
        self,
        http_request: Request | None = None,
        on_output: Callable[[int, RequestOutput], None] | None = None,
    ) -> list[RequestOutput]:
        """The final output of every prompt, in prompt order; aborts if the client goes away meanwhile.
        `on_output` sees every output as it comes (with its prompt's index), as a stream would."""
        finals: dict[int, RequestOutput] = {}

        async def consume() -> None:
            async for i, out in self.stream():
                if on_output is not None:
                    on_output(i, out)
                if out.finished:
                    finals[i] = out

        task = asyncio.create_task(consume())
        watcher = asyncio.create_task(_wait_for_disconnect(http_request)) if http_request is not None else None
        try:
            await asyncio.wait({task, watcher} - {None}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if watcher is not None:
                watcher.cancel()
        if not task.done():
            task.cancel()
            self.close()  # now, not when the cancelled task gets to it: its line belongs to this HTTP request's
            raise ClientDisconnected()
        task.result()
        return [finals[i] for i in range(len(self.prompts))]

    def abort(self) -> None:
        """Abort every request of the call still running, in one engine command. Before start() has added them
        all, every id it may have added: an add still on its way to the engine thread runs before this abort, as
        commands run in order (and the ids are this call's while it holds its api id)."""
        if self._beams is not None:
            self._beams.cancel()  # its round's requests are aborted as it stops (and below)
        engine = self.state.engine
        if engine is None:
            return
        if self._entered:
            engine.abort_nowait(*self._pending)
        elif self._claimed:
            engine.abort_nowait(*self._planned_ids())


async def _unless_disconnected(task: asyncio.Future, request: Request) -> None:
    """Wait for `task`; ClientDisconnected (the task cancelled) if the client leaves first."""
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        raise ClientDisconnected()
    task.result()


async def _wait_for_disconnect(request: Request) -> None:
    """Returns when the client closes the connection (the request body was already read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
