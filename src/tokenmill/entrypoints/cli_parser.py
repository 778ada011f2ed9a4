"""The `tokenmill` command's arguments: every subcommand's parser (cli.py runs them)."""

import argparse
from dataclasses import fields

from tokenmill import __version__
from tokenmill.config import EngineConfig, ModelOptions
from tokenmill.entrypoints.model_names import check_model_name
from tokenmill.server import DEFAULT_MAX_REQUEST_BYTES, DEFAULT_RESPONSES_STORE_BYTES

DESCRIPTION = "tokenmill: an LLM inference engine. With no --model, the bundled SmolLM2-135M-Instruct is used."


def add_model_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("model")
    add_config_options(g, "model", ModelOptions)
    add_config_options(g, "model")  # EngineConfig's --device
    g.add_argument("-v", "--verbose", action="store_true", help="log what the engine does")


def model_options(args: argparse.Namespace) -> ModelOptions:
    """The model options of parsed arguments, validated (the quantization parsed: "none" -> None)."""
    given = {f.name: getattr(args, f.name) for f in fields(ModelOptions) if getattr(args, f.name) is not None}
    return ModelOptions(**given)


def model_to_load(args: argparse.Namespace) -> ModelOptions:
    """model_options, for a command about to load its model: a --model that names nothing there is is refused
    first, with the names there are (entrypoints/model_names.py)."""
    options = model_options(args)
    check_model_name(options.model)
    return options


def add_config_options(
    group: argparse._ArgumentGroup, name: str, config: type = EngineConfig, skip: tuple[str, ...] = ()
) -> None:
    """The command-line options of a config's fields in help group `name` (config/engine.py's `option`): flags,
    types, choices and help come from the fields, and an option left out leaves the field's default (or the
    field's cli_default, where the command line's differs)."""
    for f in fields(config):
        meta = f.metadata
        if "help" not in meta or meta["group"] != name or f.name in skip:
            continue
        flags = meta.get("flags", ("--" + f.name.replace("_", "-"),))
        kwargs: dict = {"dest": f.name, "default": meta.get("cli_default"), "help": meta["help"]}
        if meta["type"] is None:  # a switch: --x / --no-x
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = meta["type"]
        if "choices" in meta:
            kwargs["choices"] = meta["choices"]
        group.add_argument(*flags, **kwargs)


def add_engine_args(parser: argparse.ArgumentParser, request_seed: bool = True) -> None:
    """The engine's options; `request_seed`: its --seed (the benchmarks' --seed seeds their workload instead)."""
    add_config_options(parser.add_argument_group("engine"), "engine", skip=() if request_seed else ("seed",))
    add_config_options(parser.add_argument_group("tensor parallelism"), "tensor parallelism")


# every EngineConfig field that is a command-line option
ENGINE_OPTIONS = tuple(f.name for f in fields(EngineConfig) if "help" in f.metadata)


def engine_options(args: argparse.Namespace) -> dict:
    return {k: getattr(args, k) for k in ENGINE_OPTIONS if getattr(args, k, None) is not None}


