"""How far a LoRA batch's rows move from the same requests alone: tests/test_lora.py's batch-invariance case (a tiny
llama from the bundled model, four PEFT adapters, 10 requests of 5 prompts in one batch, against each alone), with
each generated token's log-probability compared instead of the tokens only.

    .venv/bin/python benchmarks/lora_invariance.py [--quantization auto|none] [--tokens 12]

Prints one JSON line per request: its prompt length, adapter, the largest |log p together - log p alone| of the
chosen tokens over the steps where both chose the same token, and the first step where the tokens differ (null
if none). Base rows under `auto` take the native decoder; adapter rows the model's forward (runner/model_runner.py).
"""

import argparse
import dataclasses
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/lora_cases.py writes the model and adapters

from tests.lora_cases import ADAPTERS, PROMPT, write_adapter, write_tiny_llama  # noqa: E402
from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.loader.model_path import bundled_model_path  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quantization", default="auto", choices=["auto", "none"])
    parser.add_argument("--tokens", type=int, default=12)
    args = parser.parse_args()
    quantization = None if args.quantization == "none" else args.quantization
    greedy = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True, logprobs=1)
    root = Path(tempfile.mkdtemp())
    base = write_tiny_llama(root, bundled_model_path())
    adapters = {
        name: write_adapter(base, root / name, seed, **cfg) for seed, (name, cfg) in enumerate(ADAPTERS.items())
    }
    modules = {name: str(path) for name, path in adapters.items()}
    names = [None, *adapters]
    prompts = [PROMPT[:n] for n in (3, 17, 40, 9, 33)]
    jobs = [(p, names[(i + k) % len(names)]) for i, p in enumerate(prompts) for k in (0, 2)]  # as tests/test_lora.py
    together = LLM(str(base), quantization=quantization, lora_modules=modules, enable_prefix_caching=False)
    params = [dataclasses.replace(greedy, lora_name=name) for _, name in jobs]
    outs = together.generate([{"prompt_token_ids": p} for p, _ in jobs], params, use_tqdm=False)
    alone = LLM(str(base), quantization=quantization, lora_modules=modules, enable_prefix_caching=False)
    for (prompt, name), out in zip(jobs, outs, strict=True):
        mine = out.outputs[0]
        solo = alone.generate({"prompt_token_ids": prompt}, dataclasses.replace(greedy, lora_name=name), use_tqdm=False)
        ref = solo[0].outputs[0]
        first_difference, largest = None, 0.0
        for step, (a, b) in enumerate(zip(ref.token_ids, mine.token_ids, strict=True)):
            if a != b:
                first_difference = step
                break
            largest = max(largest, abs(ref.logprobs[step][a].logprob - mine.logprobs[step][a].logprob))
        line = {"prompt_tokens": len(prompt), "adapter": name, "largest_logprob_difference": largest}
        print(json.dumps(line | {"first_different_token": first_difference}), flush=True)


if __name__ == "__main__":
    main()
