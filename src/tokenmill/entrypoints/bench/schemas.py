"""The JSON schema the structured-output benchmarks compile: what a response_format usually looks like (nested
object, bounded array, enum, bounded integer, a pattern, no extra keys). Plain data: benchmarks/grammar_libraries.py
imports it in the peers' venv, without tokenmill's dependencies."""

TYPICAL_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 5},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "tags"],
    "additionalProperties": False,
}
