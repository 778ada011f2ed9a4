"""POST /v1/chat/completions: the chat template rendered server-side, streaming or not, with logprobs."""

import asyncio
import dataclasses
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.encoders import jsonable_encoder
from fastapi.responses import JSONResponse

from tokenmill.outputs import CompletionOutput, RequestOutput
from tokenmill.parsers.reply import PROMPT_TAIL_CHARS, ReplyDelta, ReplyFormat, ReplyParser
from tokenmill.parsers.think import ANSWER, BEFORE, start_state
from tokenmill.parsers.think import END as THINK_END
from tokenmill.parsers.think import START as THINK_START
from tokenmill.sampling_params import ThinkingBudget
from tokenmill.server.beam_search_fields import beam_search_params
from tokenmill.server.errors import APIError
from tokenmill.server.generation import Generation
from tokenmill.server.logprobs_format import LogprobsShape, chat_logprobs, prompt_logprobs_json
from tokenmill.server.neutral_request import NeutralRequest
from tokenmill.server.protocol import ChatCompletionRequest
from tokenmill.server.request_ids import call_id, echo
from tokenmill.server.served_model import ServedModel
from tokenmill.server.state import ServerState
from tokenmill.server.stream_or_collect import aborted_error, collected, openai_usage, streamed, usage_so_far
from tokenmill.structured import StructuredOutputsParams, tools
from tokenmill.tokenizer import Tokenizer


@dataclass
class ChatCall:
    """A chat's engine requests, started: every chat API (OpenAI's, Ollama's, Anthropic's, Responses) translates
    its request into this one call and formats what comes out, each choice read back by a reply_parser()."""

    generation: Generation
    functions: list[dict]  # the functions the reply may call
    format: ReplyFormat  # how the model writes its thinking and its calls
    prompt_tail: str  # the end of the rendered prompt
    tokenizer: Tokenizer  # the model's: a reply is read one token at a time
    required: bool = False  # tool_choice required or named: the reply is a call
    parsers: list[ReplyParser] = field(default_factory=list)  # choice i's is the i-th reply_parser() made

    def __post_init__(self) -> None:
        self.generation.reported_finish = self.finish_reason  # the call's log line says what the API said

    @property
    def forced_name(self) -> str | None:
        """The one function tool_choice names (a cut-off call keeps its name)."""
        return self.functions[0]["name"] if self.required and len(self.functions) == 1 else None

    def reply_parser(self) -> ReplyParser:
        """The next choice's reply parser (one per choice, made in choice order)."""
        parser = ReplyParser(self.format, self.prompt_tail, self.functions, self.forced_name, self.tokenizer)
        self.parsers.append(parser)
        return parser

    def finish_reason(self, o: CompletionOutput) -> str | None:
        """OpenAI's finish reason for a choice's output: "tool_calls" where its reply called (and was not cut)."""
        parser = self.parsers[o.index] if o.index < len(self.parsers) else None
        if o.finish_reason == "stop" and parser is not None and parser.calls:
            return "tool_calls"
        return o.finish_reason


