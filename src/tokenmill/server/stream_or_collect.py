"""How every API ends a generating call, whatever its shape: streamed (events as the outputs come) or collected
(every prompt's final output, then one body). Each API writes its own events and bodies; what happens when the
client leaves, when the engine aborts a request or when a stream fails is decided here, once.
"""

from collections.abc import AsyncIterator, Callable

from fastapi import Request

from tokenmill.outputs import RequestOutput
from tokenmill.server.errors import APIError, guarded_stream, sse_error
from tokenmill.server.generation import Generation, GenerationStream
from tokenmill.server.state import ServerState

SSE = "text/event-stream"
NDJSON = "application/x-ndjson"  # Ollama's streams

SHUTDOWN_ERROR = APIError(
    503, "the server is shutting down; the request was stopped", "server_error", code="server_shutdown"
)


def aborted_error(state: ServerState, message: str = "the request was aborted") -> APIError:
    """The error for a request the engine aborted: 503 while the server shuts down, else a 500."""
    return SHUTDOWN_ERROR if state.shutting_down else APIError(500, message, "server_error")


def streamed(
    state: ServerState,
    generation: Generation,
    events: AsyncIterator[str],
    headers: dict[str, str] | None = None,
    error_event: Callable[[APIError], str] = sse_error,
    media_type: str = SSE,
    on_close: Callable[[], None] | None = None,
) -> GenerationStream:
    """The call's events as its response: a stream that fails ends with the API's error event (`error_event`),
    never a cut connection, and counts as an internal error; the call closes however the response ends (its
    client leaving included: what still runs is aborted), then `on_close` runs."""
    guarded = guarded_stream(events, state.metrics.internal_errors.inc, error_event)
    return GenerationStream(guarded, generation, headers=headers, media_type=media_type, on_close=on_close)


async def collected(
    state: ServerState,
    generation: Generation,
    http_request: Request,
    on_output: Callable[[int, RequestOutput], None] | None = None,
) -> list[RequestOutput]:
    """Every prompt's final output, in prompt order (`on_output` sees each output as it comes). A client that
    leaves meanwhile: the call is aborted and ClientDisconnected raised (the app answers 499, which nobody reads);
    a request the engine aborted (the server stopping): aborted_error."""
    finals = await generation.collect(http_request, on_output)
    if any(o.finish_reason == "abort" for out in finals for o in out.outputs):
        raise aborted_error(state)
    return finals


def openai_usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; prompt_tokens_details.cached_tokens counts prompt tokens served from the prefix
    cache."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def usage_so_far(prompt_tokens: int, completion_tokens: int) -> dict:
    """The usage a streamed chunk carries under vLLM's continuous_usage_stats (the counts so far, no details)."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
