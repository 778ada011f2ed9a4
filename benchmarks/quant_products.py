"""The native products over GGUF blocks (NativeLinear) on the shapes of SmolLM2-1.7B (hidden 2048, MLP 8192, 24
layers), against torch's dense bfloat16 and float32 F.linear of the same weights, all alternating in one process.

    .venv/bin/python benchmarks/quant_products.py [--gguf PATH] [--rows 1 4 8 64 512] [--reps 5] [--threads 2]
        [--parts products,model,repack,stream]

Prints JSON lines:
- "products": each GGUF type (MXFP4, gpt-oss's experts, among them) on the MLP's two shapes ([8192, 2048] up and
  [2048, 8192] down; Q4_K and Q6_K are the file's own tensors, the other types random blocks: a product's time
  does not depend on the values), per row count and activation passes: median ms per call, GMAC/s (multiply-adds
  of the dense product) and the weight's GB/s; the same weight dense in bfloat16 and float32 through F.linear. The
  weight is read from the caches here (one 9 MB weight fits in L3): the "model" lines are the memory-bound figures.
- "model": every projection of the 24 layers (the file's Q4_K and Q6_K, 0.9 GB: read from memory) per row count
  and passes: ms for all of them (one token's or one prompt chunk's layer products), GMAC/s and GB/s; tokens/s
  that alone would allow.
- "repack": the file's raw rows into NativeLinear's layout, GB/s of input.
- "stream": what two threads read per second here (torch.sum over 1 GiB of float32).
- "peak": vpdpbusd's rate per core (a C loop compiled here, 12 chains in registers), so GMAC/s can be read as a
  fraction of it.
Medians of --reps alternating repetitions; the machine is shared, so run it when idle and read medians.
"""

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from tokenmill import native
from tokenmill.layers.quantized_linear import NativeLinear
from tokenmill.loader.dequantize import dequantize
from tokenmill.loader.gguf_file import GGUFFile

DEFAULT_GGUF = Path.home() / ".cache/tokenmill/synth/synth-smollm2-1.7b-Q4_K_M.gguf"
TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "MXFP4"]
HALVES = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2)}
HALVES |= {"Q5_K": (0, 2), "Q6_K": (208,), "MXFP4": ()}  # MXFP4's scale: an E8M0 exponent byte (offset 0)
# 12 independent chains in registers (an array of accumulators would be kept in memory: a load and a store each)
PEAK_C = r"""
#include <immintrin.h>
#include <stdio.h>
#include <time.h>
#define N 100000000L
#define OP(a) a = _mm512_dpbusd_epi32(a, b, c)
int main(void) {
    const __m512i b = _mm512_set1_epi8(1), c = _mm512_set1_epi8(2);
    __m512i a0 = b, a1 = c, a2 = b, a3 = c, a4 = b, a5 = c, a6 = b, a7 = c, a8 = b, a9 = c, a10 = b, a11 = c;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (long i = 0; i < N; ++i) {
        OP(a0); OP(a1); OP(a2); OP(a3); OP(a4); OP(a5); OP(a6); OP(a7); OP(a8); OP(a9); OP(a10); OP(a11);
        __asm__ volatile("" : "+v"(a0), "+v"(a1), "+v"(a2), "+v"(a3), "+v"(a4), "+v"(a5));
        __asm__ volatile("" : "+v"(a6), "+v"(a7), "+v"(a8), "+v"(a9), "+v"(a10), "+v"(a11));
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    double s = (t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) * 1e-9;
    __m512i t = _mm512_add_epi32(_mm512_add_epi32(a0, a1), _mm512_add_epi32(a2, a11));
    printf("%f %d\n", N * 12 / s / 1e9, _mm512_reduce_add_epi32(t));
    return 0;
}
"""


