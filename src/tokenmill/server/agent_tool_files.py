"""The tools of agent_tools.py that read, search, write and edit files, and say where they run: blocking functions
of (params, cwd) -> the tool's JSON answer (the routes run them in a thread). A tool's own failure is its answer,
`{"error": ...}`; a missing or mistyped parameter raises ToolCallError (400)."""

import base64
import os
import platform
import re
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

READ_FILE_MAX_BYTES = 16 * 1024  # a plain read's answer, at most (a larger file needs a line range)
READ_FILE_MAX_BYTES_BASE64 = 32 * 1024 * 1024  # x-resp-type: base64 (the UI attaching a file)
SEARCH_MAX_RESULTS = 100  # file_glob_search's and grep_search's
LIST_TIMEOUT_S = 15  # one listing (git ls-files, or the walk), as llama-server's
GIT_LS_FILES_MAX_BYTES = 8 * 1024 * 1024
INFO_TIMEOUT_S = 5
# listed, never descended into: they can be enormous
JUNK_DIRS = frozenset(
    {".git", ".svn", ".hg", "node_modules", "__pycache__", ".venv", "venv", "dist", "build", "target", ".cache"}
    | {".idea", ".vscode"}
)


class ToolCallError(Exception):
    """A call the caller got wrong (400): a missing or mistyped parameter."""


# ---------------------------------------------------------------------------------------------------------------
# parameters


def required_str(params: dict, name: str) -> str:
    value = params.get(name)
    if not isinstance(value, str):
        raise ToolCallError(f'the tool needs "{name}", a string')
    return value


def optional(params: dict, name: str, kind: type, default: Any) -> Any:
    value = params.get(name, default)
    if value is None:
        return default
    if kind is int and isinstance(value, bool) or not isinstance(value, kind):
        raise ToolCallError(f'"{name}" must be {"an integer" if kind is int else f"a {kind.__name__}"}')
    return value


def resolve(path: str, cwd: str | None) -> str:
    """`path` made absolute: a leading `~` expanded, then joined to `cwd` (else the server's directory), `.` and
    `..` dropped."""
    if path == "~" or path.startswith(("~/", "~\\")):
        path = os.path.expanduser(path)
    full = os.path.join(cwd or os.getcwd(), path)
    return os.path.normpath(full)


