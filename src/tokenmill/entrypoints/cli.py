"""The `tokenmill` command: `serve` (OpenAI-compatible server), `generate` (one answer), `chat` (interactive),
`bench` (measurements), `models` (what it can find), `pull` (download from the Hugging Face Hub)."""

import argparse
import dataclasses
import logging
import os
import sys
import time
from collections.abc import Callable
from contextlib import closing
from pathlib import Path

from tokenmill.entrypoints.cli_parser import (
    ENGINE_OPTIONS,
    build_parser,
    engine_options,
    model_options,
    model_to_load,
    server_settings,
    settle_model_argument,
)
from tokenmill.errors import TokenmillError
from tokenmill.log import setup_logging

STARTED = time.monotonic()  # about when the process started (its imports so far are light: ~0.1 s)

SAMPLING_OPTIONS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def sampling_params_from(args: argparse.Namespace, llm=None):
    """The model's recommended settings with the options given on the command line on top; without `llm`, only
    the given options (to check them before the model loads)."""
    from tokenmill.sampling_params import SamplingParams

    given = {k: getattr(args, k) for k in SAMPLING_OPTIONS if getattr(args, k) is not None}
    given.update(max_tokens=args.max_tokens, seed=args.sampling_seed)
    return SamplingParams(**given) if llm is None else llm.get_default_sampling_params(**given)


def load_llm_with_progress(args: argparse.Namespace):
    """generate and chat: the model loads under a loading line (importing torch alone takes seconds)."""
    from tokenmill.entrypoints.terminal import LoadingLine

    m = model_to_load(args)  # a --model that names nothing fails before the loading line
    with LoadingLine(args.model or "the bundled SmolLM2-135M-Instruct") as line:
        line.phase("importing torch")
        from tokenmill.entrypoints.llm import LLM

        line.phase("reading the model and building the engine")
        return LLM(m.model, dtype=m.dtype, quantization=m.quantization, **engine_options(args))


def stream_answer(llm, prompt, params, reply=None, stopped: Callable[[], bool] = lambda: False) -> tuple[str, str]:
    """Print the answer as it streams; returns (answer text, timings line). `reply`: a ReplyParser for a chat turn
    (tokenmill/parsers): a reasoning model's thinking goes to stderr (dimmed on a terminal), only its answer to
    stdout and into the conversation. Once `stopped()` holds (Ctrl-C in chat) the answer ends where it is: its
    request is aborted, and what was shown is the answer."""
    start = time.monotonic()
    last = None
    printer = AnswerPrinter(reply)
    with closing(llm.generate_stream(prompt, params)) as outputs:  # closed early: the request is aborted
        for out in outputs:
            if stopped():
                break
            printer.show(out.outputs[0])
            last = out
    sys.stdout.write("\n")  # the terminal on a new line, however the answer ended
    sys.stdout.flush()
    if last is None:
        return "", "[stopped before the first token]"
    answer = reply.text if reply is not None else last.outputs[0].text
    timings = format_timings(last, start)
    return answer, (timings[:-1] + "; stopped by Ctrl-C]" if stopped() else timings)


class AnswerPrinter:
    """An answer's text to stdout as it grows; with a reply parser, its thinking to stderr first, marked."""

    def __init__(self, reply=None):
        self.reply = reply
        self.thought = self.answered = False

    def show(self, o) -> None:
        text = o.delta_text
        if self.reply is not None:
            delta = self.reply.feed_output(o)
            if delta.thinking:
                dim, plain = ("\x1b[2m", "\x1b[0m") if sys.stderr.isatty() else ("", "")
                sys.stderr.write(f"{dim}{'' if self.thought else '[thinking] '}{delta.thinking}{plain}")
                sys.stderr.flush()
                self.thought = True
            text = delta.text
            if self.thought and text and not self.answered:
                sys.stderr.write("\n")  # the thinking's end, before the answer starts
            self.answered = self.answered or bool(text)
        sys.stdout.write(text)
        sys.stdout.flush()


def chat_turn(llm, messages: list[dict], params):
    """A chat turn's prompt, its parameters and its reply parser: the model's own format read back (thinking apart;
    harmony's markers kept in the text for it)."""
    from tokenmill.parsers.reply import PROMPT_TAIL_CHARS, ReplyParser, reply_format

    text = llm.engine.inputs.render_chat(messages)
    fmt = reply_format(llm.engine.chat_template.source)
    if fmt.keeps_special_tokens:
        params = dataclasses.replace(params, skip_special_tokens=False)
    prompt = {"prompt_token_ids": llm.engine.inputs.encode_rendered_chat(text)}
    return prompt, params, ReplyParser(fmt, text[-PROMPT_TAIL_CHARS:], tokenizer=llm.engine.tokenizer)


