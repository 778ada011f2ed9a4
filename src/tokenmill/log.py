"""tokenmill's own log handler (as vLLM has): INFO to stderr unless TOKENMILL_LOG_LEVEL says otherwise."""

import logging
import os

_FORMAT = "%(asctime)s.%(msecs)03d %(levelname)s %(name)s: %(message)s"


def setup_logging(level: str | int | None = None) -> None:
    logger = logging.getLogger("tokenmill")
    if not any(getattr(h, "_tokenmill", False) for h in logger.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%H:%M:%S"))
        handler._tokenmill = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(level or os.environ.get("TOKENMILL_LOG_LEVEL", "INFO").upper())
