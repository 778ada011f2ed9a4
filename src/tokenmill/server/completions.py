"""POST /v1/completions: prompts as text, token ids or lists of either; streaming or not; echo and logprobs."""

import json
import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.encoders import jsonable_encoder
from fastapi.responses import JSONResponse

from tokenmill.outputs import CompletionOutput, RequestOutput
from tokenmill.server.beam_search_fields import beam_search_params
from tokenmill.server.errors import APIError
from tokenmill.server.generation import Generation
from tokenmill.server.logprobs_format import CompletionLogprobs, LogprobsShape, prompt_logprobs_json
from tokenmill.server.neutral_request import NeutralRequest
from tokenmill.server.protocol import CompletionRequest
from tokenmill.server.request_ids import call_id, echo
from tokenmill.server.served_model import PromptInput
from tokenmill.server.state import ServerState
from tokenmill.server.stream_or_collect import aborted_error, collected, openai_usage, streamed, usage_so_far
from tokenmill.tokenizer import Tokenizer


def split_prompts(prompt: str | list) -> list[PromptInput]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be empty", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [{"prompt_token_ids": list(prompt)}]
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if all(isinstance(p, list) for p in prompt):
        return [{"prompt_token_ids": p} for p in prompt]
    raise APIError(400, "prompt must be a string, a list of token ids, or a list of either", param="prompt")


class CompletionFormatter:
    """Per-choice state for building responses and stream chunks."""

    def __init__(self, req: CompletionRequest, tokenizer: Tokenizer, drop_generated: bool):
        self.req = req
        self.tokenizer = tokenizer
        self.drop_generated = drop_generated  # max_tokens=0 with echo: one token is generated, then dropped
        self.k = req.logprobs
        self.shape = LogprobsShape(req.logprobs or 0, bool(req.logprob_token_ids), req.return_tokens_as_token_ids)
        self.logprob_builders: dict[int, CompletionLogprobs] = {}
        self.started: set[int] = set()

    def choice_index(self, prompt_index: int, sample_index: int) -> int:
        return prompt_index * self.req.n + sample_index

    def prompt_part(self, out: RequestOutput, index: int) -> tuple[str, dict | None]:
        """Echoed prompt text (and its logprobs) for a choice's first chunk."""
        builder = self._builder(index)
        text = out.prompt if out.prompt is not None else self.tokenizer.decode(out.prompt_token_ids)
        if self.k is None:
            return text, None
        return text, builder.build(out.prompt_token_ids, list(out.prompt_logprobs or []))

    def _builder(self, index: int) -> CompletionLogprobs:
        if index not in self.logprob_builders:
            self.logprob_builders[index] = CompletionLogprobs(self.tokenizer, self.shape)
        return self.logprob_builders[index]

    def choice(self, prompt_index: int, out: RequestOutput, o: CompletionOutput, delta: bool) -> dict:
        index = self.choice_index(prompt_index, o.index)
        text = "" if self.drop_generated else (o.delta_text if delta else o.text)
        token_ids = [] if self.drop_generated else (o.delta_token_ids if delta else o.token_ids)
        first = len(o.token_ids) - len(token_ids)
        logprobs = None
        echo_text, echo_logprobs = "", None
        if self.req.echo and index not in self.started:
            echo_text, echo_logprobs = self.prompt_part(out, index)
        self.started.add(index)
        if self.k is not None:
            gen = self._builder(index).build(token_ids, list((o.logprobs or [])[first : first + len(token_ids)]))
            logprobs = gen if echo_logprobs is None else {k: echo_logprobs[k] + gen[k] for k in gen}
        choice = {"index": index, "text": echo_text + text, "logprobs": logprobs, "finish_reason": o.finish_reason}
        if not delta:  # vLLM's: each prompt token's log-probabilities (null unless the request asked)
            choice["prompt_logprobs"] = prompt_logprobs_json(out.prompt_logprobs)
        if self.req.return_token_ids:
            choice["token_ids"] = list(token_ids)
            if not delta or first == 0:
                choice["prompt_token_ids"] = out.prompt_token_ids
        return choice

    def completion_tokens(self, outs: list[RequestOutput]) -> int:
        return sum(self.completion_tokens_of(o) for out in outs for o in out.outputs)

    def completion_tokens_of(self, o: CompletionOutput) -> int:
        return 0 if self.drop_generated else len(o.token_ids)


