"""Where offline-32's time goes (auto): the LM head, the native decoder's layers, the prompts' torch path and the
rest, from timers around the runner's parts during one run of the offline workload; and one head product at 1, 8
and 32 rows.

    .venv/bin/python benchmarks/offline_breakdown.py [--model gemma3-270m]

Prints one JSON line.
"""

import argparse
import json
import time

import torch

from tokenmill import LLM, SamplingParams
from tokenmill.entrypoints.bench.workload import make_workload


def timed(totals: dict[str, float], name: str, fn, rows_of=None):
    def wrapper(*args):
        start = time.perf_counter()
        out = fn(*args)
        totals[name] += time.perf_counter() - start
        if rows_of is not None:
            totals[name + "_rows"] += rows_of(args)
        return out

    return wrapper


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None)
    args = parser.parse_args()
    llm = LLM(args.model, quantization="auto")
    runner, model = llm.engine.runner, llm.engine.runner.model
    workload = make_workload(32, (32, 256), (16, 128), 0)
    prompts = [{"prompt_token_ids": p} for p, _ in workload]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for _, m in workload]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
    totals = {"head": 0.0, "head_rows": 0, "native_layers": 0.0, "torch_path": 0.0, "torch_path_rows": 0}
    model.compute_logits = timed(totals, "head", model.compute_logits, lambda a: a[0].shape[0])
    model.forward = timed(totals, "torch_path", model.forward, lambda a: a[0].shape[0])
    if runner.decode_backend is not None:
        runner.decode_backend.forward = timed(totals, "native_layers", runner.decode_backend.forward)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    total = time.perf_counter() - start
    head_ms = {}
    for rows in (1, 8, 32):
        x = torch.randn(rows, model.config.hidden_size)
        model.lm_head(x)
        t = time.perf_counter()
        for _ in range(5):
            model.lm_head(x)
        head_ms[rows] = round((time.perf_counter() - t) / 5 * 1e3, 2)
    seconds = {k: round(v, 2) for k, v in totals.items() if not k.endswith("_rows")}
    rest = round(total - sum(seconds.values()), 2)
    print(json.dumps({"total_s": round(total, 2), **seconds, "rest_s": rest, "head_rows": totals["head_rows"],
                      "head_ms_by_rows": head_ms, "model": args.model or "bundled"}))  # fmt: skip


if __name__ == "__main__":
    main()
