"""llama.cpp (llama-cpp-python's low-level API) on the same GGUF and the same workloads as `tokenmill bench`.

Runs in the peers' virtual environment (`make bench-peers`); prints one JSON line per benchmark:
- offline: the offline workload (benchmarks/workload.py, identical to tests/data/workload.py), greedy,
  ignore EOS: prompts packed 512 tokens a batch, then one llama_decode per step for all live sequences;
- latency: one request of --input-len random tokens, then --output-len greedy tokens; median of --runs;
- load: model + context creation;
- logprobs: for each prompt of a JSON file (a list of token id lists), the log-probabilities of the next token
  after it: {"logprobs": [[log p(token) for every vocabulary id], ...]} (for benchmarks/accuracy.py).
"""

import argparse
import ctypes
import json
import statistics
import sys
import time
from pathlib import Path

import llama_cpp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from workload import make_workload, parse_range  # noqa: E402


class Engine:
    def __init__(self, path: str, n_ctx: int, n_seq_max: int, threads: int, n_batch: int = 512, cache_type="f16"):
        llama_cpp.llama_backend_init()
        start = time.monotonic()
        mparams = llama_cpp.llama_model_default_params()
        self.model = llama_cpp.llama_model_load_from_file(path.encode(), mparams)
        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx = n_ctx
        cparams.n_batch = n_batch
        cparams.n_ubatch = n_batch
        cparams.n_seq_max = n_seq_max
        cparams.n_threads = threads
        cparams.n_threads_batch = threads
        if cache_type == "q8_0":  # 8-bit K/V: llama.cpp needs flash attention for a quantized V
            cparams.type_k = cparams.type_v = llama_cpp.GGML_TYPE_Q8_0
            cparams.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
        self.ctx = llama_cpp.llama_init_from_model(self.model, cparams)
        self.load_seconds = time.monotonic() - start
        vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)
        self.n_batch = n_batch
        self.batch = llama_cpp.llama_batch_init(n_batch, 0, n_seq_max)

    def clear(self) -> None:
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(self.ctx), True)

    def decode(self, entries: list[tuple[int, int, int, bool]]) -> list[int]:
        """entries: (token, position, sequence, wants_logits) -> greedy next token for each wanting logits."""
        b = self.batch
        for i, (token, pos, seq, logits) in enumerate(entries):
            b.token[i] = token
            b.pos[i] = pos
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq
            b.logits[i] = logits
        b.n_tokens = len(entries)
        if llama_cpp.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")
        return [int(self.logits(i).argmax()) for i, (_, _, _, logits) in enumerate(entries) if logits]

    def logits(self, i: int) -> np.ndarray:
        """The last decode's logits of its entry i: float32 [n_vocab] (a view into llama.cpp's buffer)."""
        ptr = llama_cpp.llama_get_logits_ith(self.ctx, i)
        return np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(self.n_vocab,))


def next_token_logprobs(engine: Engine, prompts: list[list[int]]) -> dict:
    rows = []
    for prompt in prompts:
        engine.clear()
        engine.decode([(t, pos, 0, pos == len(prompt) - 1) for pos, t in enumerate(prompt)])
        logits = engine.logits(len(prompt) - 1).astype(np.float64)
        shifted = logits - logits.max()
        rows.append((shifted - np.log(np.exp(shifted).sum())).tolist())
    return {"bench": "logprobs", "engine": "llama.cpp", "logprobs": rows}


def offline(engine: Engine, workload: list[tuple[list[int], int]]) -> dict:
    engine.clear()
    start = time.monotonic()
    # prefill: prompts packed into batches of n_batch tokens; the last token of each prompt asks for logits
    pending = [(tok, pos, seq, pos == len(p) - 1) for seq, (p, _) in enumerate(workload) for pos, tok in enumerate(p)]
    next_token: dict[int, int] = {}
    for i in range(0, len(pending), engine.n_batch):
        part = pending[i : i + engine.n_batch]
        firsts = engine.decode(part)
        for (_, _, seq, _), token in zip([e for e in part if e[3]], firsts, strict=True):
            next_token[seq] = token
    generated = {seq: [next_token[seq]] for seq in range(len(workload))}
    while True:
        live = [seq for seq, (_, m) in enumerate(workload) if len(generated[seq]) < m]
        if not live:
            break
        entries = [(generated[s][-1], len(workload[s][0]) + len(generated[s]) - 1, s, True) for s in live]
        for s, token in zip(live, engine.decode(entries), strict=True):
            generated[s].append(token)
    seconds = time.monotonic() - start
    prompt_tokens = sum(len(p) for p, _ in workload)
    output_tokens = sum(len(g) for g in generated.values())
    return {
        "bench": "offline",
        "engine": "llama.cpp",
        "seconds": round(seconds, 3),
        "output_tok_s": round(output_tokens / seconds, 2),
        "total_tok_s": round((prompt_tokens + output_tokens) / seconds, 2),
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
    }


