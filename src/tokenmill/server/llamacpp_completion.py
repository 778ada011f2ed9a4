"""llama-server's POST /completion (and /completions): its prompt shapes, its sampling fields, the call run in
slots (llamacpp_slots.py), the answer whole or streamed as server-sent `data:` lines (no [DONE], as llama-server's
own stream), with n_probs' probabilities and response_fields. The engine call is the one every API makes
(generation.Generation)."""

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.errors import APIError
from tokenmill.server.generation import Generation
from tokenmill.server.llamacpp_format import (
    CompletionSettings,
    final_json,
    only_fields,
    partial_json,
    probabilities,
    timings,
)
from tokenmill.server.llamacpp_prompts import logit_bias, prompt_tokens, split_prompts
from tokenmill.server.llamacpp_protocol import LlamaCompletionRequest
from tokenmill.server.llamacpp_slots import Slot, SlotTable
from tokenmill.server.neutral_request import NeutralRequest
from tokenmill.server.request_ids import call_id, echo
from tokenmill.server.sampling_defaults import over_defaults
from tokenmill.server.served_model import ServedModel
from tokenmill.server.state import ServerState
from tokenmill.server.stream_or_collect import aborted_error, collected, streamed


def completion_settings(req: LlamaCompletionRequest, state: ServerState, model: ServedModel) -> CompletionSettings:
    """The request's sampling over the server's defaults (the model's recommended settings, or POST /props')."""
    output = req.output_length()
    defaults = model.sampling_defaults()
    # a request without a seed takes the server's (--seed), as llama-server's: the same request, the same answer
    seed = req.seed if req.seed is not None else model.config.seed
    params = SamplingParams(
        max_tokens=None,  # settled by Generation from `output` (output_limits.py)
        seed=seed,
        stop=req.stop or None,
        ignore_eos=req.ignore_eos,
        logit_bias=logit_bias(model.tokenizer, req.logit_bias, ignore_eos=req.ignore_eos),
        logprobs=req.n_probs or None,
        processed_logprobs=req.post_sampling_probs,
        report_prompt_progress=req.stream and req.return_progress,
        skip_reading_prefix_cache=not req.cache_prompt,
        **over_defaults(defaults, req.sampling_given()),
    )
    # what Generation will settle it to, as the answer's generation_settings shows it (-1: up to the context)
    max_tokens = state.output_limits().settle(output)
    n_predict = 0 if output.prompt_only else (max_tokens if max_tokens is not None else -1)
    return CompletionSettings(params, output, n_predict, req.stream, req.n_probs, seed)


async def create_llama_completion(
    req: LlamaCompletionRequest, http_request: Request, state: ServerState, slots: SlotTable, endpoint: str
):
    client_id, request_id = call_id(http_request, "cmpl")
    state.check_model(req.model)
    model = state.require_model()
    settings = completion_settings(req, state, model)
    prompts = split_prompts(req.prompt)
    ids = await asyncio.to_thread(lambda: [prompt_tokens(model.tokenizer, p) for p in prompts])
    taken = await slots.acquire(req.id_slot, ids)
    run = SlotRun(taken, ids, settings.as_json())
    prompt_only = settings.output.prompt_only
    try:
        neutral = NeutralRequest(settings.params, settings.output)
        generation = Generation(state, [{"prompt_token_ids": i} for i in ids], neutral, request_id, endpoint)
        await generation.start(http_request)
    except BaseException:
        run.end(slots)
        raise
    answer = Answer(model, state, settings, req, taken, prompt_only)
    if req.stream:
        events = _events(generation, answer, run)
        return streamed(state, generation, events, echo(client_id), _error_event, on_close=lambda: run.end(slots))
    try:
        finals = await collected(state, generation, http_request, run.observe)
    finally:
        run.end(slots)
    bodies = [answer.final(i, out, out.outputs[0].text, stream=False) for i, out in enumerate(finals)]
    return JSONResponse(bodies[0] if len(bodies) == 1 else bodies, headers=echo(client_id))


class SlotRun:
    """A call's slots while it runs: their counters as outputs come, their tokens when it ends."""

    def __init__(self, slots: list[Slot], prompts: list[list[int]], params: dict[str, Any]):
        self.slots = slots
        self.prompts = prompts
        self.latest: dict[int, RequestOutput] = {}
        self.ended = False
        for slot, prompt in zip(slots, prompts, strict=True):
            slot.n_prompt_tokens = len(prompt)
            slot.n_prompt_processed = slot.n_prompt_cache = 0
            slot.params = params

    def observe(self, index: int, out: RequestOutput) -> None:
        slot = self.slots[index]
        slot.n_prompt_cache = out.num_cached_tokens
        slot.n_prompt_processed = len(out.prompt_token_ids) - out.num_cached_tokens
        slot.n_decoded = len(out.outputs[0].token_ids)
        self.latest[index] = out

    def end(self, slots: SlotTable) -> None:
        """Free the slots (idempotent); each keeps the tokens its KV now holds: the prompt and the output but its
        last token (sampled, never computed)."""
        if self.ended:
            return
        self.ended = True
        for i, slot in enumerate(self.slots):
            out = self.latest.get(i)
            tokens = None if out is None else out.prompt_token_ids + out.outputs[0].token_ids[:-1]
            slots.release(slot, tokens)


