"""How far each engine's outputs move from HF transformers float32 on the bundled models' reference prompts
(tests/data/smollm2.json and gemma3.json: the same GGUF files, HF's top-10 log-probabilities after each prompt and
its 32 greedy tokens), tokenmill's modes beside llama.cpp on the same file.

    .venv/bin/python benchmarks/accuracy.py [--peers-python .venv-peers/bin/python]

Per model and variant one JSON line: per prompt, the top-10 log-probability drift (the largest |log p - log p_HF|
over HF's 10 most likely next tokens after the prompt) and how many of the 32 greedy tokens agree with HF's before
the first difference (llama.cpp's greedy tokens are the reference file's); then their medians and maxima.
Variants: tokenmill `none` (float32, the blocks dequantized), `auto` with every projection's products in one int8
activation pass (the engine's default, ACTIVATION_PASSES: what llama.cpp does) and in two (the LM head always takes
two), and llama.cpp 0.3.36 (the peers' environment); with --kv-int8 also 8-bit K/V: tokenmill's int8 (a scale per
token and head) under `none` and `auto`, and llama.cpp's q8_0 (a scale per 32 values).
"""

import argparse
import json
import statistics
import subprocess
import tempfile
from pathlib import Path

import torch

from tokenmill import LLM, SamplingParams
from tokenmill.layers.quantized_linear import NativeLinear
from tokenmill.loader.model_path import bundled_model_path, gemma3_270m_path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"  # the reference outputs the tests use


def agreement(tokens: list[int], reference: list[int]) -> int:
    return next((i for i, (a, b) in enumerate(zip(tokens, reference, strict=False)) if a != b), len(reference))


def drift(logprob_of: dict[int, float], g: dict) -> float:
    """The largest |log p - log p_HF| over HF's top-10 next tokens (inf when one is missing from logprob_of)."""
    pairs = zip(g["hf_fp32_top10_ids"], g["hf_fp32_top10_logprobs"], strict=True)
    return max(abs(logprob_of[t] - lp) if t in logprob_of else float("inf") for t, lp in pairs)


def summary(variant: str, model: str, drifts: list[float], agree: list[int]) -> dict:
    return {
        "model": model,
        "variant": variant,
        "top10_logprob_drift": [round(d, 4) for d in drifts],
        "drift_median": round(statistics.median(drifts), 4),
        "drift_max": round(max(drifts), 4),
        "greedy_tokens_agreeing": agree,
        "agreeing_median": statistics.median(agree),
    }


def tokenmill(llm: LLM, generations: list[dict]) -> tuple[list[float], list[int]]:
    # logprobs=20: HF's top 10 are among tokenmill's top 20 unless the drift is large
    params = SamplingParams(temperature=0, max_tokens=32, min_tokens=32, logprobs=20)
    outs = llm.generate([{"prompt_token_ids": g["prompt_ids"]} for g in generations], params, use_tqdm=False)
    drifts, agree = [], []
    for out, g in zip(outs, generations, strict=True):
        first = {t: lp.logprob for t, lp in out.outputs[0].logprobs[0].items()}
        drifts.append(drift(first, g))
        agree.append(agreement(out.outputs[0].token_ids, g["hf_fp32_greedy"]))
    return drifts, agree


def set_passes(llm: LLM, passes: int) -> None:
    """The int8 activation passes of every projection's product (the native decoder takes the projections')."""
    model = llm.engine.runner.model
    for module in model.modules():
        if isinstance(module, NativeLinear) and module is not model.lm_head:
            module.passes = passes


def llama_cpp(peers_python: str, path: Path, generations: list[dict], cache_type: str = "f16") -> list[float]:
    with tempfile.NamedTemporaryFile("w", suffix=".json") as prompts:
        json.dump([g["prompt_ids"] for g in generations], prompts)
        prompts.flush()
        peer = [peers_python, str(ROOT / "benchmarks" / "peers" / "llamacpp_peer.py"), "--model", str(path)]
        command = [*peer, "logprobs", "--prompts", prompts.name, "--cache-type", cache_type]
        out = subprocess.run(command, capture_output=True, text=True, check=True)
    rows = json.loads(out.stdout.strip().splitlines()[-1])["logprobs"]
    drifts = []
    for row, g in zip(rows, generations, strict=True):
        top = torch.tensor(row).topk(20)
        drifts.append(drift(dict(zip(top.indices.tolist(), top.values.tolist(), strict=True)), g))
    return drifts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peers-python", default=str(ROOT / ".venv-peers" / "bin" / "python"))
    parser.add_argument("--kv-int8", action="store_true", help="only the 8-bit K/V variants")
    args = parser.parse_args()
    if args.kv_int8:
        return int8_kv(args.peers_python)
    for name, path in (("smollm2", bundled_model_path()), ("gemma3", gemma3_270m_path())):
        generations = json.loads((DATA / f"{name}.json").read_text())["generations"]
        llama_agree = [agreement(g["llamacpp_greedy"], g["hf_fp32_greedy"]) for g in generations]
        print(json.dumps(summary("llama.cpp", name, llama_cpp(args.peers_python, path, generations), llama_agree)))
        print(json.dumps(summary("tokenmill none (float32)", name, *tokenmill(LLM(str(path)), generations))))
        for passes in (1, 2):
            auto = LLM(str(path), quantization="auto", enable_prefix_caching=False)
            set_passes(auto, passes)
            variant = f"tokenmill auto, {passes} activation pass{'es' if passes > 1 else ''}"
            print(json.dumps(summary(variant, name, *tokenmill(auto, generations))), flush=True)
            auto.close()


def int8_kv(peers_python: str) -> None:
    """8-bit K/V beside 16-bit in each engine (llama.cpp's greedy tokens are not measured with q8_0: only its drift)."""
    for name, path in (("smollm2", bundled_model_path()), ("gemma3", gemma3_270m_path())):
        generations = json.loads((DATA / f"{name}.json").read_text())["generations"]
        for cache_type in ("f16", "q8_0"):
            drifts = llama_cpp(peers_python, path, generations, cache_type)
            print(json.dumps(summary(f"llama.cpp, {cache_type} K/V", name, drifts, [0] * len(drifts))), flush=True)
        for quantization in ("none", "auto"):
            for kv in ("float16", "int8"):
                llm = LLM(str(path), quantization=quantization, kv_cache_dtype=kv, enable_prefix_caching=False)
                variant = f"tokenmill {quantization}, {kv} K/V"
                print(json.dumps(summary(variant, name, *tokenmill(llm, generations))), flush=True)
                llm.close()


if __name__ == "__main__":
    main()
