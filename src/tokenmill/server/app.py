"""The FastAPI application: every API's routes, health, metrics, tokenizer endpoints, the request explorer, auth.

Every route declares what it answers (tokenmill/server/schemas.py), so /openapi.json describes the server as it
behaves: errors are 400 (never FastAPI's 422), 401, 404, 413 and 503 in OpenAI's shape.
"""

import asyncio
import json
import threading
from contextlib import aclosing, asynccontextmanager

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from tokenmill import __version__
from tokenmill.server import schemas
from tokenmill.server.agent_routes import add_agent_routes
from tokenmill.server.anthropic import add_anthropic_routes
from tokenmill.server.chat import render_chat
from tokenmill.server.errors import APIError, install_error_handlers
from tokenmill.server.events import engine_snapshot
from tokenmill.server.infill import add_infill_routes
from tokenmill.server.llamacpp import add_llamacpp_routes, llama_tokenize
from tokenmill.server.llamacpp_metrics import llamacpp_metrics_text
from tokenmill.server.lora_routes import add_lora_routes
from tokenmill.server.middleware import install_guards
from tokenmill.server.ollama import add_ollama_routes
from tokenmill.server.openai_routes import ROOT_PATHS, add_openai_routes
from tokenmill.server.responses import add_responses_routes
from tokenmill.server.router_info import add_router_routes
from tokenmill.server.schemas import error_responses
from tokenmill.server.served_model import ServedModel
from tokenmill.server.state import ServerState
from tokenmill.server.tokenize_protocol import DetokenizeRequest, TokenizeRequest
from tokenmill.server.web_assets import STATIC_DIR, add_web_assets
from tokenmill.structured import tools

# with an API key set, these need it (the explorer's page and its files hold no data; the page asks for the key)
PROTECTED_PREFIXES = (
    "/v1/", "/api/", "/tokenize", "/detokenize", "/explorer/", "/infill", "/server_info", "/model_info",
    "/get_load", "/get_server_info", "/get_model_info", "/completion", "/apply-template", "/props", "/slots",
    "/tools", "/cors-proxy", *ROOT_PATHS,
)  # fmt: skip


def create_app(state: ServerState, load_in_background: bool = True) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if state.engine is None and load_in_background:
            threading.Thread(target=_load, args=(state,), name="tokenmill-load", daemon=True).start()
        yield
        if state.engine is not None:
            state.engine.shutdown()

    settings = state.settings
    app = FastAPI(title="tokenmill", lifespan=lifespan)
    app.state.tokenmill = state
    install_error_handlers(app, state.metrics.internal_errors.inc)

    def protected(path: str) -> bool:
        return path.startswith(PROTECTED_PREFIXES) or (settings.metrics_require_key and path == "/metrics")

    install_guards(app, settings, protected)
    with_model = error_responses(400, 401, 404, 413, 503)

    @app.get(
        "/health",
        response_model=schemas.HealthStatus,
        responses={503: {"model": schemas.HealthStatus, "description": "not ready (loading, failed, stopping)"}},
    )
    async def health() -> JSONResponse:
        if state.healthy:
            return JSONResponse({"status": "ok"})
        reason = (
            "shutting down"
            if state.shutting_down
            else (
                f"engine failed: {state.load_error or (state.engine and state.engine.error)}"
                if state.load_error or state.engine is not None
                else "loading"
            )
        )
        return JSONResponse({"status": reason}, status_code=503)

    # load balancers and uptime checks ask with HEAD: the same status, no body (not in the schema: HEAD has none)
    app.head("/health", include_in_schema=False)(health)

    @app.get(
        "/metrics",
        response_class=Response,
        responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}, **error_responses(401, 501)},
    )
    async def metrics() -> Response:
        """tokenmill's metrics (vLLM's names under tokenmill:), then llama-server's (llamacpp:*)."""
        if not settings.metrics:
            raise APIError(
                501,
                "This server does not support metrics endpoint. Start it with `--metrics`",
                "not_supported_error",
            )
        m = state.metrics
        text = generate_latest(m.registry) + llamacpp_metrics_text(m.llama, m.engine_stats()).encode()
        headers = {"Process-Start-Time-Unix": str(m.llama.started_unix)}  # as llama-server's
        return Response(text, media_type=CONTENT_TYPE_LATEST, headers=headers)

    @app.post(
        "/tokenize",
        response_class=Response,
        responses={200: {"model": schemas.TokenizeResponse | schemas.LlamaTokenizeResponse}, **with_model},
    )
    async def tokenize(req: TokenizeRequest) -> Response:
        state.check_model(req.model)
        model = state.require_model()
        if req.content is not None:  # llama.cpp's shape
            if req.prompt is not None or req.messages is not None:
                raise APIError(400, "give one of content, prompt or messages", param="content")
            args = (model, req.content, req.add_special, req.with_pieces)
            return Response(json.dumps(await asyncio.to_thread(llama_tokenize, *args)), media_type="application/json")
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", param="prompt")
        # a long text takes a while to tokenize, and its answer to write: neither on the event loop
        body = await asyncio.to_thread(_tokenize, model, req)
        return Response(body, media_type="application/json")

    @app.post("/detokenize", response_model=schemas.DetokenizeResponse, responses=with_model)
    async def detokenize(req: DetokenizeRequest) -> dict:
        state.check_model(req.model)
        model = state.require_model()
        vocab = model.shape.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token id {bad[0]} is out of vocabulary (ids 0..{vocab - 1})", param="tokens")
        text = await asyncio.to_thread(model.detokenize, req.tokens)
        return {"prompt": text, "content": text}  # vLLM's name, llama.cpp's

    @app.get("/tokenizer_info", response_model=schemas.TokenizerInfo, responses=error_responses(401, 503))
    async def tokenizer_info() -> dict:
        model = state.require_model()
        tok = model.tokenizer
        return {
            "tokenizer_class": "tokenmill.Tokenizer",
            "model": state.model_name,
            "bos_token": tok.bos_token or None,
            "eos_token": tok.eos_token or None,
            "pad_token": tok.eos_token or None,
            "bos_token_id": tok.bos_token_id,
            "eos_token_id": tok.eos_token_id,
            "add_bos_token": tok.add_bos,
            "vocab_size": tok.vocab_size,
            "model_max_length": model.max_model_len,
            "chat_template": model.own_chat_template,
        }

    add_openai_routes(app, state)
    add_lora_routes(app, state)
    add_ollama_routes(app, state)
    add_anthropic_routes(app, state)
    add_responses_routes(app, state)
    add_infill_routes(app, state)
    add_router_routes(app, state)
    add_llamacpp_routes(app, state)
    add_agent_routes(app, state)

    @app.get("/version", response_model=schemas.Version)
    async def version() -> dict:
        return {"version": __version__}

    add_web_assets(app, settings.explorer)
    if settings.explorer:
        _add_explorer(app, state)

    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = _without_422(
                get_openapi(title=app.title, version=app.version, routes=app.routes, description=__doc__)
            )
        return app.openapi_schema

    app.openapi = openapi
    return app


