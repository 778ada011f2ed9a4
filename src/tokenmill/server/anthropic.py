"""Anthropic's Messages API (what coding agents and the `anthropic` client speak): POST /v1/messages, streamed
as Anthropic's events or whole, with text and tool_use content blocks, and POST /v1/messages/count_tokens.

The request is translated onto the chat call the other chat APIs make (chat.start_chat); the reply is read back
into content blocks. Errors come in Anthropic's shape (errors.py, by the path).
"""

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from tokenmill.outputs import CompletionOutput, RequestOutput
from tokenmill.parsers.reply import ReplyParser
from tokenmill.server.anthropic_protocol import CountTokensRequest, MessagesRequest
from tokenmill.server.chat import chat_prompt, require_thinking, start_chat
from tokenmill.server.errors import ANTHROPIC_PREFIX, APIError
from tokenmill.server.neutral_request import NeutralRequest
from tokenmill.server.request_ids import call_id, echo
from tokenmill.server.schemas import AnthropicError, answers, error_responses
from tokenmill.server.state import ServerState
from tokenmill.server.stream_or_collect import aborted_error, collected, streamed
from tokenmill.structured import tools
from tokenmill.structured.tools import ToolCall

ERRORS = error_responses(400, 401, 404, 413, 503, model=AnthropicError)


def add_anthropic_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/messages", responses={**answers("the message", "text/event-stream"), **ERRORS})
    async def messages(req: MessagesRequest, request: Request):
        return await _messages(req, request, state)

    @app.post("/v1/messages/count_tokens", responses={**answers("the prompt's token count"), **ERRORS})
    async def count_tokens(req: CountTokensRequest) -> dict:
        state.check_model(req.model)
        model = state.require_model()
        functions = tools.check_tools(req.openai_tools()) if req.tools else []
        _, callable_functions = tools.chosen_functions(functions, req.openai_tool_choice())
        ids = await asyncio.to_thread(chat_prompt, model, req.chat_messages(), callable_functions)
        # as /v1/messages would: a prompt too long for the context is refused (however many messages make it up)
        model.check_prompt_length(len(ids))
        return {"input_tokens": len(ids)}


async def _messages(req: MessagesRequest, http_request: Request, state: ServerState):
    client_id, request_id = call_id(http_request, "msg")
    state.check_model(req.model)
    model = state.require_model()
    require_thinking(state, req.thinking is not None and req.thinking.type in ("enabled", "between_tools"), "thinking")
    require_thinking(state, req.output_config is not None and req.output_config.effort is not None, "effort")
    neutral = NeutralRequest(req.sampling_params(model.sampling_defaults()), req.output_length())
    chat = await start_chat(
        state,
        request_id,
        "/v1/messages",
        req.chat_messages(),
        neutral,
        req.openai_tools(),
        req.openai_tool_choice(),
        http_request=http_request,
        template_kwargs=req.template_kwargs(),
        thinking_budget=req.thinking.budget_tokens if req.thinking is not None else None,
    )
    message_id = "msg_" + uuid.uuid4().hex[:24]
    head = {"id": message_id, "type": "message", "role": "assistant", "model": state.model_name}
    show_thinking = req.shows_thinking and bool(chat.format.reasoning)
    if req.stream:
        events = _events(chat.generation, chat.reply_parser(), head, state, show_thinking)
        return streamed(state, chat.generation, events, echo(client_id), _error_event)
    reply = chat.reply_parser()
    (final,) = await collected(state, chat.generation, http_request, lambda _, out: reply.feed_output(out.outputs[0]))
    o = final.outputs[0]
    content = [_thinking_block(reply.thinking)] if reply.thinking and show_thinking else []
    content += [{"type": "text", "text": reply.text}] if reply.text or not reply.calls else []
    content += [_tool_use(c) for c in reply.calls]
    return JSONResponse(
        {**head, "content": content, **_stop(o, reply.calls), "usage": _usage(final)}, headers=echo(client_id)
    )


def _thinking_block(text: str) -> dict[str, Any]:
    return {"type": "thinking", "thinking": text, "signature": ""}  # nothing signs it here


