"""Errors in the OpenAI shape: {"error": {"message", "type", "param", "code"}} with the right HTTP status.

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
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenmill.errors import InvalidParameterError, PromptTooLongError

logger = logging.getLogger(__name__)


class ErrorJSONResponse(JSONResponse):
    def render(self, content: object) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode()


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

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return ErrorJSONResponse(self.body(), status_code=self.status, headers=self.headers)

    def sse(self) -> str:
        """The error as a server-sent event, for failures after a stream has started."""
        return f"data: {json.dumps(self.body(), ensure_ascii=True)}\n\n"


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


async def guarded_stream(events: AsyncIterator[str], on_internal_error: Callable[[], None]) -> AsyncIterator[str]:
    """A stream of server-sent events that ends with an error event, never a cut connection, if it fails."""
    try:
        async for event in events:
            yield event
    except Exception as exc:  # noqa: BLE001 - the last resort for a stream whose headers are sent
        on_internal_error()
        yield internal_error(exc).sse()
        yield "data: [DONE]\n\n"


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    ctx = first.get("ctx") or {}
    if first.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {ctx.get('error', first.get('msg'))}", None
    if first.get("type") in ("invalid_unicode", "unsupported_field"):
        return first["msg"], ctx.get("param")
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    where = ".".join(loc) if loc else "body"
    return f"{where}: {first.get('msg')}", loc[0] if loc else None


def install_error_handlers(app: FastAPI, on_internal_error: Callable[[], None]) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(InvalidParameterError)
    async def invalid_parameter(_: Request, exc: InvalidParameterError) -> JSONResponse:
        return from_engine_error(exc).response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return APIError(400, message, param=param).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return APIError(exc.status_code, str(exc.detail), type_=type_, headers=exc.headers).response()

    @app.exception_handler(Exception)
    async def last_resort(_: Request, exc: Exception) -> JSONResponse:
        on_internal_error()
        return internal_error(exc).response()