async def start_chat(
    state: ServerState,
    request_id: str,
    endpoint: str,
    messages: list[dict],
    request: NeutralRequest,
    tool_list: list[dict] | None = None,
    tool_choice: str | dict | None = None,
    add_generation_prompt: bool = True,
    http_request: Request | None = None,
    template_kwargs: dict | None = None,
    thinking_budget: int | None = None,
    continue_final_message: bool = False,
) -> ChatCall:
    """Check the tools (OpenAI's shape), render the chat template and start generating `request` (Generation
    settles its max_tokens, as every API's); raises the 400s. `http_request`: its client leaving while the call
    starts aborts it (ClientDisconnected). `template_kwargs`: the template's other variables (enable_thinking,
    reasoning_effort); `thinking_budget`: at most this many tokens of thinking (Anthropic's budget_tokens, vLLM's
    thinking_token_budget; <think> models), then the sampler closes the block; `continue_final_message`: the final
    message is left open for the reply to go on with (vLLM's)."""
    model = state.require_model()
    fmt = state.reply_format()
    params = request.params
    functions = tools.check_tools(tool_list) if tool_list is not None else []
    mode, callable_functions = tools.chosen_functions(functions, tool_choice)
    if functions:  # every function's parameters must compile, whatever tool_choice says
        call = StructuredOutputsParams(json=tools.call_schema(functions), source="tools")
        await asyncio.to_thread(model.compile_constraint, call)
    if mode == "required" and params.structured_outputs is not None:
        raise APIError(
            400,
            "tool_choice 'required' or a named function cannot be combined with response_format or structured_outputs",
            param="tool_choice",
        )
    # rendering and tokenizing a long conversation takes a while: not on the event loop
    # a chat too long for the context is cut, not refused (a beam search takes no truncation)
    truncated = getattr(params, "truncate_prompt_tokens", None) is not None
    text = await asyncio.to_thread(
        render_chat,
        model,
        messages,
        callable_functions,
        add_generation_prompt,
        template_kwargs,
        continue_final_message,
        truncated,
    )
    prompt_ids = await asyncio.to_thread(model.encode_rendered_chat, text)
    tail = text[-PROMPT_TAIL_CHARS:]
    thinking = start_state(tail) if fmt.reasoning == "think" else ANSWER
    if mode == "required":  # the reply is a call in the model's own syntax, enforced by a grammar
        special = fmt.tools == "harmony" and _special_markers(model.tokenizer)
        fmt, call = call_constraint(fmt, callable_functions, thinking, special)
        params = dataclasses.replace(params, structured_outputs=call)
    elif params.structured_outputs is not None and thinking != ANSWER:  # the constraint is on the answer only
        params = dataclasses.replace(
            params, structured_outputs=dataclasses.replace(params.structured_outputs, thinking=thinking)
        )
    if thinking_budget is not None and fmt.reasoning == "think" and thinking != ANSWER:
        encode = model.tokenizer.encode
        opening = encode(THINK_START) if thinking == BEFORE else None
        params = dataclasses.replace(
            params, thinking_budget=ThinkingBudget(thinking_budget, encode(THINK_END), opening)
        )
    if fmt.keeps_special_tokens:  # harmony's markers are special tokens: its parser reads them
        params = dataclasses.replace(params, skip_special_tokens=False)
    prompt = [{"prompt_token_ids": prompt_ids}]
    generation = Generation(state, prompt, request.with_params(params), request_id, endpoint)
    await generation.start(http_request)
    return ChatCall(generation, callable_functions, fmt, tail, model.tokenizer, mode == "required")


# a call's syntax as text around its JSON: (before, after, the key of its arguments)
CALL_SYNTAX = {
    "hermes": ("<tool_call>\n", "\n</tool_call>", "arguments"),
    "llama3_json": ("", "", "parameters"),
    "mistral": ("[TOOL_CALLS][", "]", "arguments"),
}


def require_thinking(state: ServerState, asked: bool, param: str) -> None:
    """A request that asks a model to think (Ollama's think, Anthropic's thinking or effort, a Responses
    reasoning effort): 400 naming `param` when the model's chat template has no thinking (as Ollama answers)."""
    if asked and not state.reply_format().reasoning:
        raise APIError(
            400,
            f"{state.model_name} does not think (its chat template has no reasoning): {param} asks it to",
            param=param,
        )


