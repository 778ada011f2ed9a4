"""A config option given as a dict or its JSON (the command line's form), read as a dataclass's fields."""

import json
from dataclasses import fields
from typing import Any

from tokenmill.errors import InvalidParameterError


def json_object_fields(cls: type, value: "dict[str, Any] | str", option: str) -> dict[str, Any]:
    """`value` (a dict, or a JSON object) as fields of the dataclass `cls`; a 400 naming `option` for anything else:
    not JSON, not an object, a field cls does not have."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise InvalidParameterError(f"{option}: is not JSON: {exc}", option) from exc
    if not isinstance(value, dict):
        raise InvalidParameterError(f"{option}: must be a JSON object", option)
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise InvalidParameterError(
            f"{option}: unknown field(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})", option
        )
    return value
