"""Errors in the OpenAI shape: {"error": {"message", "type", "param", "code"}} with the right HTTP status."""

import json

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenmill.errors import InvalidParameterError, PromptTooLongError


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
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)

    def sse(self) -> str:
        """The error as a server-sent event, for failures after a stream has started."""
        return f"data: {json.dumps(self.body())}\n\n"


def from_engine_error(exc: InvalidParameterError) -> APIError:
    code = "context_length_exceeded" if isinstance(exc, PromptTooLongError) else None
    return APIError(400, str(exc), param=exc.param, code=code)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}", None
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = loc[0] if loc else None
    where = ".".join(loc) if loc else "body"
    return f"{where}: {first.get('msg')}", param


def install_error_handlers(app: FastAPI) -> None:
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
