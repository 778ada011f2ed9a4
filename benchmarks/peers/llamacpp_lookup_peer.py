"""llama.cpp through llama-cpp-python's high-level API, with and without its prompt-lookup decoding
(`LlamaPromptLookupDecoding`), on one prompt given as token ids; greedy. Runs in the peers' virtual environment
(`make bench-peers`); prints one JSON line: decode tokens/s per repetition, plain and with lookup alternating."""

import argparse
import json
import time

from llama_cpp import Llama
from llama_cpp.llama_speculative import LlamaPromptLookupDecoding


def decode_rate(llm: Llama, prompt: list[int], max_tokens: int, ignore_eos: bool) -> tuple[float, int, list[str]]:
    """(decode tokens/s after the first token, tokens generated, their texts), streamed so the first is timed."""
    llm.reset()  # no KV reuse between runs: each one prefills the prompt again
    times, pieces = [], []
    logit_bias = {llm.token_eos(): -1e9} if ignore_eos else None
    for chunk in llm.create_completion(
        prompt, max_tokens=max_tokens, temperature=0.0, top_k=1, stream=True, logit_bias=logit_bias
    ):
        times.append(time.perf_counter())
        pieces.append(chunk["choices"][0]["text"])
    n = len(times)
    return ((n - 1) / (times[-1] - times[0]) if n > 1 else float("nan")), n, pieces


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--prompt-ids", required=True, help="JSON list of token ids")
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--num-pred-tokens", type=int, default=4)
    p.add_argument("--max-ngram-size", type=int, default=4)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    prompt = json.loads(args.prompt_ids)
    common = {"model_path": args.model, "n_ctx": 4096, "n_threads": args.threads, "n_batch": 512, "verbose": False}
    plain = Llama(**common)
    lookup = Llama(
        **common,
        draft_model=LlamaPromptLookupDecoding(num_pred_tokens=args.num_pred_tokens, max_ngram_size=args.max_ngram_size),
    )
    decode_rate(plain, prompt, 8, args.ignore_eos)  # warm-up
    decode_rate(lookup, prompt, 8, args.ignore_eos)
    rates: dict[str, list[float]] = {"plain": [], "lookup": []}
    tokens: dict[str, int] = {}
    texts: dict[str, str] = {}
    for _ in range(args.reps):
        for name, llm in (("plain", plain), ("lookup", lookup)):
            rate, n, pieces = decode_rate(llm, prompt, args.max_tokens, args.ignore_eos)
            rates[name].append(round(rate, 2))
            tokens[name] = n
            texts[name] = "".join(pieces)
    print(json.dumps({"peer": "llama.cpp (llama-cpp-python)", "decode_tok_s": rates, "tokens": tokens,
                      "same_text": texts["plain"] == texts["lookup"], "text_head": texts["lookup"][:120]}))  # fmt: skip


if __name__ == "__main__":
    main()
