"""llama-server's built-in tools for agents (`--tools`; its tools/server/server-tools.cpp): read, search, write and
edit files, run a shell command, and say where they run. Its web UI (and any agent) lists them with GET /tools and
calls one with POST /tools `{"tool": NAME, "params": {...}, "stream": false}`; server/agent_routes.py has the routes.

They act on the machine the server runs on, as the user who started it: `--tools` is for a trusted user on a local
machine, as llama-server's help says, and turning it on narrows the web pages that may call the server to local
ones (origins.py). Relative paths resolve against the caller's `x-tool-cwd` header, else the server's working
directory; a leading `~` is the home directory. A tool's own failure (no such file, a pattern that does not compile)
is its answer, `{"error": ...}` with status 200, as llama-server's: the model reads it; a call that names no tool,
an unknown tool, or a missing parameter is the caller's error (400, 404).

What differs from llama-server: its `--tools-runtime` and `x-tool-runtime` (running the tools in a container or
over SSH) are not offered, and a call that asks for one is refused rather than run on the host; a glob's `**/`
also matches no directory at all (`**/*.py` finds `a.py`), as git's and most globs do.
"""

import asyncio
import codecs
import os
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from tokenmill.server.agent_tool_files import (
    SEARCH_MAX_RESULTS,
    ToolCallError,
    edit_file,
    file_glob_search,
    get_info,
    grep_search,
    optional,
    read_file,
    required_str,
    write_file,
)
from tokenmill.server.origins import is_loopback

SHELL_MAX_OUTPUT_BYTES = 16 * 1024
SHELL_DEFAULT_TIMEOUT_S = 10
SHELL_MAX_TIMEOUT_S = 60

__all__ = ["ToolCallError", "Tool", "TOOLS", "UnknownTool", "enabled_tools", "find_tool", "invoke"]


class UnknownTool(Exception):
    """A tool that is not enabled, or asked to stream that cannot (404, as llama-server answers)."""


# exec_shell_command: `sh -c COMMAND` in the caller's directory, stdout and stderr together


def exec_shell_command(params: dict, cwd: str | None) -> AsyncIterator[str]:
    """The command's output as it comes (at most max_output_size bytes), then its exit line (its parameters are
    checked now, before anything runs)."""
    command = required_str(params, "command")
    timeout_s = min(optional(params, "timeout", int, SHELL_DEFAULT_TIMEOUT_S), SHELL_MAX_TIMEOUT_S)
    max_output = min(optional(params, "max_output_size", int, SHELL_MAX_OUTPUT_BYTES), SHELL_MAX_OUTPUT_BYTES)
    return _shell(command, timeout_s, max_output, cwd)


async def _shell(command: str, timeout_s: int, max_output: int, cwd: str | None) -> AsyncIterator[str]:
    """`sh -c command` in a process group of its own, killed whole at its timeout or when the caller stops
    reading."""
    try:
        process = await asyncio.create_subprocess_exec(
            "sh",
            "-c",
            command,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            cwd=cwd,
            start_new_session=True,
        )
    except OSError:
        yield "failed to spawn process\n[exit code: -1]"
        return
    assert process.stdout is not None
    deadline = time.monotonic() + max(timeout_s, 0)
    used, timed_out, truncated = 0, False, False
    text = codecs.getincrementaldecoder("utf-8")(errors="replace")  # a character split between reads stays whole
    try:
        while True:
            left = deadline - time.monotonic()
            try:
                chunk = await asyncio.wait_for(process.stdout.read(4096), timeout=max(left, 0.001))
            except TimeoutError:
                timed_out = True
                _kill(process)
                break
            if not chunk:
                break
            if truncated:
                continue  # keep draining, or the command blocks on a full pipe
            keep = chunk[: max_output - used]
            used += len(keep)
            truncated = len(keep) < len(chunk)
            if keep:
                yield text.decode(keep)
        code = await process.wait()
    finally:
        if process.returncode is None:  # the caller went away: the command goes too
            _kill(process)
            await process.wait()
    tail = text.decode(b"", final=True)
    tail += "\n[output truncated]" if truncated else ""
    tail += f"\n[exit code: {code}]"
    if timed_out:
        tail += " [exit due to timed out]"
    yield tail


