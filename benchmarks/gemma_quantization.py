"""Gemma 3 270M under `auto`: how far re-quantizing its k-quants (Q4_K, Q5_0, Q6_K and Q8_0 projections) into
tokenmill's 4-bit layout moves its outputs, against tests/data/gemma3.json (HF transformers, float32,
same GGUF), beside float32 and llama.cpp's own greedy tokens on the file's k-quants (from the reference).

    .venv/bin/python benchmarks/gemma_quantization.py

The one-pass variant emulates llama.cpp's activation quantization in the LM head alone (what would halve the
head's integer products): the activations are rounded to one int8 pass per block of 32 before the two-pass
kernel, whose second pass then has nothing left to add.

Prints one JSON line per variant: per reference prompt, how many of the 32 greedy tokens agree with HF float32's
before the first difference, and the largest top-10 log-probability difference after the prompt (llama.cpp:
agreement only; the reference has no log-probabilities of its).
"""

import json
from pathlib import Path

from activation_quantization import one_int8_pass

from tokenmill import LLM, SamplingParams
from tokenmill.loader.model_path import gemma3_270m_path

DATA = Path(__file__).resolve().parents[1] / "tests" / "data"  # the reference outputs the tests use


def agreement(tokens: list[int], reference: list[int]) -> int:
    return next((i for i, (a, b) in enumerate(zip(tokens, reference, strict=False)) if a != b), len(reference))


def measure(llm: LLM, generations: list[dict]) -> dict:
    params = SamplingParams(temperature=0, max_tokens=32, min_tokens=32, logprobs=10)
    outs = llm.generate([{"prompt_token_ids": g["prompt_ids"]} for g in generations], params, use_tqdm=False)
    agree, drift = [], []
    for out, g in zip(outs, generations, strict=True):
        agree.append(agreement(out.outputs[0].token_ids, g["hf_fp32_greedy"]))
        first = out.outputs[0].logprobs[0]
        drift.append(
            round(
                max(
                    abs(first[t].logprob - lp) if t in first else float("inf")
                    for t, lp in zip(g["hf_fp32_top10_ids"], g["hf_fp32_top10_logprobs"], strict=True)
                ),
                4,
            )
        )
    return {"greedy_tokens_agreeing": agree, "top10_logprob_drift": drift}


def main() -> None:
    generations = json.loads((DATA / "gemma3.json").read_text())["generations"]
    path = str(gemma3_270m_path())
    llama_cpp = [agreement(g["llamacpp_greedy"], g["hf_fp32_greedy"]) for g in generations]
    print(json.dumps({"variant": "llama.cpp (reference file)", "greedy_tokens_agreeing": llama_cpp}))
    print(json.dumps({"variant": "float32", **measure(LLM(path), generations)}))
    auto = LLM(path, quantization="auto")
    print(json.dumps({"variant": "auto (native decoder)", **measure(auto, generations)}))
    head = auto.engine.runner.model.lm_head
    two_passes = head.forward
    head.forward = lambda x: two_passes(one_int8_pass(x))  # the head's activations rounded to one int8 pass first
    print(json.dumps({"variant": "auto, LM head with one activation pass (emulated)", **measure(auto, generations)}))
    head.forward = two_passes
    auto.engine.runner.native_decoder = None  # the same weights through the torch path's AutoLinear
    print(json.dumps({"variant": "auto (torch path)", **measure(auto, generations)}))


if __name__ == "__main__":
    main()
