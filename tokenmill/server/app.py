"""The FastAPI application: OpenAI endpoints, health, metrics, tokenizer endpoints, auth."""

import hmac
import json
import logging
import threading
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.types import ASGIApp, Receive, Scope, Send

from tokenmill.server.chat import create_chat_completion
from tokenmill.server.completions import create_completion
from tokenmill.server.errors import APIError, install_error_handlers
from tokenmill.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from tokenmill.server.state import ServerState

logger = logging.getLogger(__name__)

PROTECTED_PREFIXES = ("/v1/", "/tokenize", "/detokenize")
STATIC_DIR = Path(__file__).with_name("static")  # the request explorer: plain HTML, CSS and JavaScript


def create_app(state: ServerState, load_in_background: bool = True) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if state.engine is None and load_in_background:
            threading.Thread(target=_load, args=(state,), name="tokenmill-load", daemon=True).start()
        yield
        if state.engine is not None:
            state.engine.shutdown()

    app = FastAPI(title="tokenmill", lifespan=lifespan)
    app.state.tokenmill = state
    install_error_handlers(app)

    @app.middleware("http")
    async def guard(request: Request, call_next):
        path = request.url.path
        key = state.settings.api_key
        if key and path.startswith(PROTECTED_PREFIXES):
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
                return APIError(
                    401, "Incorrect API key provided; send it as 'Authorization: Bearer <key>'", code="invalid_api_key"
                ).response()
        return await call_next(request)

    @app.get("/health")
    async def health() -> Response:
        if state.healthy:
            return Response(status_code=200)
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

    @app.get("/v1/models")
    async def models() -> dict:
        engine = state.require_engine()
        return {
            "object": "list",
            "data": [
                {
                    "id": state.model_name,
                    "object": "model",
                    "created": state.created,
                    "owned_by": "tokenmill",
                    "root": state.model_path,
                    "max_model_len": engine.engine.max_model_len,
                }
            ],
        }

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        return await create_completion(req, request, state)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request):
        return await create_chat_completion(req, request, state)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> dict:
        state.check_model(req.model)
        engine = state.require_engine().engine
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", param="prompt")
        if req.messages is not None:
            tokens = engine.encode_chat(req.messages, req.add_generation_prompt)
        else:
            tokens = engine.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        strs = [engine.tokenizer.id_to_token(t) for t in tokens] if req.return_token_strs else None
        out = {"count": len(tokens), "max_model_len": engine.max_model_len, "tokens": tokens, "token_strs": strs}
        if req.return_token_texts:
            out["token_texts"] = [engine.tokenizer.decode([t]) for t in tokens]
        return out

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> dict:
        state.check_model(req.model)
        engine = state.require_engine().engine
        vocab = engine.model_config.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside the vocabulary 0..{vocab - 1}", param="tokens")
        return {"prompt": engine.tokenizer.decode(req.tokens)}

    @app.get("/", include_in_schema=False)
    async def explorer_page() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html")

    @app.get("/explorer/info")
    async def explorer_info() -> dict:
        """What the page needs to turn block counts into bytes, and the cache's size."""
        engine = state.require_engine().engine
        c = engine.model_config
        runner = engine.runner
        return {
            "model": state.model_name,
            "quantization": engine.quantization or "none",
            "device": str(engine.device),
            "num_layers": c.num_layers,
            "num_kv_heads": c.num_kv_heads,
            "head_dim": c.head_dim,
            "kv_dtype": str(runner.dtype).removeprefix("torch."),
            "kv_element_bytes": runner.dtype.itemsize,
            "block_size": engine.config.block_size,
            "kv_blocks_total": engine.block_manager.num_blocks,
            "kv_bytes_per_block": runner.kv_bytes_per_block(),
            "max_model_len": engine.max_model_len,
            "prefix_caching": engine.config.enable_prefix_caching,
            "max_num_batched_tokens": engine.config.max_num_batched_tokens,
            "chat_template": not engine.chat_template.is_fallback,
        }

    @app.get("/explorer/events")
    async def explorer_events() -> StreamingResponse:
        """Server-sent events: one per engine step (the batch, per sequence), and engine stats while idle."""
        state.require_engine()

        async def stream():
            async for event in state.events.subscribe():
                yield f"data: {json.dumps(event)}\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict:
        engine = state.require_engine().engine
        tok = engine.tokenizer
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
            "model_max_length": engine.max_model_len,
            "chat_template": None if engine.chat_template.is_fallback else engine.chat_template.source,
        }

    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    return app


class APIKeyMiddleware:
    """With an API key set, /v1/*, /tokenize and /detokenize need `Authorization: Bearer <key>`.

    A plain ASGI middleware (not BaseHTTPMiddleware), so that handlers still see client disconnects.
    """

    def __init__(self, app: ASGIApp, state: ServerState):
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        key = self.state.settings.api_key
        if key and scope["type"] == "http" and scope["path"].startswith(PROTECTED_PREFIXES):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, f"Bearer {key}".encode()):
                response = APIError(
                    401, "Incorrect API key provided; send it as 'Authorization: Bearer <key>'", code="invalid_api_key"
                ).response()
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _load(state: ServerState) -> None:
    try:
        state.load()
    except BaseException:
        return  # recorded in state.load_error; /health answers 503 and the server exits (serve.py)
