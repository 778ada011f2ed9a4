"""OpenAI's Responses API: POST /v1/responses (whole, or streamed as its typed events), GET and DELETE
/v1/responses/{id}. A stored response (store, the default) keeps its conversation in this process, so that a
later request continues it with previous_response_id; the oldest go once MAX_STORED are kept.

The request is translated onto the chat call the other chat APIs make (chat.start_chat); the reply is read back
into output items: a message with output_text, or function_call items.
"""

import json
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from tokenmill.outputs import RequestOutput
from tokenmill.parsers.reply import ReplyDelta, ReplyParser
from tokenmill.server.chat import require_thinking, start_chat
from tokenmill.server.errors import APIError
from tokenmill.server.generation import Generation
from tokenmill.server.neutral_request import NeutralRequest
from tokenmill.server.request_ids import call_id, echo
from tokenmill.server.responses_logprobs import TextLogprobs
from tokenmill.server.responses_protocol import ResponsesRequest
from tokenmill.server.schemas import answers, error_responses
from tokenmill.server.state import ServerState
from tokenmill.server.stream_or_collect import aborted_error, collected, streamed
from tokenmill.structured.tools import ToolCall

MAX_STORED = 1000
logger = logging.getLogger(__name__)


class ResponseStore:
    """Responses by id, each with the conversation it ends (messages, without the request's instructions), kept
    as compact JSON: at most `max_count` of them in at most `max_bytes`, the oldest dropped first. A response
    still being made is kept with its status (in_progress) and no conversation yet."""

    def __init__(self, max_bytes: int, max_count: int = MAX_STORED):
        self.max_bytes = max_bytes
        self.max_count = max_count
        self._items: OrderedDict[str, bytes] = OrderedDict()  # oldest first
        self.num_bytes = 0

    def __len__(self) -> int:
        return len(self._items)

    def put(self, body: dict, conversation: list[dict] | None) -> None:
        """Store (or replace) a response; `conversation` None: it cannot be continued (not completed)."""
        response_id = body["id"]
        data = json.dumps({"body": body, "conversation": conversation}, separators=(",", ":")).encode()
        self._drop(response_id)
        if len(data) > self.max_bytes:
            logger.warning(
                "response %s is not stored: its %d bytes are more than --responses-store-bytes (%d)",
                response_id,
                len(data),
                self.max_bytes,
            )
            return
        self._items[response_id] = data
        self.num_bytes += len(data)
        while len(self._items) > self.max_count or self.num_bytes > self.max_bytes:
            self._drop(next(iter(self._items)))

    def body(self, response_id: str) -> dict:
        return self._entry(response_id, None)["body"]

    def conversation(self, response_id: str) -> list[dict]:
        """The conversation a completed response ends, for previous_response_id (404: not stored; 400: not
        completed)."""
        entry = self._entry(response_id, "previous_response_id")
        if entry["conversation"] is None:
            status = entry["body"]["status"]
            raise APIError(
                400,
                f"response '{response_id}' is {status}: only a finished response can be continued",
                param="previous_response_id",
            )
        return entry["conversation"]

    def delete(self, response_id: str) -> None:
        self._entry(response_id, None)
        self._drop(response_id)

    def _entry(self, response_id: str, param: str | None) -> dict:
        data = self._items.get(response_id)
        if data is None:
            raise APIError(404, f"no response with id '{response_id}' is stored in this server", param=param)
        return json.loads(data)

    def _drop(self, response_id: str) -> None:
        data = self._items.pop(response_id, None)
        if data is not None:
            self.num_bytes -= len(data)


def add_responses_routes(app: FastAPI, state: ServerState) -> None:
    store = ResponseStore(state.settings.responses_store_bytes)

    @app.post(
        "/v1/responses",
        responses={**answers("the response", "text/event-stream"), **error_responses(400, 401, 404, 413, 503)},
    )
    async def create(req: ResponsesRequest, request: Request):
        return await _create(req, request, state, store)

    @app.get("/v1/responses/{response_id}", responses={**answers("a stored response"), **error_responses(401, 404)})
    async def retrieve(response_id: str) -> dict:
        return store.body(response_id)

    @app.delete("/v1/responses/{response_id}", responses={**answers("deleted"), **error_responses(401, 404)})
    async def delete(response_id: str) -> dict:
        store.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}