def call_constraint(
    fmt: ReplyFormat, functions: list[dict], thinking: str, special_markers: bool = False
) -> tuple[ReplyFormat, StructuredOutputsParams]:
    """A required call, as the grammar that enforces it: in the model's own syntax where tokenmill writes its
    grammar (hermes, llama3_json, mistral: after any thinking; harmony: one function's call after any analysis,
    `special_markers` when the tokenizer's markers are special tokens), else tokenmill's constrained JSON (which the
    reply is then read as: harmony's choice among several functions)."""
    if fmt.tools == "harmony" and len(functions) == 1:
        header = f"<|channel|>commentary to=functions.{functions[0]['name']} <|constrain|>json<|message|>"
        arguments = tools.closed_objects(functions[0]["parameters"])
        return fmt, StructuredOutputsParams(
            json=arguments, wrap=(header, ""), thinking="harmony", special_markers=special_markers, source="tool_choice"
        )
    if fmt.tools in CALL_SYNTAX:
        before, after, key = CALL_SYNTAX[fmt.tools]
        schema = tools.call_schema(functions, key)
        wrap = (before, after) if before or after else None
        return fmt, StructuredOutputsParams(
            json=schema, wrap=wrap, thinking=None if thinking == ANSWER else thinking, source="tool_choice"
        )
    call = StructuredOutputsParams(json=tools.call_schema(functions), source="tool_choice")
    return dataclasses.replace(fmt, tools="constrained"), call


def _special_markers(tokenizer: Tokenizer) -> bool:
    """Whether harmony's markers are special tokens of this tokenizer (gpt-oss's), as a grammar must name them."""
    token = tokenizer.backend.token_to_id("<|channel|>")
    added = tokenizer.backend.get_added_tokens_decoder().get(token) if token is not None else None
    return bool(added is not None and added.special)


def render_chat(
    model: ServedModel,
    messages: list[dict],
    functions: list[dict],
    add_generation_prompt: bool = True,
    template_kwargs: dict | None = None,
    continue_final_message: bool = False,
    truncated: bool = False,
) -> str:
    """The conversation's prompt text: the chat template over it, with the functions the model may call shown (by
    a template that takes tools, else in a system message), and earlier turns' thinking under the names the
    templates read (Qwen3's reasoning_content, gpt-oss's thinking). `continue_final_message`: the final message left
    open; `truncated`: the request cuts its prompt, so a chat too long for the context is no 400."""
    takes_tools = model.template_takes_tools
    messages = [template_message(m) for m in tools.template_messages(messages, functions, takes_tools)]
    template_tools = [{"type": "function", "function": f} for f in functions] if takes_tools else None
    return model.render_chat(
        messages, add_generation_prompt, template_tools, template_kwargs, continue_final_message, truncated
    )


