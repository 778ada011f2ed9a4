"""One request-log line per failed call, whatever its status (issue 39: 400, 404, 413, 429, 499 and 503 left none),
in process: the statuses a running server answers are tested against one in tests/test_server.py
(test_every_failed_call_leaves_one_log_line) and tests/test_server_hardening.py (503 busy, 401)."""

import logging

from fastapi.testclient import TestClient
from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

from tokenmill.server.app import create_app
from tokenmill.server.call_log import CallLog
from tokenmill.server.state import ServerSettings, ServerState


def lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "tokenmill.requests"]


def test_a_loading_servers_503_and_a_missing_route_leave_a_line_each(caplog) -> None:
    c = TestClient(create_app(ServerState(ServerSettings()), load_in_background=False), base_url="http://127.0.0.1")
    with caplog.at_level(logging.INFO, logger="tokenmill.requests"):
        assert c.get("/v1/models", headers={"X-Request-Id": "early"}).status_code == 503
        assert c.get("/v1/nothing").status_code == 404
        assert c.get("/health").status_code == 503  # polled while loading: no line
    early, missing = lines(caplog)
    assert early.startswith("early /v1/models 503: ") and missing.startswith("- /v1/nothing 404: ")


def test_any_status_from_400_up_leaves_its_line_with_the_errors_message(caplog) -> None:
    """A 429 (tokenmill itself answers none; a route or a proxy in front may) and a 499 with no body."""

    async def limited(request):
        return JSONResponse({"error": {"message": "slow down", "type": "rate_limit_error"}}, status_code=429)

    async def left(request):
        return JSONResponse(None, status_code=499)

    app = Starlette(routes=[Route("/limited", limited), Route("/left", left)])
    c = TestClient(CallLog(app, enabled=lambda: True))
    with caplog.at_level(logging.INFO, logger="tokenmill.requests"):
        c.get("/limited")
        c.get("/left")
    limited_line, left_line = lines(caplog)
    assert limited_line.startswith("- /limited 429: slow down, ")
    assert left_line.startswith("- /left 499: the client closed the connection, ")
