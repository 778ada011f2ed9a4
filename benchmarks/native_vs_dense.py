"""The native decode step against `auto`'s torch path (the same NativeLinear products, a layer at a time with
torch's attention and norms between them; until issue 23 a dense GEMM), per decode batch size: why `auto` sends
every generated token through the native decoder (tokenmill/runner/model_runner.py). Both run in one process,
alternating, on the same KV cache (150-token contexts), so a drifting machine affects them alike.

    .venv/bin/python benchmarks/native_vs_dense.py [--rows 8 16 32 64 128] [--reps 10]

Prints one JSON line per batch size: median milliseconds per step (layers and head) of each path.
"""

import argparse
import json
import statistics
import time

import numpy as np

from tokenmill import LLM
from tokenmill.runner.model_runner import StepChunk


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 16, 32, 64, 128])
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--context", type=int, default=150)
    args = parser.parse_args()
    runner = LLM(quantization="auto").engine.runner
    decoder = runner.decode_backend
    if decoder is None:
        raise SystemExit("the native kernels are not built here: nothing to compare")
    rng = np.random.default_rng(0)
    blocks_per_seq = args.context // runner.block_size + 1
    for rows in args.rows:
        # one decode token per sequence, each with its own blocks (the cache's contents do not matter for timing)
        chunks = [
            StepChunk(
                [int(rng.integers(100, 9000))], args.context, list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq))
            )
            for i in range(rows)
        ]
        times: dict[str, list[float]] = {"native_ms": [], "dense_ms": []}
        for _ in range(args.reps):
            for path in ("native_ms", "dense_ms"):
                # without the native decoder every token takes the torch path: dense GEMMs, attention in torch
                runner.decode_backend = decoder if path == "native_ms" else None
                start = time.perf_counter()
                runner.execute(chunks)
                times[path].append(time.perf_counter() - start)
        result = {k: round(statistics.median(v) * 1000, 1) for k, v in times.items()}
        print(
            json.dumps(
                {"rows": rows, **result, "dense_over_native": round(result["dense_ms"] / result["native_ms"], 2)}
            )
        )


if __name__ == "__main__":
    main()
