"""llama-server's agent features, in process through httpx (no model needed): the built-in tools at /tools
(`--tools`), the CORS proxy at /cors-proxy (`--ui-mcp-proxy`), their security defaults (403 when off, the API key,
local pages only with tools on), and the web page's public files (/sw.js, /manifest.webmanifest,
/_app/version.json), as llama.cpp's tools/server/tests/unit/test_security.py and server-tools.cpp define them."""

import base64
import json
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from fastapi.testclient import TestClient

from tokenmill.server.agent_tool_files import path_glob_match
from tokenmill.server.agent_tools import TOOLS
from tokenmill.server.app import create_app
from tokenmill.server.state import ServerSettings, ServerState

KEY = "sk-secret"
AUTH = {"Authorization": f"Bearer {KEY}"}
PREFLIGHT = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "Authorization"}


def client(**settings) -> TestClient:
    state = ServerState(ServerSettings(**settings))
    return TestClient(create_app(state, load_in_background=False), base_url="http://127.0.0.1:8000")


@pytest.fixture
def tools() -> TestClient:
    return client(tools=["all"], api_key=KEY)


def call(c: TestClient, tool: str, where, headers: dict | None = None, **params) -> dict:
    r = c.post(
        "/tools", json={"tool": tool, "params": params}, headers={**AUTH, "x-tool-cwd": str(where), **(headers or {})}
    )
    assert r.status_code == 200, r.text
    return r.json()


def test_without_the_options_the_routes_answer_403_feature_disabled() -> None:
    c = client()
    for r in (c.get("/tools"), c.post("/tools", json={"tool": "get_info"}), c.get("/cors-proxy?url=http://a/")):
        assert r.status_code == 403 and r.json()["error"]["type"] == "feature_disabled", r.text


def test_the_tools_are_listed_as_llama_server_lists_them_and_need_the_key(tools: TestClient) -> None:
    assert tools.get("/tools").status_code == 401
    assert tools.post("/tools", json={"tool": "get_info"}).json()["error"]["type"] == "authentication_error"
    listed = tools.get("/tools", headers=AUTH).json()
    names = ["read_file", "file_glob_search", "grep_search", "exec_shell_command", "write_file", "edit_file"]
    assert [t["tool"] for t in listed] == [*names, "get_info"]
    shell = listed[3]
    assert shell["permissions"] == {"write": True} and shell["type"] == "server" and shell["uses_cwd"]
    function = shell["definition"]["function"]
    assert function["name"] == "exec_shell_command" and function["parameters"]["required"] == ["command"]
    assert listed[5]["definition"]["function"]["parameters"]["properties"]["edits"]["items"]["required"] == [
        "old_text",
        "new_text",
    ]
    only = client(tools=["read_file", "get_info"]).get("/tools").json()
    assert [t["tool"] for t in only] == ["read_file", "get_info"]


