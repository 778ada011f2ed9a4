"""ASGI middleware in front of the routes: the API key, and the limit on request body size.

Plain ASGI classes (not BaseHTTPMiddleware), so that handlers still see client disconnects and streams pass
through untouched.
"""

import hmac
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenmill.server.errors import APIError


class APIKeyGuard:
    """With a key set, every path for which `protects(path)` holds needs `Authorization: Bearer <key>` (or
    `x-api-key: <key>`, as Anthropic's clients send it)."""

    def __init__(self, app: ASGIApp, key: Callable[[], str | None], protects: Callable[[str], bool]):
        self.app = app
        self.key = key
        self.protects = protects

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        key = self.key()
        if key and scope["type"] == "http" and self.protects(scope["path"]):
            headers = dict(scope["headers"])
            bearer = hmac.compare_digest(headers.get(b"authorization", b""), f"Bearer {key}".encode())
            if not bearer and not hmac.compare_digest(headers.get(b"x-api-key", b""), key.encode()):
                response = APIError(
                    401, "Incorrect API key provided; send it as 'Authorization: Bearer <key>'", code="invalid_api_key"
                ).response(scope["path"])
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyLimit:
    """Reads a request's body before the route does, and answers 413 as soon as it passes `max_bytes` (by its
    Content-Length, or by counting a chunked body): nothing larger is parsed, validated or tokenized."""

    def __init__(self, app: ASGIApp, max_bytes: Callable[[], int | None]):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        limit = self.max_bytes()
        if limit is None or scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await self._too_large(scope, receive, send, limit)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending it all
                await self.app(scope, _replay([], message, receive), send)
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await self._too_large(scope, receive, send, limit)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body: Message = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        await self.app(scope, _replay([body], None, receive), send)

    @staticmethod
    async def _too_large(scope: Scope, receive: Receive, send: Send, limit: int) -> None:
        response = APIError(
            413,
            f"the request body is larger than this server's limit of {limit:,} bytes (--max-request-bytes)",
            code="request_too_large",
        ).response(scope["path"])
        await response(scope, receive, send)


def _replay(messages: list[Message], last: Message | None, receive: Receive) -> Receive:
    """A receive that hands out the messages already read, then `last` (if any), then the real ones (so the route
    still hears the client disconnect)."""
    pending = [*messages, *([last] if last is not None else [])]

    async def replay() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return replay
