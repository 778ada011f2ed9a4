"""The FastAPI application of a server of several models: the same guards as the one-model server's (Host and
Origin, CORS, API key, body size, JSON bodies), the model-free endpoints answered here (/health, the model lists,
Ollama's /api/ps, /api/pull, /api/delete and load/unload requests, /metrics, the explorer's page), and every other
request forwarded to the model it names (its body's `model`, Ollama's `name`, or `?model=`; the first model where
it names none), which loads first if it must."""

import asyncio
import json
import time
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST

from tokenmill import __version__
from tokenmill.server.errors import OLLAMA_PREFIX, APIError, install_error_handlers
from tokenmill.server.middleware import install_guards
from tokenmill.server.model_router import hub_pull, listing
from tokenmill.server.model_router.catalog import ServableModel, served_model
from tokenmill.server.model_router.metrics import exposition, merged, own_families, scrape
from tokenmill.server.model_router.router import ModelRouter, json_body, named_model
from tokenmill.server.ollama import OLLAMA_API_VERSION
from tokenmill.server.stream_or_collect import NDJSON
from tokenmill.server.web_assets import PUBLIC_ASSETS, STATIC_DIR, add_web_assets

# with an API key set, every path needs it but these (as the one-model server's; /metrics with
# --metrics-require-key): a request must not load a model before its key is checked
OPEN_PATHS = ("/health", "/", "/favicon.ico", "/version", "/openapi.json", "/metrics", *PUBLIC_ASSETS)
AUTH_HEADERS = ("authorization", "x-api-key")


