"""Ollama's keep_alive: how long a model stays loaded after its last request. A number is seconds; a string a Go
duration ("5m", "1h30m", "2.5s", "-1m") or seconds ("300"); 0 unloads at once; a negative value keeps the model
loaded (None here: forever)."""

import math
import re

from tokenmill.errors import InvalidParameterError

_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_PART = re.compile(r"([0-9]*\.?[0-9]+)(ns|us|µs|ms|s|m|h)")


def parse_keep_alive(value: float | int | str) -> float | None:
    """Seconds to stay loaded, 0.0 for at once, None for forever; InvalidParameterError for anything else."""
    if isinstance(value, bool):
        raise InvalidParameterError(f"keep_alive {value!r} is no duration", "keep_alive")
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str):
        seconds = _seconds(value.strip())
    else:
        raise InvalidParameterError(f"keep_alive {value!r} is no duration", "keep_alive")
    if math.isnan(seconds):
        raise InvalidParameterError("keep_alive is not a number", "keep_alive")
    return None if seconds < 0 or math.isinf(seconds) else seconds


def _seconds(text: str) -> float:
    try:
        return float(text)  # "300", "-1", "0"
    except ValueError:
        pass
    sign = -1.0 if text.startswith("-") else 1.0
    body = text.lstrip("+-")
    parts = _PART.findall(body)
    if not body or "".join(n + u for n, u in parts) != body:
        raise InvalidParameterError(
            f"keep_alive {text!r} is no duration (examples: 5m, 1h30m, 30s, 0, -1)", "keep_alive"
        )
    return sign * sum(float(n) * _UNITS[u] for n, u in parts)