def latency(
    engine: Engine, input_len: int, output_len: int, runs: int, seed: int, warmup_len: int | None = None
) -> dict:
    rng = np.random.default_rng(seed)
    ttfts, decodes = [], []
    for run in range(runs + 1):  # the first run warms up (with warmup_len prompt tokens when given)
        engine.clear()
        length = (warmup_len or input_len) if run == 0 else input_len
        prompt = rng.integers(100, 10000, size=length).tolist()
        start = time.monotonic()
        token = None
        for i in range(0, length, engine.n_batch):
            part = [(t, i + j, 0, i + j == length - 1) for j, t in enumerate(prompt[i : i + engine.n_batch])]
            got = engine.decode(part)
            token = got[-1] if got else token
        first = time.monotonic()
        for k in range(output_len - 1):
            token = engine.decode([(token, length + k, 0, True)])[0]
        end = time.monotonic()
        if run:
            ttfts.append(first - start)
            if output_len > 1:
                decodes.append((output_len - 1) / (end - first))
    ttft = statistics.median(ttfts)
    return {
        "bench": "latency",
        "engine": "llama.cpp",
        "input_len": input_len,
        "output_len": output_len,
        "ttft_ms": round(ttft * 1000, 2),
        "prefill_tok_s": round(input_len / ttft, 2),
        "decode_tok_s": round(statistics.median(decodes), 2) if decodes else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--threads", type=int, default=2)
    sub = parser.add_subparsers(dest="bench", required=True)
    off = sub.add_parser("offline")
    off.add_argument("--num-prompts", type=int, default=32)
    off.add_argument("--input-len", default="32:256")
    off.add_argument("--output-len", default="16:128")
    off.add_argument("--seed", type=int, default=0)
    lat = sub.add_parser("latency")
    lat.add_argument("--input-len", type=int, default=128)
    lat.add_argument("--output-len", type=int, default=128)
    lat.add_argument("--runs", type=int, default=5)
    lat.add_argument("--seed", type=int, default=0)
    lat.add_argument("--warmup-len", type=int, default=None, help="the warm-up run's prompt (default: --input-len)")
    lat.add_argument("--cache-type", choices=("f16", "q8_0"), default="f16", help="K/V element type (llama.cpp's)")
    logp = sub.add_parser("logprobs")
    logp.add_argument("--prompts", required=True, help="a JSON file: a list of token id lists")
    logp.add_argument("--cache-type", choices=("f16", "q8_0"), default="f16", help="K/V element type (llama.cpp's)")
    args = parser.parse_args()
    if args.bench == "logprobs":
        prompts = json.loads(Path(args.prompts).read_text())
        n_ctx = max(len(p) for p in prompts) + 16
        engine = Engine(args.model, n_ctx, 1, args.threads, cache_type=args.cache_type)
        result = next_token_logprobs(engine, prompts)
    elif args.bench == "offline":
        workload = make_workload(args.num_prompts, parse_range(args.input_len), parse_range(args.output_len), args.seed)
        longest = max(len(p) + m for p, m in workload)
        engine = Engine(args.model, n_ctx=len(workload) * (longest + 16), n_seq_max=len(workload), threads=args.threads)
        result = offline(engine, workload)
    else:
        engine = Engine(args.model, args.input_len + args.output_len + 16, 1, args.threads, cache_type=args.cache_type)
        result = latency(engine, args.input_len, args.output_len, args.runs, args.seed, args.warmup_len)
        result["cache_type"] = args.cache_type
    result["load_seconds"] = round(engine.load_seconds, 3)
    result["llama_cpp_python"] = llama_cpp.__version__
    print(json.dumps(result))


if __name__ == "__main__":
    main()
