"""Which Host names and which web-page origins a server on a user's own machine answers.

Two attacks reach a server that listens on 127.0.0.1 without a key: a page on any site calling it from the
user's browser (cross-origin requests: refused unless the origin is allowed, even the "simple" ones a browser
sends without asking first), and DNS rebinding (a page whose own name the attacker's DNS points at 127.0.0.1, so
its requests are same-origin: the Host header still carries the attacker's name, and is refused). Ollama's rules,
which the issue follows: Host must be a name the server is known by, and only local pages (and those given) may
call it.

Allowed Host names: localhost (and *.localhost), any IP address (a rebinding page can only send its DNS name),
the --host values, the machine's own name when listening on every interface (0.0.0.0, ::), and --allowed-hosts
(`*`: any). Allowed origins: http(s) pages on localhost, loopback addresses, any port; the page's own server
(the request explorer: Origin is the Host it was loaded from); and --allowed-origins (`*`: any). A server with an
API key allows pages of any origin, as llama-server does: the key guards every API path, and a browser never sends
it by itself, so a page can only call what its user gave it the key for (what needs no key, /health, /version,
/metrics without --metrics-require-key, any client on the network reads too), unless the server's agent tools are
on (--tools: files and a shell): then only local pages and --allowed-origins, key or not, as llama-server narrows
its CORS origins to localhost with them. Without a key, llama-server's default lets any site on the web drive a
server on its visitor's machine; tokenmill's does not.
"""

import ipaddress
import socket
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from tokenmill.config.server import ServerSettings

ANY = "*"
UNSPECIFIED_HOSTS = ("", "0.0.0.0", "::", "[::]")


@dataclass(frozen=True)
class OriginPolicy:
    listen_host: str = "127.0.0.1"  # --host (one address or several, comma-separated)
    allowed_hosts: tuple[str, ...] = ()  # --allowed-hosts, beyond the names above
    allowed_origins: tuple[str, ...] = ()  # --allowed-origins, beyond the local ones
    key_required: bool = False  # --api-key: the key guards the API, so pages of any origin may call it
    tools_enabled: bool = False  # --tools: pages of other origins may not, key or not
    _host_names: frozenset[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        listening = [h.strip() for h in self.listen_host.split(",")] if self.listen_host else [""]
        names = {*(_host_name(h) for h in listening), *(_host_name(h) for h in self.allowed_hosts)}
        if any(h in UNSPECIFIED_HOSTS for h in listening):
            names |= {socket.gethostname().lower(), socket.getfqdn().lower()}
        object.__setattr__(self, "_host_names", frozenset(names))

    @classmethod
    def of(cls, settings: ServerSettings) -> "OriginPolicy":
        """The policy a server's settings give (the one-model server's and the several-models router's alike)."""
        s = settings
        return cls(s.host, tuple(s.allowed_hosts), tuple(s.allowed_origins), bool(s.api_key), bool(s.tools))

    @property
    def any_host(self) -> bool:
        return ANY in self.allowed_hosts

    @property
    def any_origin(self) -> bool:
        return ANY in self.allowed_origins or (self.key_required and not self.tools_enabled)

    def host_allowed(self, host_header: str | None) -> bool:
        """Whether a request's Host header names this server (no header: a client that is no browser)."""
        if host_header is None or self.any_host:
            return True
        name = _host_name(host_header)
        return _is_local_name(name) or _is_ip(name) or name in self._host_names

    def origin_allowed(self, origin: str | None, host_header: str | None) -> bool:
        """Whether a page of `origin` may call the API (no Origin header: not a browser's cross-origin call). Call
        it once the Host is allowed: a page of the server itself (Origin = its Host) is then allowed too."""
        if origin is None or self.any_origin:
            return True
        normalized = origin.strip().rstrip("/").lower()
        if normalized in {o.rstrip("/").lower() for o in self.allowed_origins}:
            return True
        try:
            parts = urlsplit(normalized)
            parts.port  # noqa: B018 - raises on a port that is no number
        except ValueError:
            return False
        if parts.scheme not in ("http", "https") or parts.hostname is None:
            return False  # "null" (a sandboxed frame, a file:// page) and other schemes
        if _is_local_name(parts.hostname):
            return True
        return host_header is not None and parts.netloc == host_header.strip().lower()

    def cors_origin_regex(self) -> str:
        """Starlette's CORSMiddleware answers the preflight of the origins this regex matches (local pages); the
        exact ones given come as its list."""
        return r"https?://(localhost|[a-z0-9.-]+\.localhost|127(\.\d{1,3}){3}|\[::1\])(:\d+)?"


def is_loopback(host: str) -> bool:
    """Whether a --host address is this machine's own (localhost, 127.0.0.0/8, ::1): no other can connect."""
    return _is_local_name(_host_name(host))


def _host_name(host: str) -> str:
    """`host` without its port, brackets and trailing dot, lowercased: "[::1]:8000" -> "::1"."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    if host.count(":") == 1:
        host = host.split(":", 1)[0]
    return host.rstrip(".")


def _is_local_name(name: str) -> bool:
    name = name.strip("[]")
    if name == "localhost" or name.endswith(".localhost"):
        return True
    return _is_ip(name) and ipaddress.ip_address(name).is_loopback


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name.strip("[]"))
    except ValueError:
        return False
    return True
