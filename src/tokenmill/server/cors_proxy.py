"""llama-server's CORS proxy (`--ui-mcp-proxy`; its server-cors-proxy.h): GET or POST /cors-proxy?url=TARGET
forwards the call to TARGET and streams its answer back, so a web page can reach a server (an MCP server, in
llama.cpp's web UI) that answers no cross-origin calls itself.

Only the headers the caller names for the target travel: `x-llama-server-proxy-header-NAME: VALUE` is sent as
`NAME: VALUE`; the caller's own Authorization, X-Api-Key, Cookie and every other header stay here, so the key to
this server never reaches another one. The body goes as it came. TARGET must be http(s), with a host and no password
in it; redirects are followed. The answer keeps the target's status, Content-Type and headers, less those that
describe this hop (Content-Length, Transfer-Encoding, Keep-Alive, Server), the target's CORS headers (this
server's own apply) and its Set-Cookie (which would land on this server's origin). A target that cannot be reached
is a 502 "proxy error: ..." (llama-server says 500).
"""

import logging
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import httpx
from starlette.requests import Request
from starlette.responses import StreamingResponse

from tokenmill.server.errors import APIError

logger = logging.getLogger(__name__)

HEADER_PREFIX = "x-llama-server-proxy-header-"
TIMEOUT_S = 600.0  # a read or write may wait this long (llama-server's 10 minutes)
# what describes the hop to the target, never forwarded: httpx writes its own
REQUEST_HOP_HEADERS = frozenset({"host", "content-length", "transfer-encoding", "accept-encoding", "connection"})
ANSWER_HOP_HEADERS = frozenset({"server", "transfer-encoding", "content-length", "keep-alive", "connection"})
# a target's cookies would be set on this server's origin: they stay out (llama-server passes them)
ANSWER_DROPPED = ANSWER_HOP_HEADERS | {"set-cookie", "content-type"}


def target_url(url: str | None) -> str:
    """The target, checked as llama-server checks it (400 otherwise)."""
    if not url:
        raise APIError(400, "give the target as ?url=http(s)://HOST/PATH", param="url")
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises on a port that is no number
    except ValueError as e:
        raise APIError(400, f"invalid target URL: {e}", param="url") from None
    if parts.scheme not in ("http", "https"):
        raise APIError(400, f"unsupported URL scheme in target URL: {parts.scheme or '(none)'}", param="url")
    if not parts.hostname:
        raise APIError(400, "invalid target URL: missing host", param="url")
    if parts.password is not None:
        raise APIError(400, "authentication in target URL is not supported", param="url")
    return url


def forwarded_headers(request: Request) -> dict[str, str]:
    """The headers the caller named for the target, without their prefix."""
    out = {}
    for name, value in request.headers.items():
        name = name.lower()
        if name.startswith(HEADER_PREFIX) and len(name) > len(HEADER_PREFIX):
            target_name = name[len(HEADER_PREFIX) :]
            if target_name not in REQUEST_HOP_HEADERS:
                out[target_name] = value
    return out


async def proxy(request: Request) -> StreamingResponse:
    url = target_url(request.query_params.get("url"))
    headers = forwarded_headers(request)
    body = await request.body() if request.method == "POST" else None
    parts = urlsplit(url)
    logger.info("proxying %s request to %s://%s%s", request.method, parts.scheme, parts.netloc, parts.path or "/")
    # no default headers of httpx's beyond what HTTP needs; identity, so the body comes back as the target sent it
    client = httpx.AsyncClient(
        follow_redirects=True, timeout=httpx.Timeout(TIMEOUT_S), headers={"accept-encoding": "identity"}
    )
    try:
        sent = client.build_request(request.method, url, headers=headers, content=body)
        answer = await client.send(sent, stream=True)
    except httpx.HTTPError as e:
        await client.aclose()
        raise APIError(502, f"proxy error: {e or type(e).__name__}", "server_error") from None
    except BaseException:
        await client.aclose()
        raise

    async def body_chunks() -> AsyncIterator[bytes]:
        try:
            async for chunk in answer.aiter_raw():
                yield chunk
        except httpx.HTTPError as e:  # the target broke off: the answer ends there
            logger.warning("proxy: the target's answer broke off: %s", e)
        finally:
            await answer.aclose()
            await client.aclose()

    kept = {
        name: value
        for name, value in answer.headers.multi_items()
        if name.lower() not in ANSWER_DROPPED and not name.lower().startswith("access-control-")
    }
    return StreamingResponse(
        body_chunks(), status_code=answer.status_code, headers=kept, media_type=answer.headers.get("content-type")
    )