class Answer:
    """Writes a call's answers in llama-server's shape."""

    def __init__(
        self,
        model: ServedModel,
        state: ServerState,
        settings: CompletionSettings,
        req: LlamaCompletionRequest,
        slots: list[Slot],
        prompt_only: bool,
    ):
        self.tokenizer = model.tokenizer
        self.model = state.model_name
        self.settings = settings
        self.req = req
        self.slots = slots
        self.prompt_only = prompt_only

    def final(self, index: int, out: RequestOutput, content: str, stream: bool, tokens: list[int] | None = None):
        o = out.outputs[0]
        if self.prompt_only:
            content, tokens = "", []
        elif tokens is None:
            tokens = list(o.token_ids) if self.req.return_tokens else []
        prompt = self.tokenizer.decode(out.prompt_token_ids)
        body = final_json(out, content, tokens, self.settings, self.model, self.slots[index].id, prompt)
        body["index"] = index
        if self.prompt_only:
            body["tokens_predicted"] = body["timings"]["predicted_n"] = 0
        if self.req.n_probs and not stream and not self.prompt_only:
            body["completion_probabilities"] = self.probabilities(o.token_ids, o.logprobs or [])
        return only_fields(body, self.req.response_fields) if self.req.response_fields else body

    def partial(self, index: int, out: RequestOutput) -> dict[str, Any]:
        o = out.outputs[0]
        body = partial_json(out, o.delta_text, list(o.delta_token_ids), self.slots[index].id)
        body["index"] = index
        if self.req.timings_per_token:
            body["timings"] = timings(out)
        if self.req.n_probs and o.delta_token_ids:
            first = len(o.token_ids) - len(o.delta_token_ids)
            body["completion_probabilities"] = self.probabilities(o.delta_token_ids, (o.logprobs or [])[first:])
        return body

    def progress(self, index: int, out: RequestOutput | None, total: int) -> dict[str, Any]:
        """A prompt_progress event (return_progress): the prompt's tokens, those read from the cache and those in
        the cache so far (read or computed), and the milliseconds since it started; `out` None: before any."""
        computed = out.num_computed_prompt_tokens if out is not None else 0
        cache = out.num_cached_tokens if out is not None else 0
        started = out.metrics.first_scheduled_time if out is not None else None
        done = out.metrics.first_token_time if out is not None else None  # the prompt's end, once it came
        elapsed_ms = ((done or time.monotonic()) - started) * 1e3 if started is not None else 0.0
        body: dict[str, Any] = {
            "index": index,
            "content": "",
            "tokens": [],
            "stop": False,
            "id_slot": self.slots[index].id,
            "tokens_predicted": 0,
            "tokens_evaluated": total,
            "prompt_progress": {"total": total, "cache": cache, "processed": computed, "time_ms": int(elapsed_ms)},
        }
        if self.req.timings_per_token:
            prompt_n = max(computed - cache, 0)
            body["timings"] = {
                "cache_n": cache,
                "prompt_n": prompt_n,
                "prompt_ms": elapsed_ms,
                "prompt_per_token_ms": elapsed_ms / prompt_n if prompt_n else 0.0,
                "prompt_per_second": 1e3 / elapsed_ms * prompt_n if elapsed_ms else 0.0,
                "predicted_n": 0,
                "predicted_ms": 0.0,
                "predicted_per_token_ms": 0.0,
                "predicted_per_second": 0.0,
            }
        return body

    def probabilities(self, token_ids: list[int], positions: list) -> list:
        req = self.req
        return probabilities(
            self.tokenizer, list(token_ids), positions[: len(token_ids)], req.n_probs, req.post_sampling_probs
        )


def _event(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


def _error_event(error: APIError) -> str:
    return _event(error.body())


async def _events(generation: Generation, answer: Answer, run: SlotRun) -> AsyncIterator[str]:
    """One `data:` line per new piece of text, then each prompt's final object (stop: true); with return_progress,
    a prompt_progress event before each prompt starts and after each step that computed part of it."""
    progress = answer.req.return_progress
    reported = [0] * len(run.prompts)  # prompt tokens in the cache, as last reported
    try:
        if progress:
            for i, prompt in enumerate(run.prompts):
                yield _event(answer.progress(i, None, len(prompt)))
        async for i, out in generation.stream():
            run.observe(i, out)
            o = out.outputs[0]
            if o.finish_reason == "abort":
                yield _error_event(aborted_error(generation.state, "aborted"))
                return
            if progress and out.num_computed_prompt_tokens > reported[i]:
                reported[i] = out.num_computed_prompt_tokens
                yield _event(answer.progress(i, out, len(out.prompt_token_ids)))
            if answer.prompt_only:
                if o.finish_reason is not None:
                    yield _event(answer.final(i, out, "", stream=True))
                continue
            if o.delta_token_ids or o.delta_text:
                yield _event(answer.partial(i, out))
            if o.finish_reason is not None:
                yield _event(answer.final(i, out, "", stream=True))
    except APIError as exc:
        yield _error_event(exc)