def create_router_app(router: ModelRouter) -> FastAPI:
    settings = router.settings

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        await router.close()  # every model's process stopped

    app = FastAPI(title="tokenmill", lifespan=lifespan, openapi_url=None, docs_url=None, redoc_url=None)
    install_error_handlers(app, lambda: None)

    def protected(path: str) -> bool:
        if path == "/metrics":
            return settings.metrics_require_key
        return path not in OPEN_PATHS and not path.startswith("/static/")

    install_guards(app, settings, protected)
    created = int(time.time())

    def shown_path(model: ServableModel, request: Request) -> str:
        key = settings.api_key
        carries = key and request.headers.get("authorization", "").removeprefix("Bearer ").strip() == key
        return model.path if carries else Path(model.path).name

    @app.get("/health")
    async def health() -> JSONResponse:
        if router.shutting_down:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        return JSONResponse({"status": "ok"})

    app.head("/health", include_in_schema=False)(health)

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @app.get("/api/version")
    async def ollama_version() -> dict:
        return {"version": OLLAMA_API_VERSION, "tokenmill": __version__}

    # ---- the model lists -------------------------------------------------------------------------------------

    async def openai_models(request: Request) -> dict:
        models = await asyncio.to_thread(router.catalog.all)
        slots = router.registry.slots
        cards = [listing.openai_card(m, slots.get(m.name), created, shown_path(m, request)) for m in models]
        return {"object": "list", "data": cards}

    async def openai_model(model_id: str, request: Request) -> dict:
        model = await asyncio.to_thread(router.find, model_id, request.url.path)
        return listing.openai_card(model, router.registry.slots.get(model.name), created, shown_path(model, request))

    for prefix in ("/v1", ""):
        app.get(f"{prefix}/models")(openai_models)
        app.get(prefix + "/models/{model_id:path}")(openai_model)

    @app.get("/api/tags")
    async def tags() -> dict:
        def entries() -> list[dict]:
            return [listing.ollama_entry(m, listing.facts_of(m)) for m in router.catalog.all()]

        return {"models": await asyncio.to_thread(entries)}

    @app.get("/api/ps")
    async def ps(request: Request) -> dict:
        return await ps_listing(router, request)

    # ---- Ollama's model management ---------------------------------------------------------------------------

    @app.post("/api/pull")
    async def pull(request: Request) -> Response:
        body = await json_body(await request.body()) or {}
        name = named_model(body, request)
        if name is None:
            raise APIError(400, "model is required", param="model")
        stream = body.get("stream", True) is not False
        ref = hub_pull.hub_reference(name)
        if ref is None:
            await asyncio.to_thread(router.find, name, request.url.path)  # 404 unless it is served already
            return _ndjson([{"status": "success"}]) if stream else JSONResponse({"status": "success"})

        async def events():
            async for event in hub_pull.pull_events(ref):
                if event.get("status") == "success":
                    path = event.pop("path")
                    router.catalog.add(served_model(name.removesuffix(":latest"), path, source="/api/pull"))
                    router.catalog.forget_hub_cache()
                yield event

        if stream:
            return StreamingResponse((listing_line(e) async for e in events()), media_type=NDJSON)
        last: dict[str, Any] = {}
        async for event in events():
            last = event
        if "error" in last:
            raise APIError(400, last["error"], param="model")
        return JSONResponse(last)

    @app.delete("/api/delete")
    async def delete(request: Request) -> Response:
        body = await json_body(await request.body()) or {}
        name = named_model(body, request)
        if name is None:
            raise APIError(400, "model is required", param="model")
        ref = hub_pull.hub_reference(name)
        model = await asyncio.to_thread(router.catalog.find, name)
        if model is not None:  # loaded: unloaded first (its files go)
            slot = router.registry.slots.get(model.name)
            if slot is not None and slot.process is not None:
                await router.registry.unload(slot)
        if ref is None or not await asyncio.to_thread(hub_pull.delete_cached, ref):
            raise APIError(404, f"model '{name}' not found", param="model", code="model_not_found")
        router.catalog.forget(name.removesuffix(":latest"))
        router.catalog.forget_hub_cache()
        return Response(status_code=200)

    @app.post("/api/show")
    async def show(request: Request) -> Response:
        """A loaded model's own answer; a model not loaded is described from its file, and stays unloaded."""
        body = await request.body()
        parsed = await json_body(body)
        model = await asyncio.to_thread(router.find, named_model(parsed, request), request.url.path)
        slot = router.registry.slots.get(model.name)
        if slot is not None and slot.loaded:
            return await router.forward(request, body, model, slot.keep_alive_s)
        try:
            return JSONResponse(await asyncio.to_thread(listing.show_unloaded, model))
        except Exception as exc:  # noqa: BLE001 - a file that cannot be read: said, as a load would say it
            raise APIError(500, f"cannot read the model {model.name!r}: {exc}", "server_error") from exc

    @app.post("/api/generate")
    async def ollama_generate(request: Request) -> Response:
        return await _ollama_call(router, request, "prompt", {"response": ""})

    @app.post("/api/chat")
    async def ollama_chat(request: Request) -> Response:
        return await _ollama_call(router, request, "messages", {"message": {"role": "assistant", "content": ""}})

    # ---- metrics and the explorer ------------------------------------------------------------------------------

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        if not settings.metrics:
            raise APIError(
                501, "This server does not support metrics endpoint. Start it with `--metrics`", "not_supported_error"
            )
        headers = {k: v for k, v in request.headers.items() if k in AUTH_HEADERS}
        per_model = await scrape(router.client, router.registry.loaded(), headers)
        models = await asyncio.to_thread(router.catalog.all)
        own = own_families(models, router.registry.slots, router.loads, router.load_seconds)
        text = await asyncio.to_thread(exposition, [*merged(per_model), *own])
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    add_web_assets(app, settings.explorer)  # answered here: the page's files load no model
    if settings.explorer:

        @app.get("/explorer/info")
        async def explorer_info(request: Request) -> Response:
            """The info of the model `?model=` names (else the one used last, else the first), with every model's
            name: the page can say which it shows."""
            name = request.query_params.get("model") or _recent(router)
            model = await asyncio.to_thread(router.find, name, request.url.path)
            slot = await router.acquire(model)
            try:
                process = slot.process
                assert process is not None
                headers = {k: v for k, v in request.headers.items() if k in AUTH_HEADERS}
                answer = await router.client.get(f"{process.url}/explorer/info", headers=headers)
            finally:
                router.registry.release(slot, slot.keep_alive_s)
            info = answer.json()
            if answer.status_code == 200:
                info["models"] = [m.name for m in await asyncio.to_thread(router.catalog.all)]
            return JSONResponse(info, status_code=answer.status_code)

        app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")

    # ---- everything else: the model's own server ---------------------------------------------------------------

    @app.api_route("/{path:path}", methods=["GET", "POST", "DELETE", "PUT", "PATCH"], include_in_schema=False)
    async def to_model(path: str, request: Request) -> Response:
        body = await request.body()
        parsed = await json_body(body)
        name = named_model(parsed, request) if request.url.path.startswith(OLLAMA_PREFIX) else _model_field(parsed)
        if name is None and request.url.path.startswith("/explorer/"):
            name = request.query_params.get("model") or _recent(router)
        elif name is None:
            name = request.query_params.get("model")
        model = await asyncio.to_thread(router.find, name, request.url.path)
        keep_alive = router.keep_alive_of(parsed, request.url.path)
        hold = request.url.path != "/explorer/events"  # an open explorer tab keeps no model loaded
        return await router.forward(request, body, model, keep_alive, hold)

    return app


