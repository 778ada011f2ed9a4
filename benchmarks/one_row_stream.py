"""One-row (decode) native products per GGUF type at weights that fit in L2, in L3 and only in memory, so that a
tile's own speed and its streaming from memory read apart; the machine's streaming read (torch.sum) alternates with
them, since the host's load moves it by half from one minute to the next.

    PYTHONPATH=src .venv/bin/python benchmarks/one_row_stream.py [--threads 2] [--types Q4_K,Q6_K,MXFP4,Q8_0]

Prints one JSON line per type and size: the weight's MB, median microseconds per call, GMAC/s and GB/s of weight,
and the streaming read measured between its calls. Random blocks (a product's time does not depend on the values,
quant_products.py); at the memory size three weights taken in turn, so that each call reads its weight from memory.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType

sys.path.insert(0, str(Path(__file__).resolve().parent))
from quant_products import random_blocks  # noqa: E402

from tokenmill.layers.quantized_linear import NativeLinear  # noqa: E402

K = 2048  # inputs
ROWS = {"L2": 512, "L3": 8192, "memory": 32768}  # outputs: ~0.6, ~9.7 and ~39 MB of Q4_K


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--types", default="Q4_K,Q6_K,MXFP4,Q8_0")
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    stream = torch.ones(64 * 1024 * 1024)  # 256 MiB of float32
    for type_name in args.types.split(","):
        for where, n in ROWS.items():
            copies = 3 if where == "memory" else 1  # one weight stays in its cache; three in turn do not
            blocks = [random_blocks(type_name, n, K, rng) for _ in range(copies)]
            layers = [NativeLinear.from_gguf([(b, GGMLQuantizationType[type_name])], K, 1) for b in blocks]
            x = torch.randn(1, K)
            calls = max(3, int(2e8 / (n * K)))  # calls per timing: several milliseconds
            product, streamed = [], []
            for rep in range(args.reps + 1):
                start = time.perf_counter()
                stream.sum()  # (it evicts the caches: the next, untimed, call brings a cached weight back)
                stream_gb_s = stream.nbytes / (time.perf_counter() - start) / 1e9
                layers[0](x)
                start = time.perf_counter()
                for i in range(calls):
                    layers[(rep + i) % copies](x)
                if rep:  # the first round warms up
                    product.append((time.perf_counter() - start) / calls)
                    streamed.append(stream_gb_s)
            t = statistics.median(product)
            line = {"type": type_name, "where": where, "n": n, "k": K, "weight_mb": round(layers[0].nbytes / 1e6, 2)}
            line |= {"us": round(t * 1e6, 1), "gmac_s": round(n * K / t / 1e9, 1)}
            line |= {"weight_gb_s": round(layers[0].nbytes / t / 1e9, 1)}
            line |= {"stream_gb_s": round(statistics.median(streamed), 1), "threads": args.threads}
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
