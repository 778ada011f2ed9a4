"""`tokenmill serve` with several models (--model given more than once, or --models-dir): uvicorn running the
router's app (app.py). It listens at once; no model loads before a request names it (as Ollama's). On SIGTERM it
stops taking connections, lets the answers in flight finish (--shutdown-grace), then stops every model's process."""

import logging

import uvicorn

from tokenmill.config.server import ServerSettings
from tokenmill.server.model_router.app import create_router_app
from tokenmill.server.model_router.catalog import Catalog, ServableModel
from tokenmill.server.model_router.router import ModelRouter
from tokenmill.server.serve import bind

logger = logging.getLogger("tokenmill.server")


def serve_models(settings: ServerSettings, models: list[ServableModel]) -> int:
    catalog = Catalog(models, settings.models_dir)
    served = catalog.all()
    if not served:
        logger.error("no model to serve: --models-dir %s holds none, and no --model was given", settings.models_dir)
        return 2
    router = ModelRouter(settings, catalog)
    config = uvicorn.Config(
        create_router_app(router),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level or "info",
        access_log=settings.access_log,
        timeout_graceful_shutdown=int(settings.shutdown_grace_s) + 5,
    )
    logger.info(
        "serving %d models, each loaded on its first request (keep_alive %s, at most %d loaded%s): %s",
        len(served),
        settings.keep_alive,
        settings.max_loaded_models,
        f", within {settings.memory_budget}" if settings.memory_budget else "",
        ", ".join(m.name for m in served),
    )
    server = uvicorn.Server(config)
    hosts = [h.strip() for h in settings.host.split(",") if h.strip()]
    server.run(sockets=[bind(h, settings.port) for h in hosts] if len(hosts) > 1 else None)
    return 0