def _lines(text: str) -> list[str]:
    """Lines as C++'s getline reads them: a last newline makes no empty last line."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return lines


def _read_text(path: str) -> str | None:
    try:
        return Path(path).read_bytes().decode("utf-8", errors="replace")
    except OSError:
        return None


# ---------------------------------------------------------------------------------------------------------------
# globs and listings


def glob_regex(pattern: str) -> re.Pattern:
    """llama.cpp's glob (common.cpp's glob_match): `*` and `?` stay within one path part, `**` crosses them (`**/`
    also matches no directory), `[...]` is a class (`[!...]` or `[^...]` negated)."""
    out, i = [], 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif c == "*":
            out.append("[^/]*")
            i += 1
        elif c == "?":
            out.append("[^/]")
            i += 1
        elif c == "[" and "]" in pattern[i + 2 :]:
            end = pattern.index("]", i + 2)
            body = pattern[i + 1 : end]
            negate = body[:1] in ("!", "^")
            body = body[1:] if negate else body
            out.append("[" + ("^" if negate else "") + body.replace("\\", "\\\\") + "]")
            i = end + 1
        else:
            out.append(re.escape(c))
            i += 1
    return re.compile("".join(out), re.DOTALL)


def path_glob_match(pattern: str, rel_path: str) -> bool:
    """No `/` in the pattern: it matches the name at any depth; else the whole relative path, anchored with `**/`
    unless it starts with `**` or `/`."""
    if "/" not in pattern:
        return glob_regex(pattern).fullmatch(rel_path.rsplit("/", 1)[-1]) is not None
    if not (pattern == "**" or pattern.startswith(("**/", "/"))):
        pattern = "**/" + pattern
    return glob_regex(pattern).fullmatch(rel_path) is not None


@dataclass
class Listing:
    entries: list[tuple[str, bool]]  # (path relative to the base, '/'-separated; is a directory)
    error: str = ""
    truncated: bool = False  # the time budget ran out, or a directory could not be read


def list_entries(base: str, max_depth: int, kind: str) -> Listing:
    """The files (kind "file"), directories ("dir") or both ("all") under `base`, at most `max_depth` deep (0: any
    depth). Files of a git work tree come from `git ls-files` (what .gitignore leaves); otherwise a walk that
    lists the junk directories but does not enter them, nor follow links."""
    if not os.path.isdir(base):
        return Listing([], "path does not exist or is not a directory")
    deadline = time.monotonic() + LIST_TIMEOUT_S
    if kind == "file":
        git = ["git", "-C", base, "ls-files", "--cached", "--others", "--exclude-standard"]
        try:
            done = subprocess.run(git, capture_output=True, timeout=LIST_TIMEOUT_S, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired):
            done = None
        if done is not None and done.returncode == 0:
            entries = []
            for line in done.stdout[:GIT_LS_FILES_MAX_BYTES].decode("utf-8", errors="replace").splitlines():
                rel = line.strip("\r").replace("\\", "/")
                if rel and not (max_depth > 0 and rel.count("/") + 1 > max_depth):
                    if os.path.isfile(os.path.join(base, rel)):
                        entries.append((rel, False))
            return Listing(entries)
    listing = Listing([])
    stack = [(base, "", 0)]
    while stack:
        directory, rel_dir, depth = stack.pop()
        try:
            children = list(os.scandir(directory))
        except OSError:
            listing.truncated = True
            continue
        for entry in children:
            if time.monotonic() > deadline:
                listing.truncated = True
                return listing
            rel = f"{rel_dir}/{entry.name}" if rel_dir else entry.name
            try:
                is_dir = entry.is_dir()
                is_file = not is_dir and entry.is_file()
            except OSError:
                continue
            if is_dir:
                if kind in ("dir", "all"):
                    listing.entries.append((rel, True))
                if entry.name in JUNK_DIRS or entry.is_symlink():
                    continue
                if max_depth == 0 or depth + 1 < max_depth:
                    stack.append((entry.path, rel, depth + 1))
            elif is_file and kind in ("file", "all"):
                listing.entries.append((rel, False))
    return listing


# ---------------------------------------------------------------------------------------------------------------
# the tools


def read_file(params: dict, cwd: str | None) -> dict:
    path = required_str(params, "path")
    start_line = optional(params, "start_line", int, 1)
    end_line = optional(params, "end_line", int, -1)  # -1: to the end
    append_loc = optional(params, "append_loc", bool, False)
    full = resolve(path, cwd)
    try:
        size = os.stat(full).st_size
    except OSError:
        return {"error": f"cannot stat file: {path}"}
    if params.get("resp_type") == "base64":  # from the x-resp-type header only: the model cannot ask for it
        if size > READ_FILE_MAX_BYTES_BASE64:
            return {"error": f"file too large ({size} bytes, max {READ_FILE_MAX_BYTES_BASE64})"}
        try:
            data = Path(full).read_bytes()
        except OSError:
            return {"error": f"failed to open file: {path}"}
        return {"base64": base64.b64encode(data).decode(), "size_bytes": len(data)}
    if size > READ_FILE_MAX_BYTES and end_line == -1:
        return {
            "error": f"file too large ({size} bytes, max {READ_FILE_MAX_BYTES}). "
            "Use start_line/end_line to read a portion."
        }
    text = _read_text(full)
    if text is None:
        return {"error": f"failed to open file: {path}"}
    result, used = [], 0
    for number, line in enumerate(_lines(text), start=1):
        if number < start_line:
            continue
        if end_line != -1 and number > end_line:
            break
        out = f"{number}\u2192{line}\n" if append_loc else f"{line}\n"
        if used + len(out.encode()) > READ_FILE_MAX_BYTES:
            result.append("[output truncated]")
            break
        result.append(out)
        used += len(out.encode())
    return {"plain_text_response": "".join(result)}


def file_glob_search(params: dict, cwd: str | None) -> dict:
    path = required_str(params, "path")
    include = optional(params, "include", str, "**")
    exclude = optional(params, "exclude", str, "")
    kind = optional(params, "type", str, "file")
    max_depth = max(0, optional(params, "max_depth", int, 0))
    limit = optional(params, "limit", int, SEARCH_MAX_RESULTS)
    if limit < 1:
        return {"error": f"invalid limit: {limit} (expected 1 or more)"}
    if kind not in ("file", "dir", "all"):
        return {"error": f'invalid type: {kind} (expected "file", "dir" or "all")'}
    base = resolve(path, cwd)
    listing = list_entries(base, max_depth, kind)
    if listing.error:
        return {"error": f"{listing.error}: {path}"}
    matches = [
        (rel, is_dir)
        for rel, is_dir in listing.entries
        if path_glob_match(include, rel) and not (exclude and path_glob_match(exclude, rel))
    ]
    shown = matches[: min(limit, SEARCH_MAX_RESULTS)]
    text = "".join(f"{rel}{'/' if is_dir else ''}\n" for rel, is_dir in shown)
    text += f"\n---\nTotal matches: {len(matches)}\n"
    if len(matches) > len(shown):
        text += (
            f"[{len(shown)} results limit reached ({len(matches)} total matches). "
            "Refine the glob pattern to narrow the search.]\n"
        )
    if listing.truncated:
        text += "[results truncated: time budget or unreadable directory]\n"
    entries = [{"path": rel, "type": "dir" if is_dir else "file"} for rel, is_dir in shown]
    return {"plain_text_response": text, "entries": entries, "base": base}


def grep_search(params: dict, cwd: str | None) -> dict:
    path = required_str(params, "path")
    source = required_str(params, "pattern")
    include = optional(params, "include", str, "**")
    exclude = optional(params, "exclude", str, "")
    show_numbers = optional(params, "return_line_numbers", bool, False)
    literal = optional(params, "literal", bool, False)
    ignore_case = optional(params, "ignore_case", bool, False)
    context = max(0, optional(params, "context_lines", int, 0))
    try:
        pattern = re.compile(re.escape(source) if literal else source, re.IGNORECASE if ignore_case else 0)
    except re.error as e:
        return {"error": f"invalid regex: {e}"}
    full = resolve(path, cwd)
    if os.path.isfile(full):
        files = [(full, path)]
    elif os.path.isdir(full):
        listing = list_entries(full, 0, "file")
        if listing.error:
            return {"error": f"{listing.error}: {path}"}
        files = [
            (os.path.join(full, rel), rel)
            for rel, _ in listing.entries
            if path_glob_match(include, rel) and not (exclude and path_glob_match(exclude, rel))
        ]
    else:
        return {"error": f"path does not exist: {path}"}
    out, total, limited = [], 0, False
    numbered = show_numbers or context > 0
    for file_path, shown in files:
        text = _read_text(file_path)
        if text is None:
            continue
        lines = _lines(text)
        for i, line in enumerate(lines):
            if total >= SEARCH_MAX_RESULTS:
                limited = True
                break
            if not pattern.search(line):
                continue
            for j in range(max(0, i - context), min(len(lines) - 1, i + context) + 1):
                mark = ":" if j == i else "-"
                out.append(f"{shown}{mark}{f'{j + 1}{mark}' if numbered else ''}{lines[j]}\n")
            if context > 0:
                out.append("--\n")
            total += 1
        if limited:
            break
    out.append(f"\n---\nTotal matches: {total}\n")
    if limited:
        out.append(f"[{SEARCH_MAX_RESULTS} matches limit reached. Narrow the path/pattern/include to see more.]\n")
    return {"plain_text_response": "".join(out)}


def write_file(params: dict, cwd: str | None) -> dict:
    path = required_str(params, "path")
    content = required_str(params, "content")
    full = Path(resolve(path, cwd))
    try:
        full.parent.mkdir(parents=True, exist_ok=True)
        full.write_bytes(content.encode())
    except OSError:
        return {"error": f"failed to write file: {path}"}
    return {"result": "file written successfully", "path": path, "bytes": len(content.encode())}


def get_info(params: dict, cwd: str | None) -> dict:
    try:
        done = subprocess.run(
            ["uname", "-a"], capture_output=True, timeout=INFO_TIMEOUT_S, stdin=subprocess.DEVNULL, cwd=cwd
        )
        os_name = done.stdout.decode(errors="replace").strip() if done.returncode == 0 else "unknown"
    except (OSError, subprocess.TimeoutExpired):
        os_name = f"{platform.system()} {platform.release()}".strip() or "unknown"
    return {"os": os_name, "cwd": cwd or os.getcwd()}


# edit_file: exact replacements, else (where an old_text is not found as it is) matched with trailing whitespace,
# typographic quotes, dashes and spaces normalized, the untouched lines kept as they were

_FUZZY = str.maketrans(
    {
        **dict.fromkeys("\u2018\u2019\u201a\u201b", "'"),
        **dict.fromkeys("\u201c\u201d\u201e\u201f", '"'),
        **dict.fromkeys("\u2010\u2011\u2012\u2013\u2014\u2015\u2212", "-"),
        **dict.fromkeys("\u00a0\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a\u202f\u205f\u3000", " "),
    }
)


def _normalized(text: str) -> str:
    """Each line without its trailing spaces, tabs and CR, typographic characters made ASCII; lines stay lines."""
    return "\n".join(line.rstrip(" \t\r").translate(_FUZZY) for line in text.split("\n"))


def edit_file(params: dict, cwd: str | None) -> dict:
    path = required_str(params, "path")
    edits = params.get("edits")
    if not isinstance(edits, list) or not edits:
        return {"error": '"edits" must be a non-empty array'}
    pairs = []
    for i, edit in enumerate(edits):
        if not isinstance(edit, dict) or not all(isinstance(edit.get(k), str) for k in ("old_text", "new_text")):
            raise ToolCallError(f"edits[{i}] needs old_text and new_text, strings")
        if not edit["old_text"]:
            return {"error": f"edits[{i}].old_text must not be empty"}
        pairs.append((edit["old_text"], edit["new_text"]))
    full = resolve(path, cwd)
    original = _read_text(full)
    if original is None:
        return {"error": f"failed to open file: {path}"}
    fuzzy = False
    for i, (old, _) in enumerate(pairs):
        if old in original:
            continue
        if _normalized(old) not in _normalized(original):
            return {
                "error": f"could not find edits[{i}].old_text in {path}, it must match the file's current content "
                "exactly"
            }
        fuzzy = True
    base = _normalized(original) if fuzzy else original
    matched = []  # (index in base, length, new text, edit index)
    for i, (old, new) in enumerate(pairs):
        needle = _normalized(old) if fuzzy else old
        occurrences = _normalized(original).count(_normalized(old))
        if occurrences > 1:
            return {"error": f"found {occurrences} occurrences of edits[{i}].old_text in {path}, it must be unique"}
        matched.append((base.find(needle), len(needle), new, i))
    matched.sort()
    for a, b in zip(matched, matched[1:], strict=False):
        if a[0] + a[1] > b[0]:
            return {
                "error": f"edits[{a[3]}] and edits[{b[3]}] overlap in {path}; merge them into one edit or target "
                "disjoint regions"
            }
    updated = _replace_keeping_lines(original, base, matched) if fuzzy else _replace(base, matched, 0)
    if updated == original:
        return {"error": "no changes made: the replacement(s) produced identical content"}
    try:
        Path(full).write_bytes(updated.encode())
    except OSError:
        return {"error": f"failed to write file: {path}"}
    return {"result": "file edited successfully", "path": path, "edits_applied": len(matched)}


def _replace(text: str, matched: list, offset: int) -> str:
    for start, length, new, _ in reversed(matched):
        at = start - offset
        text = text[:at] + new + text[at + length :]
    return text


def _replace_keeping_lines(original: str, base: str, matched: list) -> str:
    """The replacements (offsets into the normalized `base`) applied to the lines they touch; every other line
    comes from `original` as it was."""
    original_lines = original.splitlines(keepends=True)
    spans, at = [], 0
    for line in base.splitlines(keepends=True):
        spans.append((at, at + len(line)))
        at += len(line)
    groups: list[list] = []  # [first line, end line, replacements]
    for rep in matched:
        start, end = rep[0], rep[0] + rep[1]
        first = next(i for i, (a, b) in enumerate(spans) if a <= start < b)
        last = first
        while last < len(spans) - 1 and spans[last][1] < end:
            last += 1
        if groups and first < groups[-1][1]:
            groups[-1][1] = max(groups[-1][1], last + 1)
            groups[-1][2].append(rep)
        else:
            groups.append([first, last + 1, [rep]])
    out, line = [], 0
    for first, end, reps in groups:
        out += original_lines[line:first]
        offset = spans[first][0]
        out.append(_replace(base[offset : spans[end - 1][1]], reps, offset))
        line = end
    out += original_lines[line:]
    return "".join(out)