def format_timings(out, start: float) -> str:
    m = out.metrics
    n = len(out.outputs[0].token_ids)
    ttft_ms = (m.first_token_time - start) * 1000 if m.first_token_time else float("nan")
    decode_s = (m.last_token_time or 0) - (m.first_token_time or 0)
    tok_s = (n - 1) / decode_s if n > 1 and decode_s > 0 else float("nan")
    return (
        f"[{len(out.prompt_token_ids)} prompt tokens, {n} generated; time to first token {ttft_ms:.0f} ms; "
        f"{tok_s:.1f} tokens/s; finish: {out.outputs[0].finish_reason}]"
    )


def warn_if_base_model(llm) -> None:
    """Chat asked of a model whose file has no chat template (a base model, as a rule): say so before answering."""
    if llm.engine.base_model_note is not None:
        print(f"tokenmill: note: {llm.engine.base_model_note}", file=sys.stderr)


def run_generate(args: argparse.Namespace) -> int:
    sampling_params_from(args)  # a bad option fails before the model loads
    llm = load_llm_with_progress(args)
    params = sampling_params_from(args, llm)
    reply = None
    if args.raw:
        prompt = args.prompt
    else:
        warn_if_base_model(llm)
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": args.prompt}
        ]
        prompt, params, reply = chat_turn(llm, messages, params)
    _, timings = stream_answer(llm, prompt, params, reply)
    print(timings, file=sys.stderr)
    return 0


CHAT_COMMANDS = "/reset (forget the conversation), /system TEXT (set the system message), /help, /exit"


def run_chat(args: argparse.Namespace) -> int:
    from tokenmill.entrypoints.terminal import HeldInput, Interrupts, TypeAhead, input_with

    sampling_params_from(args)  # a bad option fails before the model loads
    llm = load_llm_with_progress(args)
    params = sampling_params_from(args, llm)
    warn_if_base_model(llm)
    prompt = "> " if sys.stdin.isatty() else ""
    ahead = TypeAhead()  # keys typed while answers streamed
    system = args.system
    history: list[dict] = []
    if prompt:
        print(f"tokenmill chat with {llm.engine.model_name}. {CHAT_COMMANDS}.", file=sys.stderr)
    while True:
        if ahead.lines:  # entered while an answer streamed: sent in turn, shown as if typed now
            line = ahead.lines.pop(0)
            print(f"{prompt}{line}")
        else:
            try:
                line = input_with(ahead.take_partial(), prompt)
            except EOFError:
                break
            except KeyboardInterrupt:  # Ctrl-C at the prompt (the one during an answer only stopped that answer)
                print()
                return 130
        text = line.strip()
        if not text:
            continue
        command, _, rest = text.partition(" ")
        if command in ("/exit", "/quit"):
            break
        if command == "/reset":
            history = []
            print("[conversation cleared]", file=sys.stderr)
            continue
        if command == "/system":
            system = rest.strip() or None
            history = []
            print("[system message set; conversation cleared]", file=sys.stderr)
            continue
        if command in ("/help", "/?"):
            print(f"[commands: {CHAT_COMMANDS}; a message that starts with / is sent with // instead]", file=sys.stderr)
            continue
        if text.startswith("//"):
            text = text[1:]
        elif text.startswith("/"):
            print(f"[{command} is no command; the commands: {CHAT_COMMANDS}. As text: /{text}]", file=sys.stderr)
            continue
        history.append({"role": "user", "content": text})
        messages = ([{"role": "system", "content": system}] if system else []) + history
        held = HeldInput()  # keys typed while the answer streams are not printed into it
        try:
            turn, turn_params, reply = chat_turn(llm, messages, params)
            with held, Interrupts() as ctrl_c:  # Ctrl-C stops this answer, not the chat
                answer, timings = stream_answer(llm, turn, turn_params, reply, lambda: ctrl_c.seen)
        except TokenmillError as exc:
            history.pop()
            print(f"[error: {exc}]", file=sys.stderr)
            continue
        finally:
            ahead.add(held.lines, held.text)
        print(timings, file=sys.stderr)
        if answer or not ctrl_c.seen:  # a stopped answer stays in the conversation as far as it was shown
            history.append({"role": "assistant", "content": answer})
        else:  # stopped before it said anything: the question was not answered
            history.pop()
    return 0