class _Turn:
    """One response being made: its request, ids, the conversation it continues, and its output items."""

    def __init__(self, req: ResponsesRequest, state: ServerState, store: ResponseStore, history: list[dict]):
        self.req = req
        self.state = state
        self.store = store
        self.history = history  # the conversation before this reply, instructions aside
        self.id = "resp_" + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.message_id = "msg_" + uuid.uuid4().hex[:24]
        self.reasoning_id = "rs_" + uuid.uuid4().hex[:24]
        self.settled = False  # finished, or stored as cancelled or failed
        top = req.logprobs_top()
        tokenizer = state.require_model().tokenizer
        self.logprobs = TextLogprobs(tokenizer, top) if top is not None else None  # include's output_text.logprobs

    def body(
        self, status: str, output: list[dict], final: RequestOutput | None = None, error: dict | None = None
    ) -> dict:
        req = self.req
        incomplete = final is not None and final.outputs[0].finish_reason == "length"
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": "incomplete" if incomplete else status,
            "model": self.state.model_name,
            "output": output,
            "instructions": req.instructions,
            "previous_response_id": req.previous_response_id,
            "max_output_tokens": req.max_output_tokens,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "tools": req.tools or [],
            "tool_choice": req.tool_choice or "auto",
            "parallel_tool_calls": req.parallel_tool_calls,
            "text": req.text_echo(),
            "truncation": "disabled",
            "store": req.store,
            "metadata": req.metadata or {},
            "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "usage": _usage(final) if final is not None else None,
        }

    def text_logprobs(self) -> list[dict]:
        return self.logprobs.content if self.logprobs is not None else []

    def message_item(self, text: str, status: str = "completed") -> dict:
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": self.text_logprobs()}
        content = [part] if status == "completed" else []
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant", "content": content}

    def reasoning_item(self, thinking: str, status: str = "completed") -> dict:
        """The reply's thinking, as OpenAI's Responses API gives an open-weight model's: its text in content."""
        content = [{"type": "reasoning_text", "text": thinking}] if status == "completed" else []
        return {"type": "reasoning", "id": self.reasoning_id, "summary": [], "content": content, "status": status}

    def output(self, reply: ReplyParser) -> list[dict]:
        items = [self.reasoning_item(reply.thinking)] if reply.thinking else []
        items += [self.message_item(reply.text)] if reply.text or not reply.calls else []
        return items + [_call_item(c) for c in reply.calls]

    def raw_messages(self, final: RequestOutput) -> dict:
        """vLLM's enable_response_messages: the prompt as the model read it and the reply as it wrote it, each as
        text and token ids."""
        tokenizer = self.state.require_model().tokenizer
        prompt, reply = final.prompt_token_ids, final.outputs[0]
        return {
            "input_messages": [raw_message(tokenizer.decode(prompt), prompt)],
            "output_messages": [raw_message(tokenizer.decode(reply.token_ids), reply.token_ids)],
        }

    def begin(self) -> None:
        """Stored (when the request asks) as in_progress while it is made: GET answers so meanwhile."""
        if self.req.store:
            self.store.put(self.body("in_progress", []), None)

    def settle(self, error: APIError | None = None) -> None:
        """The response ended unfinished: stored as failed (with the error) or cancelled (its client left, or the
        server stopped it), so GET says what became of it. A no-op once it finished or settled."""
        if self.settled:
            return
        self.settled = True
        if self.req.store:
            failure = None if error is None else {"code": error.code or error.type, "message": error.message}
            self.store.put(self.body("cancelled" if error is None else "failed", [], None, failure), None)

    def finish(self, final: RequestOutput, reply: ReplyParser) -> dict:
        """The finished response's body, stored with its conversation when the request asks (the thinking kept
        with the reply: the chat template decides what a later turn shows of it, as harmony's drops old analysis)."""
        self.settled = True
        body = self.body("completed", self.output(reply), final)
        body["usage"]["output_tokens_details"]["reasoning_tokens"] = reply.thinking_tokens
        if self.req.enable_response_messages:
            body.update(self.raw_messages(final))
        if self.req.store:
            message: dict[str, Any] = {"role": "assistant", "content": reply.text}
            if reply.thinking:
                message["reasoning_content"] = reply.thinking
            if reply.calls:
                message["tool_calls"] = [c.as_openai() for c in reply.calls]
            self.store.put(body, [*self.history, message])
        return body


async def _create(req: ResponsesRequest, http_request: Request, state: ServerState, store: ResponseStore):
    client_id, request_id = call_id(http_request, "resp")
    state.check_model(req.model)
    model = state.require_model()
    history = list(store.conversation(req.previous_response_id)) if req.previous_response_id else []
    history += req.input_messages()
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + history
    effort = req.reasoning.effort if req.reasoning is not None else None
    require_thinking(state, effort not in (None, "none") or bool(req.reasoning and req.reasoning.summary), "reasoning")
    neutral = NeutralRequest(req.sampling_params(model.sampling_defaults()), req.output_length())
    chat = await start_chat(
        state,
        request_id,
        "/v1/responses",
        messages,
        neutral,
        req.chat_tools(),
        req.chat_tool_choice(),
        http_request=http_request,
        template_kwargs=req.template_kwargs(),
    )
    turn = _Turn(req, state, store, history)
    turn.begin()
    reply = chat.reply_parser()

    def feed(output: RequestOutput) -> ReplyDelta:
        """The reply's next delta; the text's log-probabilities follow it."""
        if turn.logprobs is None:
            return reply.feed_output(output.outputs[0])
        return turn.logprobs.read(reply, output.outputs[0])

    if req.stream:
        seq = _Sequence()
        events = _events(chat.generation, reply, feed, turn, seq)
        return streamed(state, chat.generation, events, echo(client_id), seq.error, on_close=turn.settle)
    try:
        (final,) = await collected(state, chat.generation, http_request, lambda _, out: feed(out))
        return JSONResponse(turn.finish(final, reply), headers=echo(client_id))
    except APIError as exc:  # failed (an engine abort too); a client that leaves: cancelled (finally)
        turn.settle(exc)
        raise
    finally:
        turn.settle()


