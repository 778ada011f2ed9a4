"""Long prompts at a real size, tokenmill beside llama.cpp in one run: time to first token of one long prompt, and
decode speed at that context, with 16-bit K/V in both engines (and 8-bit with --int8: tokenmill's int8 beside
llama.cpp's q8_0).

    .venv/bin/python benchmarks/long_context.py --peers-python .venv-peers/bin/python [--shape smollm2-1.7b]
        [--input-len 8192] [--output-len 33] [--reps 1] [--context 32768] [--int8]

The model is synth_model.py's GGUF of the shape (real_size.py writes it when missing), copied once with its
context_length raised to --context (random weights: only speed is measured, and both engines read the same file),
so that an 8,192-token prompt and its output fit the trained length tokenmill enforces. Each engine runs in its own
process: a 512-token warm-up request, then --input-len random tokens (time to first token), then --output-len - 1
decoded tokens at that context. tokenmill runs `tokenmill bench latency` (quantization auto, chunked prefill of
512 tokens a step, as llama.cpp's n_batch); llama.cpp runs benchmarks/peers/llamacpp_peer.py (llama-cpp-python,
flash attention as llama.cpp chooses). Prints JSON lines, then a markdown table for benchmarks/README.md.
"""

import argparse
import json
import shutil
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from real_size import BIN, ROOT, measured, synth_file  # noqa: E402

WARMUP_LEN = 512


def with_context(path: Path, context: int) -> Path:
    """A copy of the GGUF whose `{arch}.context_length` says `context` (patched in place in the copy's header)."""
    import gguf

    out = path.with_name(f"{path.stem}-ctx{context}.gguf")
    if out.exists():
        return out
    partial = out.with_suffix(".partial")
    shutil.copyfile(path, partial)
    reader = gguf.GGUFReader(partial, "r+")
    arch = reader.fields["general.architecture"].contents()
    field = reader.fields[f"{arch}.context_length"]
    field.parts[field.data[0]][0] = context
    del reader  # flushes the memmap
    partial.rename(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers-python", default=str(ROOT / ".venv-peers" / "bin" / "python"))
    parser.add_argument("--shape", default="smollm2-1.7b")
    parser.add_argument("--quant", default="Q4_K_M")
    parser.add_argument("--input-len", type=int, default=8192)
    parser.add_argument("--output-len", type=int, default=33)
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--context", type=int, default=32768, help="the copy's context_length")
    parser.add_argument("--int8", action="store_true", help="also 8-bit K/V (tokenmill int8, llama.cpp q8_0)")
    args = parser.parse_args()
    path = with_context(synth_file(args.peers_python, args.shape, args.quant), args.context)
    lengths = ["--input-len", str(args.input_len), "--output-len", str(args.output_len)]
    lengths += ["--warmup-len", str(WARMUP_LEN)]
    tm = [str(BIN / "tokenmill"), "bench", "latency", "--model", str(path), "--json", "--runs", "1", *lengths]
    tm += ["--quantization", "auto", "--max-model-len", str(args.input_len + args.output_len + 16)]
    peer = [args.peers_python, str(ROOT / "benchmarks" / "peers" / "llamacpp_peer.py"), "--model", str(path)]
    peer += ["latency", "--runs", "1", *lengths]
    settings = [("16-bit", "float16", "f16")] + ([("8-bit", "int8", "q8_0")] if args.int8 else [])
    runs: dict[str, list[dict]] = {}
    for _ in range(args.reps):
        for label, ours, theirs in settings:
            runs.setdefault(f"tokenmill {label}", []).append(measured([*tm, "--kv-cache-dtype", ours]))
            runs.setdefault(f"llama.cpp {label}", []).append(measured([*peer, "--cache-type", theirs]))

    def med(name: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[name])

    print(f"| {args.shape} {args.quant}, {args.input_len}-token prompt | tokenmill | llama.cpp | ratio |")
    print("| --- | --- | --- | --- |")
    for label, _, _ in settings:
        ours, theirs = f"tokenmill {label}", f"llama.cpp {label}"
        ttft_t, ttft_l = med(ours, "ttft_ms") / 1e3, med(theirs, "ttft_ms") / 1e3
        print(f"| time to first token, {label} K/V | {ttft_t:.1f} s | {ttft_l:.1f} s | {ttft_l / ttft_t:.2f}x |")
        dec_t, dec_l = med(ours, "decode_tok_s"), med(theirs, "decode_tok_s")
        print(f"| decode at {args.input_len} context, {label} K/V | {dec_t:.2f} tok/s | {dec_l:.2f} tok/s | "
              f"{dec_t / dec_l:.2f}x |")  # fmt: skip
        rss_t, rss_l = med(ours, "peak_rss_mib"), med(theirs, "peak_rss_mib")
        print(f"| peak RSS, {label} K/V | {rss_t:,.0f} MiB | {rss_l:,.0f} MiB | |")
        print(f"| KV bytes per token (tokenmill's pool), {label} | {med(ours, 'kv_bytes_per_token'):,.0f} | | |")
    print(json.dumps({"bench": "long_context", "input_len": args.input_len, "model": path.name}))


if __name__ == "__main__":
    main()
