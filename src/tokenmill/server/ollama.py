"""Ollama's API (what Open WebUI, editors and the `ollama` Python client speak): /api/chat, /api/generate,
/api/embed (and the older /api/embeddings), /api/tags, /api/show, /api/ps and /api/version.

Each endpoint translates its request onto the engine call the OpenAI endpoints make (chat.start_chat, Generation)
and writes Ollama's answer: streamed as newline-delimited JSON unless `"stream": false`, times in nanoseconds,
errors as {"error": message}. The served model answers to its name, with or without Ollama's ":latest" tag.
"""

import asyncio
import json
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from tokenmill import __version__
from tokenmill.outputs import CompletionOutput, RequestOutput
from tokenmill.parsers.reply import PROMPT_TAIL_CHARS, ReplyDelta, ReplyFormat, ReplyParser
from tokenmill.pooling_params import PoolingParams
from tokenmill.server.chat import render_chat, require_thinking, start_chat
from tokenmill.server.errors import APIError
from tokenmill.server.generation import Generation
from tokenmill.server.neutral_request import NeutralRequest
from tokenmill.server.ollama_protocol import (
    ChatRequest,
    EmbedRequest,
    GenerateRequest,
    GenerationRequest,
    LegacyEmbeddingsRequest,
    ShowRequest,
)
from tokenmill.server.request_ids import call_id
from tokenmill.server.schemas import OllamaError, answers, error_responses
from tokenmill.server.state import ServerState
from tokenmill.server.stream_or_collect import NDJSON, SHUTDOWN_ERROR, aborted_error, collected, streamed

OLLAMA_API_VERSION = "0.12.0"  # the Ollama release whose API shapes these endpoints follow
TAG = ":latest"


def errors(*statuses: int) -> dict:
    return error_responses(*statuses, model=OllamaError)


def add_ollama_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/api/version", responses={**answers("the Ollama API version followed"), **errors(401)})
    async def version() -> dict:
        return {"version": OLLAMA_API_VERSION, "tokenmill": __version__}

    @app.get("/api/tags", responses={**answers("the served model, as Ollama lists models"), **errors(401, 503)})
    async def tags() -> dict:
        return {"models": [_model_entry(state)]}

    @app.get("/api/ps", responses={**answers("the loaded model"), **errors(401, 503)})
    async def ps() -> dict:
        entry = _model_entry(state)
        model = state.require_model()
        on_gpu = model.on_gpu
        return {
            "models": [
                {
                    **entry,
                    "expires_at": "2318-01-01T00:00:00Z",  # loaded for the server's life (Ollama's "forever")
                    "size_vram": entry["size"] if on_gpu else 0,
                    "context_length": model.max_model_len,
                }
            ]
        }

    @app.post("/api/show", responses={**answers("the model's details"), **errors(400, 401, 404, 413, 503)})
    async def show(req: ShowRequest, request: Request) -> dict:
        name = req.model or req.name
        if name is None:
            raise APIError(400, "model is required", param="model")
        check_model(state, name)
        return _show(state, state.shown_path(request))

    @app.post("/api/chat", responses={**answers("the reply", NDJSON), **errors(400, 401, 404, 413, 503)})
    async def chat(req: ChatRequest, request: Request):
        return await _chat(req, request, state)

    @app.post("/api/generate", responses={**answers("the completion", NDJSON), **errors(400, 401, 404, 413, 503)})
    async def generate(req: GenerateRequest, request: Request):
        return await _generate(req, request, state)

    @app.post("/api/embed", responses={**answers("the vectors"), **errors(400, 401, 404, 413, 503)})
    async def embed(req: EmbedRequest, request: Request) -> dict:
        check_model(state, req.model)
        inputs = [req.input] if isinstance(req.input, str) else req.input
        params = PoolingParams(dimensions=req.dimensions)
        finals, seconds = await _embeddings(state, request, inputs, params, req.truncate, "/api/embed")
        return {
            "model": req.model,
            "embeddings": [f.embedding for f in finals],
            "total_duration": _ns(seconds),
            "load_duration": 0,
            "prompt_eval_count": sum(len(f.prompt_token_ids) for f in finals),
        }

    @app.post("/api/embeddings", responses={**answers("the vector"), **errors(400, 401, 404, 413, 503)})
    async def embeddings(req: LegacyEmbeddingsRequest, request: Request) -> dict:
        """The older endpoint: one prompt, its vector not normalized (as Ollama's)."""
        check_model(state, req.model)
        if not req.prompt:
            return {"embedding": []}
        params = PoolingParams(normalize=False)
        (final,), _ = await _embeddings(state, request, [req.prompt], params, True, "/api/embeddings")
        return {"embedding": final.embedding}


