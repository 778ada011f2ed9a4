"""POST /v1/chat/completions: the chat template rendered server-side, streaming or not, with logprobs."""

import asyncio
import dataclasses
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request
from fastapi.encoders import jsonable_encoder
from fastapi.responses import JSONResponse

from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.errors import PromptTooLongError
from tokenmill.outputs import CompletionOutput, RequestOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.completions import _usage, aborted_error
from tokenmill.server.errors import APIError, guarded_stream
from tokenmill.server.generation import ClientDisconnected, Generation, GenerationStream
from tokenmill.server.logprobs_format import chat_logprobs
from tokenmill.server.protocol import ChatCompletionRequest
from tokenmill.server.request_ids import call_id, echo
from tokenmill.server.state import ServerState
from tokenmill.structured import StructuredOutputsParams, tools
from tokenmill.tokenizer import Tokenizer


@dataclass
class ChatCall:
    """A chat's engine requests, started: every chat API (OpenAI's, Ollama's, Anthropic's) translates its request
    into this one call and formats what comes out."""

    generation: Generation
    functions: list[dict]  # the functions the reply may call: parse its text with tools.parse_tool_calls


async def start_chat(
    state: ServerState,
    request_id: str,
    endpoint: str,
    messages: list[dict],
    params: SamplingParams,
    tool_list: list[dict] | None = None,
    tool_choice: str | dict | None = None,
    add_generation_prompt: bool = True,
    context_limit: int | None = None,
    http_request: Request | None = None,
) -> ChatCall:
    """Check the tools (OpenAI's shape), render the chat template and start generating; raises the 400s.
    `context_limit`: prompt and output together stay within this many tokens (Ollama's num_ctx). `http_request`:
    its client leaving while the call starts aborts it (ClientDisconnected)."""
    llm_engine = state.require_engine().engine
    functions = tools.check_tools(tool_list) if tool_list is not None else []
    mode, callable_functions = tools.chosen_functions(functions, tool_choice)
    if functions:  # every function's parameters must compile, whatever tool_choice says
        call = StructuredOutputsParams(json=tools.call_schema(functions), source="tools")
        await asyncio.to_thread(llm_engine.grammars.compile, call)
    if mode == "required":  # the reply is a call, enforced as a JSON schema
        if params.structured_outputs is not None:
            raise APIError(
                400,
                "tool_choice 'required' or a named function cannot be combined with "
                "response_format or structured_outputs",
                param="tool_choice",
            )
        call = StructuredOutputsParams(json=tools.call_schema(callable_functions), source="tool_choice")
        params = dataclasses.replace(params, structured_outputs=call)
    # rendering and tokenizing a long conversation takes a while: not on the event loop
    prompt_ids = await asyncio.to_thread(chat_prompt, llm_engine, messages, callable_functions, add_generation_prompt)
    if context_limit is not None:
        params = within_context(params, len(prompt_ids), context_limit)
    generation = Generation(state, [{"prompt_token_ids": prompt_ids}], params, request_id, endpoint)
    await generation.start(http_request)
    return ChatCall(generation, callable_functions)


def chat_prompt(
    llm_engine: LLMEngine, messages: list[dict], functions: list[dict], add_generation_prompt: bool = True
) -> list[int]:
    """The conversation's prompt tokens: the chat template over it, with the functions the model may call shown
    (by a template that takes tools, else in a system message)."""
    takes_tools = llm_engine.chat_template.takes_tools
    messages = tools.template_messages(messages, functions, takes_tools)
    template_tools = [{"type": "function", "function": f} for f in functions] if takes_tools else None
    return llm_engine.encode_chat(messages, add_generation_prompt, template_tools)


class CallWatch:
    """One reply's text as it streams, when it may call functions: held back while it may still become a call,
    let out once it cannot; at the end, the calls it makes (or None: its text)."""

    def __init__(self, functions: list[dict]):
        self.functions = functions
        self.held = ""

    def delta(self, text: str, finished: bool) -> tuple[str, list[tools.ToolCall] | None]:
        """(the text that goes out now, the calls once the reply is known to be them)."""
        if not self.functions:
            return text, None
        self.held += text
        if finished:
            calls = tools.parse_tool_calls(self.held, self.functions)
            out, self.held = ("" if calls else self.held), ""
            return out, calls
        if tools.may_be_a_call(self.held):
            return "", None
        out, self.held = self.held, ""
        return out, None


