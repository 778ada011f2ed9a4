"""The OpenAI-compatible HTTP server (FastAPI + uvicorn) over the async engine."""

DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024  # bodies above this get 413 before they are parsed (--max-request-bytes)
