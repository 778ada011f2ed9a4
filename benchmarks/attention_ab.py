"""Two builds of native/attention.c in one process, alternating (ABBA): one layer's prompt attention at SmolLM2-1.7B's
shape (32 heads of 64, no GQA), a chunk of queries at the end of each context. Is a kernel change faster? (issue 38)

    .venv/bin/python benchmarks/attention_ab.py BASE.c [reps]      # this tree's attention.c against BASE.c

    git show e685fd0:src/tokenmill/native/attention.c > /tmp/base.c          # e.g. the kernel before a change

Environment: CACHE (float16, the default, or float32), CONTEXTS (default "512 2048 8192"), QUERIES (512). Prints one
JSON line per context: the two builds' median ms and the median of the per-pair ratios (base / this tree: above 1,
this tree is faster).
"""

import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from native_variant import build_with  # benchmarks/, the script's own folder

import tokenmill.native as native
from tokenmill.layers import native_attention


def main() -> None:
    base_c = Path(sys.argv[1])
    reps = int(sys.argv[2]) if len(sys.argv) > 2 else 10
    builds = {"this": native.load(), "base": build_with("attention.c", base_c)}
    cache = {"float16": torch.float16, "float32": torch.float32}[os.environ.get("CACHE", "float16")]
    heads, dim, queries = 32, 64, int(os.environ.get("QUERIES", "512"))
    for context in [int(c) for c in os.environ.get("CONTEXTS", "512 2048 8192").split()]:
        g = torch.Generator().manual_seed(0)
        k, v = (torch.randn(context, heads, dim, generator=g).to(cache) for _ in range(2))
        q = torch.randn(queries, heads, dim, generator=g)
        slots = torch.arange(context)
        times: dict[str, list[float]] = {"this": [], "base": []}
        for i in range(reps):
            for name in ("this", "base") if i % 2 == 0 else ("base", "this"):
                native._lib = builds[name]
                start = time.perf_counter()
                native_attention.prefill_attention(q, k, v, [(0, queries, slots)], 0.125)
                times[name].append(time.perf_counter() - start)
        native._lib = builds["this"]
        ratios = [b / t for b, t in zip(times["base"], times["this"], strict=True)]
        line = {"cache": str(cache).removeprefix("torch."), "context": context, "queries": queries}
        line |= {f"{name}_ms": round(statistics.median(ts) * 1e3, 2) for name, ts in times.items()}
        print(json.dumps(line | {"base_over_this": round(statistics.median(ratios), 3)}), flush=True)


if __name__ == "__main__":
    main()
