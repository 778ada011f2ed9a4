"""llama-server's routes for agents: GET and POST /tools (`--tools`: agent_tools.py) and GET and POST /cors-proxy
(`--ui-mcp-proxy`: cors_proxy.py). A server started without one answers its routes 403 `feature_disabled`, as
llama-server's; with an API key, both need it (app.py)."""

import json
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from tokenmill.server import agent_tools
from tokenmill.server.cors_proxy import proxy
from tokenmill.server.errors import APIError, disabled
from tokenmill.server.schemas import ANY_LIST, answers, error_responses
from tokenmill.server.state import ServerState

logger = logging.getLogger(__name__)


class ToolCall(BaseModel):
    """POST /tools: one call of one tool."""

    model_config = ConfigDict(extra="forbid")
    tool: str = Field(description="the tool's name, as GET /tools lists it")
    params: dict[str, Any] = Field(default_factory=dict, description="its arguments, as its definition names them")
    stream: bool = Field(False, description="its output as server-sent events as it comes (exec_shell_command)")


def add_agent_routes(app: FastAPI, state: ServerState) -> None:
    settings = state.settings
    tools = agent_tools.check_tools_option(settings.tools, settings.host, settings.api_key)
    features = [name for name, on in (("server tools", tools), ("the CORS proxy", settings.ui_mcp_proxy)) if on]
    if features:
        logger.warning(
            "security: %s enabled (experimental) - do not expose this server to untrusted environments",
            " and ".join(features),
        )

    @app.get(
        "/tools",
        responses={**answers("the enabled tools: each one's name, permissions and definition", schema=ANY_LIST),
                   **error_responses(401, 403)},
    )  # fmt: skip
    async def list_tools() -> list[dict]:
        if not tools:
            raise disabled("--tools")
        return [tool.to_json() for tool in tools]

    @app.post(
        "/tools",
        response_class=Response,
        responses={
            **answers("the tool's answer (its own failure is {error}); with stream: events", "text/event-stream"),
            **error_responses(400, 401, 403, 404, 413),
        },
    )
    async def call_tool(call: ToolCall, request: Request) -> Response:
        if not tools:
            raise disabled("--tools")
        if request.headers.get("x-tool-runtime"):
            raise APIError(
                400,
                "x-tool-runtime is not supported: tokenmill runs its tools on the server's own machine only",
                param="x-tool-runtime",
            )
        try:
            tool = agent_tools.find_tool(tools, call.tool, call.stream)
        except agent_tools.UnknownTool as e:
            raise APIError(404, str(e), param="tool") from None
        # where they run and how read_file answers come from headers only, never from what a model wrote
        params = {k: v for k, v in call.params.items() if k not in ("cwd", "runtime", "resp_type")}
        if request.headers.get("x-resp-type"):
            params["resp_type"] = request.headers["x-resp-type"]
        cwd = request.headers.get("x-tool-cwd") or None
        try:
            if call.stream:
                return StreamingResponse(_events(tool.run(params, cwd)), media_type="text/event-stream")
            return JSONResponse(await agent_tools.invoke(tool, params, cwd))
        except agent_tools.ToolCallError as e:
            raise APIError(400, str(e), param="params") from None

    proxy_responses = {
        **answers("the target's answer, as it sent it", schema={}),
        **error_responses(400, 401, 403, 413, 502),
    }

    @app.get("/cors-proxy", response_class=Response, responses=proxy_responses)
    async def cors_proxy_get(request: Request) -> Response:
        if not settings.ui_mcp_proxy:
            raise disabled("--ui-mcp-proxy")
        return await proxy(request)

    @app.post("/cors-proxy", response_class=Response, responses=proxy_responses)
    async def cors_proxy_post(request: Request) -> Response:
        if not settings.ui_mcp_proxy:
            raise disabled("--ui-mcp-proxy")
        return await proxy(request)


async def _events(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """llama-server's tool stream: `data: {"chunk": ...}` as output comes, then `data: {"done": true}` (with an
    `error` where the tool failed)."""
    done: dict[str, Any] = {"done": True}
    try:
        async with aclosing(chunks):  # a caller gone: the command is killed now, not when collected
            async for chunk in chunks:
                if chunk:
                    yield f"data: {json.dumps({'chunk': chunk})}\n\n"
    except Exception as e:  # noqa: BLE001 - the stream has begun: its end says what went wrong
        logger.exception("a tool's stream failed")
        done["error"] = str(e) or type(e).__name__
    yield f"data: {json.dumps(done)}\n\n"
