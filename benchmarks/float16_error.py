"""How far float16 arithmetic in the prompt attention moves its output (issue 38, benchmarks/README.md "Fifth session").

    .venv/bin/python benchmarks/float16_error.py

Two JSON lines:
- "kernel": the native kernel over a float16 cache on tests/test_native_attention.py's chunking data (300 tokens, 9
  heads on 3 KV heads), against float64 attention over the cache's numbers: its mean and max error, and the same
  figures for rounding K and V to float16 itself (float64 over float16 K/V against float64 over float32 K/V). At HEAD
  the kernel is float32 (error ~1e-7); at commit 6b05577 (`git checkout 6b05577 -- src/tokenmill/native
  src/tokenmill/layers/native_attention.py`) it multiplies the values in float16.
- "simulation": the arithmetic written out in torch on random heads of 64 (1,024 causal positions, sharpened
  queries), each float16 step rounded as the instruction rounds it: the output's mean and max error for the scores
  summed in float16 over 64 dimensions, the values summed in float16 per block of 64 keys, both, and the scores
  summed in float16 per 8, 16 or 32 dimensions (float32 across) with the values in float16.
"""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the test's data and its float64 reference

from tests.test_native_attention import chunked, random_qkv, reference  # noqa: E402


def kernel() -> dict:
    q, k, v = random_qkv(300, 9, 3, 64, seed=1)
    out, _ = chunked(q, k, v, [(0, 300)], torch.float16)
    exact = reference(q, k, v, torch.float16)
    storage = (exact - reference(q, k, v, torch.float32)).abs()
    error = (out.double() - exact).abs()
    return {"mean": error.mean().item(), "max": error.max().item()} | {
        "storage_mean": storage.mean().item(),
        "storage_max": storage.max().item(),
    }


def scores16(q16: torch.Tensor, k: torch.Tensor, dims: int) -> torch.Tensor:
    """q16 [L, D] (times the scale, float16) . k [L, D]: float16 sums over `dims` dimensions, float64 across."""
    total = torch.zeros(q16.shape[0], k.shape[0], dtype=torch.float64)
    for d0 in range(0, q16.shape[1], dims):
        acc = torch.zeros(q16.shape[0], k.shape[0], dtype=torch.float16)
        for d in range(d0, d0 + dims):  # one rounding a step, as a fused multiply-add in float16
            acc = (acc.float() + q16[:, d : d + 1].float() * k[:, d].float()[None]).half()
        total += acc.double()
    return total


def attend(scores: torch.Tensor, v: torch.Tensor, half_values: bool) -> torch.Tensor:
    """Causal softmax(scores) . v, the values' products summed in float16 per 64 keys when `half_values`."""
    n = scores.shape[0]
    scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    if not half_values:
        return torch.softmax(scores, -1) @ v.double()
    e = torch.exp(scores - scores.max(-1, keepdim=True).values)
    p16 = e.half()
    out = torch.zeros(n, v.shape[1], dtype=torch.float64)
    for b in range(0, n, 64):
        acc = torch.zeros(n, v.shape[1], dtype=torch.float16)
        for j in range(b, min(b + 64, n)):
            acc = (acc.float() + p16[:, j : j + 1].float() * v[j].float()).half()
        out += acc.double()
    return out / e.sum(-1, keepdim=True)


def simulation() -> dict:
    g = torch.Generator().manual_seed(0)
    length, dim = 1024, 64
    q = torch.randn(length, dim, generator=g) * 2
    k, v = (torch.randn(length, dim, generator=g).half().float() for _ in range(2))  # a float16 cache's numbers
    scale = dim**-0.5
    exact_scores = (q.double() @ k.double().T) * scale
    exact = attend(exact_scores, v, False)
    q16 = (q * scale).half()
    cases = {
        "scores16": (scores16(q16, k, dim), False),
        "values16": (exact_scores, True),
        "both": (scores16(q16, k, dim), True),
    } | {f"scores16_per_{n}_values16": (scores16(q16, k, n), True) for n in (8, 16, 32)}
    line = {}
    for name, (scores, half_values) in cases.items():
        error = (attend(scores, v, half_values) - exact).abs()
        line[name] = {"mean": float(f"{error.mean().item():.3g}"), "max": float(f"{error.max().item():.3g}")}
    return line


def main() -> None:
    print(json.dumps({"kernel": kernel()}), flush=True)
    print(json.dumps({"simulation": simulation()}), flush=True)


if __name__ == "__main__":
    main()
