"""What a server of several models knows: its settings, the models it serves (catalog.py), which are loaded
(registry.py), and how a request reaches its model (proxy.py)."""

import asyncio
import json
from typing import Any

from fastapi import Request

from tokenmill.config.engine import parse_memory
from tokenmill.config.server import ServerSettings
from tokenmill.errors import InvalidParameterError
from tokenmill.server.errors import OLLAMA_PREFIX, APIError
from tokenmill.server.model_router.catalog import Catalog, ServableModel
from tokenmill.server.model_router.keep_alive import parse_keep_alive
from tokenmill.server.model_router.model_process import ModelLoadError
from tokenmill.server.model_router.proxy import ProxiedResponse, forward, new_client
from tokenmill.server.model_router.registry import ModelRegistry, Slot

_PARSED_INLINE_BYTES = 64 * 1024  # larger bodies are parsed in a worker thread, off the event loop


class ModelRouter:
    def __init__(self, settings: ServerSettings, catalog: Catalog):
        self.settings = settings
        self.catalog = catalog
        self.default_keep_alive_s = parse_keep_alive(settings.keep_alive)
        budget = parse_memory(settings.memory_budget) if settings.memory_budget else None
        self.registry = ModelRegistry(settings, self.default_keep_alive_s, budget, self._count_load)
        self.loads: dict[str, int] = {}  # model id -> loads so far (metrics)
        self.load_seconds: dict[str, float] = {}  # model id -> its last load's seconds (metrics)
        self.client = new_client()
        self.shutting_down = False

    def _count_load(self, slot: Slot) -> None:
        name = slot.model.name
        self.loads[name] = self.loads.get(name, 0) + 1
        self.load_seconds[name] = slot.process.load_seconds if slot.process else 0.0

    def find(self, name: str | None, path: str) -> ServableModel:
        """The model a request names (the default one where it names none); 404 in the API's shape if unknown."""
        model = self.catalog.default if name is None else self.catalog.find(name)
        if model is not None:
            return model
        served = ", ".join(m.name for m in self.catalog.all())
        message = (
            f"model '{name}' not found; this server serves: {served}"
            if path.startswith(OLLAMA_PREFIX)
            else f"The model `{name}` does not exist; this server serves: {served}."
        )
        raise APIError(404, message, param="model", code="model_not_found")

    async def acquire(self, model: ServableModel) -> Slot:
        """The model loaded (a request for a model being loaded waits here); 503 while shutting down, 500 when
        its load fails."""
        if self.shutting_down:
            raise APIError(503, "the server is shutting down", "server_error", code="server_shutdown")
        try:
            return await self.registry.acquire(model)
        except ModelLoadError as exc:
            raise APIError(500, str(exc), "server_error", code="model_load_failed") from exc

    async def forward(
        self, request: Request, body: bytes, model: ServableModel, keep_alive_s: float | None, hold: bool = True
    ):
        """The request answered by its model's server; the model is released (its keep_alive set) as the answer
        ends. hold=False (the explorer's never-ending events): a loaded model only, neither loaded for it nor kept
        loaded by it (503 when it is not loaded)."""
        if not hold:
            idle = self.registry.slots.get(model.name)
            if idle is None or idle.process is None or not idle.loaded:
                raise APIError(503, f"the model {model.name!r} is not loaded", "server_error", code="not_loaded")
            return await forward(self.client, idle.process.url, request, body, lambda: None, model.name)
        slot = await self.acquire(model)
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.registry.release(slot, keep_alive_s)

        process = slot.process
        if process is None:  # unloaded between its load and now (a keep_alive of 0 elsewhere): not reached as a rule
            release()
            raise APIError(503, f"the model {model.name!r} was unloaded; retry", "server_error")
        response: ProxiedResponse = await forward(self.client, process.url, request, body, release, model.name)
        return response

    def keep_alive_of(self, body: dict[str, Any] | None, path: str) -> float | None:
        """An Ollama request's keep_alive (400 when it is no duration), else the server's default."""
        value = body.get("keep_alive") if body is not None and path.startswith(OLLAMA_PREFIX) else None
        if value is None:
            return self.default_keep_alive_s
        try:
            return parse_keep_alive(value)
        except InvalidParameterError as exc:
            raise APIError(400, str(exc), param="keep_alive") from exc

    async def close(self) -> None:
        self.shutting_down = True
        await self.registry.stop_all()
        await self.client.aclose()


async def json_body(body: bytes) -> dict[str, Any] | None:
    """The body as a JSON object, or None (not JSON, or no object: the model's server answers that)."""
    if not body:
        return None
    try:
        parsed = json.loads(body) if len(body) <= _PARSED_INLINE_BYTES else await asyncio.to_thread(json.loads, body)
    except (ValueError, UnicodeDecodeError):
        return None
    return parsed if isinstance(parsed, dict) else None


def named_model(body: dict[str, Any] | None, request: Request) -> str | None:
    """The model a request names: its body's `model` (Ollama's older `name`), else the query's `model`."""
    for key in ("model", "name"):
        value = body.get(key) if body is not None else None
        if isinstance(value, str) and value:
            return value
    return request.query_params.get("model") or None
