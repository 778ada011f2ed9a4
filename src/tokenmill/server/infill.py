"""llama.cpp's POST /infill: code completion with fill-in-the-middle, for models whose vocabulary has FIM tokens
(tokenizer/fim.py). The prompt is [BOS] (other files) <prefix> input_prefix <suffix> input_suffix <middle> prompt;
the answer is llama.cpp's completion shape (content, stop, stop_type, token counts, timings), whole or streamed
as server-sent events. A model without FIM tokens gets a 400 that says so."""

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from tokenmill.errors import InvalidParameterError
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.errors import APIError
from tokenmill.server.generation import Generation
from tokenmill.server.llamacpp_protocol import LlamaSampling
from tokenmill.server.neutral_request import NeutralRequest, OutputLength
from tokenmill.server.protocol import STRICT, APIRequest
from tokenmill.server.request_ids import call_id, echo
from tokenmill.server.sampling_defaults import over_defaults
from tokenmill.server.schemas import answers, error_responses
from tokenmill.server.served_model import ServedModel
from tokenmill.server.state import ServerState
from tokenmill.server.stream_or_collect import aborted_error, collected, streamed


class ExtraFile(BaseModel):
    model_config = ConfigDict(**STRICT, extra="forbid")

    filename: str = ""
    text: str


class InfillRequest(APIRequest, LlamaSampling):
    model: str | None = None
    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: list[ExtraFile] = Field(default_factory=list)  # the repository's other files, for context
    prompt: str = ""  # text after the middle token: what the completion continues
    n_predict: Annotated[int, Field(ge=-1)] = -1  # -1: until a stop
    stop: list[str] | None = None
    stream: bool = False
    cache_prompt: bool = True  # tokenmill caches prefixes always
    n_probs: Annotated[int, Field(le=0)] = 0  # token probabilities in the answer: not served here
    mirostat: Annotated[int, Field(le=0)] = 0

    def output_length(self) -> OutputLength:
        return OutputLength(self.n_predict if self.n_predict > 0 else None)  # -1: the server's default

    def sampling_params(self, defaults: dict[str, Any]) -> SamplingParams:
        """max_tokens is left unset: Generation settles it from output_length() (output_limits.py)."""
        return SamplingParams(
            max_tokens=None,
            seed=self.seed,
            stop=self.stop or None,
            **over_defaults(defaults, self.sampling_given()),
        )


def infill_prompt(model: ServedModel, req: InfillRequest) -> list[int]:
    """The FIM prompt's token ids (prefix, suffix, middle order, as llama.cpp's)."""
    fim = model.fim_tokens
    if fim is None:
        raise InvalidParameterError(
            f"{model.name}'s vocabulary has no fill-in-the-middle tokens: /infill needs a code model trained for it",
            "input_prefix",
        )
    tokenizer = model.tokenizer

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    ids = [tokenizer.bos_token_id] if tokenizer.add_bos and tokenizer.bos_token_id is not None else []
    for extra in req.input_extra:
        ids += ([fim.separator] if fim.separator is not None else []) + encode(f"{extra.filename}\n{extra.text}")
    ids += [fim.prefix, *encode(req.input_prefix), fim.suffix, *encode(req.input_suffix), fim.middle]
    ids += encode(req.prompt)
    model.check_prompt_length(len(ids))
    return ids


def add_infill_routes(app: FastAPI, state: ServerState) -> None:
    @app.post(
        "/infill",
        responses={
            **answers("llama.cpp's completion", "text/event-stream"),
            **error_responses(400, 401, 404, 413, 503),
        },
    )
    async def infill(req: InfillRequest, request: Request):
        client_id, request_id = call_id(request, "infill")
        state.check_model(req.model)
        model = state.require_model()
        ids = await asyncio.to_thread(infill_prompt, model, req)
        neutral = NeutralRequest(req.sampling_params(model.sampling_defaults()), req.output_length())
        generation = Generation(state, [{"prompt_token_ids": ids}], neutral, request_id, "/infill")
        await generation.start(request)
        if req.stream:
            return streamed(state, generation, _events(generation, state), echo(client_id), _error_event)
        (final,) = await collected(state, generation, request)
        return JSONResponse(_final(final, state, final.outputs[0].text), headers=echo(client_id))


def _final(out: RequestOutput, state: ServerState, content: str) -> dict[str, Any]:
    o, m = out.outputs[0], out.metrics
    end = m.finished_time or m.last_token_time or m.arrival_time
    first = m.first_token_time or end
    word = o.stop_reason if isinstance(o.stop_reason, str) else ""
    return {
        "index": 0,
        "content": content,
        "stop": True,
        "model": state.model_name,
        "stop_type": "limit" if o.finish_reason == "length" else ("word" if word else "eos"),
        "stopping_word": word,
        "tokens_predicted": len(o.token_ids),
        "tokens_evaluated": len(out.prompt_token_ids),
        "tokens_cached": out.num_cached_tokens,
        "truncated": False,
        "timings": {
            "prompt_n": len(out.prompt_token_ids) - out.num_cached_tokens,
            "prompt_ms": (first - (m.first_scheduled_time or m.arrival_time)) * 1e3,
            "predicted_n": len(o.token_ids),
            "predicted_ms": (end - first) * 1e3,
        },
    }


def _event(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, ensure_ascii=True)}\n\n"


def _error_event(error: APIError) -> str:
    return _event(error.body())


async def _events(generation: Generation, state: ServerState) -> AsyncIterator[str]:
    try:
        async for _, out in generation.stream():
            o = out.outputs[0]
            if o.finish_reason == "abort":
                yield _error_event(aborted_error(state, "aborted"))
                return
            if o.finish_reason is not None:
                yield _event(_final(out, state, o.delta_text))
            elif o.delta_text:
                yield _event({"index": 0, "content": o.delta_text, "stop": False})
    except APIError as exc:
        yield _error_event(exc)