def _kill(process: asyncio.subprocess.Process) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


# ---------------------------------------------------------------------------------------------------------------
# what GET /tools lists


@dataclass(frozen=True)
class Tool:
    name: str
    display_name: str
    description: str
    properties: dict[str, tuple[str, str]]  # parameter -> (JSON type, description)
    required: tuple[str, ...]
    run: Callable[[dict, str | None], Any]
    write: bool = False  # changes the machine (the UI asks before it calls)
    streams: bool = False  # POST /tools with "stream": true

    def definition(self) -> dict:
        """The tool as a chat request's `tools` entry names it."""
        properties: dict[str, Any] = {}
        for name, (kind, text) in self.properties.items():
            properties[name] = {"type": kind, "description": text}
        if self.name == "edit_file":
            properties["edits"]["items"] = EDIT_ITEM
        parameters: dict[str, Any] = {"type": "object", "properties": properties}
        if self.required:
            parameters["required"] = list(self.required)
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": parameters},
        }

    def to_json(self) -> dict:
        return {
            "display_name": self.display_name,
            "tool": self.name,
            "type": "server",
            "permissions": {"write": self.write},
            "uses_cwd": True,
            "definition": self.definition(),
        }


EDIT_ITEM = {
    "type": "object",
    "properties": {
        "old_text": {
            "type": "string",
            "description": "Exact text to find; must be unique in the file and must not overlap with other edits",
        },
        "new_text": {"type": "string", "description": "Text to replace old_text with"},
    },
    "required": ["old_text", "new_text"],
}
_GLOB_NOTE = (
    "include/exclude: a pattern with no '/' matches the basename at any depth; a pattern containing '/' matches the "
    'full relative path (auto-anchored with "**/" unless already anchored).'
)
TOOLS = (
    Tool(
        "read_file",
        "Read file",
        "Read the contents of a file. Optionally specify a 1-based line range. If append_loc is true, each line is "
        'prefixed with its line number (e.g. "1\u2192...").',
        {
            "path": ("string", "Path to the file"),
            "start_line": ("integer", "First line to read, 1-based (default: 1)"),
            "end_line": ("integer", "Last line to read, 1-based inclusive (default: end of file)"),
            "append_loc": ("boolean", "Prefix each line with its line number"),
        },
        ("path",),
        read_file,
    ),
    Tool(
        "file_glob_search",
        "File search",
        "Recursively search for files matching a glob pattern under a directory. Automatically skips files ignored "
        "by .gitignore (when the directory is inside a git repo) and common junk directories (.git, node_modules, "
        "build, dist, etc.) otherwise. A pattern with no '/' (e.g. \"*.cpp\") matches the file's basename at any "
        "depth. A pattern containing '/' matches the full relative path; unless already anchored with \"**/\" or a "
        'leading \'/\', it is automatically prefixed with "**/". Use type="dir" or "all" to also list '
        "directories; directory entries are suffixed with '/' in the output. Note: directory listings do not apply "
        ".gitignore filtering.",
        {
            "path": ("string", "Base directory to search in"),
            "include": ("string", 'Glob pattern for files to include (e.g. "*.cpp" or "src/**/*.cpp"). Default: **'),
            "exclude": ("string", "Glob pattern for files to exclude"),
            "type": ("string", 'Entry type to return: "file" (default), "dir" or "all"'),
            "max_depth": (
                "integer",
                "Maximum depth to descend into subdirectories (default: 0 = unlimited; 1 = direct children only)",
            ),
            "limit": (
                "integer",
                f"Maximum number of results to return, capped at {SEARCH_MAX_RESULTS} (default {SEARCH_MAX_RESULTS})",
            ),
        },
        ("path",),
        file_glob_search,
    ),
    Tool(
        "grep_search",
        "Grep search",
        "Search for a pattern in files under a path. Returns matching lines with file paths (and, unless searching "
        "a single file, paths relative to the given directory). Automatically skips files ignored by .gitignore "
        "(when the directory is inside a git repo) and common junk directories (.git, node_modules, build, dist, "
        "etc.) otherwise. " + _GLOB_NOTE,
        {
            "path": ("string", "File or directory to search in"),
            "pattern": ("string", "Pattern to search for (regular expression unless literal is true)"),
            "include": ("string", "Glob pattern to filter files (default: **)"),
            "exclude": ("string", "Glob pattern to exclude files"),
            "return_line_numbers": ("boolean", "If true, include line numbers in results"),
            "literal": (
                "boolean",
                "Treat pattern as a literal string instead of a regular expression (default: false)",
            ),
            "ignore_case": ("boolean", "Case-insensitive search (default: false)"),
            "context_lines": (
                "integer",
                "Number of lines of context to show before and after each match (default: 0)",
            ),
        },
        ("path", "pattern"),
        grep_search,
    ),
    Tool(
        "exec_shell_command",
        "Execute shell command",
        "Execute a shell command and return its output (stdout and stderr combined).",
        {
            "command": ("string", "Shell command to execute"),
            "timeout": (
                "integer",
                f"Timeout in seconds (default {SHELL_DEFAULT_TIMEOUT_S}, max {SHELL_MAX_TIMEOUT_S})",
            ),
            "max_output_size": ("integer", f"Maximum output size in bytes (default {SHELL_MAX_OUTPUT_BYTES})"),
        },
        ("command",),
        exec_shell_command,
        write=True,
        streams=True,
    ),
    Tool(
        "write_file",
        "Write file",
        "Write content to a file, creating it (including parent directories) if it does not exist. May use with "
        "edit_file for more complex edits.",
        {"path": ("string", "Path of the file to write"), "content": ("string", "Content to write")},
        ("path", "content"),
        write_file,
        write=True,
    ),
    Tool(
        "edit_file",
        "Edit file",
        "Edit a file using exact text replacement. Each edits[].old_text must be unique in the file and is matched "
        "against the original content, not incrementally. Merge nearby changes into one edit instead of "
        "overlapping edits. Use write_file to replace the whole file.",
        {
            "path": ("string", "Path to the file to edit"),
            "edits": ("array", "One or more exact text replacements to apply"),
        },
        ("path", "edits"),
        edit_file,
        write=True,
    ),
    Tool(
        "get_info",
        "Get Runtime Info",
        "Returns runtime info: the OS name/version and the current working directory",
        {},
        (),
        get_info,
    ),
)
TOOL_NAMES = tuple(t.name for t in TOOLS)


