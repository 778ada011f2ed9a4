"""Tool calls on /v1/chat/completions: the request's `tools` and `tool_choice` checked, the tools shown to the
model, the call enforced by a JSON schema when it is required, and the model's reply read back as calls.

A call is written as a JSON object {"name": ..., "arguments": {...}} (several: a JSON list of them), bare or
inside <tool_call>...</tool_call> as Hermes- and Qwen-style templates teach their models. A chat template that
takes `tools` renders them itself; for one that does not (the bundled SmolLM2's), the tools and the call format
are described in a system message (FALLBACK_INSTRUCTIONS), prepended to the first system message or added
before the conversation. An assistant message with `tool_calls` in the history is shown to such a template as
its calls' JSON, and `role: "tool"` messages as the template renders any role.
"""

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from tokenmill.errors import InvalidParameterError

NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
FALLBACK_INSTRUCTIONS = (
    "You can call functions. To call one, reply with only a JSON object of the form "
    '{{"name": <function name>, "arguments": <an object of its arguments>}} and nothing else. '
    "The functions:\n{functions}"
)
TAGGED_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)  # a call in Hermes/Qwen tags


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # the arguments as JSON text, as OpenAI's API carries them
    id: str

    def as_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def check_tools(tools: Any) -> list[dict[str, Any]]:
    """OpenAI's `tools` -> their functions ({"name", "description", "parameters"}), or InvalidParameterError."""
    if not isinstance(tools, list) or not tools:
        raise InvalidParameterError("tools must be a non-empty list", "tools")
    functions, names = [], set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise InvalidParameterError(f"{where} must be {{'type': 'function', 'function': {{...}}}}", "tools")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise InvalidParameterError(f"{where}.function must be an object", "tools")
        name = function.get("name")
        if not isinstance(name, str) or not NAME.match(name):
            raise InvalidParameterError(f"{where}.function.name must be 1-64 letters, digits, _ . or -", "tools")
        if name in names:
            raise InvalidParameterError(f"{where}: a second function named {name!r}", "tools")
        names.add(name)
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
            raise InvalidParameterError(f"{where}.function.parameters must be a JSON schema of an object", "tools")
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise InvalidParameterError(f"{where}.function.description must be a string", "tools")
        functions.append({"name": name, "description": description or "", "parameters": parameters})
    return functions


def chosen_functions(functions: list[dict[str, Any]], tool_choice: Any) -> tuple[str, list[dict[str, Any]]]:
    """(mode, the functions the model may call): mode "none", "auto" or "required" (a named function is
    "required" with that one function)."""
    if tool_choice is None:
        return ("auto", functions) if functions else ("none", [])
    if tool_choice in ("none", "auto", "required"):
        if tool_choice != "none" and not functions:
            raise InvalidParameterError(f"tool_choice {tool_choice!r} needs tools", "tool_choice")
        return tool_choice, functions if tool_choice != "none" else []
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        name = (tool_choice.get("function") or {}).get("name")
        match = [f for f in functions if f["name"] == name]
        if not match:
            known = ", ".join(f["name"] for f in functions) or "none"
            raise InvalidParameterError(f"tool_choice names function {name!r}, not in tools ({known})", "tool_choice")
        return "required", match
    raise InvalidParameterError(
        "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}",
        "tool_choice",
    )


def call_schema(functions: list[dict[str, Any]], arguments_key: str = "arguments") -> dict[str, Any]:
    """The JSON schema of one call of one of these functions, arguments matching its parameters. Parameters with
    references ("$ref": "#/$defs/X", as pydantic writes nested models) are moved under the call schema's own
    $defs, each function's under names of its own, with their references rewritten: inside the call schema a
    pointer from the parameters' root would no longer resolve. `arguments_key`: Llama 3's calls say "parameters".
    Objects take only the properties they declare unless they say otherwise (closed_objects)."""
    definitions: dict[str, Any] = {}
    options = []
    for i, f in enumerate(functions):
        arguments = closed_objects(f["parameters"])
        if _has_local_ref(arguments):
            arguments = _hoisted(arguments, f"f{i}", definitions)
        options.append(
            {
                "type": "object",
                "properties": {"name": {"const": f["name"]}, arguments_key: arguments},
                "required": ["name", arguments_key],
                "additionalProperties": False,
            }
        )
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return {**schema, "$defs": definitions} if definitions else schema


