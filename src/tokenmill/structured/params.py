"""What a request's output must match, with vLLM's names (`StructuredOutputsParams`). No torch, no grammar library
here: the constraint is compiled when the request reaches the engine (grammars.py)."""

import json
from dataclasses import dataclass, field
from typing import Any

from tokenmill.errors import InvalidParameterError

KINDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one of: `json` (a JSON schema, as a dict or its JSON text), `regex` (the whole output matches it),
    `choice` (the output is one of these strings), `grammar` (a Lark grammar, or GBNF as llama.cpp writes it), or
    `json_object=True` (any JSON object)."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    # A reasoning model's thinking comes first, free, and the constraint applies to the answer after it: "before"
    # (the reply may open a <think> block) or "thinking" (it starts inside one, which the prompt opened)
    thinking: str | None = None
    # (or "harmony": gpt-oss's analysis message may come first)
    # literal text around the constrained part: a tool-call syntax's tags, e.g. ("<tool_call>\n", "\n</tool_call>")
    wrap: tuple[str, str] | None = None
    # harmony's markers in `wrap` and its analysis are the tokenizer's special tokens (gpt-oss's), not text
    special_markers: bool = False
    # the request field the constraint came from, named in errors (the server's response_format, guided_json...)
    source: str = field(default="structured_outputs", compare=False, repr=False)

    def __post_init__(self) -> None:
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise InvalidParameterError(
                f"structured_outputs needs exactly one of {', '.join(KINDS)}; got {', '.join(given) or 'none'}",
                self.source,
            )
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as exc:
                    raise InvalidParameterError(f"the JSON schema is not valid JSON: {exc}", self.source) from exc
            if not isinstance(schema, dict | bool):
                raise InvalidParameterError("a JSON schema must be a JSON object", self.source)
        if self.regex is not None and not isinstance(self.regex, str):
            raise InvalidParameterError("regex must be a string", self.source)
        if self.grammar is not None and not isinstance(self.grammar, str):
            raise InvalidParameterError("grammar must be a string", self.source)
        if self.choice is not None and (
            not isinstance(self.choice, list) or not self.choice or not all(isinstance(c, str) for c in self.choice)
        ):
            raise InvalidParameterError("choice must be a non-empty list of strings", self.source)
        if self.thinking not in (None, "before", "thinking", "harmony"):
            raise InvalidParameterError("thinking must be 'before', 'thinking' or 'harmony'", self.source)
        if self.wrap is not None and (len(self.wrap) != 2 or not all(isinstance(w, str) for w in self.wrap)):
            raise InvalidParameterError("wrap must be two strings", self.source)
        if not isinstance(self.json_object, bool):
            raise InvalidParameterError("json_object must be true or false", self.source)

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def cache_key(self) -> tuple[str, str]:
        """Equal for equal constraints (a schema's key order aside), to compile each distinct one once."""
        value = getattr(self, self.kind)
        if self.kind == "json":
            value = json.loads(value) if isinstance(value, str) else value
        text = json.dumps(value, sort_keys=True) if not isinstance(value, str) else value
        if self.thinking is None and self.wrap is None:
            return self.kind, text
        return f"{self.kind}:{self.thinking}:{json.dumps(self.wrap)}:{self.special_markers}", text
