"""The `tokenmill` command's arguments: every subcommand's parser (cli.py runs them)."""

import argparse
from dataclasses import fields

from tokenmill import __version__
from tokenmill.config import EngineConfig, ModelOptions
from tokenmill.config.server import ServerSettings
from tokenmill.entrypoints.model_names import find_model

DESCRIPTION = "tokenmill: an LLM inference engine. With no --model, the bundled SmolLM2-135M-Instruct is used."


class _SeveralModels(argparse.Action):
    """serve's --model: given more than once, several models (args.models, in order; args.model the first)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        namespace.models = [*(getattr(namespace, "models", None) or []), values]
        namespace.model = namespace.models[0]


def add_model_args(parser: argparse.ArgumentParser, several: bool = False) -> None:
    """The model's options; `several`: --model may be given more than once (serve)."""
    g = parser.add_argument_group("model")
    if several:
        help = next(f.metadata["help"] for f in fields(ModelOptions) if f.name == "model")
        g.add_argument(
            "--model",
            dest="model",
            action=_SeveralModels,
            default=None,
            help=help + ". Given more than once (NAME=MODEL names one), several models: each loads on its first "
            "request and unloads after --keep-alive",
        )
        parser.set_defaults(models=None)
    add_config_options(g, "model", ModelOptions, skip=("model",) if several else ())
    add_config_options(g, "model")  # EngineConfig's --device
    g.add_argument("-v", "--verbose", action="store_true", help="log what the engine does")


def settle_model_argument(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """`tokenmill serve MODEL` is `--model MODEL`; both, naming different models, is an error."""
    given = getattr(args, "model_positional", None)
    if given is None:
        return
    if len(getattr(args, "models", None) or []) > 1:
        parser.error(f"serve was given a model ({given!r}) beside several --model: give each with --model")
    if args.model is not None and args.model != given:
        parser.error(f"serve was given two models: {given!r} and --model {args.model!r}")
    args.model = given
    args.models = [given]


def model_options(args: argparse.Namespace) -> ModelOptions:
    """The model options of parsed arguments, validated (the quantization parsed: "none" -> None)."""
    given = {f.name: getattr(args, f.name) for f in fields(ModelOptions) if getattr(args, f.name) is not None}
    return ModelOptions(**given)


def model_to_load(args: argparse.Namespace) -> ModelOptions:
    """model_options, for a command about to load its model: a Hub repository is downloaded (or found in the
    cache) and becomes its local path; a --model that names nothing there is is refused first, with the names
    there are (entrypoints/model_names.py)."""
    options = model_options(args)
    options.model = find_model(options.model, options.revision, options.hf_file)
    options.revision = options.hf_file = None  # settled: `model` is a local path or a name now
    return options


def add_config_options(
    group: argparse._ActionsContainer, name: str, config: type = EngineConfig, skip: tuple[str, ...] = ()
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
        if "action" in meta:  # a switch one way only: store_true (--access-log) or store_false (--no-explorer)
            kwargs["action"] = meta["action"]
        elif meta["type"] is None:  # a switch: --x / --no-x
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = meta["type"]
        for key in ("choices", "metavar", "nargs"):
            if key in meta:
                kwargs[key] = meta[key]
        group.add_argument(*flags, **kwargs)


def add_engine_args(parser: argparse.ArgumentParser, request_seed: bool = True) -> None:
    """The engine's options; `request_seed`: its --seed (the benchmarks' --seed seeds their workload instead)."""
    add_config_options(parser.add_argument_group("engine"), "engine", skip=() if request_seed else ("seed",))
    add_config_options(parser.add_argument_group("tensor parallelism"), "tensor parallelism")


# every EngineConfig field that is a command-line option
ENGINE_OPTIONS = tuple(f.name for f in fields(EngineConfig) if "help" in f.metadata)


def engine_options(args: argparse.Namespace) -> dict:
    return {k: getattr(args, k) for k in ENGINE_OPTIONS if getattr(args, k, None) is not None}


# every ServerSettings field that is a flag of `tokenmill serve` (the others are filled from the model's and the
# engine's options)
SERVER_OPTIONS = tuple(f.name for f in fields(ServerSettings) if "help" in f.metadata)


def server_settings(args: argparse.Namespace) -> ServerSettings:
    """The server's settings from parsed `serve` arguments: a flag left out leaves its field's default. The fields
    that are no flags (the model's, the engine's options) keep their defaults here: the caller fills them."""
    return ServerSettings(**{k: getattr(args, k) for k in SERVER_OPTIONS if getattr(args, k) is not None})


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
        "llama.cpp's (/completion, /infill, /props, /slots, /apply-template; /tools with --tools, /cors-proxy with "
        "--ui-mcp-proxy), the SGLang gateway's /server_info, /model_info and /get_load, with /health, /metrics "
        "(Prometheus), /tokenize, /detokenize, /tokenizer_info, /version, /openapi.json and the request explorer "
        "at /. Example client: openai.OpenAI(base_url='http://127.0.0.1:8000/v1', api_key='none').",
    )
    serve.add_argument(
        "model_positional",
        nargs="?",
        metavar="MODEL",
        help="the model, as --model takes it (vLLM's `vllm serve ORG/NAME`)",
    )
    add_config_options(serve, "server", ServerSettings)  # listed first, under "options"
    add_model_args(serve, several=True)
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
        description="The models --model NAME finds (bundled and installed packages), the GGUF files and "
        "Hugging Face checkpoint directories in tokenmill's cache (~/.cache/tokenmill/models, or "
        "$TOKENMILL_CACHE_DIR/models) and the models in the Hugging Face Hub's cache (`tokenmill pull`; "
        "~/.cache/huggingface/hub, or $HF_HUB_CACHE), by the name --model takes: architecture, "
        "parameters, quantization and size.",
    )
    models.add_argument("--json", action="store_true", help="print one JSON line")
    pull = sub.add_parser(
        "pull",
        help="download a model from the Hugging Face Hub",
        description="Download a model from the Hugging Face Hub into its cache (~/.cache/huggingface/hub, or "
        "$HF_HUB_CACHE), resuming a download that was cut, and print where it is. MODEL: ORG/NAME (a safetensors "
        "repository) or ORG/NAME-GGUF:QUANT (the GGUF file whose name holds QUANT; every shard of a split one). "
        "HF_TOKEN reads gated and private repositories; HF_ENDPOINT names a mirror; with HF_HUB_OFFLINE=1 only the "
        "cache is looked at. `--model` with the same name loads it without a network.",
    )
    pull.add_argument("model", help="ORG/NAME or ORG/NAME-GGUF:QUANT")
    pull.add_argument("--revision", default=None, help="a branch, tag or commit (default: main)")
    pull.add_argument("--hf-file", default=None, help="one .gguf file of the repository, by its path there")
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
        description="Alternating constrained and free requests in one process "
        "(tokenmill/entrypoints/bench/structured.py); also a typical schema's compile time and the time spent "
        "computing masks.",
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
