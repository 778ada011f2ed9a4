"""One log line per API call (logger `tokenmill.requests`; `--disable-log-requests`: none).

A call the engine ran writes its own line when it closes (generation.py: tokens, finish reasons, TTFT). Every
other call that fails (400, 401, 403, 404, 413, 499, 503, ...) gets its line here, from the outermost middleware,
which sees every answer, those of the guards in front of the routes included:
`- /v1/chat/completions 404: The model `x` does not exist; ..., 0.002 s` (the client's X-Request-Id for `-`).
"""

import json
import logging
import time
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger("tokenmill.requests")

QUIET_PATHS = ("/health",)  # polled while the model loads (503): a line each time would drown the log
MAX_ERROR_BODY_BYTES = 4096  # of an error's body, read for its message


@dataclass
class CallRecord:
    """Whether this HTTP request's call has written its line (a context variable holds the one of the request)."""

    logged: bool = False


_current: ContextVar[CallRecord | None] = ContextVar("tokenmill_call_record", default=None)


def mark_logged() -> None:
    """The call of the request being served has written its line (generation.py): the middleware writes none."""
    record = _current.get()
    if record is not None:
        record.logged = True


class CallLog:
    """ASGI middleware: a line for every failed call that has not written its own (see the module's docstring)."""

    def __init__(self, app: ASGIApp, enabled: Callable[[], bool]):
        self.app = app
        self.enabled = enabled

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in QUIET_PATHS or not self.enabled():
            await self.app(scope, receive, send)
            return
        record = CallRecord()
        token = _current.set(record)
        started = time.monotonic()
        status = 0
        body = bytearray()

        async def watched(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and status >= 400 and len(body) < MAX_ERROR_BODY_BYTES:
                body.extend(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except Exception:
            status = status or 500  # the handler of last resort answers it, and logs its traceback
            raise
        finally:
            _current.reset(token)
            if status >= 400 and not record.logged:
                logger.info(
                    "%s %s %d: %s, %.3f s",
                    _client_id(scope),
                    scope["path"],
                    status,
                    error_message(bytes(body), status),
                    time.monotonic() - started,
                )


def _client_id(scope: Scope) -> str:
    """The id the client gave the call (X-Request-Id), or "-"."""
    given = dict(scope["headers"]).get(b"x-request-id")
    return given.decode("latin-1")[:64] if given else "-"


def error_message(body: bytes, status: int) -> str:
    """The message of an error body in any of the APIs' shapes (OpenAI's and Anthropic's {"error": {"message"}},
    Ollama's {"error": text}), else a word for the status."""
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError):
        error = None
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return error["message"]
    if isinstance(error, str):
        return error
    return "the client closed the connection" if status == 499 else "no message"
