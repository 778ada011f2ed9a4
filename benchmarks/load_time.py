"""Time from starting a Python process to a ready engine on the bundled model (median of several runs).

Prints one JSON line: {"process_to_ready_s": ..., "llm_init_s": ..., "runs": [...]}. `llm_init_s` is LLM()
alone (GGUF parse, tokenizer, dequantization, KV cache), `process_to_ready_s` includes interpreter start and
`import torch`.
"""

import argparse
import json
import statistics
import subprocess
import sys
import time

CHILD = (
    "import time; t = time.monotonic(); from tokenmill import LLM; llm = LLM(); "
    "print(time.monotonic() - t, llm.engine.load_seconds)"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    totals, inits = [], []
    for _ in range(args.runs):
        start = time.monotonic()
        out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True)
        totals.append(time.monotonic() - start)
        inits.append(float(out.stdout.split()[1]))
    print(
        json.dumps(
            {
                "process_to_ready_s": round(statistics.median(totals), 3),
                "llm_init_s": round(statistics.median(inits), 3),
                "runs": [round(t, 3) for t in totals],
            }
        )
    )


if __name__ == "__main__":
    main()