def raw_message(text: str, token_ids: list[int]) -> dict:
    return {"type": "raw_message_tokens", "message": text, "tokens": list(token_ids)}


def _call_item(call: ToolCall) -> dict:
    return {
        "type": "function_call",
        "id": "fc_" + call.id.removeprefix("call_"),
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments,
        "status": "completed",
    }


def _usage(out: RequestOutput) -> dict:
    prompt, output = len(out.prompt_token_ids), sum(len(o.token_ids) for o in out.outputs)
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": out.num_cached_tokens},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + output,
    }


class _Sequence:
    """The events of one stream, numbered."""

    def __init__(self) -> None:
        self.number = 0

    def event(self, kind: str, body: dict[str, Any]) -> str:
        data = {"type": kind, "sequence_number": self.number, **body}
        self.number += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=True)}\n\n"

    def error(self, error: APIError) -> str:
        return self.event("error", {"code": error.code or error.type, "message": error.message, "param": error.param})


async def _events(
    generation: Generation,
    reply: ReplyParser,
    feed: Callable[[RequestOutput], ReplyDelta],
    turn: _Turn,
    seq: _Sequence,
) -> AsyncIterator[str]:
    """response.created and in_progress; a reasoning item's text deltas while the reply thinks, then the message
    item's (held back while the reply may be a call); function_call items as they complete; response.completed
    (or incomplete)."""
    yield seq.event("response.created", {"response": turn.body("in_progress", [])})
    yield seq.event("response.in_progress", {"response": turn.body("in_progress", [])})
    items = 0  # output items added
    open_item, open_at = "", -1  # the item open now ("reasoning" or "message"; "": none) and its output index

    def where() -> dict:
        item_id = turn.reasoning_id if open_item == "reasoning" else turn.message_id
        return {"item_id": item_id, "output_index": open_at, "content_index": 0}

    def switch(kind: str) -> list[str]:
        """Events that close the open item and open one of `kind` ("": none), unless it is open already."""
        nonlocal items, open_item, open_at
        if kind == open_item:
            return []
        events = []
        if open_item == "reasoning":
            item = turn.reasoning_item(reply.thinking)
            events.append(seq.event("response.reasoning_text.done", {**where(), "text": reply.thinking}))
            events.append(seq.event("response.output_item.done", {"output_index": open_at, "item": item}))
        elif open_item == "message":
            item = turn.message_item(reply.text)
            done = {**where(), "text": reply.text, "logprobs": turn.text_logprobs()}
            events.append(seq.event("response.output_text.done", done))
            events.append(seq.event("response.content_part.done", {**where(), "part": item["content"][0]}))
            events.append(seq.event("response.output_item.done", {"output_index": open_at, "item": item}))
        open_item = kind
        if kind:
            open_at, items = items, items + 1
            item = (
                turn.reasoning_item("", "in_progress") if kind == "reasoning" else turn.message_item("", "in_progress")
            )
            events.append(seq.event("response.output_item.added", {"output_index": open_at, "item": item}))
            if kind == "message":
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                events.append(seq.event("response.content_part.added", {**where(), "part": part}))
        return events

    try:
        async for _, out in generation.stream():
            o = out.outputs[0]
            if o.finish_reason == "abort":
                state = turn.state
                yield seq.error(aborted_error(state, "aborted"))
                return
            taken = len(turn.text_logprobs())
            delta = feed(out)
            if delta.thinking:
                for event in switch("reasoning"):
                    yield event
                yield seq.event("response.reasoning_text.delta", {**where(), "delta": delta.thinking})
            if delta.text:
                for event in switch("message"):
                    yield event
                logprobs = turn.text_logprobs()[taken:]  # those of the tokens that made this text
                yield seq.event("response.output_text.delta", {**where(), "delta": delta.text, "logprobs": logprobs})
            if delta.calls or o.finish_reason is not None:
                for event in switch(""):
                    yield event
            for call in delta.calls:
                item = _call_item(call)
                yield seq.event(
                    "response.output_item.added",
                    {"output_index": items, "item": {**item, "arguments": "", "status": "in_progress"}},
                )
                at = {"item_id": item["id"], "output_index": items}
                yield seq.event("response.function_call_arguments.delta", {**at, "delta": call.arguments})
                yield seq.event(
                    "response.function_call_arguments.done", {**at, "name": call.name, "arguments": call.arguments}
                )
                yield seq.event("response.output_item.done", {"output_index": items, "item": item})
                items += 1
            if o.finish_reason is None:
                continue
            body = turn.finish(out, reply)
            kind = "response.incomplete" if body["status"] == "incomplete" else "response.completed"
            yield seq.event(kind, {"response": body})
    except APIError as exc:
        turn.settle(exc)
        yield seq.error(exc)