def test_files_are_written_read_edited_and_found(tools: TestClient, tmp_path) -> None:
    assert call(tools, "write_file", tmp_path, path="src/a.py", content="def f():\n    return “1”  \n")["bytes"] > 0
    (tmp_path / "src" / "b.txt").write_text("one\ntwo\nthree\n")
    (tmp_path / "node_modules").mkdir()
    (tmp_path / "node_modules" / "c.py").write_text("x")
    assert call(tools, "read_file", tmp_path, path="src/b.txt", start_line=2, end_line=3, append_loc=True) == {
        "plain_text_response": "2\u2192two\n3\u2192three\n"
    }
    raw = call(tools, "read_file", tmp_path, headers={"x-resp-type": "base64"}, path="src/b.txt")
    assert base64.b64decode(raw["base64"]) == b"one\ntwo\nthree\n" and raw["size_bytes"] == 14
    assert "cannot stat file" in call(tools, "read_file", tmp_path, path="missing.txt")["error"]
    (tmp_path / "big.txt").write_text("x" * 20000)
    assert "file too large" in call(tools, "read_file", tmp_path, path="big.txt")["error"]

    # the edit's old_text has plain quotes and no trailing spaces: matched after normalizing, other lines kept
    edit = {"old_text": 'return "1"', "new_text": 'return "2"'}
    assert call(tools, "edit_file", tmp_path, path="src/a.py", edits=[edit])["edits_applied"] == 1
    assert (tmp_path / "src" / "a.py").read_text() == 'def f():\n    return "2"\n'
    twice = call(tools, "edit_file", tmp_path, path="src/b.txt", edits=[{"old_text": "o", "new_text": "0"}])
    assert "occurrences" in twice["error"]

    found = call(tools, "file_glob_search", tmp_path, path=".", include="*.py")
    assert [e["path"] for e in found["entries"]] == ["src/a.py"]  # node_modules is not entered
    assert found["base"] == str(tmp_path) and "Total matches: 1" in found["plain_text_response"]
    dirs = call(tools, "file_glob_search", tmp_path, path=".", type="dir")
    assert sorted(e["path"] for e in dirs["entries"]) == ["node_modules", "src"]
    assert call(tools, "file_glob_search", tmp_path, path=".", limit=1)["entries"].__len__() == 1

    grep = call(tools, "grep_search", tmp_path, path=".", pattern="T[wh]", ignore_case=True, return_line_numbers=True)
    assert grep["plain_text_response"].startswith("src/b.txt:2:two\nsrc/b.txt:3:three\n")
    literal = call(tools, "grep_search", tmp_path, path="src/b.txt", pattern="t.o", literal=True)
    assert "Total matches: 0" in literal["plain_text_response"]
    context = call(tools, "grep_search", tmp_path, path="src", pattern="two", context_lines=1)
    assert context["plain_text_response"].startswith("b.txt-1-one\nb.txt:2:two\nb.txt-3-three\n--\n")
    assert "invalid regex" in call(tools, "grep_search", tmp_path, path=".", pattern="(")["error"]


def test_the_shell_runs_in_the_callers_directory_with_a_timeout_and_a_cap(tools: TestClient, tmp_path) -> None:
    assert call(tools, "exec_shell_command", tmp_path, command="pwd; echo err >&2; exit 3") == {
        "plain_text_response": f"{tmp_path}\nerr\n\n[exit code: 3]"
    }
    slow = call(tools, "exec_shell_command", tmp_path, command="echo a; sleep 30", timeout=1)["plain_text_response"]
    assert slow.startswith("a\n") and slow.endswith("[exit due to timed out]")
    big = call(tools, "exec_shell_command", tmp_path, command="yes | head -c 100000", max_output_size=10)
    assert big["plain_text_response"].startswith("y\ny\ny\ny\ny\n\n[output truncated]")
    r = tools.post(
        "/tools",
        json={"tool": "exec_shell_command", "params": {"command": "echo one; sleep 0.1; echo two"}, "stream": True},
        headers=AUTH,
    )
    events = [json.loads(line[6:]) for line in r.text.split("\n\n") if line.startswith("data: ")]
    assert r.headers["content-type"].startswith("text/event-stream")
    assert "".join(e.get("chunk", "") for e in events) == "one\ntwo\n\n[exit code: 0]"
    assert events[-1] == {"done": True}
    split = call(tools, "exec_shell_command", tmp_path, command=r"printf '\303'; sleep 0.2; printf '\251'")
    assert split["plain_text_response"].startswith("\u00e9\n[exit code: 0]")  # one character across two reads
    info = call(tools, "get_info", tmp_path)
    assert info["cwd"] == str(tmp_path) and info["os"] != "unknown"


