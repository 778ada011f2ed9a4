"""The server's options (`tokenmill serve`'s flags), declared once: each ServerSettings field made with `option` is a
flag, and entrypoints/cli_parser.py generates the flags from the fields and reads parsed flags back into a
ServerSettings (an option left out leaves the field's default), as it does for EngineConfig's. The other fields
(`filled`) the command line fills from options declared elsewhere: the model's and the engine's. No torch here."""

import os
from dataclasses import dataclass, field
from typing import Any

from tokenmill.config.engine import option

DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024  # bodies above this get 413 before they are parsed (--max-request-bytes)
DEFAULT_RESPONSES_STORE_BYTES = 64 * 1024 * 1024  # the Responses API's stored responses, at most (oldest go first)
LOG_LEVELS = ("debug", "info", "warning", "error")


def server_option(default: Any, help: str, type: type | None = None, **cli: Any) -> Any:
    """A ServerSettings field that is a flag of `tokenmill serve` (config/engine.py's `option`, in the server's
    group: listed first in serve's help, with no heading of its own)."""
    return option(default, help, type, group="server", **cli)


def filled(default: Any, by: str) -> Any:
    """A ServerSettings field that is no flag of its own: the command line fills it from the options `by` names."""
    if isinstance(default, dict | list):
        return field(default_factory=default.copy, metadata={"filled_by": by})
    return field(default=default, metadata={"filled_by": by})


def _names(value: list[str] | str) -> list[str]:
    """A comma-separated flag's names ("a, b" -> ["a", "b"]); a list stays as it is."""
    return [name.strip() for name in value.split(",") if name.strip()] if isinstance(value, str) else value


