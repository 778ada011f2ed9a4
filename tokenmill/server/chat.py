"""POST /v1/chat/completions: the chat template rendered server-side, streaming or not, with logprobs."""

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from tokenmill.outputs import CompletionOutput, RequestOutput
from tokenmill.server.completions import SHUTDOWN_ERROR, _usage
from tokenmill.server.errors import APIError, guarded_stream
from tokenmill.server.generation import ClientDisconnected, Generation
from tokenmill.server.logprobs_format import chat_logprobs
from tokenmill.server.protocol import ChatCompletionRequest
from tokenmill.server.state import ServerState
from tokenmill.tokenizer import Tokenizer


async def create_chat_completion(req: ChatCompletionRequest, http_request: Request, state: ServerState):
    state.check_model(req.model)
    engine = state.require_engine()
    if req.tools:
        raise APIError(400, "tool calling is not supported", param="tools")
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    k = (req.top_logprobs or 0) if req.logprobs else None
    params = req.sampling_params(req.max_completion_tokens or req.max_tokens, k)
    llm_engine = engine.engine
    # rendering and tokenizing a long conversation takes a while: not on the event loop
    prompt_ids = await asyncio.to_thread(llm_engine.encode_chat, req.message_dicts(), req.add_generation_prompt)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    generation = Generation(state, [{"prompt_token_ids": prompt_ids}], params, request_id)
    await generation.start()
    created = int(time.time())
    tokenizer = llm_engine.tokenizer
    if req.stream:
        events = _stream(generation, req, tokenizer, state, request_id, created, k)
        return StreamingResponse(
            guarded_stream(events, state.metrics.internal_errors.inc), media_type="text/event-stream"
        )
    try:
        (final,) = await generation.collect(http_request)
    except ClientDisconnected:
        return JSONResponse({}, status_code=499)
    if any(o.finish_reason == "abort" for o in final.outputs):
        raise SHUTDOWN_ERROR if state.shutting_down else APIError(500, "the request was aborted", "server_error")
    choices = [
        {
            "index": o.index,
            "message": {"role": "assistant", "content": o.text},
            "logprobs": _logprobs(tokenizer, o, o.token_ids, 0, k),
            "finish_reason": o.finish_reason,
            **({"token_ids": o.token_ids} if req.return_token_ids else {}),
        }
        for o in final.outputs
    ]
    response = {
        "id": request_id,
        "object": "chat.completion",
        "created": created,
        "model": state.model_name,
        "choices": choices,
        "usage": _request_usage(final),
    }
    if req.return_token_ids:
        response["prompt_token_ids"] = final.prompt_token_ids
    return response


def _request_usage(final: RequestOutput) -> dict:
    completion_tokens = sum(len(o.token_ids) for o in final.outputs)
    return _usage(len(final.prompt_token_ids), completion_tokens, final.num_cached_tokens)


def _logprobs(tokenizer: Tokenizer, o: CompletionOutput, token_ids: list[int], first: int, k: int | None):
    if k is None:
        return None
    return {"content": chat_logprobs(tokenizer, token_ids, (o.logprobs or [])[first : first + len(token_ids)], k)}


async def _stream(
    generation: Generation,
    req: ChatCompletionRequest,
    tokenizer: Tokenizer,
    state: ServerState,
    request_id: str,
    created: int,
    k: int | None,
) -> AsyncIterator[str]:
    head = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": state.model_name}
    extra = {"usage": None} if req.include_usage else {}

    def chunk(choices: list[dict]) -> str:
        return f"data: {json.dumps({**head, 'choices': choices, **extra})}\n\n"

    yield chunk(
        [
            {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            for i in range(req.n)
        ]
    )
    final: RequestOutput | None = None
    finished: set[int] = set()  # choices whose finish_reason was sent
    try:
        async for _, out in generation.stream():
            final = out
            for o in out.outputs:
                if o.finish_reason == "abort":
                    yield (SHUTDOWN_ERROR if state.shutting_down else APIError(500, "aborted", "server_error")).sse()
                    yield "data: [DONE]\n\n"
                    return
                newly_finished = o.finish_reason is not None and o.index not in finished
                if not (o.delta_text or o.delta_token_ids or newly_finished):
                    continue
                if newly_finished:
                    finished.add(o.index)
                first = len(o.token_ids) - len(o.delta_token_ids)
                delta = {"content": o.delta_text} if o.delta_text else {}
                choice = {
                    "index": o.index,
                    "delta": delta,
                    "logprobs": _logprobs(tokenizer, o, o.delta_token_ids, first, k),
                    "finish_reason": o.finish_reason,
                }
                if req.return_token_ids:
                    choice["token_ids"] = list(o.delta_token_ids)
                    if first == 0:
                        choice["prompt_token_ids"] = out.prompt_token_ids
                yield chunk([choice])
    except APIError as exc:
        yield exc.sse()
        yield "data: [DONE]\n\n"
        return
    if req.include_usage and final is not None:
        yield f"data: {json.dumps({**head, 'choices': [], 'usage': _request_usage(final)})}\n\n"
    yield "data: [DONE]\n\n"
