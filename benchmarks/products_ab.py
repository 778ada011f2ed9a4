"""Two builds of native/products.c in one process, alternating (ABBA), on SmolLM2-1.7B's file tensors: is a kernel
change faster, and are its outputs the same bits? (issue 38)

    .venv/bin/python benchmarks/products_ab.py VARIANT.c [threads] [reps] [Q4_K,Q6_K]   # BASE=OTHER.c: not HEAD's

ROWS (environment, default 512) activation rows; GGUF (environment): another file than the 1.7B shape's, its first
layer's projections of the listed types (the bundled model's Q4_1; Gemma 3's Q5_0, Q8_0, Q4_K and Q6_K). Prints
JSON: per tensor the two builds' fastest and median ms, the median of the per-pair time ratios (base / variant:
above 1, the variant is faster), and whether the outputs are bit-equal.
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
from tokenmill.layers.quantized_linear import NativeLinear
from tokenmill.loader.gguf_file import GGUFFile

variant = Path(sys.argv[1])
threads = int(sys.argv[2])
reps = int(sys.argv[3])
types = sys.argv[4].split(",") if len(sys.argv) > 4 else ["Q4_K", "Q6_K"]
rows = int(os.environ.get("ROWS", "512"))
torch.set_num_threads(threads)
base = native.load()


var = build_with("products.c", variant)
if os.environ.get("BASE"):
    base = build_with("products.c", Path(os.environ["BASE"]))
g = GGUFFile(Path(os.environ.get("GGUF", Path.home() / ".cache/tokenmill/synth/synth-smollm2-1.7b-Q4_K_M.gguf")))
out = {}
names = ["ffn_up", "ffn_down", "attn_q"] + (["attn_output", "attn_v"] if "GGUF" in os.environ else [])
for name in (f"blk.0.{n}.weight" for n in names):
    t = g.tensor(name)
    if t.ggml_type.name not in types:
        continue
    n, k = t.shape
    la = NativeLinear([(t.data, t.ggml_type)], k, 1, lib=base)
    lb = NativeLinear([(t.data, t.ggml_type)], k, 1, lib=var)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(0))
    ya, yb = la(x), lb(x)
    same = torch.equal(ya, yb)
    ta, tb = [], []
    for i in range(reps):
        order = [(la, ta), (lb, tb)] if i % 2 == 0 else [(lb, tb), (la, ta)]
        for layer, ts in order:
            s = time.perf_counter()
            layer(x)
            ts.append(time.perf_counter() - s)
    mac = rows * n * k
    out[name.split(".")[2] + ":" + t.ggml_type.name] = {
        "base_ms": round(min(ta) * 1e3, 2),
        "var_ms": round(min(tb) * 1e3, 2),
        "base_med": round(statistics.median(ta) * 1e3, 2),
        "var_med": round(statistics.median(tb) * 1e3, 2),
        "speedup_min": round(min(ta) / min(tb), 3),
        "pair_ratio_med": round(statistics.median([a / b for a, b in zip(ta, tb, strict=True)]), 3),
        "speedup_med": round(statistics.median(ta) / statistics.median(tb), 3),
        "var_gmac_s": round(mac / min(tb) / 1e9, 1),
        "bit_equal": same,
        "maxdiff": float((ya - yb).abs().max()),
    }
print(json.dumps(out, indent=1))
