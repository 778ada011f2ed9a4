"""tokenmill's cache directory: compiled kernels, models assembled from packages. TOKENMILL_CACHE_DIR moves it."""

import os
from pathlib import Path


def cache_dir() -> Path:
    root = os.environ.get("TOKENMILL_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tokenmill"
    )
    return Path(root)
