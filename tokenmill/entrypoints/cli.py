"""The `tokenmill` command: `generate` streams one answer to the terminal."""

import argparse
import logging
import sys
import time

from tokenmill.errors import TokenmillError
from tokenmill.log import setup_logging

DESCRIPTION = "tokenmill: an LLM inference engine. With no --model, the bundled SmolLM2-135M-Instruct is used."


def add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="path of a .gguf file (default: the bundled SmolLM2-135M)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: CUDA if available)")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what the engine does")


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=256, help="stop after this many tokens (default 256)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default 0)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenmill", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
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
    add_sampling_args(gen)
    return parser


def sampling_params_from(args: argparse.Namespace):
    from tokenmill.sampling_params import SamplingParams

    return SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, max_tokens=args.max_tokens, seed=args.seed
    )


def run_generate(args: argparse.Namespace) -> int:
    from tokenmill.entrypoints.llm import LLM

    params = sampling_params_from(args)
    llm = LLM(args.model, dtype=args.dtype, device=args.device)
    if args.raw:
        prompt = args.prompt
    else:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": args.prompt}
        ]
        prompt = {"prompt_token_ids": llm.engine.encode_chat(messages)}
    start = time.monotonic()
    last = None
    for out in llm.generate_stream(prompt, params):
        sys.stdout.write(out.outputs[0].delta_text)
        sys.stdout.flush()
        last = out
    sys.stdout.write("\n")
    assert last is not None
    print(format_timings(last, start), file=sys.stderr)
    return 0


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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging(logging.INFO if getattr(args, "verbose", False) else logging.WARNING)
    try:
        if args.command == "generate":
            return run_generate(args)
    except TokenmillError as exc:
        print(f"tokenmill: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 1


if __name__ == "__main__":
    sys.exit(main())
