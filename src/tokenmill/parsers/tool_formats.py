"""The syntaxes models were trained to call tools in, read back into calls (vLLM's tool parsers are the anchor):

- hermes: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, one block per call, after any text
  (Qwen2.5, Qwen3, QwQ, Hermes; Qwen's templates teach it).
- llama3_json: `{"name": ..., "parameters": {...}}` as the whole answer, or after `<|python_tag|>`; several
  joined by `;` (Llama 3.1-3.3's templates).
- mistral: `[TOOL_CALLS]` then a JSON list of {"name", "arguments"}, or `NAME[ARGS]{...}` per call (Mistral's
  newer tokenizers).
- constrained: tokenmill's own wrapper, {"name", "arguments"} (a JSON list of them, or in `<tool_call>` tags) as the
  whole answer, which a system message teaches to models whose template shows no tools (structured/tools.py).

A call's region runs from its opening marker to the end of the reply. Closed calls are taken as they complete
(hermes' closing tag), the rest when the reply ends; a reply cut off inside a call (max_tokens) gives that call
as far as it was written, its name (or the one tool_choice names) and its arguments' text so far.
"""

import json
import re
from dataclasses import dataclass

from tokenmill.structured.tools import (
    TAGGED_CALL,
    ToolCall,
    call_of,
    calls_of,
    json_or_none,
    new_call,
    parse_tool_calls,
)

_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
_ARGUMENTS = re.compile(r'"(?:arguments|parameters)"\s*:\s*')


def partial_call(text: str, forced_name: str | None) -> ToolCall:
    """A call cut off while it was written: its name as far as known, its arguments' text so far."""
    name = _NAME.search(text)
    arguments = _ARGUMENTS.search(text)
    rest = text[arguments.end() :] if arguments else ""
    return new_call(forced_name or (json.loads(f'"{name.group(1)}"') if name else ""), rest.rstrip())


@dataclass(frozen=True)
class ToolFormat:
    name: str
    openers: tuple[str, ...]  # markers that open the call region wherever they appear in the answer
    leading: tuple[str, ...] = ()  # markers that open it only as the answer's first text

    def closed_calls(self, region: str, names: set[str]) -> tuple[list[ToolCall], int]:
        """The calls of `region` complete so far, taken out as soon as they close, and how many characters of it
        they used (hermes: whole blocks; the others end only with the reply)."""
        if self.name != "hermes":
            return [], 0
        calls, used = [], 0
        for block in TAGGED_CALL.finditer(region):
            if region[used : block.start()].strip():
                break
            call = call_of(json_or_none(block.group(1)), names)
            if call is None:
                break
            calls.append(call)
            used = block.end()
        return calls, used

    def final_calls(self, region: str, names: set[str]) -> list[ToolCall] | None:
        """The calls the rest of the region (the reply has ended) holds; None if it is not calls."""
        text = region.strip()
        if not text:
            return []
        if self.name == "hermes":
            calls, used = self.closed_calls(text, names)
            return calls if not text[used:].strip() else None
        if self.name == "llama3_json":
            text = text.removeprefix("<|python_tag|>").strip()
            return calls_of([json_or_none(part) for part in re.split(r"\s*;\s*(?=\{)", text)], names)
        if self.name == "mistral":
            return _mistral_calls(text.removeprefix("[TOOL_CALLS]").strip(), names)
        return parse_tool_calls(text, [{"name": n} for n in names])  # constrained

    def cut_call(self, region: str, names: set[str], forced_name: str | None) -> list[ToolCall]:
        """The calls of a region cut off by max_tokens: the complete ones, then the one being written."""
        calls, used = self.closed_calls(region, names)
        rest = region[used:]
        if rest.strip():
            if self.name == "mistral" and "[ARGS]" in rest:
                name, _, arguments = rest.removeprefix("[TOOL_CALLS]").partition("[ARGS]")
                calls.append(new_call(forced_name or name.strip(), arguments.rstrip()))
            else:
                calls.append(partial_call(rest, forced_name))
        return calls


def _mistral_calls(text: str, names: set[str]) -> list[ToolCall] | None:
    if "[ARGS]" in text:  # NAME[ARGS]{...} per call, each after its own [TOOL_CALLS]
        parts = [part.partition("[ARGS]") for part in text.split("[TOOL_CALLS]")]
        return calls_of([{"name": n.strip(), "arguments": json_or_none(a.strip())} for n, _, a in parts], names)
    value = json_or_none(text)
    return calls_of(value if isinstance(value, list) else [value], names)


FORMATS = {
    "hermes": ToolFormat("hermes", ("<tool_call>",)),
    "llama3_json": ToolFormat("llama3_json", ("<|python_tag|>",), ("{",)),
    "mistral": ToolFormat("mistral", ("[TOOL_CALLS]",)),
    "constrained": ToolFormat("constrained", (), ("{", "[", "<tool_call>")),
}
