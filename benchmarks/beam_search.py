"""What vLLM's beam search costs here (LLM.beam_search, engine/beam_search.py): a 32-token beam search of width 4
against greedy decoding of the same prompt, one sequence and four, on the bundled model.

    .venv/bin/python benchmarks/beam_search.py [--quantization auto|none] [--reps 3] [--width 4] [--tokens 32]

Each repetition runs the three, alternating; the medians, and the engine's counters for one beam search (steps,
prompt tokens computed and read from the prefix cache), are printed as one JSON line. A beam search round asks
the engine for one token per live beam, each beam a request of its own whose prompt is the beam so far: the prefix
cache holds its full blocks, so a round computes each beam's last partial block (up to block_size - 1 tokens) and
its new token, where greedy decoding computes one token per sequence.
"""

import argparse
import json
import statistics
import time

from tokenmill import LLM, BeamSearchParams, SamplingParams

PROMPT = "The history of the printing press begins"


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quantization", default="auto", help="auto (as `tokenmill serve`) or none (float32)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--width", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    quantization = None if args.quantization == "none" else args.quantization
    llm = LLM(quantization=quantization)
    greedy = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    beams = BeamSearchParams(beam_width=args.width, max_tokens=args.tokens, ignore_eos=True)
    runs = {
        "greedy_1_seq_s": lambda: llm.generate(PROMPT, greedy, use_tqdm=False),
        f"greedy_{args.width}_seqs_s": lambda: llm.generate([PROMPT] * args.width, greedy, use_tqdm=False),
        f"beam_search_width_{args.width}_s": lambda: llm.beam_search(PROMPT, beams),
    }
    llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.reps):
        for name, run in runs.items():
            times[name].append(timed(run))
    before = llm.stats()
    llm.beam_search(PROMPT, beams)
    after = llm.stats()
    counters = {
        key: after[key] - before[key]
        for key in ("num_steps", "prompt_tokens_total", "prefix_cache_query_tokens", "prefix_cache_hit_tokens")
    }
    medians = {name: round(statistics.median(t), 2) for name, t in times.items()}
    beam, one = medians[f"beam_search_width_{args.width}_s"], medians["greedy_1_seq_s"]
    result = {
        "quantization": args.quantization,
        "prompt_tokens": len(llm.get_tokenizer().encode(PROMPT)),
        "tokens": args.tokens,
        "width": args.width,
        **medians,
        "all_s": {name: [round(x, 2) for x in t] for name, t in times.items()},
        "beam_over_greedy_1": round(beam / one, 2),
        f"beam_over_greedy_{args.width}": round(beam / medians[f"greedy_{args.width}_seqs_s"], 2),
        "one_beam_search": counters,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
