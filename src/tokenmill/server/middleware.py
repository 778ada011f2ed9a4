"""ASGI middleware in front of the routes: the Host and Origin checks, bodies read as JSON, the API key, and the
limit on request body size.

Plain ASGI classes (not BaseHTTPMiddleware), so that handlers still see client disconnects and streams pass
through untouched.
"""

import hmac
from collections.abc import Callable

from starlette.applications import Starlette
from starlette.middleware.cors import CORSMiddleware
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenmill.config.server import ServerSettings
from tokenmill.server.call_log import CallLog
from tokenmill.server.errors import APIError
from tokenmill.server.origins import OriginPolicy

JSON = b"application/json"


class HostOriginGuard:
    """403 for a request whose Host is no name of this server (DNS rebinding) or that a web page of a disallowed
    origin sends (its preflight included), before anything else runs (origins.py has the rules)."""

    def __init__(self, app: ASGIApp, policy: OriginPolicy):
        self.app = app
        self.policy = policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            policy = self.policy
            headers = dict(scope["headers"])
            host = _text(headers.get(b"host"))
            origin = _text(headers.get(b"origin"))
            error = None
            if not policy.host_allowed(host):
                error = APIError(
                    403,
                    f"the Host header {host!r} is no name this server answers to (a guard against DNS rebinding); "
                    "start it with --allowed-hosts NAME to answer it",
                    code="host_not_allowed",
                )
            elif not policy.origin_allowed(origin, host):
                error = APIError(
                    403,
                    f"web pages from {origin!r} may not call this server; start it with --allowed-origins {origin} "
                    "to let them",
                    code="origin_not_allowed",
                )
            if error is not None and _is_preflight(scope, headers) and error.code == "origin_not_allowed":
                # a disallowed page's preflight: 200 without CORS headers (the browser then sends nothing), as
                # llama-server and the CORS protocol answer it; its request itself would get the 403
                await Response(status_code=200, headers={"Vary": "Origin"})(scope, receive, send)
                return
            if error is not None:
                await error.response(scope["path"])(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _is_preflight(scope: Scope, headers: dict[bytes, bytes]) -> bool:
    return scope["method"] == "OPTIONS" and b"access-control-request-method" in headers


class CanonicalHeaderNames:
    """Response header names in their usual case (Content-Type, Access-Control-Allow-Origin): Starlette writes
    them lowercase, and some clients (llama.cpp's tests among them) look them up in a case-sensitive dict. HTTP/1.1
    names are case-insensitive, so no client that reads them properly sees a difference."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_cased(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [(_canonical(k), v) for k, v in message.get("headers", [])]}
            await send(message)

        await self.app(scope, receive, send_cased)


def _canonical(name: bytes) -> bytes:
    return b"-".join(part[:1].upper() + part[1:] for part in name.split(b"-"))


class JSONBodies:
    """Every request body is read as JSON, whatever its Content-Type says: Ollama's documented calls are
    `curl URL -d '{...}'`, which sends application/x-www-form-urlencoded. Safe only behind HostOriginGuard: a web
    page can send such a body without a preflight, so its origin must be checked first."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] in ("POST", "PUT", "PATCH", "DELETE"):
            headers = scope["headers"]
            kind = next((value for name, value in headers if name == b"content-type"), None)
            if kind is None or not _is_json(kind):
                rest = [(name, value) for name, value in headers if name != b"content-type"]
                scope = {**scope, "headers": [*rest, (b"content-type", JSON)]}
        await self.app(scope, receive, send)


def _is_json(content_type: bytes) -> bool:
    kind = content_type.split(b";", 1)[0].strip().lower()
    return kind == JSON or kind.endswith(b"+json")


def _text(value: bytes | None) -> str | None:
    return None if value is None else value.decode("latin-1")


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
            if not carries_key(headers, key):
                await key_error(headers).response(scope["path"])(scope, receive, send)
                return
        await self.app(scope, receive, send)


def key_error(headers: dict[bytes, bytes]) -> APIError:
    """The 401 for a request without the right key: a missing key is said to be missing (as OpenAI says it), a
    wrong one to be wrong."""
    bearer = headers.get(b"authorization", b"").removeprefix(b"Bearer").strip()
    if not bearer and not headers.get(b"x-api-key"):
        return APIError(
            401,
            "You didn't provide an API key; this server needs one: send it as 'Authorization: Bearer <key>' "
            "(or 'x-api-key: <key>')",
            code="missing_api_key",
        )
    return APIError(401, "Incorrect API key provided; send it as 'Authorization: Bearer <key>'", code="invalid_api_key")


def carries_key(headers: dict[bytes, bytes], key: str) -> bool:
    """Whether a request's headers (lowercase names) hold the API key, as a bearer token or as x-api-key."""
    bearer = hmac.compare_digest(headers.get(b"authorization", b""), f"Bearer {key}".encode())
    return bearer or hmac.compare_digest(headers.get(b"x-api-key", b""), key.encode())


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


def install_guards(app: Starlette, settings: ServerSettings, protects: Callable[[str], bool]) -> None:
    """The middleware in front of every route, the one-model server's and the several-models router's alike; the
    API key guards the paths `protects` names. Added innermost first. From the outside in: response header names in
    their usual case; every failed call gets its log line (call_log.py); Host and Origin are checked before
    anything else; a browser's preflight (OPTIONS, no key) is answered by CORS; the key is checked before a body is
    read; bodies are bounded before they are parsed, and read as JSON whatever their Content-Type (safe behind the
    origin check)."""
    policy = OriginPolicy.of(settings)
    app.add_middleware(JSONBodies)
    app.add_middleware(BodyLimit, max_bytes=lambda: settings.max_request_bytes)
    app.add_middleware(APIKeyGuard, key=lambda: settings.api_key, protects=protects)
    app.add_middleware(
        CORSMiddleware,
        allow_origins=["*"] if policy.any_origin else list(policy.allowed_origins),
        allow_origin_regex=None if policy.any_origin else policy.cors_origin_regex(),
        allow_methods=["GET", "POST", "DELETE", "OPTIONS"],
        allow_headers=["*"],
        allow_credentials=True,  # a page's cookies and auth go with its calls: the origin is echoed (never "*")
        expose_headers=["x-request-id"],
    )
    app.add_middleware(HostOriginGuard, policy=policy)
    app.add_middleware(CallLog, enabled=lambda: settings.log_requests)
    app.add_middleware(CanonicalHeaderNames)
