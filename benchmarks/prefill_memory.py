"""Where resident memory goes at load and through prompt steps (`--quantization auto`): after `import torch`, after
the engine is built (its weights' and KV cache's bytes beside it), and after each prompt of --lengths tokens
(fresh random tokens, one output token), with the peak (VmHWM) of each step. Linux only (/proc/self).

    .venv/bin/python benchmarks/prefill_memory.py [--model PATH_OR_NAME] [--lengths 8 64 128 256 512 512 512]

Prints one JSON line per stage (MiB).
"""

import argparse
import json

import numpy as np
import torch  # noqa: F401 - its import is the first stage measured

from tokenmill import LLM
from tokenmill.sampling_params import SamplingParams


def status_mib() -> dict[str, int]:
    with open("/proc/self/status") as f:
        fields = dict(line.split(":", 1) for line in f)
    return {key: int(fields[key].split()[0]) // 1024 for key in ("VmRSS", "RssAnon", "RssFile", "VmHWM")}


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM starts again from VmRSS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="a GGUF or a name (default: the bundled model)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[8, 64, 128, 256, 512, 512, 512])
    args = parser.parse_args()
    print(json.dumps({"stage": "imported (torch, tokenmill)", **status_mib()}), flush=True)
    reset_peak()
    llm = LLM(args.model, quantization="auto", num_kv_blocks=64)
    runner = llm.engine.runner
    weights = sum(t.nbytes for t in runner.model.buffers()) + sum(p.nbytes for p in runner.model.parameters())
    kv = sum(k.nbytes + v.nbytes for k, v in runner.kv_caches)
    print(json.dumps({"stage": "loaded", **status_mib(), "model_tensors_mib": weights >> 20, "kv_mib": kv >> 20}))
    rng = np.random.default_rng(0)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    for n in args.lengths:
        reset_peak()
        llm.generate({"prompt_token_ids": rng.integers(100, 10000, size=n).tolist()}, params, use_tqdm=False)
        print(json.dumps({"stage": f"prompt of {n}", **status_mib()}), flush=True)


if __name__ == "__main__":
    main()