def _stop(o: CompletionOutput, calls: list[ToolCall] | None) -> dict[str, Any]:
    """Anthropic's stop_reason and stop_sequence for the output."""
    if o.finish_reason == "length":
        return {"stop_reason": "max_tokens", "stop_sequence": None}
    if calls:
        return {"stop_reason": "tool_use", "stop_sequence": None}
    if isinstance(o.stop_reason, str):
        return {"stop_reason": "stop_sequence", "stop_sequence": o.stop_reason}
    return {"stop_reason": "end_turn", "stop_sequence": None}


def _usage(out: RequestOutput) -> dict[str, int]:
    """Anthropic's usage: input_tokens counts the prompt tokens computed, cache_read_input_tokens those the prefix
    cache served (this server writes its cache on every request, at no extra cost: no cache_creation)."""
    cached = out.num_cached_tokens
    return {
        "input_tokens": len(out.prompt_token_ids) - cached,
        "output_tokens": sum(len(o.token_ids) for o in out.outputs),
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
    }


def _tool_use(call: ToolCall) -> dict[str, Any]:
    try:
        arguments = json.loads(call.arguments)
    except ValueError:  # a call cut off by max_tokens: its input as far as it was written
        arguments = {}
    return {"type": "tool_use", "id": "toolu_" + call.id.removeprefix("call_"), "name": call.name, "input": arguments}


def _event(kind: str, body: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **body}, ensure_ascii=True)}\n\n"


def _error_event(error: APIError) -> str:
    body = error.body(ANTHROPIC_PREFIX)
    return _event("error", {"error": body["error"]})


async def _events(
    generation, reply: ReplyParser, head: dict, state: ServerState, show_thinking: bool
) -> AsyncIterator[str]:
    """message_start (once the prompt is computed: its usage tells the prefix-cache hits, as Anthropic's), then
    each content block's start, deltas and stop (thinking, text, tool_use), then message_delta and message_stop."""
    started = False
    blocks = 0  # content blocks started
    open_kind = ""  # the kind of the block open now ("thinking", "text"), or ""

    def switch(kind: str) -> list[str]:
        """Events that close the open block and open one of `kind` (none when it is open already)."""
        nonlocal blocks, open_kind
        if open_kind == kind:
            return []
        events = [_event("content_block_stop", {"index": blocks - 1})] if open_kind else []
        if kind:
            block = _thinking_block("") if kind == "thinking" else {"type": "text", "text": ""}
            events.append(_event("content_block_start", {"index": blocks, "content_block": block}))
            blocks += 1
        open_kind = kind
        return events

    try:
        async for _, out in generation.stream():
            if not started:
                started = True
                start_usage = {**_usage(out), "output_tokens": 0}
                message = {**head, "content": [], "stop_reason": None, "stop_sequence": None, "usage": start_usage}
                yield _event("message_start", {"message": message})
                yield _event("ping", {})
            o = out.outputs[0]
            if o.finish_reason == "abort":
                yield _error_event(aborted_error(state, "aborted"))
                return
            delta = reply.feed_output(o)
            if delta.thinking and show_thinking:
                for event in switch("thinking"):
                    yield event
                body = {"type": "thinking_delta", "thinking": delta.thinking}
                yield _event("content_block_delta", {"index": blocks - 1, "delta": body})
            if delta.text:
                for event in switch("text"):
                    yield event
                body = {"type": "text_delta", "text": delta.text}
                yield _event("content_block_delta", {"index": blocks - 1, "delta": body})
            if delta.calls or o.finish_reason is not None:
                for event in switch(""):
                    yield event
            for call in delta.calls:
                block = {**_tool_use(call), "input": {}}
                yield _event("content_block_start", {"index": blocks, "content_block": block})
                body = {"type": "input_json_delta", "partial_json": call.arguments}
                yield _event("content_block_delta", {"index": blocks, "delta": body})
                yield _event("content_block_stop", {"index": blocks})
                blocks += 1
            if o.finish_reason is None:
                continue
            usage = {"output_tokens": len(o.token_ids)}
            yield _event("message_delta", {"delta": _stop(o, reply.calls), "usage": usage})
            yield _event("message_stop", {})
    except APIError as exc:
        yield _error_event(exc)