def _model_field(body: dict[str, Any] | None) -> str | None:
    value = body.get("model") if body is not None else None
    return value if isinstance(value, str) and value else None


def _recent(router: ModelRouter) -> str | None:
    """The model used last among the loaded ones (None: none is, the first model then)."""
    loaded = router.registry.loaded()
    return max(loaded, key=lambda s: s.last_used).model.name if loaded else None


async def ps_listing(router: ModelRouter, request: Request) -> dict[str, Any]:
    """Ollama's /api/ps: the loaded models. One that unloads while their details are gathered (a keep_alive running
    out, an unload request) is left out: its process is gone (its entry failed: a 500 for the whole list)."""
    loaded = router.registry.loaded()
    contexts = await asyncio.gather(*(_context_length(router, s, request) for s in loaded))
    facts = await asyncio.gather(*(asyncio.to_thread(listing.facts_of, s.model) for s in loaded))
    rows = [(s, f, c) for s, f, c in zip(loaded, facts, contexts, strict=True) if s.loaded]  # still loaded now
    return {"models": [listing.ps_entry(s, f, c) for s, f, c in rows]}


async def _context_length(router: ModelRouter, slot, request: Request) -> int | None:
    process = slot.process
    if process is None:
        return None
    headers = {k: v for k, v in request.headers.items() if k in AUTH_HEADERS}
    try:
        answer = await router.client.get(f"{process.url}/api/ps", headers=headers, timeout=5.0)
        return answer.json()["models"][0].get("context_length")
    except Exception:  # noqa: BLE001 - listed without it
        return None


async def _ollama_call(router: ModelRouter, request: Request, content_field: str, empty: dict[str, Any]) -> Response:
    """/api/generate and /api/chat: forwarded, except Ollama's unload (no prompt or messages, keep_alive 0),
    answered here without loading the model."""
    body = await request.body()
    parsed = await json_body(body)
    model = await asyncio.to_thread(router.find, named_model(parsed, request), request.url.path)
    keep_alive = router.keep_alive_of(parsed, request.url.path)
    if parsed is not None and not parsed.get(content_field) and keep_alive == 0:
        slot = router.registry.slots.get(model.name)
        if slot is not None:
            await router.registry.unload_when_idle(slot)
        now = datetime.now(UTC).isoformat().replace("+00:00", "Z")
        return JSONResponse(
            {
                "model": parsed.get("model", model.name),
                "created_at": now,
                **empty,
                "done": True,
                "done_reason": "unload",
            }
        )
    return await router.forward(request, body, model, keep_alive)


def listing_line(event: dict[str, Any]) -> str:
    return json.dumps(event) + "\n"


def _ndjson(events: list[dict[str, Any]]) -> StreamingResponse:
    async def lines():
        for e in events:
            yield listing_line(e)

    return StreamingResponse(lines(), media_type=NDJSON)
