"""HF transformers (float32, the GGUF dequantized by transformers) on one request at a time.

Runs in the peers' virtual environment; prints one JSON line: time to first token, prefill and decode tokens/s
(greedy, EOS ignored) for --input-len random tokens and --output-len new tokens, median of --runs.
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(2)
    path = Path(args.model)
    start = time.monotonic()
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    load_s = time.monotonic() - start
    rng = np.random.default_rng(args.seed)
    ttfts, decodes = [], []
    for run in range(args.runs + 1):
        ids = torch.tensor([rng.integers(100, 10000, size=args.input_len).tolist()])
        with torch.no_grad():
            t0 = time.monotonic()
            out = model(ids, use_cache=True)
            t1 = time.monotonic()
            past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
            for _ in range(args.output_len - 1):
                out = model(token, past_key_values=past, use_cache=True)
                past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
            t2 = time.monotonic()
        if run:
            ttfts.append(t1 - t0)
            decodes.append((args.output_len - 1) / (t2 - t1))
    ttft = statistics.median(ttfts)
    print(
        json.dumps(
            {
                "bench": "latency",
                "engine": "hf-transformers",
                "input_len": args.input_len,
                "output_len": args.output_len,
                "ttft_ms": round(ttft * 1000, 2),
                "prefill_tok_s": round(args.input_len / ttft, 2),
                "decode_tok_s": round(statistics.median(decodes), 2),
                "load_seconds": round(load_s, 2),
            }
        )
    )


if __name__ == "__main__":
    main()
