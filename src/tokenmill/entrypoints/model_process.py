"""One model of a server that serves several (server/model_router): today's one-model server, started by that
server as its child with its settings as JSON on stdin, listening on 127.0.0.1 only. It dies with its parent
(a router killed outright leaves no model behind)."""

import ctypes
import json
import logging
import os
import signal
import sys
import time

STARTED = time.monotonic()
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _die_with_parent(parent: int) -> None:
    """SIGTERM this process when its parent dies (Linux); elsewhere the parent stops it on its way out."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


def main() -> int:
    parent = int(os.environ.get("TOKENMILL_ROUTER_PID", os.getppid()))
    _die_with_parent(parent)
    payload = json.loads(sys.stdin.read())
    from tokenmill.config.server import ServerSettings
    from tokenmill.entrypoints.engine_prefetch import EnginePrefetch
    from tokenmill.log import setup_logging

    s = ServerSettings(**payload["settings"])
    setup_logging(s.log_level.upper() if s.log_level else logging.INFO)
    prefetched = EnginePrefetch(s.model)
    prefetched.start_engine(s.dtype, s.quantization, s.engine_options)
    from tokenmill.server.serve import serve

    return serve(s, s.host, s.port, s.access_log, prefetched, s.log_level, STARTED)


if __name__ == "__main__":
    sys.exit(main())
