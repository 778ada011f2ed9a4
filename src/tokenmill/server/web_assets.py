"""The request explorer's page (/, with its /favicon.ico) and the files a browser asks a server's web page for
beside it, as llama-server serves its web UI's: /sw.js, /manifest.webmanifest and /_app/version.json (revalidated
on every load: `Cache-Control: no-cache`); all public (no API key: they hold no data; the page asks for the key).
The one-model server and the several-models router serve them alike.

tokenmill's page is the request explorer, not llama.cpp's web UI, so /sw.js is the worker that removes itself: a
browser that used llama.cpp's UI at the same address keeps its service worker, which would go on showing that UI,
until the worker's update check fetches this one (what llama-server answers when its own UI is off or replaced; so
with --no-explorer too). The manifest names the explorer as an installable page; /_app/version.json (what
llama.cpp's UI polls for a new build) says tokenmill's version."""

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse, JSONResponse

from tokenmill import __version__

STATIC_DIR = Path(__file__).with_name("static")
PUBLIC_ASSETS = ("/sw.js", "/manifest.webmanifest", "/_app/version.json")
NO_CACHE = {"Cache-Control": "no-cache"}


def add_web_assets(app: FastAPI, explorer: bool) -> None:
    @app.get("/sw.js", include_in_schema=False)
    async def service_worker() -> FileResponse:
        return FileResponse(STATIC_DIR / "sw.js", media_type="application/javascript", headers=NO_CACHE)

    if not explorer:
        return

    @app.get("/", include_in_schema=False)
    async def explorer_page() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html")

    @app.get("/favicon.ico", include_in_schema=False)
    async def favicon() -> FileResponse:
        return FileResponse(STATIC_DIR / "favicon.svg", media_type="image/svg+xml")

    @app.get("/manifest.webmanifest", include_in_schema=False)
    async def manifest() -> FileResponse:
        return FileResponse(
            STATIC_DIR / "manifest.webmanifest", media_type="application/manifest+json", headers=NO_CACHE
        )

    @app.get("/_app/version.json", include_in_schema=False)
    async def version_file() -> JSONResponse:
        return JSONResponse({"version": __version__}, headers=NO_CACHE)