def _add_explorer(app: FastAPI, state: ServerState) -> None:
    @app.get("/explorer/info", response_model=schemas.ExplorerInfo, responses=error_responses(401, 503))
    async def explorer_info() -> dict:
        """What the page needs to turn block counts into bytes, the cache's size, and the engine's state now."""
        engine = state.require_engine()
        model = state.require_model()
        c, config, kv = model.shape, model.config, model.kv_layout()
        return {
            "model": state.model_name,
            "quantization": model.quantization or "none",
            "device": model.device,
            "num_layers": c.num_layers,
            "num_kv_heads": c.num_kv_heads,
            "head_dim": c.head_dim,
            "kv_dtype": kv["kv_dtype"],
            "kv_element_bytes": kv["kv_element_bytes"],
            "kv_scale_bytes": kv["kv_scale_bytes"],
            "block_size": config.block_size,
            "kv_blocks_total": model.kv_blocks_total,
            "kv_bytes_per_block": kv["kv_bytes_per_block"],
            "max_model_len": model.max_model_len,
            "prefix_caching": config.enable_prefix_caching,
            "max_num_batched_tokens": config.max_num_batched_tokens,
            "tensor_parallel_size": config.tensor_parallel_size,
            "chat_template": model.own_chat_template is not None,
            "base_model_note": model.base_model_note,
            "sampling_defaults": model.sampling_defaults(),
            "sampling_defaults_source": model.sampling_defaults_source,
            "engine": engine_snapshot(engine, model),
        }

    @app.get(
        "/explorer/events",
        response_class=StreamingResponse,
        responses={
            200: {"content": {"text/event-stream": {"schema": schemas.SSE_EVENT}}, "description": "never ends"},
            **error_responses(401, 503),
        },
    )
    async def explorer_events() -> StreamingResponse:
        """Server-sent events: one per engine step (the batch, per sequence: request ids, token counts and blocks,
        never prompt text or token ids), and engine stats while idle."""
        state.require_engine()

        async def stream():
            async with aclosing(state.events.subscribe()) as events:
                async for event in events:
                    if state.shutting_down:  # the stream never ends by itself, and uvicorn's shutdown waits for it
                        return
                    yield f"data: {json.dumps(event)}\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")


def _tokenize(model: ServedModel, req: TokenizeRequest) -> bytes:
    """The /tokenize answer as JSON bytes (runs in a worker thread)."""
    tok = model.tokenizer
    if req.messages is not None:  # as the chat endpoint renders them (its tools shown the same way)
        messages = [m.model_dump(exclude_unset=True) for m in req.messages]
        functions = tools.check_tools(req.tools) if req.tools is not None else []
        args = (functions, req.add_generation_prompt, None, req.continue_final_message)
        tokens = model.encode_rendered_chat(render_chat(model, messages, *args))
    else:
        tokens = tok.encode(req.prompt or "", req.add_special_tokens)
    strs = [tok.id_to_token(t) for t in tokens] if req.return_token_strs else None
    out = {"count": len(tokens), "max_model_len": model.max_model_len, "tokens": tokens, "token_strs": strs}
    if req.return_token_texts:
        out["token_texts"] = [tok.decode([t]) for t in tokens]
    return json.dumps(out).encode()


def _without_422(schema: dict) -> dict:
    """FastAPI documents 422 for every body it validates; tokenmill answers those with 400 (OpenAI's status)."""
    for path in schema.get("paths", {}).values():
        for operation in path.values():
            operation.get("responses", {}).pop("422", None)
    components = schema.get("components", {}).get("schemas", {})
    components.pop("HTTPValidationError", None)
    components.pop("ValidationError", None)
    return schema


def _load(state: ServerState) -> None:
    try:
        state.load()
    except BaseException:
        return  # recorded in state.load_error; /health answers 503 and the server exits (serve.py)