async def create_completion(req: CompletionRequest, http_request: Request, state: ServerState):
    client_id, request_id = call_id(http_request, "cmpl")
    lora = state.adapter_for(req.model)
    model = state.require_model()
    if req.suffix:
        raise APIError(400, "suffix is not supported", param="suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise APIError(400, "best_of must equal n (other values are not supported)", param="best_of")
    output = req.output_length()
    drop_generated = output.prompt_only
    if drop_generated and not req.echo:
        raise APIError(400, "max_tokens must be at least 1 (0 is allowed only with echo)", param="max_tokens")
    defaults = model.sampling_defaults()
    if req.use_beam_search:  # vLLM's beam search: one finished output per prompt, n beams (never streamed)
        params = beam_search_params(req, defaults)
    else:
        params = req.sampling_params(defaults)
    prompts = split_prompts(req.prompt)
    generation = Generation(
        state, prompts, NeutralRequest(params, output, lora_name=lora), request_id, "/v1/completions"
    )
    await generation.start(http_request)
    tokenizer = model.tokenizer
    fmt = CompletionFormatter(req, tokenizer, drop_generated)
    created = int(time.time())
    if req.stream:
        return streamed(state, generation, _stream(generation, fmt, state, request_id, created), echo(client_id))
    finals = await collected(state, generation, http_request)
    choices = [fmt.choice(i, out, o, delta=False) for i, out in enumerate(finals) for o in out.outputs]
    if drop_generated:
        for c in choices:
            c["finish_reason"] = "length"
    prompt_tokens = sum(len(out.prompt_token_ids) for out in finals)
    completion_tokens = fmt.completion_tokens(finals)
    body = {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": state.reply_model(fmt.req.model),
        "system_fingerprint": state.system_fingerprint,
        "choices": sorted(choices, key=lambda c: c["index"]),
        "usage": openai_usage(prompt_tokens, completion_tokens, sum(out.num_cached_tokens for out in finals)),
    }
    return JSONResponse(jsonable_encoder(body), headers=echo(client_id))  # as FastAPI encodes a dict


async def _stream(
    generation: Generation, fmt: CompletionFormatter, state: ServerState, request_id: str, created: int
) -> AsyncIterator[str]:
    include_usage = fmt.req.include_usage
    prompt_tokens = 0
    completion_tokens = 0
    cached_tokens = 0
    head = {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": state.reply_model(fmt.req.model),
        "system_fingerprint": state.system_fingerprint,
    }
    # choices whose finish chunk was sent: with n > 1 a finished sample stays in its request's later outputs (as
    # the others go on), and its finish_reason with it
    finished: set[int] = set()
    try:
        async for i, out in generation.stream():
            for o in out.outputs:
                index = fmt.choice_index(i, o.index)
                if index in finished:
                    continue
                if not (
                    o.delta_text or o.delta_token_ids or o.finish_reason or (fmt.req.echo and index not in fmt.started)
                ):
                    continue
                if o.finish_reason is not None:
                    finished.add(index)
                if o.finish_reason == "abort":
                    yield aborted_error(state, "aborted").sse()
                    yield "data: [DONE]\n\n"
                    return
                choice = fmt.choice(i, out, o, delta=True)
                if fmt.drop_generated and o.finish_reason:
                    choice["finish_reason"] = "length"
                chunk = {**head, "choices": [choice]}
                if fmt.req.continuous_usage:  # the usage so far: this prompt's tokens, this choice's output
                    chunk["usage"] = usage_so_far(len(out.prompt_token_ids), fmt.completion_tokens_of(o))
                elif include_usage:
                    chunk["usage"] = None
                yield f"data: {json.dumps(chunk)}\n\n"
            if out.finished:
                prompt_tokens += len(out.prompt_token_ids)
                completion_tokens += fmt.completion_tokens([out])
                cached_tokens += out.num_cached_tokens
    except APIError as exc:
        yield exc.sse()
        yield "data: [DONE]\n\n"
        return
    if include_usage:
        usage = openai_usage(prompt_tokens, completion_tokens, cached_tokens)
        yield f"data: {json.dumps({**head, 'choices': [], 'usage': usage})}\n\n"
    yield "data: [DONE]\n\n"