def within_context(params: SamplingParams, prompt_len: int, context_limit: int) -> SamplingParams:
    """`params` with max_tokens cut so that the prompt and the output fit `context_limit` tokens (Ollama's num_ctx);
    400 naming num_ctx when the prompt alone does not."""
    room = context_limit - prompt_len
    if room < 1:
        raise PromptTooLongError(
            f"the prompt has {prompt_len} tokens; num_ctx {context_limit} leaves no room for the output", "num_ctx"
        )
    return dataclasses.replace(params, max_tokens=min(params.max_tokens or room, room))


async def create_chat_completion(req: ChatCompletionRequest, http_request: Request, state: ServerState):
    client_id, request_id = call_id(http_request, "chatcmpl")
    state.check_model(req.model)
    engine = state.require_engine()
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    k = (req.top_logprobs or 0) if req.logprobs else None
    llm_engine = engine.engine
    max_tokens = state.output_limit(req.max_completion_tokens or req.max_tokens, None)
    params = req.sampling_params(max_tokens, k, defaults=llm_engine.generation_defaults.sampling_values())
    chat = await start_chat(
        state,
        request_id,
        "/v1/chat/completions",
        req.message_dicts(),
        params,
        req.tools,
        req.tool_choice,
        req.add_generation_prompt,
        http_request=http_request,
    )
    generation, callable_functions = chat.generation, chat.functions
    created = int(time.time())
    tokenizer = llm_engine.tokenizer
    if req.stream:
        events = _stream(generation, req, tokenizer, state, request_id, created, k, callable_functions)
        return GenerationStream(
            guarded_stream(events, state.metrics.internal_errors.inc), generation, headers=echo(client_id)
        )
    try:
        (final,) = await generation.collect(http_request)
    except ClientDisconnected:
        return JSONResponse({}, status_code=499)
    if any(o.finish_reason == "abort" for o in final.outputs):
        raise aborted_error(state)
    choices = []
    for o in final.outputs:
        message: dict = {"role": "assistant", "content": o.text}
        finish_reason = o.finish_reason
        calls = tools.parse_tool_calls(o.text, callable_functions) if callable_functions else None
        if calls and finish_reason == "stop":
            message, finish_reason = {"role": "assistant", "content": None}, "tool_calls"
            message["tool_calls"] = [c.as_openai() for c in calls]
        choices.append(
            {
                "index": o.index,
                "message": message,
                "logprobs": _logprobs(tokenizer, o, o.token_ids, 0, k),
                "finish_reason": finish_reason,
                **({"token_ids": o.token_ids} if req.return_token_ids else {}),
            }
        )
    response = {
        "id": request_id,
        "object": "chat.completion",
        "created": created,
        "model": state.model_name,
        "system_fingerprint": state.system_fingerprint,
        "choices": choices,
        "usage": _request_usage(final),
    }
    if req.return_token_ids:
        response["prompt_token_ids"] = final.prompt_token_ids
    return JSONResponse(jsonable_encoder(response), headers=echo(client_id))  # as FastAPI encodes a dict


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
    functions: list[dict],
) -> AsyncIterator[str]:
    """With callable functions, a choice's text is held back while it may still be a call: sent as one tool_calls
    delta if it is one when it ends, else as content once it cannot be one."""
    head = {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": state.model_name,
        "system_fingerprint": state.system_fingerprint,
    }
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
    held: dict[int, str] = {i: "" for i in range(req.n)} if functions else {}  # text held back per choice
    try:
        async for _, out in generation.stream():
            final = out
            for o in out.outputs:
                if o.finish_reason == "abort":
                    yield aborted_error(state, "aborted").sse()
                    yield "data: [DONE]\n\n"
                    return
                newly_finished = o.finish_reason is not None and o.index not in finished
                if not (o.delta_text or o.delta_token_ids or newly_finished):
                    continue
                if newly_finished:
                    finished.add(o.index)
                first = len(o.token_ids) - len(o.delta_token_ids)
                text, finish_reason = o.delta_text, o.finish_reason
                delta: dict = {}
                if o.index in held:
                    held[o.index] += text
                    calls = tools.parse_tool_calls(held[o.index], functions) if newly_finished else None
                    if calls and finish_reason == "stop":
                        delta = {"tool_calls": [{"index": j, **c.as_openai()} for j, c in enumerate(calls)]}
                        finish_reason, text = "tool_calls", ""
                        del held[o.index]
                    elif newly_finished or not tools.may_be_a_call(held[o.index]):
                        text = held.pop(o.index)  # not a call: what was held goes out as content
                    else:
                        continue  # may still become a call: hold on
                if text:
                    delta = {"content": text}
                choice = {
                    "index": o.index,
                    "delta": delta,
                    "logprobs": _logprobs(tokenizer, o, o.delta_token_ids, first, k),
                    "finish_reason": finish_reason,
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
