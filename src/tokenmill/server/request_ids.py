"""The id of an API call: the client's own (an `X-Request-Id` header, as vLLM honours it) or a random one.

The call's id in responses and in the engine is "<prefix>-<id>" (e.g. "chatcmpl-<id>"); the response's
`X-Request-Id` header echoes <id>. A client that names its call can follow it from the moment it is sent (the
request explorer watches the engine's steps for it), so the id must be short, printable, and not in flight.
"""

import re
import uuid

from fastapi import Request

from tokenmill.server.errors import APIError

HEADER = "X-Request-Id"
_VALID = re.compile(r"[A-Za-z0-9._-]{1,64}")


def call_id(request: Request, prefix: str) -> tuple[str, str]:
    """(the id the client named or a new one, the call's id "<prefix>-<that id>"); 400 for an id that is not a
    short printable token."""
    given = request.headers.get(HEADER)
    if given is None:
        base = uuid.uuid4().hex
    elif _VALID.fullmatch(given):
        base = given
    else:
        raise APIError(
            400,
            f"the {HEADER} header must be 1 to 64 letters, digits, '-', '_' or '.'",
            param=HEADER,
            code="invalid_request_id",
        )
    return base, f"{prefix}-{base}"


def echo(base: str) -> dict[str, str]:
    """The response headers that name the call."""
    return {HEADER: base}