def test_calls_the_caller_gets_wrong_are_refused(tools: TestClient, tmp_path) -> None:
    def post(body: dict, **headers):
        return tools.post("/tools", json=body, headers={**AUTH, **headers})

    assert post({"tool": "nope"}).status_code == 404
    assert "does not support stream" in post({"tool": "read_file", "stream": True}).json()["error"]["message"]
    assert post({"tool": "read_file"}).status_code == 400  # no path
    assert post({"params": {}}).status_code == 400  # no tool
    assert post({"tool": "get_info", "extra": 1}).status_code == 400
    refused = post({"tool": "get_info"}, **{"x-tool-runtime": "docker-container:abc"})
    assert refused.status_code == 400 and "x-tool-runtime" in refused.json()["error"]["message"]
    # where a tool runs comes from the header only, never from the params a model wrote
    assert call(tools, "get_info", tmp_path, cwd="/")["cwd"] == str(tmp_path)


def test_with_tools_only_local_pages_may_call_even_with_a_key() -> None:
    """llama-server's --tools makes its CORS origins default to localhost; a key alone lets any page call."""
    for c in (client(tools=["all"], api_key=KEY), client(tools=["all"])):
        local = c.options("/completions", headers={"Origin": "http://localhost:8080", **PREFLIGHT})
        assert local.status_code == 200 and local.headers["access-control-allow-origin"] == "http://localhost:8080"
        evil = c.options("/completions", headers={"Origin": "http://evil.com", **PREFLIGHT})
        assert evil.status_code == 200 and "access-control-allow-origin" not in evil.headers
        assert (
            c.post("/tools", json={"tool": "get_info"}, headers={"Origin": "http://evil.com", **AUTH}).status_code
            == 403
        )
    keyed = client(api_key=KEY).options("/completions", headers={"Origin": "http://evil.com", **PREFLIGHT})
    assert keyed.headers["access-control-allow-origin"] == "http://evil.com"
    widened = client(tools=["all"], allowed_origins=["https://app.example"])
    r = widened.options("/completions", headers={"Origin": "https://app.example", **PREFLIGHT})
    assert r.headers["access-control-allow-origin"] == "https://app.example"


class Target(BaseHTTPRequestHandler):
    def _answer(self) -> None:
        length = int(self.headers.get("content-length") or 0)
        self.server.seen.append((self.command, self.path, dict(self.headers), self.rfile.read(length)))
        self.send_response(201)
        self.send_header("Content-Type", "application/json")
        self.send_header("Set-Cookie", "theirs=1")
        self.send_header("Access-Control-Allow-Origin", "*")
        self.send_header("X-Target", "yes")
        self.end_headers()
        self.wfile.write(b'{"ok": true}')

    do_GET = do_POST = _answer

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def target():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Target)
    server.seen = []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


def test_the_proxy_forwards_only_the_headers_named_for_the_target(target) -> None:
    """llama.cpp's test_cors_proxy_only_forwards_explicit_proxy_headers, and its POST."""
    c = client(ui_mcp_proxy=True, api_key=KEY)
    url = f"http://127.0.0.1:{target.server_port}/capture?q=1"
    assert c.get(f"/cors-proxy?url={url}").status_code == 401  # the key guards it
    headers = {
        **AUTH,
        "Proxy-Authorization": "Basic secret",
        "X-Api-Key": KEY,
        "Cookie": "session=secret",
        "x-llama-server-proxy-header-accept": "application/json",
        "x-llama-server-proxy-header-authorization": "Bearer explicit",
    }
    r = c.get("/cors-proxy", params={"url": url}, headers=headers)
    assert r.status_code == 201 and r.json() == {"ok": True}
    assert r.headers["content-type"] == "application/json" and r.headers["x-target"] == "yes"
    assert "set-cookie" not in r.headers and "access-control-allow-origin" not in r.headers
    method, path, seen, _ = target.seen[-1]
    seen = {k.lower(): v for k, v in seen.items()}
    assert (method, path) == ("GET", "/capture?q=1")
    assert seen["accept"] == "application/json" and seen["authorization"] == "Bearer explicit"
    assert not {"proxy-authorization", "x-api-key", "cookie"} & set(seen)

    body = b'{"jsonrpc": "2.0", "method": "tools/list", "id": 1}'
    named = {**AUTH, "x-llama-server-proxy-header-content-type": "application/json"}
    assert c.post("/cors-proxy", params={"url": url}, content=body, headers=named).status_code == 201
    method, _, seen, sent = target.seen[-1]
    assert method == "POST" and sent == body and seen["content-type"] == "application/json"


