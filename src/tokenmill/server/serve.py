"""`tokenmill serve`: uvicorn with a graceful SIGTERM.

On SIGTERM (or Ctrl-C) the server takes no new requests (it keeps listening, so /health and new requests get a 503
that says it is shutting down, as a load balancer expects), lets requests in flight finish for `--shutdown-grace`
seconds, then aborts what is left (a stream gets a final error event), stops listening and exits. A second signal
aborts at once.
"""

import asyncio
import logging
import os
import signal
import socket
import threading
import time

import uvicorn

from tokenmill.loader.gguf_file import check_gguf_magic
from tokenmill.loader.hf_checkpoint import HFCheckpoint, is_hf_checkpoint
from tokenmill.loader.model_path import resolve_model_path
from tokenmill.server.state import ServerSettings, ServerState

logger = logging.getLogger("tokenmill.server")


def _load_quietly(state: ServerState, prefetched=None) -> None:
    try:
        state.load(prefetched)
    except BaseException:  # noqa: BLE001 - recorded in state.load_error; the server then exits
        return


class TokenmillServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState, started: float | None = None):
        super().__init__(config)
        self.state = state
        # not `started`: uvicorn.Server sets that to True once listening, and the ready line subtracted it
        self.process_started = started if started is not None else time.monotonic()
        self.exit_code = 0
        self._loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)
        c = self.config
        where = ", ".join(_url(s.getsockname()) for s in sockets) if sockets else _url((c.host, c.port))
        logger.info("listening on %s (the model loads now; /health answers 200 when ready)", where)
        self._loop.create_task(self._watch_load())

    async def _watch_load(self) -> None:
        while not self.state.ready.is_set():
            if self.state.load_error is not None:
                logger.error("exiting: the model could not be loaded")
                self.exit_code = 1
                self.should_exit = True
                return
            await asyncio.sleep(0.05)
        model = self.state.model
        load = f" (the model loaded in {model.load_seconds:.2f} s of them, while the server started)" if model else ""
        logger.info(
            "ready to serve %r %.1f s after start%s",
            self.state.model_name,
            time.monotonic() - self.process_started,
            load,
        )

    def handle_exit(self, sig, frame) -> None:
        loop = self._loop
        if not self.state.shutting_down and loop is not None:
            # drain first, still listening; uvicorn is told to exit (and stops listening) once it is done
            self.state.shutting_down = True
            loop.call_soon_threadsafe(lambda: loop.create_task(self._drain()))
            return
        if self.state.shutting_down:  # a second signal: no more waiting
            self.state.abort_all()
        self._stop_uvicorn(sig, frame)

    def _stop_uvicorn(self, sig, frame) -> None:
        super().handle_exit(sig, frame)
        # uvicorn re-raises the signal after shutting down, so the process would die of it; a drained server
        # exits normally (status 0) instead
        self._captured_signals.clear()

    async def _drain(self) -> None:
        grace = self.state.settings.shutdown_grace_s
        n = sum(len(ids) for ids in self.state.in_flight.values())
        logger.info("shutting down: no new requests; waiting up to %.0f s for %d in flight", grace, n)
        if not await self.state.wait_idle(grace):
            logger.warning("grace period over: aborting %d requests", len(self.state.in_flight))
            self.state.abort_all()
            await self.state.wait_idle(5.0)  # their streams send their last (error) events
        self._stop_uvicorn(signal.SIGTERM, None)


def serve(
    settings: ServerSettings,
    host: str = "127.0.0.1",
    port: int = 8000,
    access_log: bool = False,
    prefetched=None,
    log_level: str | None = None,
    started: float | None = None,
) -> int:
    """`started`: time.monotonic() when the process started (the ready line counts from it)."""
    # fail fast, before listening, on a model that cannot be right (a checkpoint directory's config and headers are
    # read: cheap; a GGUF file's magic)
    path = resolve_model_path(settings.model)
    if is_hf_checkpoint(path):
        HFCheckpoint(path)
    else:
        check_gguf_magic(path)
    if settings.api_key is None:
        settings.api_key = os.environ.get("TOKENMILL_API_KEY") or None
    settings.host = host
    state = ServerState(settings)
    # load the model while the web stack is imported and started; /health says 503 until it is ready
    threading.Thread(target=_load_quietly, args=(state, prefetched), name="tokenmill-load", daemon=True).start()
    from tokenmill.server.app import create_app

    app = create_app(state, load_in_background=False)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level or "info",
        access_log=access_log,
        timeout_graceful_shutdown=int(settings.shutdown_grace_s) + 5,
    )
    server = TokenmillServer(config, state, started)
    hosts = [h.strip() for h in host.split(",") if h.strip()]
    server.run(sockets=[bind(h, port) for h in hosts] if len(hosts) > 1 else None)
    return server.exit_code


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on one of several --host addresses (uvicorn binds one itself). An IPv6 one listens on
    IPv6 only: `::` beside 0.0.0.0 would otherwise take the IPv4 port too (as llama-server's --host says)."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[
        0
    ]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if family == socket.AF_INET6:
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
    sock.bind(address)
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _url(address: tuple) -> str:
    host, port = address[0], address[1]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
