"""Regular expressions as JSON Schema reads them (ECMA-262's dialect), written for llguidance's regex engine.

llguidance reads a regex as Rust's regex crate does, with Unicode classes: `\\d` is any Unicode decimal digit
(`\\d{4}` takes '🯸🯸🯸🯸'), `\\w` any letter of any script, `\\s` Unicode's White_Space, `.` anything but \\n.
JSON Schema's `pattern` is ECMA-262's (JavaScript's) dialect, and so is what tokenmill takes for a top-level
`regex` (vLLM's structured_outputs.regex, guided_regex): `\\d` is [0-9], `\\w` [A-Za-z0-9_], `\\s` ECMA's white
space and line terminators, `.` anything but a line terminator. Each of these is written out as an explicit class.
Inside a class, `[`, `&&`, `~~` and `--` are literals in ECMA-262 (Rust would open a nested class or take a set
operation) and are escaped; `[]` matches nothing and `[^]` anything. Everything else passes as it is (the two
dialects agree on the rest that llguidance supports).
"""

from typing import Any

DIGIT = "0-9"
WORD = "0-9A-Za-z_"
# ECMA-262's WhiteSpace and LineTerminator: \t \v \f space, NBSP, ZWNBSP, the Zs category, \n \r LS PS
SPACE = "\\t\\n\\v\\f\\r \\x{a0}\\x{1680}\\x{2000}-\\x{200a}\\x{2028}\\x{2029}\\x{202f}\\x{205f}\\x{3000}\\x{feff}"
LINE_TERMINATORS = "\\n\\r\\x{2028}\\x{2029}"
CLASSES = {"d": DIGIT, "w": WORD, "s": SPACE}


def ecma_to_rust(pattern: str) -> str:
    """An ECMA-262 regex as Rust's regex crate reads it with the same meaning."""
    out: list[str] = []
    in_class = False
    i = 0
    while i < len(pattern):
        c = pattern[i]
        if c == "\\" and i + 1 < len(pattern):
            nxt = pattern[i + 1]
            lower = nxt.lower()
            if lower in CLASSES:
                negated = "^" if nxt != lower else ""
                out.append(f"[{negated}{CLASSES[lower]}]")  # a class in a class: Rust's nested class, a union
            else:
                out.append(c + nxt)
            i += 2
            continue
        if in_class:
            if c == "]":
                in_class = False
                out.append(c)
            elif c == "[":
                out.append("\\[")
            elif c in "&~-" and pattern[i + 1 : i + 2] == c:  # Rust's set operators (&&, ~~, --): literals here
                out.append(f"\\{c}")
            else:
                out.append(c)
        elif c == "[":
            # ECMA-262's "[]" matches nothing and "[^]" anything (Rust would take the ']' for a literal)
            empty = next((e for e in ("[]", "[^]") if pattern.startswith(e, i)), None)
            if empty is not None:
                out.append(f"[{'' if empty == '[^]' else '^'}\\x{{0}}-\\x{{10ffff}}]")
                i += len(empty)
                continue
            in_class = True
            out.append(c)
            if pattern.startswith("^", i + 1):
                out.append("^")
                i += 1
        elif c == ".":
            out.append(f"[^{LINE_TERMINATORS}]")
        else:
            out.append(c)
        i += 1
    return "".join(out)


# the keywords whose values are schemas, lists of schemas, or objects of schemas (JSON Schema 2020-12 and draft 7)
_SCHEMA = ("additionalProperties", "items", "contains", "not", "if", "then", "else", "propertyNames")
_SCHEMA += ("unevaluatedProperties", "unevaluatedItems", "additionalItems")
_SCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
_SCHEMA_OBJECTS = ("properties", "$defs", "definitions", "dependentSchemas")


def ecma_schema(schema: Any) -> Any:
    """A JSON schema whose `pattern`s and `patternProperties`' keys are written for Rust's regex crate with their
    ECMA-262 meaning (values such as `const`, `enum` and `default` are left as they are)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if isinstance(out.get("pattern"), str):
        out["pattern"] = ecma_to_rust(out["pattern"])
    if isinstance(out.get("patternProperties"), dict):
        out["patternProperties"] = {ecma_to_rust(k): ecma_schema(v) for k, v in out["patternProperties"].items()}
    for key in _SCHEMA:
        if key in out:
            out[key] = [ecma_schema(s) for s in out[key]] if isinstance(out[key], list) else ecma_schema(out[key])
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [ecma_schema(s) for s in out[key]]
    for key in _SCHEMA_OBJECTS:
        if isinstance(out.get(key), dict):
            out[key] = {name: ecma_schema(s) for name, s in out[key].items()}
    return out
