"""Errors in each API's own shape, with the right HTTP status: OpenAI's {"error": {"message", "type", "param",
"code"}}, Ollama's {"error": message} under /api/, Anthropic's {"type": "error", "error": {"type", "message"}}
under /v1/messages.

Every error body is ASCII JSON, so a message that quotes the client's input cannot fail to encode. An exception
nobody expected gets the handler of last resort: a JSON 500 that names an error id, the traceback in the log
under the same id, and a count on /metrics (tests assert that no input ever gets there).
"""

import json
import logging
import uuid
from collections.abc import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenmill.errors import InvalidParameterError, PromptTooLongError

logger = logging.getLogger(__name__)


class ErrorJSONResponse(JSONResponse):
    def render(self, content: object) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode()


OLLAMA_PREFIX = "/api/"
# llama.cpp's own API (/completion and the root's /completions, /infill, /props, /slots, /apply-template, /tools,
# /cors-proxy)
LLAMACPP_PREFIXES = ("/completion", "/infill", "/props", "/slots", "/apply-template", "/tools", "/cors-proxy")
ANTHROPIC_PREFIX = "/v1/messages"
ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


class ClientDisconnected(Exception):
    """The client closed its connection before its answer was ready (its work is aborted; it gets no answer)."""


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param
        self.code = code
        self.headers = headers

    def body(self, path: str = "") -> dict:
        """The error as the API that `path` belongs to writes one."""
        if path.startswith(OLLAMA_PREFIX):
            return {"error": self.message}
        if path.startswith(ANTHROPIC_PREFIX):
            kind = ANTHROPIC_TYPES.get(self.status, "invalid_request_error" if self.status < 500 else "api_error")
            return {"type": "error", "error": {"type": kind, "message": self.message}}
        kind = self.type
        if self.status == 401 and path.startswith(LLAMACPP_PREFIXES):  # llama-server's type (OpenAI's is the other)
            kind = "authentication_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def response(self, path: str = "") -> JSONResponse:
        return ErrorJSONResponse(self.body(path), status_code=self.status, headers=self.headers)

    def sse(self) -> str:
        """The error as a server-sent event, for failures after a stream has started."""
        return f"data: {json.dumps(self.body(), ensure_ascii=True)}\n\n"


def disabled(feature: str) -> APIError:
    """A route of a feature the server was started without (llama-server's 403 `feature_disabled`)."""
    return APIError(403, f"this feature is disabled (start the server with {feature})", "feature_disabled")


def from_engine_error(exc: InvalidParameterError) -> APIError:
    code = "context_length_exceeded" if isinstance(exc, PromptTooLongError) else None
    return APIError(400, str(exc), param=exc.param, code=code)


def internal_error(exc: BaseException) -> APIError:
    """Log an unexpected exception with its traceback under a new error id; the 500 the client gets names it."""
    error_id = f"err-{uuid.uuid4().hex[:16]}"
    logger.error("internal error %s: %r", error_id, exc, exc_info=exc)
    return APIError(
        500,
        f"internal server error (id {error_id}); the server's log has the details",
        "server_error",
        code="internal_error",
        headers={"X-Error-Id": error_id},
    )


def sse_error(error: APIError) -> str:
    return error.sse() + "data: [DONE]\n\n"


async def guarded_stream(
    events: AsyncIterator[str],
    on_internal_error: Callable[[], None],
    error_event: Callable[[APIError], str] = sse_error,
) -> AsyncIterator[str]:
    """A stream (server-sent events, or another API's lines: `error_event` writes its end) that ends with an error
    event, never a cut connection, if it fails."""
    try:
        async for event in events:
            yield event
    except Exception as exc:  # noqa: BLE001 - the last resort for a stream whose headers are sent
        on_internal_error()
        yield error_event(internal_error(exc))


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    ctx = first.get("ctx") or {}
    if first.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {ctx.get('error', first.get('msg'))}", None
    if first.get("type") in ("invalid_unicode", "unsupported_field", "field_error"):
        return first["msg"], ctx.get("param")
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    where = ".".join(loc) if loc else "body"
    return f"{where}: {first.get('msg')}", loc[0] if loc else None


def install_error_handlers(app: FastAPI, on_internal_error: Callable[[], None]) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response(request.url.path)

    @app.exception_handler(ClientDisconnected)
    async def client_gone(request: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=499)  # nginx's "client closed request": nobody reads it, the log says it

    @app.exception_handler(InvalidParameterError)
    async def invalid_parameter(request: Request, exc: InvalidParameterError) -> JSONResponse:
        return from_engine_error(exc).response(request.url.path)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return APIError(400, message, param=param).response(request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
        error = APIError(exc.status_code, str(exc.detail), type_=type_, headers=exc.headers)
        return error.response(request.url.path)

    @app.exception_handler(Exception)
    async def last_resort(request: Request, exc: Exception) -> JSONResponse:
        on_internal_error()
        return internal_error(exc).response(request.url.path)
