"""The native 4-bit product (Q4Linear) against the dense bfloat16 GEMM of `auto`, per number of rows, on the
four projection shapes of one SmolLM2-135M layer: what a short prompt gives up because `auto` computes every
prompt token with the dense GEMM (so that no token's kernel depends on its step's row count; until 2026-11-30
it took the 4-bit product up to 20 rows). Both alternate in one process.

    .venv/bin/python benchmarks/q4_vs_dense_linear.py [--rows 4 8 12 16 20 24 32] [--reps 7]

Prints one JSON line per row count: median milliseconds for the four products of each kernel.
"""

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from tokenmill import native
from tokenmill.layers.quantized_linear import Q4Linear

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # fused qkv, o, fused gate/up, down: [out, in]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, nargs="+", default=[4, 8, 12, 16, 20, 24, 32])
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    lib = native.load()
    if lib is None:
        raise SystemExit("the native kernels are not built here")
    weights = [torch.randn(n, k) * 0.05 for n, k in SHAPES]
    four_bit = [Q4Linear(w, lib) for w in weights]
    dense = [w.bfloat16() for w in weights]
    kernels = {
        "native_ms": lambda i, x: four_bit[i](x),
        "dense_ms": lambda i, x: F.linear(x.bfloat16(), dense[i]).float(),
    }
    for rows in args.rows:
        xs = [torch.randn(rows, k) for _, k in SHAPES]
        times: dict[str, list[float]] = {name: [] for name in kernels}
        for rep in range(args.reps + 1):
            for name, kernel in kernels.items():
                start = time.perf_counter()
                for i, x in enumerate(xs):
                    kernel(i, x)
                if rep:  # the first round warms up
                    times[name].append((time.perf_counter() - start) * 1e3)
        result = {name: round(statistics.median(t), 3) for name, t in times.items()}
        print(
            json.dumps(
                {"rows": rows, **result, "dense_over_native": round(result["dense_ms"] / result["native_ms"], 2)}
            )
        )


if __name__ == "__main__":
    main()
