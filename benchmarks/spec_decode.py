"""Speculative decoding side by side, in one run: tokenmill (`auto`) without and with n-gram speculation, and
llama.cpp (llama-cpp-python) without and with its prompt-lookup decoding, on the bundled GGUF, one request at a
time, greedy; decode tokens/s after the first token, repetitions alternating, medians.

- copy: the chat template around "Repeat this passage word for word" and a paragraph of about 100 words (the
  answer copies it: what prompt lookup is for); up to --max-tokens, ending at EOS;
- random: 128 random prompt tokens, 128 tokens sampled at temperature 1 (seeded; EOS ignored): little to look up
  (greedy would loop, and loops are easy to look up), so the cost of proposing and rejecting shows. tokenmill
  only: llama-cpp-python's prompt lookup is compared on the copy case.

    .venv/bin/python benchmarks/spec_decode.py --peers-python .venv-peers/bin/python
"""

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np

from tokenmill import LLM, SamplingParams
from tokenmill.loader.model_path import bundled_model_path

ROOT = Path(__file__).resolve().parent.parent
PASSAGE = (
    "The river wound slowly through the valley, past old stone farmhouses and fields of barley. In the evening the "
    "light turned gold and the swallows flew low over the water. Children ran along the bank, calling to each "
    "other, while their parents talked quietly on the bridge. Far away a church bell rang seven times, and the "
    "first lamps were lit in the village windows. An old fisherman pulled his boat onto the shingle, folded his "
    "nets with care, and walked home along the lane, whistling a tune his father had taught him long ago."
)


def decode_rate(llm: LLM, prompt: list[int], max_tokens: int, sampled: bool) -> tuple[float, list[int]]:
    params = SamplingParams(temperature=1.0 if sampled else 0.0, seed=0, max_tokens=max_tokens, ignore_eos=sampled)
    out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
    m, ids = out.metrics, out.outputs[0].token_ids
    return (len(ids) - 1) / (m.last_token_time - m.first_token_time), ids


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--peers-python", default=None, help="the peers' python (make bench-peers); none: tokenmill only")
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()
    spec = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens}
    plain, fast = LLM(quantization="auto"), LLM(quantization="auto", speculative_config=spec)
    copy = plain.engine.encode_chat([{"role": "user", "content": "Repeat this passage word for word:\n\n" + PASSAGE}])
    random = np.random.default_rng(0).integers(100, 10000, size=128).tolist()
    cases = {"copy": (copy, args.max_tokens, False), "random": (random, 128, True)}
    result: dict = {"bench": "spec_decode", "speculative_config": spec, "words": len(PASSAGE.split())}
    for case, (prompt, max_tokens, sampled) in cases.items():
        for llm in (plain, fast):
            decode_rate(llm, prompt, 8, sampled)  # warm-up
        rates: dict[str, list[float]] = {"plain": [], "ngram": []}
        outputs = {}
        before = fast.stats()
        for _ in range(args.reps):
            for name, llm in (("plain", plain), ("ngram", fast)):
                rate, outputs[name] = decode_rate(llm, prompt, max_tokens, sampled)
                rates[name].append(round(rate, 2))
        after = fast.stats()
        proposed = after["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"]
        accepted = after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
        drafts = after["spec_decode_num_drafts"] - before["spec_decode_num_drafts"]
        emitted = after["spec_decode_num_emitted_tokens"] - before["spec_decode_num_emitted_tokens"]
        plain_rate, fast_rate = statistics.median(rates["plain"]), statistics.median(rates["ngram"])
        per_step = emitted / drafts if drafts else 1.0
        # a step's cost with speculation against a plain one's (what K + 1 rows cost the native decoder): one run
        # decodes n - 1 tokens in (n - 1) - emitted + drafts steps (steps without proposals give one token)
        n = len(outputs["ngram"])
        steps = (n - 1) - (emitted - drafts) / args.reps
        entry = {
            "tokens": len(outputs["plain"]),
            "same_tokens": outputs["plain"] == outputs["ngram"],
            "tokenmill_decode_tok_s": rates,
            "tokenmill_speedup": round(fast_rate / plain_rate, 3),
            "acceptance_rate": round(accepted / proposed, 3) if proposed else None,
            "tokens_per_verifying_step": round(per_step, 3),
            "ms_per_step": {
                "plain": round(1000 / plain_rate, 3),
                "ngram": round(1000 * (n - 1) / fast_rate / steps, 3),
            },
        }
        if args.peers_python and case == "copy":
            peer = [
                args.peers_python,
                str(ROOT / "benchmarks" / "peers" / "llamacpp_lookup_peer.py"),
                "--model", str(bundled_model_path()),
                "--prompt-ids", json.dumps(prompt),
                "--max-tokens", str(max_tokens),
                "--num-pred-tokens", str(args.num_speculative_tokens),
                "--reps", str(args.reps),
            ]  # fmt: skip
            theirs = json.loads(subprocess.run(peer, capture_output=True, text=True, check=True).stdout)
            entry["llamacpp"] = theirs
            ours = statistics.median(rates["ngram"])
            entry["tokenmill_ngram_vs_llamacpp_lookup"] = round(
                ours / statistics.median(theirs["decode_tok_s"]["lookup"]), 3
            )
        result[case] = entry
    print(json.dumps(result), file=sys.stdout)


if __name__ == "__main__":
    main()