def adapter_of(state: ServerState, name: str) -> str | None:
    """The LoRA adapter `name` chooses (with or without ":latest"), as Ollama's ADAPTER models are chosen by name."""
    model = state.model
    adapters = {a.name for a in model.lora_adapters()} if model is not None else set()
    return next((n for n in (name, name.removesuffix(TAG)) if n in adapters), None)


def check_model(state: ServerState, name: str, adapters: bool = False) -> None:
    """404 unless `name` is the served model's (or, with `adapters`, one of its LoRA adapters: chat and generate)."""
    state.require_engine()
    if adapters and adapter_of(state, name) is not None:
        return
    if name not in [n + tag for n in state.model_names for tag in ("", TAG)]:
        raise APIError(404, f"model '{name}' not found; this server serves '{state.model_name}'", param="model")


# ---- chat and generate ------------------------------------------------------------------------------------------


async def _chat(req: ChatRequest, http_request: Request, state: ServerState):
    check_model(state, req.model, adapters=True)
    req.refuse_unsupported()
    if not req.messages or _loads_only(req):  # Ollama's way to load a model: nothing is generated
        return _loaded(req, {"message": {"role": "assistant", "content": ""}})
    _, request_id = call_id(http_request, "ollama-chat")
    require_thinking(state, req.think not in (None, False), "think")
    chat = await start_chat(
        state,
        request_id,
        "/api/chat",
        [m.as_chat_message() for m in req.messages],
        _neutral(req, state),
        req.tools or None,  # the ollama client sends [] for none
        "auto" if req.tools else None,
        http_request=http_request,
        template_kwargs=req.template_kwargs(),
    )
    reply = _Reply(req.model, chat.reply_parser(), as_chat=True, show_thinking=req.think is not False)
    return await _respond(req, http_request, state, chat.generation, reply)


async def _generate(req: GenerateRequest, http_request: Request, state: ServerState):
    check_model(state, req.model, adapters=True)
    req.refuse_unsupported()
    if not req.prompt or _loads_only(req):
        return _loaded(req, {"response": ""})
    _, request_id = call_id(http_request, "ollama-gen")
    require_thinking(state, req.think not in (None, False) and not req.raw, "think")
    model = state.require_model()
    tail = ""
    if req.raw:
        ids = await asyncio.to_thread(model.encode_prompt, req.prompt)
    else:  # the model's chat template, as Ollama renders its own template over System and Prompt
        system = [{"role": "system", "content": req.system}] if req.system else []
        messages = [*system, {"role": "user", "content": req.prompt}]
        text = await asyncio.to_thread(render_chat, model, messages, [], True, req.template_kwargs())
        ids = await asyncio.to_thread(model.encode_rendered_chat, text)
        tail = text[-PROMPT_TAIL_CHARS:]
    ids = list(req.context or []) + ids  # the previous exchange, continued
    generation = Generation(state, [{"prompt_token_ids": ids}], _neutral(req, state), request_id, "/api/generate")
    await generation.start(http_request)
    parser = ReplyParser(ReplyFormat("", "constrained"))  # raw text: nothing to split
    if not req.raw:  # the chat template's reply: its thinking apart
        parser = ReplyParser(state.reply_format(), tail, tokenizer=model.tokenizer)
    reply = _Reply(req.model, parser, as_chat=False, show_thinking=req.think is not False)
    return await _respond(req, http_request, state, generation, reply)


