"""Where a single-sequence decode step's time goes: the native layers, the LM head, the step tensors, the
runner and the whole engine step (medians per decoded token, `--quantization auto`, a 128-token prompt unless
`--prompt-len` says otherwise; `--kv-cache-dtype` as the engine's option).

    .venv/bin/python benchmarks/decode_breakdown.py [--reps 3] [--model PATH_OR_NAME] [--prompt-len 128]
        [--kv-cache-dtype auto]

Prints one JSON line per repetition (milliseconds).
"""

import argparse
import json
import statistics
import time
from collections.abc import Callable

import numpy as np

from tokenmill import LLM
from tokenmill.sampling_params import SamplingParams


def timed(record: list[float], fn: Callable) -> Callable:
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        result = fn(*args, **kwargs)
        record.append(time.perf_counter() - start)
        return result

    return wrapper


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--model", default=None, help="a GGUF or a name (default: the bundled model)")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--kv-cache-dtype", default="auto")
    args = parser.parse_args()
    llm = LLM(args.model, quantization="auto", num_kv_blocks=64, kv_cache_dtype=args.kv_cache_dtype)
    engine, runner = llm.engine, llm.engine.runner
    if runner.decode_backend is None:
        raise SystemExit("the native kernels are not built here: nothing to break down")
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    llm.generate({"prompt_token_ids": rng.integers(100, 10000, size=128).tolist()}, params, use_tqdm=False)  # warm
    times: dict[str, list[float]] = {k: [] for k in ("native_layers", "head", "prepare", "execute", "step")}
    runner.decode_backend.forward = timed(times["native_layers"], runner.decode_backend.forward)
    runner.model.compute_logits = timed(times["head"], runner.model.compute_logits)
    runner._prepare = timed(times["prepare"], runner._prepare)
    runner.execute = timed(times["execute"], runner.execute)
    engine.step = timed(times["step"], engine.step)
    for _ in range(args.reps):
        for record in times.values():
            record.clear()
        prompt = rng.integers(100, 10000, size=args.prompt_len).tolist()  # fresh tokens: no prefix-cache help
        out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
        m = out.metrics
        result = {k: round(statistics.median(v[1:]) * 1000, 3) for k, v in times.items()}  # [1:]: not the prefill
        result["decode_tok_s"] = round(
            (len(out.outputs[0].token_ids) - 1) / (m.last_token_time - m.first_token_time), 1
        )
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