def add_sampling_args(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    g = parser.add_argument_group("sampling (default: the model's recommended settings, see --generation-config)")
    g.add_argument("--max-tokens", type=int, default=max_tokens, help=f"stop after this many tokens ({max_tokens})")
    g.add_argument("--temperature", type=float, default=None, help="0 is greedy")
    g.add_argument(
        "--top-p", type=float, default=None, help="sample from the fewest tokens whose probability reaches this"
    )
    g.add_argument("--top-k", type=int, default=None, help="sample from the k most likely tokens only (0: all)")
    g.add_argument("--min-p", type=float, default=None, help="drop tokens less likely than this times the top one")
    g.add_argument(
        "--repetition-penalty",
        type=float,
        default=None,
        help="above 1, tokens already in the prompt or the output become less likely (1: off)",
    )
    g.add_argument("--sampling-seed", type=int, default=None, help="seed of this generation")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenmill", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"tokenmill {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = sub.add_parser(
        "serve",
        help="run the HTTP server (OpenAI's, Anthropic's, Ollama's and llama.cpp's APIs)",
        description="Serve the model over OpenAI's API (/v1/completions, /v1/chat/completions, /v1/embeddings, "
        "/v1/responses, /v1/models; also without /v1), Anthropic's Messages API (/v1/messages, "
        "/v1/messages/count_tokens), Ollama's (/api/chat, /api/generate, /api/embed, /api/tags, /api/show, ...), "
        "llama.cpp's /infill, the SGLang gateway's /server_info, /model_info and /get_load, with /health, /metrics "
        "(Prometheus), /tokenize, /detokenize, /tokenizer_info, /version, /openapi.json and the request explorer "
        "at /. Example client: openai.OpenAI(base_url='http://127.0.0.1:8000/v1', api_key='none').",
    )
    serve.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on, or several, comma-separated (default 127.0.0.1); beside others, :: is IPv6 only",
    )
    serve.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    serve.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="model names clients use, space- or comma-separated: the first is its id, the others aliases "
        "(default: from the file)",
    )
    serve.add_argument(
        "--tags", default="", help="comma-separated tags /v1/models shows with the model (llama-server's --tags)"
    )
    serve.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (or TOKENMILL_API_KEY)")
    serve.add_argument(
        "--max-queue",
        type=int,
        default=None,
        help="answer 503 with Retry-After when more requests than this are waiting",
    )
    serve.add_argument(
        "--shutdown-grace",
        type=float,
        default=30.0,
        help="seconds requests in flight may finish after SIGTERM (default 30)",
    )
    serve.add_argument(
        "--max-request-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BYTES,
        help="answer 413 to request bodies larger than this, before parsing them "
        f"(default {DEFAULT_MAX_REQUEST_BYTES:,}; 0: no limit)",
    )
    serve.add_argument(
        "--no-explorer",
        dest="explorer",
        action="store_false",
        help="do not serve the request explorer (/ and /explorer/*)",
    )
    serve.add_argument(
        "--allowed-origins",
        default="",
        help="comma-separated origins whose web pages may call the API, beyond the local ones "
        "(http(s)://localhost, 127.0.0.1, [::1], any port) and the server's own; '*' for any. Others get 403",
    )
    serve.add_argument(
        "--allowed-hosts",
        default="",
        help="comma-separated Host names to answer beyond localhost, IP addresses and --host (a guard against "
        "DNS rebinding: other names get 403); '*' for any, e.g. behind a proxy that keeps the client's Host",
    )
    serve.add_argument(
        "--responses-store-bytes",
        type=int,
        default=DEFAULT_RESPONSES_STORE_BYTES,
        help="the Responses API keeps its stored responses (at most 1,000) within this many bytes, the oldest "
        f"dropped first (default {DEFAULT_RESPONSES_STORE_BYTES:,})",
    )
    serve.add_argument(
        "--reasoning-parser",
        default=None,
        help="how replies' thinking is read: think (<think>...</think>: Qwen3, DeepSeek-R1 and its distills; "
        "vLLM's deepseek_r1 and qwen3 too), harmony (gpt-oss; vLLM's openai), none (the thinking stays in the "
        "answer), or auto (default: from the chat template)",
    )
    serve.add_argument(
        "--tool-call-parser",
        default=None,
        help="the syntax replies call tools in: hermes (<tool_call>: Qwen, Hermes), llama3_json, mistral, "
        "harmony (gpt-oss), constrained (tokenmill's JSON, taught in a system message), or auto (default: from "
        "the chat template)",
    )
    serve.add_argument(
        "--slots",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="llama.cpp's GET /slots: what each of the --max-num-seqs slots holds and does (default on)",
    )
    serve.add_argument(
        "--slot-save-path",
        default=None,
        help="the folder where llama.cpp's POST /slots/ID?action=save|restore keep a slot's tokens and K/V "
        "(default: none, and those actions answer 501)",
    )
    serve.add_argument(
        "--metrics",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="Prometheus metrics at /metrics (default on; --no-metrics: 501, as llama-server without --metrics)",
    )
    serve.add_argument("--metrics-require-key", action="store_true", help="with --api-key, /metrics needs the key too")
    serve.add_argument(
        "--chat-template-file",
        default=None,
        help="a Jinja chat template file to render chats with instead of the model's own",
    )
    serve.add_argument(
        "--reasoning",
        default="auto",
        choices=["on", "off", "auto"],
        help="thinking in chats: on or off sets the chat template's enable_thinking for every conversation "
        "that does not set it; auto: on where the template reads it (default)",
    )
    serve.add_argument("--access-log", action="store_true", help="uvicorn's line for every HTTP request too")
    serve.add_argument(
        "--max-tokens-default",
        type=int,
        default=None,
        help="output tokens of a request that names no max_tokens (default: the whole context for chat, 16 for "
        "completions, as OpenAI's API)",
    )
    serve.add_argument(
        "--max-tokens-limit",
        type=int,
        default=None,
        help="the most output tokens a request may ask for (400 above it); it also caps the default",
    )
    serve.add_argument(
        "--disable-log-requests",
        dest="log_requests",
        action="store_false",
        help="no line per API call (id, endpoint, status, tokens, finish reason, TTFT, duration)",
    )
    serve.add_argument(
        "--log-stats-interval",
        type=float,
        default=10.0,
        help="seconds between throughput lines while busy (default 10; 0: none)",
    )
    serve.add_argument(
        "--log-level",
        default=None,
        choices=["debug", "info", "warning", "error"],
        help="tokenmill's and uvicorn's log level (default: info, or TOKENMILL_LOG_LEVEL)",
    )
    add_model_args(serve)
    add_engine_args(serve)

    gen = sub.add_parser(
        "generate",
        help="stream an answer to one prompt",
        description="Stream the model's answer to PROMPT, then print time to first token and tokens/s. "
        "The prompt is wrapped in the model's chat template unless --raw is given.",
    )
    gen.add_argument("prompt", help='the prompt, e.g. "How do GPUs work?"')
    gen.add_argument("--raw", action="store_true", help="send the text as is, without the chat template")
    gen.add_argument("--system", default=None, help="a system message (chat mode)")
    add_model_args(gen)
    add_engine_args(gen)
    add_sampling_args(gen, 256)

    chat = sub.add_parser(
        "chat",
        help="talk with the model in the terminal",
        description="An interactive, multi-turn chat: type a message and press Enter; the answer streams, "
        "followed by its time to first token and tokens/s. Commands: /reset forgets the conversation, "
        "/system TEXT sets the system message, /help lists them, /exit (or Ctrl-D) quits; a message that starts "
        "with / is sent as //message. Lines typed while an answer streams are sent after it, in turn. Ctrl-C "
        "stops the answer that streams (the conversation goes on); at the prompt it quits.",
    )
    chat.add_argument("--system", default=None, help="a system message for the whole conversation")
    add_model_args(chat)
    add_engine_args(chat)
    add_sampling_args(chat, 512)
    models = sub.add_parser(
        "models",
        help="list the models it can find",
        description="The models --model NAME finds (bundled and installed packages) and the GGUF files and "
        "Hugging Face checkpoint directories in tokenmill's cache (~/.cache/tokenmill/models, or "
        "$TOKENMILL_CACHE_DIR/models): architecture, "
        "parameters, quantization and size.",
    )
    models.add_argument("--json", action="store_true", help="print one JSON line")
    bench = sub.add_parser(
        "bench",
        help="measure throughput and latency",
        description="Benchmarks that print one JSON line with --json (a readable summary otherwise).",
    )
    bench_sub = bench.add_subparsers(dest="bench", required=True, metavar="BENCH")
    offline = bench_sub.add_parser(
        "offline",
        help="the offline workload through LLM.generate",
        description="All requests at once; generation time excludes load and warm-up.",
    )
    latency = bench_sub.add_parser(
        "latency",
        help="one request at a time: TTFT, prefill and decode tokens/s",
        description="Median over --runs requests of --input-len random tokens.",
    )
    structured = bench_sub.add_parser(
        "structured",
        help="decode tokens/s with and without a JSON-schema constraint, at 1 and 32 concurrent requests",
        description="Alternating constrained and free requests in one process (tokenmill/bench/structured.py); also "
        "a typical schema's compile time and the time spent computing masks.",
    )
    structured.add_argument(
        "--concurrency", default="1,32", help="comma-separated request counts run together (default 1,32)"
    )
    structured.add_argument("--output-len", type=int, default=128, help="tokens each request samples (default 128)")
    structured.add_argument("--reps", type=int, default=3, help="alternating repetitions, medians (default 3)")
    serve_bench = bench_sub.add_parser(
        "serve",
        help="a streaming load generator against a running server",
        description="Sends the offline workload to --url over /v1/completions.",
    )
    soak = bench_sub.add_parser(
        "soak",
        help="mixed traffic against a running server for a while, its memory sampled",
        description="Completions and chat, streamed or not, n > 1, log-probabilities, clients that leave early and "
        "requests that must fail, from --concurrency clients for --duration seconds; every answer is checked, and "
        "the server's resident memory is read from its /metrics every --sample seconds.",
    )
    soak.add_argument("--url", default="http://127.0.0.1:8000", help="the server (default http://127.0.0.1:8000)")
    soak.add_argument("--duration", type=float, default=300.0, help="seconds (default 300)")
    soak.add_argument("--concurrency", type=int, default=8, help="clients at once (default 8)")
    soak.add_argument("--sample", type=float, default=5.0, help="seconds between memory samples (default 5)")
    soak.add_argument("--api-key", default=None, help="the server's API key, if it has one")
    for p in (offline, serve_bench):
        p.add_argument("--num-prompts", type=int, default=32, help="requests in the workload (default 32)")
        p.add_argument("--input-len", default="32:256", help="prompt length range, inclusive (default 32:256)")
        p.add_argument("--output-len", default="16:128", help="output length range, inclusive (default 16:128)")
    for p in (offline, latency, structured, serve_bench, soak):
        p.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
        p.add_argument("--json", action="store_true", help="print one JSON line")
    latency.add_argument("--input-len", type=int, default=128, help="prompt tokens (default 128)")
    latency.add_argument("--output-len", type=int, default=128, help="generated tokens (default 128)")
    latency.add_argument("--runs", type=int, default=5, help="requests, one after the other; medians (default 5)")
    latency.add_argument(
        "--warmup-len", type=int, default=None, help="the warm-up request's prompt tokens (default: --input-len)"
    )
    serve_bench.add_argument(
        "--url", default="http://127.0.0.1:8000", help="the server (default http://127.0.0.1:8000)"
    )
    serve_bench.add_argument("--concurrency", type=int, default=16, help="clients at once (default 16)")
    for p in (offline, latency, structured):
        add_model_args(p)
        add_engine_args(p, request_seed=False)
    return parser
