"""A stand-in for the Hugging Face Hub, for tests without a network: a local HTTP server that speaks the part of the
Hub's protocol huggingface_hub's `model_info`, `snapshot_download` and `hf_hub_download` use, over real files.

- `GET /api/models/{repo}[/revision/{rev}]`: the repo's id, commit (`sha`) and files (`siblings`);
- `GET /api/models/{repo}/tree/{rev}`: its files with sizes (one page);
- `HEAD`/`GET /{repo}/resolve/{rev}/{file}`: the file, with `X-Repo-Commit`, `ETag` and `Content-Length`, and
  `Range: bytes=N-` answered 206;
- errors as the Hub sends them (`X-Error-Code`: RepoNotFound 404, GatedRepo 401 without the right token,
  RevisionNotFound, EntryNotFound), and a connection dropped after a given number of bytes of a file's first GET.

Use: `with HubStandIn() as hub: hub.add_repo("org/name", {"file": path_or_bytes}); HF_ENDPOINT=hub.url`."""

import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

_API = re.compile(r"/api/models/(?P<repo>[^/]+/[^/]+)(?:/(?P<kind>revision|tree)/(?P<rev>[^/]+))?/?")
_RESOLVE = re.compile(r"/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<file>.+)")


class StandInRepo:
    def __init__(self, files: dict[str, Path | bytes], gated_token: str | None):
        self.files = {name: Path(f).read_bytes() if isinstance(f, Path) else f for name, f in files.items()}
        self.gated_token = gated_token  # None: public; else the token that may read it
        listing = json.dumps({n: hashlib.sha256(b).hexdigest() for n, b in sorted(self.files.items())})
        self.commit = hashlib.sha1(listing.encode()).hexdigest()  # 40 hex digits, as a git commit's

    def etag(self, name: str) -> str:
        return hashlib.sha256(self.files[name]).hexdigest()


class HubStandIn:
    def __init__(self) -> None:
        self.repos: dict[str, StandInRepo] = {}
        self.requests: list[tuple[str, str, str | None]] = []  # method, path, Range header
        self.drop_after: dict[str, int] = {}  # file name -> bytes sent before its first GET's connection drops
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def add_repo(self, repo_id: str, files: dict[str, Path | bytes], gated_token: str | None = None) -> str:
        """Publish (or replace) a repo; returns its commit."""
        self.repos[repo_id] = StandInRepo(files, gated_token)
        return self.repos[repo_id].commit

    def gets(self, name: str) -> list[str | None]:
        """The Range headers of the GETs of file `name` so far (None: the whole file)."""
        return [r for method, path, r in self.requests if method == "GET" and path.endswith("/" + name)]

    def __enter__(self) -> "HubStandIn":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()


def _handler_for(hub: HubStandIn) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # quiet
            pass

        def do_GET(self) -> None:
            self._answer(body=True)

        def do_HEAD(self) -> None:
            self._answer(body=False)

        def _answer(self, body: bool) -> None:
            path = unquote(urlsplit(self.path).path)
            hub.requests.append((self.command, path, self.headers.get("Range")))
            api, resolve = _API.fullmatch(path), _RESOLVE.fullmatch(path)
            match = api or resolve
            repo = hub.repos.get(match["repo"]) if match else None
            if match is None or repo is None:
                return self._error(404, "RepoNotFound", "Repository not found")
            if repo.gated_token is not None and self.headers.get("Authorization") != f"Bearer {repo.gated_token}":
                return self._error(401, "GatedRepo", f"Access to model {match['repo']} is restricted.")
            rev = match["rev"] or "main"
            if rev not in ("main", repo.commit):
                return self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}", repo.commit)
            if api is not None:
                return self._api(api["repo"], repo, api["kind"])
            if resolve["file"] not in repo.files:
                return self._error(404, "EntryNotFound", f"{resolve['file']} does not exist", repo.commit)
            self._file(repo, resolve["file"], body)

        def _api(self, repo_id: str, repo: StandInRepo, kind: str | None) -> None:
            if kind == "tree":
                data: object = [
                    {"type": "file", "path": n, "size": len(b), "oid": repo.etag(n)[:40]} for n, b in repo.files.items()
                ]
            else:
                data = {"id": repo_id, "sha": repo.commit, "siblings": [{"rfilename": n} for n in repo.files]}
            payload = json.dumps(data).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def _file(self, repo: StandInRepo, name: str, body: bool) -> None:
            data = repo.files[name]
            start = 0
            wanted = re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range") or "")
            if wanted is not None and body:
                start = int(wanted[1])
            self.send_response(206 if start else 200)
            self.send_header("X-Repo-Commit", repo.commit)
            self.send_header("ETag", f'"{repo.etag(name)}"')
            self.send_header("Content-Length", str(len(data) - start))
            self.send_header("Accept-Ranges", "bytes")
            if start:
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            self.end_headers()
            if not body:
                return
            cut = hub.drop_after.pop(name, None)
            if cut is not None:  # the connection drops mid-file, once
                self.wfile.write(data[start : start + cut])
                self.wfile.flush()
                self.close_connection = True
                self.connection.shutdown(2)
                return
            self.wfile.write(data[start:])

        def _error(self, status: int, code: str, message: str, commit: str | None = None) -> None:
            payload = json.dumps({"error": message}).encode()
            self.send_response(status)
            self.send_header("X-Error-Code", code)
            self.send_header("X-Error-Message", message)
            if commit is not None:
                self.send_header("X-Repo-Commit", commit)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(payload)

    return Handler
