"""How activation quantization moves the bundled model's outputs, against tests/data/smollm2.json (HF transformers,
float32, same GGUF): the `int4` mode as built (activations in two int8 passes inside the native products),
and the same weights with one int8 pass per block of 32 (what llama.cpp's Q8 activations do), emulated by
rounding the activations of every projection to one pass before the kernel (whose second pass then has
nothing left to add; the LM head keeps two).

    .venv/bin/python benchmarks/activation_quantization.py

Prints one JSON line per variant: per reference prompt, how many of the 32 greedy tokens agree with HF's before
the first difference, and the largest top-10 log-probability difference after the prompt.
"""

import json
from pathlib import Path

import torch

from tokenmill import LLM, SamplingParams
from tokenmill.layers.quantized_linear import Q4Linear

DATA = Path(__file__).resolve().parents[1] / "tests" / "data"  # the reference outputs the tests use


def one_int8_pass(x: torch.Tensor) -> torch.Tensor:
    """x [m, k] rounded to s * round(x / s), s = max|x| / 127 per block of 32"""
    blocks = x.float().reshape(x.shape[0], -1, 32)
    scale = blocks.abs().amax(dim=-1, keepdim=True) / 127
    return ((blocks / scale.clamp(min=1e-30)).round().clamp(-127, 127) * scale).reshape(x.shape)


def measure(llm: LLM, generations: list[dict]) -> list[dict]:
    params = SamplingParams(temperature=0, max_tokens=32, min_tokens=32, logprobs=10)
    outs = llm.generate([{"prompt_token_ids": g["prompt_ids"]} for g in generations], params, use_tqdm=False)
    rows = []
    for out, g in zip(outs, generations, strict=True):
        tokens, reference = out.outputs[0].token_ids, g["hf_fp32_greedy"]
        agree = next((i for i, (a, b) in enumerate(zip(tokens, reference, strict=False)) if a != b), len(reference))
        first = out.outputs[0].logprobs[0]
        drift = max(
            abs(first[t].logprob - lp) if t in first else float("inf")
            for t, lp in zip(g["hf_fp32_top10_ids"], g["hf_fp32_top10_logprobs"], strict=True)
        )
        rows.append({"agree": agree, "top10_drift": round(drift, 4)})
    return rows


def main() -> None:
    generations = json.loads((DATA / "smollm2.json").read_text())["generations"]
    llm = LLM(quantization="int4", enable_prefix_caching=False)  # the second variant recomputes the prompts
    print(json.dumps({"variant": "int4, two int8 passes (as built)", "prompts": measure(llm, generations)}))
    llm.engine.runner.native_decoder = None  # every product through Q4Linear.forward, patched below
    two_pass = Q4Linear.forward
    Q4Linear.forward = lambda self, x: two_pass(self, one_int8_pass(x))
    print(json.dumps({"variant": "int4, one int8 pass (llama.cpp's)", "prompts": measure(llm, generations)}))


if __name__ == "__main__":
    main()