def run_serve(args: argparse.Namespace) -> int:
    from tokenmill.distributed.group import torchrun_rank

    if torchrun_rank() not in (None, 0):  # torchrun started this rank: it computes, rank 0 serves HTTP
        return run_torchrun_worker(args)
    from dataclasses import replace

    from tokenmill.errors import InvalidParameterError
    from tokenmill.parsers.reply import reply_format
    from tokenmill.server.agent_tools import check_tools_option
    from tokenmill.server.listen import listen_problem

    s = server_settings(args)  # the server's flags (config/server.py); the model's and the engine's below
    try:  # a parser name that does not exist fails before anything loads
        reply_format("", s.reasoning_parser, s.tool_call_parser)
    except InvalidParameterError as exc:
        print(f"tokenmill: error: {exc}", file=sys.stderr)
        return 2

    try:  # an unknown tool name, or tools open to the network without a key, fail before anything loads
        check_tools_option(s.tools, s.host, s.api_key or os.environ.get("TOKENMILL_API_KEY"))
    except ValueError as exc:
        print(f"tokenmill: error: --tools: {exc}", file=sys.stderr)
        return 2
    for host in [h.strip() for h in s.host.split(",") if h.strip()] or [s.host]:
        problem = listen_problem(host, s.port)
        if problem is not None:  # before any rank starts or anything loads
            rank = "" if torchrun_rank() is None else "rank 0: "
            print(f"tokenmill: error: {rank}cannot listen on {host}:{s.port}: {problem}", file=sys.stderr)
            return 1
    if s.chat_template_file is not None:
        try:
            s = replace(s, chat_template=Path(s.chat_template_file).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as exc:
            print(f"tokenmill: error: cannot read --chat-template-file: {exc}", file=sys.stderr)
            return 2
    if s.slot_save_path is not None and not Path(s.slot_save_path).is_dir():  # as llama-server refuses it
        print(f"tokenmill: error: --slot-save-path: not a directory: {s.slot_save_path}", file=sys.stderr)
        return 2
    if s.log_level is not None:
        setup_logging(s.log_level.upper())
    if len(set(getattr(args, "models", None) or [])) > 1 or s.models_dir is not None:
        return run_serve_models(args, s)
    from tokenmill.entrypoints.engine_prefetch import EnginePrefetch

    # parse the model file and build its tokenizer while torch is imported, then build the engine while the web
    # stack is imported (serve() checks the file's header before it listens, and serves once the engine is built)
    m = model_to_load(args)  # a Hub model: downloaded now, before anything loads
    if m.model != args.model and s.served_model_name is None:
        s = replace(s, served_model_name=args.model)  # a Hub model is served by its Hub name, as vLLM serves it
    prefetched = EnginePrefetch(m.model)
    prefetched.start_engine(m.dtype, m.quantization, engine_options(args))
    from tokenmill.server.serve import serve

    s = replace(s, model=m.model, dtype=m.dtype, quantization=m.quantization, engine_options=engine_options(args))
    return serve(s, s.host, s.port, s.access_log, prefetched, s.log_level, STARTED)


def run_serve_models(args: argparse.Namespace, s) -> int:
    """serve with several models (server/model_router): each found now (a Hub model downloaded), loaded on its
    first request."""
    import os
    from dataclasses import replace

    from tokenmill.entrypoints.model_names import find_model
    from tokenmill.loader.gguf_file import check_gguf_magic
    from tokenmill.loader.hf_checkpoint import HFCheckpoint, is_hf_checkpoint
    from tokenmill.loader.model_path import resolve_model_path
    from tokenmill.server.model_router.catalog import served_model, split_named
    from tokenmill.server.model_router.keep_alive import parse_keep_alive

    if s.served_model_name is not None:
        print("tokenmill: error: with several models, name each as --model NAME=MODEL", file=sys.stderr)
        return 2
    if getattr(args, "lora_modules", None):  # an adapter belongs to one model; the router has no base to give it
        print(
            "tokenmill: error: --lora serves the adapters of one model: serve that model on its own "
            "(tokenmill serve --model MODEL --lora NAME=PATH)",
            file=sys.stderr,
        )
        return 2
    if args.revision is not None or args.hf_file is not None:
        print(
            "tokenmill: error: --revision and --hf-file apply to one model; with several, use ORG/NAME-GGUF:QUANT",
            file=sys.stderr,
        )
        return 2
    parse_keep_alive(s.keep_alive)  # a bad --keep-alive fails before anything starts
    if s.memory_budget is not None:
        from tokenmill.config.engine import parse_memory

        parse_memory(s.memory_budget)
    if s.models_dir is not None and not Path(s.models_dir).expanduser().is_dir():
        print(f"tokenmill: error: --models-dir: not a directory: {s.models_dir}", file=sys.stderr)
        return 2
    models = []
    for spec in dict.fromkeys(getattr(args, "models", None) or []):  # each once, in order
        name, model = split_named(spec)
        path = resolve_model_path(find_model(model))
        if is_hf_checkpoint(path):  # fail fast, as one model's server does, on a file that cannot be right
            HFCheckpoint(path)
        else:
            check_gguf_magic(path)
        models.append(served_model(model, str(path), name))
    m = model_options(args)
    if s.api_key is None:
        s.api_key = os.environ.get("TOKENMILL_API_KEY") or None
    s = replace(s, dtype=m.dtype, quantization=m.quantization, engine_options=engine_options(args))
    from tokenmill.server.model_router.serve import serve_models

    return serve_models(s, models)


def run_torchrun_worker(args: argparse.Namespace) -> int:
    from tokenmill.config import EngineConfig
    from tokenmill.executor.launcher import RankSpec
    from tokenmill.executor.worker import run_torchrun_worker as run_worker
    from tokenmill.loader.hub_reference import is_hub_reference

    # the model file is found after joining the ranks, except a Hub model's: each rank finds it in the Hub's cache
    # (downloading it where the cache lacks it: huggingface_hub's file locks keep the ranks' copies apart)
    m = model_to_load(args) if is_hub_reference(args.model) else model_options(args)
    config = EngineConfig.from_options(engine_options(args))
    # a rank that cannot load the model file is named in rank 0's error
    spec = RankSpec.for_engine(m.model, m.dtype, m.quantization, config)
    return run_worker(spec)


def run_bench(args: argparse.Namespace) -> int:
    import json

    from tokenmill.entrypoints.bench.workload import parse_range

    if args.bench == "soak":
        from tokenmill.entrypoints.bench.soak import run_soak

        result = run_soak(args.url, args.duration, args.concurrency, args.sample, args.seed, args.api_key)
    elif args.bench == "serve":
        from tokenmill.entrypoints.bench.serve import run_serve_bench

        result = run_serve_bench(
            args.url,
            args.concurrency,
            args.num_prompts,
            parse_range(args.input_len),
            parse_range(args.output_len),
            args.seed,
        )
    else:
        options = {k: getattr(args, k) for k in ENGINE_OPTIONS if k != "seed" and getattr(args, k, None) is not None}
        m = model_to_load(args)
        llm_kwargs = {"model": m.model, "dtype": m.dtype, "quantization": m.quantization, **options}
        if args.bench == "structured":
            from tokenmill.entrypoints.bench.structured import run_structured

            concurrencies = [int(c) for c in args.concurrency.split(",")]
            result = run_structured(llm_kwargs, concurrencies, args.output_len, args.reps, args.seed)
        elif args.bench == "offline":
            from tokenmill.entrypoints.bench.offline import run_offline

            result = run_offline(
                llm_kwargs, args.num_prompts, parse_range(args.input_len), parse_range(args.output_len), args.seed
            )
        else:
            from tokenmill.entrypoints.bench.latency import run_latency

            result = run_latency(llm_kwargs, args.input_len, args.output_len, args.runs, args.seed, args.warmup_len)
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>20}: {value}")
    return 0