def chat_prompt(
    model: ServedModel,
    messages: list[dict],
    functions: list[dict],
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> list[int]:
    """The conversation's prompt tokens (render_chat, tokenized)."""
    text = render_chat(model, messages, functions, add_generation_prompt, None, continue_final_message)
    return model.encode_rendered_chat(text)


THINKING_KEYS = ("reasoning_content", "reasoning", "thinking")


def template_message(message: dict) -> dict:
    """An assistant message as the templates read it: its thinking under each name they use, its calls'
    arguments as objects (gpt-oss's writes them with tojson; Qwen3's takes either), as vLLM hands them over."""
    if message.get("role") != "assistant":
        return message
    thinking = next((message[k] for k in THINKING_KEYS if isinstance(message.get(k), str)), None)
    if thinking is not None:
        message = {**message, **{k: thinking for k in THINKING_KEYS}}
    calls = message.get("tool_calls")
    if isinstance(calls, list):
        message = {**message, "tool_calls": [_call_for_template(c) for c in calls]}
    return message


def _call_for_template(call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    arguments = function.get("arguments") if isinstance(function, dict) else None
    if not isinstance(arguments, str):
        return call
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return call
    return {**call, "function": {**function, "arguments": parsed}}


# the engine's parameters chat sends under other names, for its 400s (the engine's logprobs is chat's top_logprobs)
CHAT_FIELD_NAMES = {"logprobs": "top_logprobs"}


async def create_chat_completion(req: ChatCompletionRequest, http_request: Request, state: ServerState):
    client_id, request_id = call_id(http_request, "chatcmpl")
    lora = state.adapter_for(req.model)
    model = state.require_model()
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    k = req.sampled_logprobs()
    shape = LogprobsShape(k, bool(req.logprob_token_ids), req.return_tokens_as_token_ids) if k is not None else None
    if req.use_beam_search:  # vLLM's beam search: n beams, a stream sends them whole once found
        params = beam_search_params(req, model.sampling_defaults())
    else:
        params = req.sampling_params(model.sampling_defaults())
    chat = await start_chat(
        state,
        request_id,
        "/v1/chat/completions",
        req.message_dicts(),
        NeutralRequest(params, req.output_length(), CHAT_FIELD_NAMES, lora),
        req.tools,
        req.tool_choice,
        req.add_generation_prompt,
        http_request=http_request,
        template_kwargs=req.template_kwargs(),
        thinking_budget=req.thinking_budget(),
        continue_final_message=req.continue_final_message,
    )
    created = int(time.time())
    tokenizer = model.tokenizer
    replies = Replies(chat, req.n)
    if req.stream:
        events = _stream(chat.generation, req, tokenizer, state, request_id, created, shape, replies)
        return streamed(state, chat.generation, events, echo(client_id))
    (final,) = await collected(state, chat.generation, http_request, lambda _, out: replies.feed(out))
    choices = []
    echoed = req.echoed()
    for o in final.outputs:
        reply = replies.parsers[o.index]
        # with calls: content null, as OpenAI's; "" for a call tool_choice required (vLLM's, which its suite reads)
        content = reply.text if reply.text or not reply.calls else ("" if chat.required else None)
        if echoed:
            content = echoed + (content or "")
        message: dict = {"role": "assistant", "content": content}
        if chat.format.reasoning and req.include_reasoning:
            message["reasoning_content"] = message["reasoning"] = reply.thinking or None
        if reply.calls:
            message["tool_calls"] = [c.as_openai() for c in reply.calls]
        choices.append(
            {
                "index": o.index,
                "message": message,
                "logprobs": _logprobs(tokenizer, o, o.token_ids, 0, shape),
                "finish_reason": chat.finish_reason(o),
                **({"token_ids": o.token_ids} if req.return_token_ids else {}),
            }
        )
    response = {
        "id": request_id,
        "object": "chat.completion",
        "created": created,
        "model": state.reply_model(req.model),
        "system_fingerprint": state.system_fingerprint,
        "choices": choices,
        "usage": replies.usage(final),
        "prompt_logprobs": prompt_logprobs_json(final.prompt_logprobs),  # vLLM's (null unless asked)
    }
    if req.return_token_ids:
        response["prompt_token_ids"] = final.prompt_token_ids
    return JSONResponse(jsonable_encoder(response), headers=echo(client_id))  # as FastAPI encodes a dict


class Replies:
    """The reply parser of each choice of a call, fed its outputs' deltas as they come (stream or not)."""

    def __init__(self, chat: ChatCall, n: int = 1):
        self.chat = chat
        self.parsers = [chat.reply_parser() for _ in range(n)]
        self._fed: set[int] = set()  # choices whose finish was fed

    def feed(self, out: RequestOutput) -> dict[int, ReplyDelta]:
        """Each choice's delta from this output (choices with nothing new are left out)."""
        deltas = {}
        for o in out.outputs:
            finished = o.finish_reason is not None
            if o.index in self._fed or not (o.delta_text or o.delta_token_ids or finished):
                continue
            if finished:
                self._fed.add(o.index)
            deltas[o.index] = self.parsers[o.index].feed_output(o)
        return deltas

    def usage(self, final: RequestOutput) -> dict:
        completion_tokens = sum(len(o.token_ids) for o in final.outputs)
        usage = openai_usage(len(final.prompt_token_ids), completion_tokens, final.num_cached_tokens)
        if self.chat.format.reasoning:
            reasoning = sum(p.thinking_tokens for p in self.parsers)
            usage["completion_tokens_details"] = {"reasoning_tokens": reasoning}
        return usage


def _logprobs(
    tokenizer: Tokenizer, o: CompletionOutput, token_ids: list[int], first: int, shape: LogprobsShape | None
) -> dict | None:
    if shape is None:
        return None
    positions = (o.logprobs or [])[first : first + len(token_ids)]
    return {"content": chat_logprobs(tokenizer, token_ids, positions, shape)}


def delta_of(reply: ReplyDelta, calls_before: int, reasoning: bool) -> dict:
    """A chat.completion.chunk's delta for what a reply's output added (calls numbered from calls_before)."""
    delta: dict = {}
    if reply.thinking and reasoning:
        delta["reasoning_content"] = delta["reasoning"] = reply.thinking
    if reply.text:
        delta["content"] = reply.text
    if reply.calls:
        delta["tool_calls"] = [{"index": calls_before + j, **c.as_openai()} for j, c in enumerate(reply.calls)]
    return delta


async def _stream(
    generation: Generation,
    req: ChatCompletionRequest,
    tokenizer: Tokenizer,
    state: ServerState,
    request_id: str,
    created: int,
    shape: LogprobsShape | None,
    replies: Replies,
) -> AsyncIterator[str]:
    """Each choice's thinking, text and calls as its reply parser lets them out: text that may still be a tag or
    the start of a call is held back; a call goes out as one tool_calls delta once it is complete."""
    head = {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": state.reply_model(req.model),
        "system_fingerprint": state.system_fingerprint,
    }
    extra = {"usage": None} if req.include_usage else {}
    reasoning = bool(replies.chat.format.reasoning) and req.include_reasoning
    prompt_token_ids = generation.prompts[0]["prompt_token_ids"]

    def chunk(choices: list[dict], completion_tokens: int = 0, top: dict | None = None) -> str:
        # continuous_usage_stats: each chunk has the usage so far (of its choice: one choice per chunk)
        usage = {"usage": usage_so_far(len(prompt_token_ids), completion_tokens)} if req.continuous_usage else extra
        return f"data: {json.dumps({**head, 'choices': choices, **usage, **(top or {})})}\n\n"

    roles = [
        {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        for i in range(req.n)
    ]
    # return_token_ids: the prompt's ids at the top of the first chunk only, as vLLM's stream has them
    prompt_ids = {"prompt_token_ids": prompt_token_ids} if req.return_token_ids else {}
    yield chunk(roles, top=prompt_ids)
    echoed = req.echoed()
    if echoed:  # echo: the final message's text first, as vLLM's stream sends it
        for i in range(req.n):
            yield chunk([{"index": i, "delta": {"content": echoed}, "logprobs": None, "finish_reason": None}])
    final: RequestOutput | None = None
    try:
        async for _, out in generation.stream():
            final = out
            if any(o.finish_reason == "abort" for o in out.outputs):
                yield aborted_error(state, "aborted").sse()
                yield "data: [DONE]\n\n"
                return
            by_index = {o.index: o for o in out.outputs}
            calls_before = {i: len(p.calls) for i, p in enumerate(replies.parsers)}
            for index, reply in replies.feed(out).items():
                o = by_index[index]
                finish_reason = replies.chat.finish_reason(o)
                delta = delta_of(reply, calls_before[index], reasoning)
                if not delta and finish_reason is None and not (req.return_token_ids or shape is not None):
                    continue  # nothing to show yet (held back)
                first = len(o.token_ids) - len(o.delta_token_ids)
                choice = {
                    "index": index,
                    "delta": delta,
                    "logprobs": _logprobs(tokenizer, o, o.delta_token_ids, first, shape),
                    "finish_reason": finish_reason,
                }
                if req.return_token_ids:
                    choice["token_ids"] = list(o.delta_token_ids)
                yield chunk([choice], len(o.token_ids))
    except APIError as exc:
        yield exc.sse()
        yield "data: [DONE]\n\n"
        return
    if req.include_usage and final is not None:
        yield f"data: {json.dumps({**head, 'choices': [], 'usage': replies.usage(final)})}\n\n"
    yield "data: [DONE]\n\n"
