"""One layer's prompt attention at SmolLM2-1.7B's shape (32 heads of 64, no GQA): the native flash-attention kernel
(tokenmill/native/attention.c) against torch's fused kernel over blocks of 128 queries (layers/attention.py's
other path), alternating in one process, for a 512-query chunk at the end of contexts of 512, 2,048 and 8,192.

    .venv/bin/python benchmarks/prefill_attention.py [--contexts 512 2048 8192] [--reps 5] [--cache float16]

Prints one JSON line per context and path: median ms per call and GMAC/s (the scores' and the values' multiply-adds
of causal attention: 2 * heads * dim * queries * (context - queries / 2)).
"""

import argparse
import json
import statistics
import time

import torch

from tokenmill.layers import kv_quant, native_attention
from tokenmill.layers.attention import AttentionMetadata, PrefillChunk, paged_attention

CACHE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "int8": torch.int8}


def cached(x: torch.Tensor, cache: str) -> torch.Tensor:
    """x [slots, heads, dim] as a cache of type `cache` holds it (int8: layers/kv_quant.py's rows)."""
    return kv_quant.encode(x) if cache == "int8" else x.to(CACHE_DTYPES[cache])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--queries", type=int, default=512)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--cache", choices=sorted(CACHE_DTYPES), default="float16")
    args = parser.parse_args()
    heads, dim, queries = args.heads, args.dim, args.queries
    for context in args.contexts:
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(queries, heads, dim, generator=g) for _ in range(3))
        k_cache, v_cache = (cached(torch.randn(context, heads, dim, generator=g), args.cache) for _ in "kv")
        start = context - queries
        kv_index = None if start == 0 else torch.arange(context)
        causal = torch.arange(context)[None] <= torch.arange(start, context)[:, None]
        mask = None if start == 0 else causal.view(1, 1, queries, context)
        meta = AttentionMetadata(torch.arange(start, context), None, [PrefillChunk(0, queries, kv_index, mask)])
        macs = 2 * heads * dim * queries * (context - queries / 2)
        times: dict[str, list[float]] = {"native": [], "torch": []}
        for _ in range(args.reps + 1):  # the first round warms up
            for path in times:
                native_attention.enabled = path == "native"
                t = time.perf_counter()
                paged_attention(q, k, v, k_cache, v_cache, meta, dim**-0.5)
                times[path].append(time.perf_counter() - t)
        native_attention.enabled = True
        for path, samples in times.items():
            ms = statistics.median(samples[1:]) * 1e3
            row = {"bench": "prefill_attention", "path": path, "context": context, "queries": queries}
            row |= {"heads": heads, "dim": dim, "cache": args.cache, "threads": torch.get_num_threads()}
            print(json.dumps(row | {"ms": round(ms, 2), "gmac_s": round(macs / ms / 1e6, 1)}), flush=True)


if __name__ == "__main__":
    main()