def _loads_only(req: GenerationRequest) -> bool:
    return req.num_predict() == 0


def _loaded(req: GenerationRequest, body: dict) -> JSONResponse:
    return JSONResponse({"model": req.model, "created_at": _now(), **body, "done": True, "done_reason": "load"})


def _neutral(req: GenerationRequest, state: ServerState) -> NeutralRequest:
    """The options over the model's defaults; num_predict and num_ctx as the output's length (Generation settles
    it, num_ctx included, as every API's)."""
    params = req.sampling_params(state.require_model().sampling_defaults())
    return NeutralRequest(params, req.output_length(), lora_name=adapter_of(state, req.model))


class _Reply:
    """One request's Ollama output: chat messages (with thinking and tool calls) or generate's responses."""

    def __init__(self, model: str, parser: ReplyParser, as_chat: bool, show_thinking: bool = True):
        self.model = model
        self.as_chat = as_chat
        self.parser = parser  # text held back while it may still be a tag or a tool call
        self.show_thinking = show_thinking  # think: false drops what thinking a model still does

    def chunk(self, delta: ReplyDelta) -> dict:
        body: dict[str, Any] = {"model": self.model, "created_at": _now()}
        thinking = delta.thinking if self.show_thinking else ""
        if self.as_chat:
            message: dict[str, Any] = {"role": "assistant", "content": delta.text}
            if thinking:
                message["thinking"] = thinking
            if delta.calls:
                message["tool_calls"] = [
                    {"function": {"name": c.name, "arguments": _arguments(c.arguments)}} for c in delta.calls
                ]
            body["message"] = message
        else:
            body["response"] = delta.text
            if thinking:
                body["thinking"] = thinking
        return body

    def delta(self, text: str, finish_reason: str | None = None, tokens: int = 0) -> ReplyDelta:
        return self.parser.feed(text, finish_reason is not None, finish_reason == "length", tokens)

    def delta_of(self, o: CompletionOutput) -> ReplyDelta:
        return self.parser.feed_output(o)

    def final(self, out: RequestOutput, delta: ReplyDelta) -> dict:
        m = out.metrics
        o = out.outputs[0]
        end = m.finished_time or time.monotonic()
        first = m.first_token_time or end
        body = {
            **self.chunk(delta),
            "done": True,
            "done_reason": "stop" if o.finish_reason in ("stop", None) else o.finish_reason,
            "total_duration": _ns(end - m.arrival_time),
            "load_duration": 0,
            "prompt_eval_count": len(out.prompt_token_ids),
            "prompt_eval_duration": _ns(first - (m.first_scheduled_time or m.arrival_time)),
            "eval_count": len(o.token_ids),
            "eval_duration": _ns(end - first),
        }
        if not self.as_chat:
            body["context"] = out.prompt_token_ids + o.token_ids
        return body


def _arguments(text: str) -> Any:
    """A call's arguments as Ollama carries them (an object; a call cut off keeps its text)."""
    try:
        return json.loads(text)
    except ValueError:
        return text


async def _respond(req: GenerationRequest, http_request: Request, state: ServerState, generation: Generation, reply):
    if req.stream:
        events = _lines(generation, reply, state)
        return streamed(state, generation, events, None, lambda e: _line(e.body("/api/")), NDJSON)
    (final,) = await collected(state, generation, http_request, lambda _, out: reply.delta_of(out.outputs[0]))
    p = reply.parser
    return JSONResponse(reply.final(final, ReplyDelta(p.thinking, p.text, p.calls)))


