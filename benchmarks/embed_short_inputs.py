"""Embedding throughput on short inputs: `LLM.embed` of 256 sentences of about 25 tokens each, 3 times (after a
warm-up call of 32), on the bundled model. Prints one JSON line. Short prompts are where prompt attention's first
blocks (layers/attention.py, query_blocks) matter: each input is a fresh prompt of its own.

    PYTHONPATH=src .venv/bin/python benchmarks/embed_short_inputs.py [--inputs 256] [--reps 3]
"""

import argparse
import json
import statistics
import time

from tokenmill import LLM

SENTENCE = "Sentence number {} tells about the weather, the sea and the mountains near the town of Bergen."


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--inputs", type=int, default=256)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    llm = LLM()
    llm.embed([SENTENCE.format(i) for i in range(32)])  # warm-up
    seconds = []
    for rep in range(args.reps):
        texts = [SENTENCE.format(i + 1000 * (rep + 1)) for i in range(args.inputs)]  # no prefix-cache help
        start = time.perf_counter()
        llm.embed(texts)
        seconds.append(time.perf_counter() - start)
    print(json.dumps({"bench": "embed_short_inputs", "inputs": args.inputs, "seconds": [round(s, 2) for s in seconds],
                      "seconds_median": round(statistics.median(seconds), 2)}))  # fmt: skip


if __name__ == "__main__":
    main()
