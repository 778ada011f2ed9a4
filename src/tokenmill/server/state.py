"""What the server knows: settings, the engine once loaded, requests in flight, and whether it is stopping."""

import asyncio
import hashlib
import logging
import threading
import time
from pathlib import Path
from typing import Any

from starlette.requests import Request

from tokenmill import __version__
from tokenmill.config.server import ServerSettings
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.loader.model_path import NAMED_MODELS
from tokenmill.parsers.reply import ReplyFormat, reply_format
from tokenmill.server.errors import APIError
from tokenmill.server.events import EventHub
from tokenmill.server.metrics import ServerMetrics
from tokenmill.server.middleware import carries_key
from tokenmill.server.output_limits import OutputLimits
from tokenmill.server.served_model import ServedModel, build_engine

logger = logging.getLogger(__name__)


class ServerState:
    def __init__(self, settings: ServerSettings):
        self.settings = settings
        self.engine: AsyncEngine | None = None  # runs the requests
        self.model: ServedModel | None = None  # answers for the model (set with the engine)
        self.load_error: BaseException | None = None
        self.model_name = settings.served_model_name or "loading"
        self.model_path = ""
        self.system_fingerprint: str | None = None  # set once the model is loaded
        self.created = int(time.time())
        self.shutting_down = False
        self.in_flight: dict[str, set[str]] = {}  # call id -> its engine request ids
        self.api_ids: set[str] = set()  # the ids of the API calls in flight ("cmpl-...", "chatcmpl-...")
        # call id -> sequences it asked for (prompts x n), counted from admission (before its requests reach the
        # engine) until it ends: what --max-queue compares with, exact however fast requests arrive
        self.admitted: dict[str, int] = {}
        self.metrics = ServerMetrics(lambda: self.engine.stats() if self.engine else None)
        self.events = EventHub()
        self._reply_format: ReplyFormat | None = None
        self.ready = threading.Event()

    def shown_path(self, http_request: Request) -> str:
        """The model's path as a caller may see it: whole to a caller that sent the API key, else only the file's
        (or directory's) name: where files live on the machine is no business of a caller without the key."""
        key = self.settings.api_key
        if key and carries_key(dict(http_request.scope["headers"]), key):
            return self.model_path
        return Path(self.model_path).name

    def output_limits(self) -> OutputLimits:
        """The rules a request's max_tokens is settled by (output_limits.py): the server's options and the served
        model's default and context (where it is loaded)."""
        s, model = self.settings, self.model
        return OutputLimits(
            s.max_tokens_default,
            s.max_tokens_limit,
            model.default_max_tokens if model is not None else None,
            model.max_model_len if model is not None else None,
        )

    def load(self, prefetched=None) -> None:
        """Build the engine (runs in a thread while the server already answers /health with 503)."""
        s = self.settings
        try:
            engine = build_engine(s.model, s.dtype, s.quantization, s.engine_options, prefetched)
        except BaseException as exc:
            self.load_error = exc
            logger.error("loading the model failed: %s", exc)
            raise
        model = ServedModel(engine)
        if s.chat_template is not None:
            model.use_chat_template(s.chat_template)
        model.template_defaults = reasoning_defaults(s.reasoning, model.chat_template_source)
        self.model_name = s.served_model_name or model.name
        self.model_path = str(model.path)
        # OpenAI's system_fingerprint: the backend's configuration (what can change a seeded answer), hashed
        what = (__version__, self.model_path, s.dtype, str(model.quantization), sorted(s.engine_options.items()))
        self.system_fingerprint = "fp_" + hashlib.sha256(repr(what).encode()).hexdigest()[:10]
        self.model = model
        self.engine = AsyncEngine(engine, self.settings.log_stats_interval_s)
        self.events.attach(self.engine, model)
        self.ready.set()
        logger.info("ready: serving %r", self.model_name)
        if model.base_model_note is not None:
            logger.warning("%s", model.base_model_note)

    @property
    def healthy(self) -> bool:
        return self.engine is not None and self.engine.is_alive and not self.shutting_down

    def reply_format(self) -> ReplyFormat:
        """The served model's reply format: its thinking and tool-call syntax (from the chat template, unless the
        server's flags name them)."""
        model = self.require_model()
        if self._reply_format is None:
            s = self.settings
            self._reply_format = reply_format(model.chat_template_source, s.reasoning_parser, s.tool_call_parser)
        return self._reply_format

    def require_engine(self) -> AsyncEngine:
        if self.shutting_down:
            raise APIError(503, "the server is shutting down", "server_error", code="server_shutdown")
        if self.engine is None:
            if self.load_error is not None:
                raise APIError(503, f"the model failed to load: {self.load_error}", "server_error")
            raise APIError(
                503, "the model is still loading", "server_error", code="loading", headers={"Retry-After": "1"}
            )
        if not self.engine.is_alive:
            raise APIError(503, f"the engine failed: {self.engine.error!r}", "server_error", code="engine_dead")
        return self.engine

    def require_model(self) -> ServedModel:
        """The served model's front, once it is loaded and the engine runs (the 503s of require_engine)."""
        self.require_engine()  # shutting down, loading, failed: its 503s
        if self.model is None:  # not reached: the model is set before the engine
            raise APIError(503, "the model is still loading", "server_error", code="loading")
        return self.model

    @property
    def model_names(self) -> list[str]:
        """Every name the served model answers to: its id, and the name the server was started with where that
        named a model (`--model gemma3-270m` serves the id gemma-3-270m-q4_k_m; a client may send either), unless
        --served-model-name chose the name."""
        s = self.settings
        started_with = s.model if s.model is not None and s.model.lower() in NAMED_MODELS else None
        if s.served_model_name is not None or started_with in (None, self.model_name):
            return list(dict.fromkeys([self.model_name, *s.served_model_aliases]))
        return [self.model_name, started_with]

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.model_names:
            raise APIError(
                404,
                f"The model `{name}` does not exist; this server serves `{self.model_name}`.",
                param="model",
                code="model_not_found",
            )

    def adapter_for(self, name: str | None) -> str | None:
        """The LoRA adapter a request's `model` names (vLLM's convention: an adapter is chosen as a model), or None
        for the base model's names; 404 for any other name (check_model's)."""
        if self._is_adapter(name):
            return name
        self.check_model(name)
        return None

    def reply_model(self, name: str | None) -> str:
        """The model a reply names: the LoRA adapter its request chose (as vLLM answers), else the model's id."""
        return name if self._is_adapter(name) else self.model_name  # type: ignore[return-value]

    def _is_adapter(self, name: str | None) -> bool:
        model = self.model
        if name is None or name in self.model_names or model is None:
            return False
        return any(a.name == name for a in model.lora_adapters())

    def admit(self, call_id: str, num_seqs: int) -> None:
        """Count a call's sequences from now on, or refuse it with 503 when it would wait beyond --max-queue.

        Sequences beyond max_num_seqs wait; so do those the engine last reported waiting (its batch may be short
        of KV blocks). Called on the event loop with no await before the count is taken, so a burst is counted
        one request at a time."""
        limit = self.settings.max_queue
        if limit is not None and self.engine is not None and self.model is not None:
            demand = sum(self.admitted.values()) + num_seqs
            waiting = max(demand - self.model.config.max_num_seqs, self.engine.stats()["num_waiting"])
            if waiting > limit:
                raise APIError(
                    503,
                    f"the server is busy: more than {limit} requests would wait; retry shortly",
                    "server_error",
                    code="overloaded",
                    headers={"Retry-After": "1"},
                )
        self.admitted[call_id] = num_seqs

    def claim_api_id(self, api_id: str) -> None:
        """Mark an API call's id as in flight; 400 when it already is (a client's X-Request-Id used twice at
        once: two calls must never share engine request ids or step events)."""
        if api_id in self.api_ids:
            raise APIError(
                400, f"request id {api_id!r} is already in flight", param="X-Request-Id", code="duplicate_request_id"
            )
        self.api_ids.add(api_id)

    def release(self, call_id: str) -> None:
        self.admitted.pop(call_id, None)

    def abort_all(self) -> None:
        """Abort every request in flight (the grace period of a shutdown has passed)."""
        if self.engine is None:
            return
        self.engine.abort_nowait(*(rid for request_ids in list(self.in_flight.values()) for rid in request_ids))

    async def wait_idle(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while self.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return not self.in_flight


def reasoning_defaults(reasoning: str, template: str) -> dict[str, Any]:
    """--reasoning as the chat template's variables: on or off is enable_thinking; auto turns it on for a template
    that reads it (llama.cpp's own templates close the thinking when enable_thinking is not true)."""
    if reasoning == "on" or (reasoning == "auto" and "enable_thinking" in template):
        return {"enable_thinking": True}
    if reasoning == "off":
        return {"enable_thinking": False}
    return {}
