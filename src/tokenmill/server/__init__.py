"""The OpenAI-compatible HTTP server (FastAPI + uvicorn) over the async engine."""

DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024  # bodies above this get 413 before they are parsed (--max-request-bytes)
DEFAULT_RESPONSES_STORE_BYTES = 64 * 1024 * 1024  # the Responses API's stored responses, at most (oldest go first)
