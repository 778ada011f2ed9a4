"""A request body as parsed JSON, before its API's model reads it: JSON's whole-number floats as ints (3.0 is the
integer 3) and every string checked to be valid Unicode (JSON can carry a lone surrogate, "\\ud800", or its bytes
in CESU-8, which no tokenizer can take)."""

from typing import Any


def normalize_json(body: Any) -> str | None:
    """Turn whole-number floats into ints in place (JSON's 3.0 is the integer 3), and return the path of the first
    string that is not valid Unicode (a lone surrogate), else None. Iterative: a body may nest deeply."""
    stack: list[tuple[Any, str]] = [(body, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, dict):
            for key, item in value.items():
                where = f"{path}.{key}" if path else str(key)
                if not _is_unicode(key):
                    return path or "the body"
                if isinstance(item, float) and item.is_integer():
                    value[key] = int(item)
                stack.append((item, where))
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, float) and item.is_integer():
                    value[i] = int(item)
                stack.append((item, f"{path}.{i}"))
        elif isinstance(value, str) and not _is_unicode(value):
            return path or "the body"
    return None


def _is_unicode(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
