"""Checking, before anything is loaded or started, that the server can listen where it was told to."""

import socket


def listen_problem(host: str, port: int) -> str | None:
    """Why (host, port) cannot be listened on (port in use, unknown address, no permission), or None."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        return f"cannot resolve {host!r}: {exc.strerror}"
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: a closing socket is no conflict
        try:
            s.bind(address)
        except OSError as exc:
            return exc.strerror or str(exc)
    return None