async def _lines(generation: Generation, reply: _Reply, state: ServerState) -> AsyncIterator[str]:
    try:
        async for _, out in generation.stream():
            o = out.outputs[0]
            if o.finish_reason == "abort":
                error = aborted_error(state, "aborted")
                yield _line(error.body("/api/"))
                return
            delta = reply.delta_of(o)
            if o.finish_reason is not None:
                yield _line(reply.final(out, delta))
            elif delta.text or delta.calls or (delta.thinking and reply.show_thinking):
                yield _line({**reply.chunk(delta), "done": False})
    except APIError as exc:
        yield _line(exc.body("/api/"))


# ---- embeddings -------------------------------------------------------------------------------------------------


async def _embeddings(
    state: ServerState, http_request: Request, inputs: list[str], params: PoolingParams, truncate: bool, endpoint: str
) -> tuple[list[RequestOutput], float]:
    _, request_id = call_id(http_request, "ollama-embed")
    model = state.require_model()
    limit = model.max_model_len - 1

    def tokenized() -> list[dict]:
        tokenizer = model.tokenizer
        ids = [tokenizer.encode(text, add_special_tokens=True) for text in inputs]
        if not truncate and any(len(i) > limit for i in ids):
            too_long = next(len(i) for i in ids if len(i) > limit)
            raise APIError(400, f"an input has {too_long} tokens, more than the context's {limit}", param="input")
        return [{"prompt_token_ids": i[:limit]} for i in ids]

    start = time.monotonic()
    prompts = await asyncio.to_thread(tokenized)
    generation = Generation(state, prompts, NeutralRequest(params), request_id, endpoint)
    await generation.start(http_request)
    finals = await generation.collect(http_request)  # a client that leaves: ClientDisconnected, answered 499
    if any(f.embedding is None for f in finals):
        raise SHUTDOWN_ERROR
    return finals, time.monotonic() - start


# ---- the model --------------------------------------------------------------------------------------------------


def _model_entry(state: ServerState) -> dict:
    facts = state.require_model().facts
    name = state.model_name + TAG
    return {
        "name": name,
        "model": name,
        "modified_at": datetime.fromtimestamp(facts.modified_time, UTC).isoformat().replace("+00:00", "Z"),
        "size": facts.size_bytes,
        "digest": facts.digest,
        "details": _details(state),
    }


def _details(state: ServerState) -> dict:
    return model_details(state.require_model().facts)


def model_details(facts) -> dict:
    """Ollama's `details` of a model from its facts (the loaded model's, or the router's read from its file)."""
    return {
        "parent_model": "",
        "format": facts.format,
        "family": facts.architecture,
        "families": [facts.architecture],
        "parameter_size": facts.parameter_size,
        "quantization_level": facts.quantization,
    }


def _show(state: ServerState, shown_path: str) -> dict:
    model = state.require_model()
    facts, c = model.facts, model.shape
    defaults = model.sampling_defaults()
    parameters = "\n".join(f"{name} {value}" for name, value in defaults.items())
    template = model.own_chat_template or ""
    arch = facts.architecture
    capabilities = ["completion", "tools", "embedding"]
    return {
        "modelfile": f"# served by tokenmill {__version__}\nFROM {shown_path}\n"
        + "".join(f"PARAMETER {line}\n" for line in parameters.splitlines()),
        "parameters": parameters,
        "template": template,
        "details": _details(state),
        "model_info": {
            "general.architecture": arch,
            "general.parameter_count": facts.parameter_count,
            f"{arch}.context_length": model.max_model_len,
            f"{arch}.embedding_length": c.hidden_size,
            f"{arch}.block_count": c.num_layers,
            f"{arch}.attention.head_count": c.num_heads,
            f"{arch}.attention.head_count_kv": c.num_kv_heads,
            f"{arch}.vocab_size": c.vocab_size,
        },
        "capabilities": capabilities,
        "modified_at": _model_entry(state)["modified_at"],
    }


def _now() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def _ns(seconds: float) -> int:
    return max(0, int(seconds * 1e9))


def _line(body: dict) -> str:
    return json.dumps(body, ensure_ascii=True) + "\n"
