"""Time from starting a Python process to a ready engine (median of several runs, one after another), on the bundled
model or `--model`.

    .venv/bin/python benchmarks/load_time.py [--runs 5] [--model PATH --quantization auto] [--weight-cache]

Prints one JSON line: {"process_to_ready_s": ..., "llm_init_s": ..., "runs": [...], "inits": [...]}. `llm_init_s`
is LLM() alone (file parse, tokenizer, weights, KV cache), `process_to_ready_s` includes interpreter start and
`import torch`. With `--weight-cache` the first run writes the cache (`first_*`, not in the medians: the process
also waits at exit for the cache to be on disk) and the rest read it; consecutive runs find the previous run's
pages in memory when they fit beside everything else (the figures are restarts, not cold loads: drop the page
cache between runs for those, `echo 1 > /proc/sys/vm/drop_caches`).
"""

import argparse
import json
import statistics
import subprocess
import sys
import time

# argv[1]: LLM's arguments as JSON ({"model": ..., other keywords})
CHILD = (
    "import json, sys, time; t = time.monotonic(); from tokenmill import LLM; a = json.loads(sys.argv[1]); "
    "llm = LLM(a.pop('model'), **a); "
    "print(time.monotonic() - t, llm.engine.load_seconds, llm.engine.runner.model.weight_store.state)"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--model", default=None, help="a model path or name (default: the bundled model)")
    parser.add_argument("--quantization", default=None, help="LLM's (default None: float32)")
    parser.add_argument("--weight-cache", action="store_true")
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    args = parser.parse_args()
    options = {"model": args.model, "quantization": args.quantization, "weight_cache": args.weight_cache}
    if args.num_kv_blocks:
        options["num_kv_blocks"] = args.num_kv_blocks
    totals, inits, states = [], [], []
    for _ in range(args.runs):
        start = time.monotonic()
        command = [sys.executable, "-c", CHILD, json.dumps(options)]
        out = subprocess.run(command, capture_output=True, text=True, check=True)
        totals.append(time.monotonic() - start)
        _, init, state = out.stdout.split()
        inits.append(float(init))
        states.append(state)
    result: dict = {}
    if states[0] == "written":  # the first run wrote the cache
        result |= {"first_process_s": round(totals[0], 3), "first_llm_init_s": round(inits[0], 3)}
        totals, inits, states = totals[1:], inits[1:], states[1:]
    result |= {
        "process_to_ready_s": round(statistics.median(totals), 3) if totals else None,
        "llm_init_s": round(statistics.median(inits), 3) if inits else None,
        "runs": [round(t, 3) for t in totals],
        "inits": [round(t, 3) for t in inits],
        "weight_cache": states,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