@dataclass
class ServerSettings:
    # the model and the engine: their own options (ModelOptions' and EngineConfig's fields, config/)
    model: str | None = filled(None, "--model")
    dtype: str = filled("float32", "--dtype")
    quantization: str | None = filled(None, "--quantization")
    # a Hub model's: settled by the command line before the server starts (`model` is then its local path)
    revision: str | None = filled(None, "--revision")
    hf_file: str | None = filled(None, "--hf-file")
    engine_options: dict[str, Any] = filled({}, "the engine's options (EngineConfig)")
    # the server's flags, in the order of serve's help
    # where it listens: a Host header may name it (server/origins.py)
    host: str = server_option(
        "127.0.0.1",
        "address to listen on, or several, comma-separated (default 127.0.0.1); beside others, :: is IPv6 only",
        str,
    )
    port: int = server_option(8000, "port (default 8000)", int)
    # the first name given is the model's id, the others aliases it answers to (a list until __post_init__)
    served_model_name: str | None = server_option(
        None,
        "model names clients use, space- or comma-separated: the first is its id, the others aliases "
        "(default: from the file)",
        str,
        nargs="+",
    )
    served_model_aliases: list[str] = filled([], "--served-model-name")
    tags: list[str] = server_option(
        [], "comma-separated tags /v1/models shows with the model (llama-server's --tags)", str
    )
    api_key: str | None = server_option(None, "require 'Authorization: Bearer KEY' (or TOKENMILL_API_KEY)", str)
    # waiting sequences above which new requests get 503
    max_queue: int | None = server_option(
        None, "answer 503 with Retry-After when more requests than this are waiting", int
    )
    shutdown_grace_s: float = server_option(
        30.0,
        "seconds requests in flight may finish after SIGTERM (default 30)",
        float,
        flags=("--shutdown-grace",),
        metavar="SHUTDOWN_GRACE",
    )
    # larger bodies get 413 before they are parsed (None, or 0 given: no limit)
    max_request_bytes: int | None = server_option(
        DEFAULT_MAX_REQUEST_BYTES,
        "answer 413 to request bodies larger than this, before parsing them "
        f"(default {DEFAULT_MAX_REQUEST_BYTES:,}; 0: no limit)",
        int,
    )
    explorer: bool = server_option(
        True,
        "do not serve the request explorer (/ and /explorer/*)",
        flags=("--no-explorer",),
        action="store_false",
    )
    # origins whose web pages may call the API beyond the local ones (http(s)://localhost etc.; ["*"]: any); a
    # comma-separated string is split
    allowed_origins: list[str] = server_option(
        [],
        "comma-separated origins whose web pages may call the API, beyond the local ones "
        "(http(s)://localhost, 127.0.0.1, [::1], any port) and the server's own; '*' for any. Others get 403",
        str,
    )
    # Host names answered beyond localhost, IP addresses and --host (["*"]: any; a guard against DNS rebinding)
    allowed_hosts: list[str] = server_option(
        [],
        "comma-separated Host names to answer beyond localhost, IP addresses and --host (a guard against "
        "DNS rebinding: other names get 403); '*' for any, e.g. behind a proxy that keeps the client's Host",
        str,
    )
    # llama-server's agent features (server/agent_tools.py, server/cors_proxy.py): off by default, each a way to
    # reach the machine's files, shell or network from a web page, so only for a trusted user on a local machine
    tools: list[str] = server_option(
        [],
        "experimental, for trusted local use only: llama-server's built-in tools for agents at /tools, "
        "comma-separated or 'all' (read_file, file_glob_search, grep_search, exec_shell_command, write_file, "
        "edit_file, get_info); with tools on, only local pages and --allowed-origins may call the server, "
        "even with --api-key",
        str,
    )
    ui_mcp_proxy: bool = server_option(
        False,
        "experimental, for trusted local use only: llama-server's /cors-proxy?url=..., which forwards a web "
        "page's GET or POST to another server (its MCP servers), with only the headers named "
        "x-llama-server-proxy-header-NAME (default off: 403)",
    )
    # vLLM hides its runtime endpoints behind VLLM_ALLOW_RUNTIME_LORA_UPDATING: a caller of them names a path on
    # this machine for the server to read
    allow_runtime_lora_updating: bool = server_option(
        False,
        "turn on /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's runtime LoRA endpoints: the caller "
        "names a file on this machine; default off, 403, or on where VLLM_ALLOW_RUNTIME_LORA_UPDATING is true)",
    )
    responses_store_bytes: int = server_option(
        DEFAULT_RESPONSES_STORE_BYTES,
        "the Responses API keeps its stored responses (at most 1,000) within this many bytes, the oldest "
        f"dropped first (default {DEFAULT_RESPONSES_STORE_BYTES:,})",
        int,
    )
    # how replies are read back (tokenmill/parsers/reply.py): None or "auto" chooses from the chat template
    reasoning_parser: str | None = server_option(
        None,
        "how replies' thinking is read: think (<think>...</think>: Qwen3, DeepSeek-R1 and its distills; "
        "vLLM's deepseek_r1 and qwen3 too), harmony (gpt-oss; vLLM's openai), none (the thinking stays in the "
        "answer), or auto (default: from the chat template)",
        str,
    )
    tool_call_parser: str | None = server_option(
        None,
        "the syntax replies call tools in: hermes (<tool_call>: Qwen, Hermes), llama3_json, mistral, "
        "harmony (gpt-oss), constrained (tokenmill's JSON, taught in a system message), or auto (default: from "
        "the chat template)",
        str,
    )
    # llama.cpp's API: GET /slots answers (llama-server's --slots; --no-slots: 501), and where its slots' save
    # and restore actions keep their files (None: those actions answer 501, as llama-server's)
    slots_endpoint: bool = server_option(
        True,
        "llama.cpp's GET /slots: what each of the --max-num-seqs slots holds and does (default on)",
        flags=("--slots",),
    )
    slot_save_path: str | None = server_option(
        None,
        "the folder where llama.cpp's POST /slots/ID?action=save|restore keep a slot's tokens and K/V "
        "(default: none, and those actions answer 501)",
        str,
    )
    metrics: bool = server_option(
        True, "Prometheus metrics at /metrics (default on; --no-metrics: 501, as llama-server without --metrics)"
    )
    metrics_require_key: bool = server_option(False, "with --api-key, /metrics needs the key too", action="store_true")
    chat_template_file: str | None = server_option(
        None, "a Jinja chat template file to render chats with instead of the model's own", str
    )
    # the text of --chat-template-file (read by the command line, so a missing file fails before anything loads)
    chat_template: str | None = filled(None, "--chat-template-file")
    # llama-server's --reasoning: on / off set the chat template's enable_thinking for every conversation that
    # does not set it; auto: on where the template reads enable_thinking (as llama.cpp's templates expect)
    reasoning: str = server_option(
        "auto",
        "thinking in chats: on or off sets the chat template's enable_thinking for every conversation "
        "that does not set it; auto: on where the template reads it (default)",
        str,
        choices=("on", "off", "auto"),
    )
    access_log: bool = server_option(False, "uvicorn's line for every HTTP request too", action="store_true")
    # a request that names no max_tokens gets this (None: the API's default)
    max_tokens_default: int | None = server_option(
        None,
        "output tokens of a request that names no max_tokens (default: the whole context for chat, 16 for "
        "completions, as OpenAI's API)",
        int,
    )
    # no request may ask for more output tokens (400)
    max_tokens_limit: int | None = server_option(
        None, "the most output tokens a request may ask for (400 above it); it also caps the default", int
    )
    log_requests: bool = server_option(  # one access line per API call (tokenmill.requests)
        True,
        "no line per API call (id, endpoint, status, tokens, finish reason, TTFT, duration)",
        flags=("--disable-log-requests",),
        action="store_false",
    )
    # a throughput line this often while busy (None, or 0 given: never)
    log_stats_interval_s: float | None = server_option(
        10.0,
        "seconds between throughput lines while busy (default 10; 0: none)",
        float,
        flags=("--log-stats-interval",),
        metavar="LOG_STATS_INTERVAL",
    )
    log_level: str | None = server_option(
        None, "tokenmill's and uvicorn's log level (default: info, or TOKENMILL_LOG_LEVEL)", str, choices=LOG_LEVELS
    )

    # several models in one server (server/model_router): --model given more than once, or --models-dir
    models_dir: str | None = server_option(
        None,
        "serve every model in this folder (.gguf files, Hugging Face checkpoint folders), each by its name and "
        "loaded on its first request, beside any --model (given several times, --model does the same)",
        str,
    )
    keep_alive: str = server_option(
        "5m",
        "with several models, how long one stays loaded after its last request (Ollama's keep_alive: 5m, 1h, "
        "30s or seconds; 0 unloads it at once; negative keeps it loaded; default 5m); requests may say otherwise",
        str,
    )
    max_loaded_models: int = server_option(
        3,
        "with several models, at most this many loaded at once: the least recently used idle one is unloaded "
        "to load another (default 3, as Ollama's on a CPU)",
        int,
    )
    memory_budget: str | None = server_option(
        None,
        "with several models, the memory (e.g. 8GiB) loaded models may hold together, each counted by its "
        "processes' resident memory: the least recently used idle ones are unloaded to stay within it "
        "(default: no budget)",
        str,
    )

    def __post_init__(self) -> None:
        # what the flags' help says, from Python too: 0 means no limit (and no throughput lines), a string names
        self.max_request_bytes = self.max_request_bytes or None
        self.log_stats_interval_s = self.log_stats_interval_s or None
        self.allowed_origins = _names(self.allowed_origins)
        self.allowed_hosts = _names(self.allowed_hosts)
        self.tags = _names(self.tags)
        if os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").lower() in ("1", "true"):  # vLLM's switch
            self.allow_runtime_lora_updating = True
        self.tools = _names(self.tools)
        if isinstance(self.served_model_name, list):  # --served-model-name's names: an id, then aliases
            names = [name for given in self.served_model_name for name in _names(given)]
            self.served_model_name = names[0] if names else None
            self.served_model_aliases = [*names[1:], *self.served_model_aliases]
