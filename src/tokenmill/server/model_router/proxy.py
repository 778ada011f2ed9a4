"""A request forwarded to a model's process, its answer streamed back as it comes (server-sent events and Ollama's
lines token by token). The model is released however the answer ends: finished, failed, or its client gone (which
closes the upstream request, so the model's server aborts the work)."""

from collections.abc import Callable

import httpx
from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from tokenmill.server.call_log import mark_logged
from tokenmill.server.errors import APIError

# per hop, never forwarded (Origin: this process checked it; the model's server sees a local call)
HOP_HEADERS = frozenset(
    ("host", "connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-connection", "origin")
)


def new_client() -> httpx.AsyncClient:
    """One client for every forwarded request: no read timeout (a long answer streams for minutes), no pool limit
    (each stream holds a connection)."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=32)
    return httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0), limits=limits)


class ProxiedResponse(StreamingResponse):
    def __init__(self, upstream: httpx.Response, on_close: Callable[[], None]):
        headers = {k: v for k, v in upstream.headers.items() if k.lower() not in HOP_HEADERS}
        super().__init__(upstream.aiter_raw(), status_code=upstream.status_code, headers=headers)
        self.upstream = upstream
        self._on_close: Callable[[], None] | None = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.upstream.aclose()
            self.close()

    def close(self) -> None:
        on_close, self._on_close = self._on_close, None
        if on_close is not None:
            on_close()


async def forward(
    client: httpx.AsyncClient,
    base_url: str,
    request: Request,
    body: bytes,
    on_close: Callable[[], None],
    model_name: str,
) -> ProxiedResponse:
    """Send `request` (its body already read) to the model's server at `base_url`; `on_close` runs once its
    answer is over (or could not be had)."""
    url = base_url + request.url.path + (f"?{request.url.query}" if request.url.query else "")
    headers = [(k, v) for k, v in request.headers.raw if k.decode("latin-1").lower() not in HOP_HEADERS]
    headers = [(k, v) for k, v in headers if k.lower() != b"content-length"]
    try:
        upstream = await client.send(
            client.build_request(request.method, url, headers=headers, content=body), stream=True
        )
    except httpx.TransportError as exc:
        on_close()
        raise APIError(503, f"the model {model_name!r} did not answer: {exc}", "server_error") from exc
    except BaseException:
        on_close()
        raise
    mark_logged()  # the model's server writes the call's line (a failure's too): this one writes none
    return ProxiedResponse(upstream, on_close)
