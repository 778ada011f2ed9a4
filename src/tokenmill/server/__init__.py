"""The OpenAI-compatible HTTP server (FastAPI + uvicorn) over the async engine. Its options: config/server.py."""
