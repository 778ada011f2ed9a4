"""When speculative decoding pays, by the number of sequences decoding together: for N requests at once (offline,
greedy, 96 tokens each), output tokens/s without speculation, with every proposal the method offers
(`verify_row_cost` 0, as vLLM proposes), and with as many as pay by each sequence's acceptance rate and the
batch's size (the default `verify_row_cost`); `disable_by_batch_size` out of the way; repetitions alternating,
medians.

- ngram: the bundled model under `auto`, n-gram proposals (K 4);
- draft_model: the float32 model, its own 4-bit copy (`auto`) drafting (K 4): the issue's draft-model case.

Two workloads: `copy` (each request asks to repeat another passage word for word: what n-gram lookup is for) and
`open` (open questions: nothing to copy; a draft model still predicts much of the answer).

    .venv/bin/python benchmarks/spec_decode_batch.py [--methods ngram,draft_model] [--batch-sizes 1,2,4,8,16]
"""

import argparse
import json
import statistics
import sys
import time

from tokenmill import LLM, SamplingParams

SENTENCES = [
    "The river wound slowly through the valley, past old stone farmhouses and fields of barley.",
    "In the evening the light turned gold and the swallows flew low over the water.",
    "Children ran along the bank, calling to each other, while their parents talked quietly on the bridge.",
    "Far away a church bell rang seven times, and the first lamps were lit in the village windows.",
    "An old fisherman pulled his boat onto the shingle and folded his nets with care.",
    "He walked home along the lane, whistling a tune his father had taught him long ago.",
]
QUESTIONS = [
    "How does a bicycle stay upright?",
    "Explain photosynthesis to a child.",
    "What are the main causes of inflation?",
    "Describe how a compiler works.",
    "Why do cats purr?",
    "What is the difference between weather and climate?",
    "How do vaccines train the immune system?",
    "Give three tips for writing clear emails.",
]


def prompts(llm: LLM, workload: str, n: int) -> list[dict]:
    out = []
    for i in range(n):
        if workload == "copy":  # another passage each: the six sentences rotated
            passage = " ".join(SENTENCES[i % 6 :] + SENTENCES[: i % 6])
            text = "Repeat this passage word for word:\n\n" + passage
        else:
            text = QUESTIONS[i % len(QUESTIONS)] + ("" if i < len(QUESTIONS) else f" (version {i})")
        out.append({"prompt_token_ids": llm.engine.encode_chat([{"role": "user", "content": text}])})
    return out


def throughput(llm: LLM, batch: list[dict], max_tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    start = time.perf_counter()
    outs = llm.generate(batch, params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", default="ngram,draft_model")
    p.add_argument("--workloads", default="copy,open")
    p.add_argument("--batch-sizes", default="1,2,4,8,16")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    result: dict = {"bench": "spec_decode_batch", "max_tokens": args.max_tokens}
    for method in args.methods.split(","):
        spec = {"method": method, "num_speculative_tokens": args.num_speculative_tokens, "disable_by_batch_size": 10**6}
        if method == "draft_model":
            spec["model"] = "smollm2-135m"  # its 4-bit copy drafting for the float32 model
        quantization = "auto" if method == "ngram" else None
        engines = {
            "plain": LLM(quantization=quantization),
            "always": LLM(quantization=quantization, speculative_config={**spec, "verify_row_cost": 0}),
            "adaptive": LLM(quantization=quantization, speculative_config=spec),
        }
        plain = engines["plain"]
        for workload in args.workloads.split(","):
            rows = []
            for n in sizes:
                batch = prompts(plain, workload, n)
                for llm in engines.values():
                    throughput(llm, batch, 4)  # warm-up (also the shapes of this batch size)
                rates: dict[str, list[float]] = {name: [] for name in engines}
                before = {name: llm.stats() for name, llm in engines.items()}
                for _ in range(args.reps):
                    for name, llm in engines.items():
                        rates[name].append(round(throughput(llm, batch, args.max_tokens), 2))
                row: dict = {"batch_size": n, "tok_s": rates}
                plain_rate = statistics.median(rates["plain"])
                for name in ("always", "adaptive"):
                    after = engines[name].stats()
                    proposed, accepted = (
                        after[f"spec_decode_num_{key}_tokens"] - before[name][f"spec_decode_num_{key}_tokens"]
                        for key in ("draft", "accepted")
                    )
                    row[f"{name}_speedup"] = round(statistics.median(rates[name]) / plain_rate, 3)
                    row[f"{name}_acceptance_rate"] = round(accepted / proposed, 3) if proposed else None
                    emitted = after["generation_tokens_total"] - before[name]["generation_tokens_total"]
                    row[f"{name}_proposed_per_token"] = round(proposed / emitted, 3)
                rows.append(row)
                print(json.dumps({"method": method, "workload": workload, **rows[-1]}), file=sys.stderr)
            result[f"{method}/{workload}"] = rows
    print(json.dumps(result))


if __name__ == "__main__":
    main()