def run_models(args: argparse.Namespace) -> int:
    import json

    from tokenmill.loader.catalog import list_models

    rows = list_models()
    if args.json:
        print(json.dumps(rows))
        return 0
    width = max([14] + [len(r["name"] or "-") for r in rows])  # Hub names are long
    print(f"{'name':<{width}} {'architecture':<12} {'params':<7} {'quant':<8} {'MiB':>7}  path; note")
    for r in rows:
        notes = [r["note"]] if r["note"] else []
        if r.get("chat_template") is False:
            notes.append("no chat template: a base model, give it text to continue (generate --raw)")
        where = "; ".join(([r["path"]] if r["path"] else []) + notes)
        print(
            f"{r['name'] or '-':<{width}} {r.get('architecture') or '-':<12} {r.get('parameters') or '-':<7} "
            f"{r.get('quantization') or '-':<8} {r.get('file_mib') or '-':>7}  {where}"
        )
    return 0


def run_pull(args: argparse.Namespace) -> int:
    """Download a Hub model (or find it in the cache) and print its local path: on stdout alone, for scripts."""
    from tokenmill.entrypoints.model_names import find_model
    from tokenmill.loader.hub_reference import is_hub_reference

    if not is_hub_reference(args.model):
        print(f"tokenmill: error: {args.model!r} is no Hugging Face Hub repository (ORG/NAME)", file=sys.stderr)
        return 2
    path = find_model(args.model, args.revision, args.hf_file)
    flags = "".join(
        f" --{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k in ("revision", "hf_file") and v
    )
    print(f"{args.model}: in the Hub's cache; `--model {args.model}{flags}` loads it from there", file=sys.stderr)
    print(path)
    return 0


COMMANDS = {
    "serve": run_serve,
    "generate": run_generate,
    "chat": run_chat,
    "bench": run_bench,
    "models": run_models,
    "pull": run_pull,
}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    settle_model_argument(parser, args)
    quiet = args.command != "serve" and not getattr(args, "verbose", False)
    setup_logging(logging.WARNING if quiet else logging.INFO)
    try:
        return COMMANDS[args.command](args)
    except TokenmillError as exc:
        print(f"tokenmill: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