def random_blocks(type_name: str, rows: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Raw rows of random blocks (valid half floats of a model's size; the rest any bytes)."""
    values, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    blocks = rng.integers(0, 256, size=(rows, k // values, block_bytes), dtype=np.uint8)
    for offset in HALVES[type_name]:
        half = rng.uniform(0.0005, 0.005, size=(rows, k // values)).astype(np.float16)
        blocks[..., offset : offset + 2] = half.view(np.uint8).reshape(rows, k // values, 2)
    if type_name == "MXFP4":  # d = 2^(e - 128): 2^-12 .. 2^-9 with e2m1's codes up to 6 (doubled: 12)
        blocks[..., 0] = rng.integers(116, 120, size=(rows, k // values), dtype=np.uint8)
    return blocks.reshape(rows, -1)


def medians(kernels: dict[str, Callable[[], object]], reps: int) -> dict[str, float]:
    """Median ms of each kernel over `reps` rounds that take them in turn (after one warm-up round)."""
    times: dict[str, list[float]] = {name: [] for name in kernels}
    for rep in range(reps + 1):
        for name, kernel in kernels.items():
            start = time.perf_counter()
            kernel()
            if rep:
                times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def products(gguf: GGUFFile, rows_list: list[int], reps: int) -> None:
    rng = np.random.default_rng(0)
    shapes = {"up": "blk.0.ffn_up.weight", "down": "blk.0.ffn_down.weight"}  # Q4_K [8192, 2048]; Q6_K [2048, 8192]
    for shape_name, tensor_name in shapes.items():
        t = gguf.tensor(tensor_name)
        n, k = t.shape
        dense32 = dequantize(t.data, t.ggml_type, (n, k))
        dense16 = dense32.bfloat16()
        for type_name in TYPES:
            file_type = t.ggml_type.name == type_name
            raw = t.data if file_type else random_blocks(type_name, n, k, rng)
            layers = {p: NativeLinear.from_gguf([(raw, GGMLQuantizationType[type_name])], k, p) for p in (1, 2)}
            for rows in rows_list:
                x = torch.randn(rows, k)
                kernels = {f"native_{p}pass": partial(layers[p], x) for p in (1, 2)}
                if type_name in ("Q4_K", "Q6_K") or type_name == TYPES[0]:  # the dense ones once per shape suffice
                    kernels["torch_bf16"] = partial(F.linear, x.bfloat16(), dense16)
                    kernels["torch_f32"] = partial(F.linear, x, dense32)
                reps_here = max(3, min(reps * 4, int(reps * 2e9 / (rows * n * k))))
                ms = medians(kernels, reps_here)
                macs = rows * n * k
                line = {
                    "part": "products",
                    "shape": shape_name,
                    "n": n,
                    "k": k,
                    "type": type_name,
                    "file_tensor": file_type,
                    "rows": rows,
                    "weight_bytes": layers[1].nbytes,
                }
                for name, value in ms.items():
                    line[name] = {"ms": round(value, 3), "gmac_s": round(macs / value / 1e6, 1)}
                    if name.startswith("native"):
                        line[name]["weight_gb_s"] = round(layers[1].nbytes / value / 1e6, 1)
                print(json.dumps(line), flush=True)


def model_layers(gguf: GGUFFile, passes: int) -> list[NativeLinear]:
    """Every layer's fused projections as the loader would build them: qkv, o, gate_up, down."""
    layers = []
    blocks = int(gguf.get("llama.block_count"))
    for i in range(blocks):
        p = f"blk.{i}."
        for names in (["attn_q", "attn_k", "attn_v"], ["attn_output"], ["ffn_gate", "ffn_up"], ["ffn_down"]):
            tensors = [gguf.tensor(p + name + ".weight") for name in names]
            parts = [(t.data, t.ggml_type) for t in tensors]
            layers.append(NativeLinear.from_gguf(parts, tensors[0].shape[1], passes))
    return layers


def run_all(layers: list[NativeLinear], xs: dict[int, torch.Tensor]) -> None:
    for layer in layers:
        layer(xs[layer.in_features])


def model(gguf: GGUFFile, rows_list: list[int], reps: int) -> None:
    seconds, built = [], {}
    for passes in (1, 2):  # the first build reads the file's pages, the second finds them in the page cache
        start = time.perf_counter()
        built[passes] = model_layers(gguf, passes)
        seconds.append(time.perf_counter() - start)
    one = built[1]
    raw_bytes = sum(t.data.nbytes for name, t in gguf.tensors.items() if name.startswith("blk.") and t.data.ndim == 2)
    line = {"part": "repack", "input_gb": round(raw_bytes / 1e9, 3), "threads": torch.get_num_threads()}
    line |= {"first_s": round(seconds[0], 3), "cached_s": round(seconds[1], 3)}
    line["cached_gb_s"] = round(raw_bytes / seconds[1] / 1e9, 2)
    print(json.dumps(line), flush=True)
    nbytes = sum(layer.nbytes for layer in one)
    macs_per_row = sum(layer.in_features * layer.out_features for layer in one)
    inputs = {k: None for k in {layer.in_features for layer in one}}
    for rows in rows_list:
        xs = {k: torch.randn(rows, k) for k in inputs}
        kernels = {f"native_{passes}pass": partial(run_all, layers, xs) for passes, layers in built.items()}
        ms = medians(kernels, reps if rows <= 64 else max(2, reps // 2))
        line = {"part": "model", "rows": rows, "weight_gb": round(nbytes / 1e9, 3), "gmac_per_row": macs_per_row / 1e9}
        for name, value in ms.items():
            line[name] = {
                "ms": round(value, 2),
                "gmac_s": round(rows * macs_per_row / value / 1e6, 1),
                "weight_gb_s": round(nbytes / value / 1e6, 1),
                "tokens_s": round(rows / value * 1e3, 1),
            }
        print(json.dumps(line), flush=True)


def stream(reps: int) -> None:
    big = torch.ones(256 * 1024 * 1024)  # 1 GiB of float32
    ms = medians({"sum": lambda: big.sum()}, reps)["sum"]
    print(json.dumps({"part": "stream", "gb_s": round(big.nbytes / ms / 1e6, 1), "threads": torch.get_num_threads()}))


def peak() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        source, binary = Path(tmp) / "peak.c", Path(tmp) / "peak"
        source.write_text(PEAK_C)
        built = subprocess.run(["cc", "-O2", "-march=native", str(source), "-o", str(binary)], capture_output=True)
        if built.returncode:
            print(json.dumps({"part": "peak", "error": "no AVX-512 VNNI compiler or CPU"}))
            return
        per_core = float(subprocess.run([str(binary)], capture_output=True, text=True).stdout.split()[0])
    print(
        json.dumps(
            {
                "part": "peak",
                "vpdpbusd_g_per_s_core": round(per_core, 2),
                "int8_gmac_s_per_core": round(per_core * 64, 1),
                "cores": os.cpu_count(),
            }
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", type=Path, default=DEFAULT_GGUF)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 64, 512])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--parts", default="peak,stream,products,model")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    lib = native.load()
    if lib is None:
        raise SystemExit("the native kernels are not built here")
    lib.tm_set_threads(args.threads)
    print(
        json.dumps(
            {
                "part": "setup",
                "vector_path": lib.tm_vector_path().decode(),
                "threads": args.threads,
                "torch": torch.__version__,
                "gguf": str(args.gguf),
            }
        ),
        flush=True,
    )
    parts = args.parts.split(",")
    gguf = GGUFFile(args.gguf)
    if "peak" in parts:
        peak()
    if "stream" in parts:
        stream(args.reps)
    if "products" in parts:
        products(gguf, args.rows, args.reps)
    if "model" in parts:
        model(gguf, args.rows, args.reps)


if __name__ == "__main__":
    main()
