"""Why a request's prompt (or an embeddings call's input) has no shape the server takes, in words a client can act
on: one check for every API that takes prompts as OpenAI's completions do."""

from typing import Any

MAX_PROMPTS_PER_REQUEST = 128  # a list of prompts becomes one engine request each (as many as n may ask for)

PROMPT_SHAPES = "a string, a list of strings, a list of token ids, or a list of token-id lists"


def prompt_problem(value: Any, limit: int = MAX_PROMPTS_PER_REQUEST, what: str = "prompt") -> str | None:
    """Why `value` is no valid prompt (at most `limit` of them; `what` they are called), or None when it is one."""
    if isinstance(value, str):
        return None if value else f"the {what} is empty"
    if not isinstance(value, list):
        return f"a {what} is {PROMPT_SHAPES}, not {_json_kind(value)}"
    if not value:
        return f"the {what} list is empty"
    kinds = sorted({_json_kind(item) for item in value})
    if len(kinds) > 1:
        return f"a {what} is {PROMPT_SHAPES}; this list mixes {' and '.join(kinds)}"
    kind = kinds[0]
    if kind == "an integer":
        return _token_ids_problem(value, f"the {what}")
    if kind not in ("a string", "a list"):
        return f"a {what} is {PROMPT_SHAPES}; this list holds {kind}"
    if len(value) > limit:
        return f"{len(value)} {what}s in one request; at most {limit} are allowed"
    for i, item in enumerate(value):
        if not item:
            return f"{what} {i} is empty"
        if kind == "a list":
            if any(_json_kind(t) != "an integer" for t in item):
                return f"{what} {i} is a list, so it must hold token ids (integers)"
            problem = _token_ids_problem(item, f"{what} {i}")
            if problem is not None:
                return problem
    return None


def _token_ids_problem(ids: list[int], what: str) -> str | None:
    negative = next((t for t in ids if t < 0), None)
    return None if negative is None else f"{what} holds token id {negative}; token ids are 0 or more"


_KINDS = ((bool, "a boolean"), (str, "a string"), (int, "an integer"), (float, "a number"), (list, "a list"))


def _json_kind(value: Any) -> str:
    """A JSON value's kind, in words (for error messages); bool first, as it is an int in Python."""
    return next(
        (name for kind, name in _KINDS if isinstance(value, kind)), "an object" if value is not None else "null"
    )