# the keys of a schema whose values are schemas, and those whose values are lists or maps of schemas
_SUBSCHEMA = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def closed_objects(schema: Any) -> Any:
    """`schema` with every object schema that says nothing of additionalProperties closed to the properties it
    declares, as OpenAI's strict mode and vLLM's grammar backends read a tool's parameters (a model that may add
    keys invents them: `id`, `tags`...). An object that allows more says so and keeps it."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA:
        if isinstance(out.get(key), dict):
            out[key] = closed_objects(out[key])
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_objects(s) for s in out[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_objects(s) for name, s in out[key].items()}
    is_object = out.get("type") == "object" or "properties" in out
    if is_object and "additionalProperties" not in out and "patternProperties" not in out:
        out["additionalProperties"] = False
    return out


def _has_local_ref(value: Any) -> bool:
    if isinstance(value, dict):
        ref = value.get("$ref")
        return (isinstance(ref, str) and ref.startswith("#")) or any(_has_local_ref(v) for v in value.values())
    return isinstance(value, list) and any(_has_local_ref(v) for v in value)


def _hoisted(parameters: dict[str, Any], prefix: str, definitions: dict[str, Any]) -> dict[str, Any]:
    """parameters' own definitions ($defs, definitions) become definitions[prefix + "_" + name], parameters
    itself definitions[prefix]; its local references are rewritten to point there -> a reference to it."""

    def rewrite(ref: str) -> str:
        for section in ("$defs", "definitions"):
            head = f"#/{section}/"
            if ref.startswith(head):
                name, _, rest = ref[len(head) :].partition("/")
                return f"#/$defs/{prefix}_{name}" + (f"/{rest}" if rest else "")
        return f"#/$defs/{prefix}" + ref[1:]  # "#" or another path from the parameters' root

    def walk(value: Any) -> Any:
        if isinstance(value, dict):
            return {
                k: rewrite(v) if k == "$ref" and isinstance(v, str) and v.startswith("#") else walk(v)
                for k, v in value.items()
            }
        return [walk(v) for v in value] if isinstance(value, list) else value

    own = {k: v for k, v in parameters.items() if k not in ("$defs", "definitions")}
    for section in ("$defs", "definitions"):
        for name, sub in (parameters.get(section) or {}).items():
            definitions[f"{prefix}_{name}"] = walk(sub)
    definitions[prefix] = walk(own)
    return {"$ref": f"#/$defs/{prefix}"}


def template_messages(
    messages: list[dict[str, Any]], functions: list[dict[str, Any]], template_takes_tools: bool
) -> list[dict[str, Any]]:
    """The conversation as the chat template should see it (see the module's docstring)."""
    if template_takes_tools:
        return messages
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if m.get("role") == "assistant" and calls and not m.get("content"):
            shown = [_call_text(c) for c in calls]
            m = {**m, "content": shown[0] if len(shown) == 1 else "[" + ", ".join(shown) + "]"}
            m.pop("tool_calls")
        out.append(m)
    if not functions:
        return out
    listing = "\n".join(json.dumps({"type": "function", "function": f}, ensure_ascii=False) for f in functions)
    instructions = FALLBACK_INSTRUCTIONS.format(functions=listing)
    if out and out[0].get("role") == "system" and isinstance(out[0].get("content"), str):
        return [{**out[0], "content": out[0]["content"] + "\n\n" + instructions}, *out[1:]]
    return [{"role": "system", "content": instructions}, *out]


def _call_text(call: Any) -> str:
    function = call.get("function", {}) if isinstance(call, dict) else {}
    arguments = function.get("arguments", "{}")
    try:
        parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
    except ValueError:
        parsed = arguments
    return json.dumps({"name": function.get("name"), "arguments": parsed}, ensure_ascii=False)


def parse_tool_calls(text: str, functions: list[dict[str, Any]]) -> list[ToolCall] | None:
    """The calls the reply makes, or None when it is not (only) calls of these functions."""
    names = {f["name"] for f in functions}
    tagged = TAGGED_CALL.findall(text)
    if tagged and not TAGGED_CALL.sub("", text).strip():
        candidates: list[Any] = []
        for body in tagged:
            value = json_or_none(body)
            if value is None:
                return None
            candidates += value if isinstance(value, list) else [value]
    else:
        value = json_or_none(text.strip())
        if value is None:
            return None
        candidates = value if isinstance(value, list) else [value]
    return calls_of(candidates, names)


def calls_of(values: list[Any], names: set[str]) -> list[ToolCall] | None:
    """Each value as a call (call_of), or None unless there are some and every one is."""
    calls = [call_of(v, names) for v in values]
    return [c for c in calls if c is not None] if calls and None not in calls else None


def call_of(value: Any, names: set[str]) -> ToolCall | None:
    """{"name": one of `names`, "arguments" (or Llama's "parameters"): an object} as a call, else None."""
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    arguments = value.get("arguments", value.get("parameters"))
    return new_call(value["name"], arguments) if isinstance(arguments, dict) else None


def new_call(name: str, arguments: Any) -> ToolCall:
    """A call with a fresh id; `arguments` an object or its JSON text as written."""
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ToolCall(name, text, f"call_{uuid.uuid4().hex[:24]}")


def json_or_none(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None