def enabled_tools(names: list[str]) -> tuple[Tool, ...]:
    """The tools `--tools` names ("all": every one), in llama-server's order; an unknown name is an error that
    lists the known ones."""
    unknown = [n for n in names if n != "all" and n not in TOOL_NAMES]
    if unknown:
        raise ValueError(f'unknown tool "{unknown[0]}". available tools: {", ".join(TOOL_NAMES)}')
    return tuple(t for t in TOOLS if "all" in names or t.name in names)


def check_tools_option(names: list[str], host: str, api_key: str | None) -> tuple[Tool, ...]:
    """The tools `--tools` names, refused (ValueError, saying why) where a name is unknown, or where the server
    listens beyond this machine without an API key: anyone who reaches it could then run commands here (llama-server
    only warns)."""
    tools = enabled_tools(names)
    exposed = [h.strip() for h in host.split(",") if not is_loopback(h.strip())] if tools and not api_key else []
    if exposed:
        raise ValueError(
            f"the tools would let anyone who reaches {exposed[0] or 'every address'} run commands on this machine: "
            "give --api-key, or listen on 127.0.0.1 only"
        )
    return tools


def find_tool(tools: tuple[Tool, ...], name: str, stream: bool) -> Tool:
    for tool in tools:
        if tool.name == name:
            if stream and not tool.streams:
                raise UnknownTool(f'tool "{name}" does not support stream = true')
            return tool
    raise UnknownTool(f'unknown tool "{name}"')


async def invoke(tool: Tool, params: dict, cwd: str | None) -> dict:
    """A whole call's answer."""
    if tool.streams:
        async with aclosing(tool.run(params, cwd)) as chunks:  # a call cut short kills its command now
            return {"plain_text_response": "".join([chunk async for chunk in chunks])}
    return await asyncio.to_thread(tool.run, params, cwd)
