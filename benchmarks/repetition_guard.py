"""Why SmolLM2's sampling defaults carry a repetition penalty (src/tokenmill/model/generation_defaults.py): the
bundled model's answer to "How do GPUs work?" (256 tokens at most, `auto`), greedy and at the model card's
temperature 0.2 / top-p 0.9 (seeds 0-2), without and with a repetition penalty of 1.1. Prints one JSON line per
setting: tokens, finish reason, sentences, and how many of them repeat an earlier one.

    .venv/bin/python benchmarks/repetition_guard.py
"""

import collections
import json
import re

from tokenmill import LLM, SamplingParams

SETTINGS = [
    {"temperature": 0.0},
    {"temperature": 0.0, "repetition_penalty": 1.1},
    {"temperature": 0.2, "top_p": 0.9},
    {"temperature": 0.2, "top_p": 0.9, "repetition_penalty": 1.1},
]


def main() -> None:
    llm = LLM(quantization="auto")
    messages = [{"role": "user", "content": "How do GPUs work?"}]
    for setting in SETTINGS:
        for seed in [0] if setting["temperature"] == 0 else [0, 1, 2]:
            out = llm.chat(messages, SamplingParams(max_tokens=256, seed=seed, **setting))[0].outputs[0]
            sentences = [s.strip() for s in re.split(r"(?<=[.!?])\s+", out.text) if s.strip()]
            repeats = sum(n - 1 for n in collections.Counter(sentences).values())
            print(json.dumps({**setting, "seed": seed, "tokens": len(out.token_ids), "finish": out.finish_reason,
                              "sentences": len(sentences), "repeated_sentences": repeats}))  # fmt: skip


if __name__ == "__main__":
    main()
