"""Does a position get the same numbers as a generated token (the native decoder, under `auto`) and as a prompt
token (the model's forward: a recomputation after preemption, a speculative verification)? Greedy-generates
`--tokens` tokens for a prompt, then for k = 1.. feeds the prompt plus the first k generated tokens as a new prompt
and compares the log-probability of generated token k as decode computed it and as the prompt path does.

    .venv/bin/python benchmarks/route_invariance.py [--quantization auto] [--tokens 8]

Prints one JSON line per k: whether the tokens agree and both log-probabilities (README.md says a token gets the
same bits either way under the quantized modes).
"""

import argparse
import json

from tokenmill import LLM, SamplingParams

PROMPT = "The history of the printing press begins"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--tokens", type=int, default=8)
    args = parser.parse_args()
    quantization = None if args.quantization == "none" else args.quantization
    llm = LLM(quantization=quantization, enable_prefix_caching=False)
    greedy = SamplingParams(temperature=0, max_tokens=args.tokens, logprobs=0)
    out = llm.generate(PROMPT, greedy, use_tqdm=False)[0]
    generated = out.outputs[0].token_ids
    for k in range(1, len(generated)):
        ids = out.prompt_token_ids + generated[:k]
        again = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=1, logprobs=0),
                             use_tqdm=False)[0].outputs[0]  # fmt: skip
        line = {
            "k": k,
            "same_token": again.token_ids[0] == generated[k],
            "decode_logprob": out.outputs[0].logprobs[k][generated[k]].logprob,
            "prompt_logprob": again.logprobs[0][again.token_ids[0]].logprob,
        }
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