def test_the_proxy_refuses_targets_it_cannot_or_should_not_reach() -> None:
    c = client(ui_mcp_proxy=True)
    for url, words in [
        ("ftp://host/x", "unsupported URL scheme"),
        ("http://user:pw@host/x", "authentication in target URL"),
        ("http:///x", "missing host"),
        ("", "give the target"),
    ]:
        r = c.get("/cors-proxy", params={"url": url})
        assert r.status_code == 400 and words in r.json()["error"]["message"], (url, r.text)
    unreachable = c.get("/cors-proxy", params={"url": "http://127.0.0.1:9/"})
    assert unreachable.status_code == 502 and "proxy error" in unreachable.json()["error"]["message"]


def test_the_pages_files_are_public_and_sw_js_removes_a_stale_worker() -> None:
    """llama.cpp's test_access_static_assets_without_api_key; with --no-explorer only /sw.js stays."""
    c = client(api_key=KEY)
    for path in ["/", "/sw.js", "/manifest.webmanifest", "/_app/version.json"]:
        assert c.get(path).status_code == 200, path
    sw = c.get("/sw.js")
    assert "registration.unregister()" in sw.text and sw.headers["cache-control"] == "no-cache"
    assert sw.headers["content-type"].startswith("application/javascript")
    assert c.get("/manifest.webmanifest").json()["start_url"] == "/"
    assert '<link rel="manifest" href="/manifest.webmanifest">' in c.get("/").text
    bare = client(api_key=KEY, explorer=False)
    assert bare.get("/sw.js").status_code == 200 and bare.get("/manifest.webmanifest").status_code == 404


def test_globs_follow_llama_cpps() -> None:
    assert path_glob_match("*.py", "a/b/c.py") and not path_glob_match("*.py", "a/b/c.pyc")
    assert path_glob_match("src/*.py", "x/src/a.py") and not path_glob_match("src/*.py", "src/d/a.py")
    assert path_glob_match("src/**/*.py", "src/d/e/a.py") and path_glob_match("**/*.py", "a.py")
    assert path_glob_match("file?.[ch]", "dir/file1.c") and not path_glob_match("file?.[!ch]", "file1.c")
    help_text = ServerSettings.__dataclass_fields__["tools"].metadata["help"]
    assert all(t.name in help_text for t in TOOLS)  # --tools' help names every tool


def test_in_a_git_work_tree_the_searches_skip_what_gitignore_ignores(tools: TestClient, tmp_path) -> None:
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / ".gitignore").write_text("ignored.py\n")
    for name in ("kept.py", "ignored.py", "sub/deep.py"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text("needle\n")
    found = call(tools, "file_glob_search", tmp_path, path=".", include="*.py")
    assert sorted(e["path"] for e in found["entries"]) == ["kept.py", "sub/deep.py"]  # untracked ones too
    shallow = call(tools, "file_glob_search", tmp_path, path=".", include="*.py", max_depth=1)
    assert [e["path"] for e in shallow["entries"]] == ["kept.py"]
    grep = call(tools, "grep_search", tmp_path, path=".", pattern="needle")["plain_text_response"]
    assert "ignored.py" not in grep and "Total matches: 2" in grep


def test_tools_are_not_offered_to_the_network_without_a_key() -> None:
    """llama-server only warns; a server listening beyond this machine with tools and no key is refused at start."""
    with pytest.raises(ValueError, match="run commands on this machine: give --api-key"):
        client(tools=["all"], host="127.0.0.1,0.0.0.0")
    assert client(tools=["all"], host="0.0.0.0", api_key=KEY).get("/tools", headers=AUTH).status_code == 200
    assert client(tools=["get_info"], host="localhost,::1").get("/tools").status_code == 200
    with pytest.raises(ValueError, match='unknown tool "nope"'):
        client(tools=["nope"])
