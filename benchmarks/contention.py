"""Decode and load with 1 and 2 threads, on a quiet machine and beside a busy neighbour (issue 24, finding 5).

A shared host, a container with a CPU quota or a noisy neighbour takes a core now and then; the kernels' threads
must not then wait for each other (native/pool.c). For each case this starts a fresh process (so that load is
measured cold of Python's imports but warm of the page cache), which loads the model with `--threads`-many
threads and decodes one sequence; the neighbour is a Python busy loop started before it and stopped after.
Cases alternate, `--reps` rounds; the medians are printed as JSON lines and a Markdown table.

    .venv/bin/python benchmarks/contention.py [--model PATH] [--tokens 128] [--reps 3]
"""

import argparse
import json
import statistics
import subprocess
import sys
import time

CHILD = r"""
import json, sys, time
start = time.perf_counter()
import numpy as np
from tokenmill import LLM, native
from tokenmill.native.threads import set_threads
from tokenmill.sampling_params import SamplingParams
threads, model, tokens = int(sys.argv[1]), sys.argv[2] or None, int(sys.argv[3])
set_threads(threads, native.load())
llm = LLM(model, quantization="auto", num_kv_blocks=64)
load = time.perf_counter() - start
rng = np.random.default_rng(0)
params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
out = llm.generate({"prompt_token_ids": rng.integers(100, 10000, size=32).tolist()}, params, use_tqdm=False)[0]
m = out.metrics
decode = (len(out.outputs[0].token_ids) - 1) / (m.last_token_time - m.first_token_time)
print(json.dumps({"load_s": load, "decode_tok_s": decode, "stalls": native.load().tm_pool_stalls()}))
"""


def run_case(threads: int, neighbour: bool, model: str, tokens: int) -> dict:
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if neighbour else None
    try:
        time.sleep(0.5 if neighbour else 0)
        out = subprocess.run(
            [sys.executable, "-c", CHILD, str(threads), model, str(tokens)], capture_output=True, text=True, check=True
        )
        return json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        if busy is not None:
            busy.kill()
            busy.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="", help="a GGUF (default: the bundled model)")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    cases = [(threads, neighbour) for neighbour in (False, True) for threads in (1, 2)]
    runs: dict[tuple[int, bool], list[dict]] = {case: [] for case in cases}
    for _ in range(args.reps):
        for case in cases:
            runs[case].append(run_case(*case, args.model, args.tokens))
    rows = ["| neighbour | threads | decode tok/s | load s | stalls (per run) |", "| --- | --- | --- | --- | --- |"]
    for (threads, neighbour), results in runs.items():
        line = {
            "bench": "contention",
            "model": args.model or "bundled",
            "threads": threads,
            "busy_neighbour": neighbour,
            "decode_tok_s": round(statistics.median(r["decode_tok_s"] for r in results), 1),
            "load_s": round(statistics.median(r["load_s"] for r in results), 2),
            "stalls": [r["stalls"] for r in results],
            "all_decode_tok_s": [round(r["decode_tok_s"], 1) for r in results],
        }
        print(json.dumps(line), flush=True)
        rows.append(
            f"| {'busy' if neighbour else 'none'} | {threads} | {line['decode_tok_s']} ({line['all_decode_tok_s']}) "
            f"| {line['load_s']} | {line['stalls']} |"
        )
    print("\n".join(rows))


if __name__ == "__main__":
    main()
