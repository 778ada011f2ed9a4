"""Single-request latency: one request at a time; time to first token, prefill and decode speed (medians)."""

import statistics
import time
from typing import Any

import numpy as np

from tokenmill.entrypoints.bench.offline import collective_figures, machine, spec_decode_figures
from tokenmill.entrypoints.llm import LLM
from tokenmill.sampling_params import SamplingParams


def run_latency(
    llm_kwargs: dict[str, Any], input_len: int, output_len: int, runs: int, seed: int, warmup_len: int | None = None
) -> dict[str, Any]:
    """`warmup_len`: the first (unmeasured) request's prompt length, input_len by default (a shorter one warms the
    kernels at a fraction of a long prompt's time)."""
    start = time.monotonic()
    llm = LLM(**llm_kwargs)
    load_s = time.monotonic() - start
    rng = np.random.default_rng(seed)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    warm = rng.integers(100, 10000, size=warmup_len or input_len).tolist()
    llm.generate({"prompt_token_ids": warm}, params, use_tqdm=False)
    ttfts, decodes, totals = [], [], []
    before = llm.stats()
    for _ in range(runs):
        prompt = rng.integers(100, 10000, size=input_len).tolist()  # fresh tokens: no prefix-cache hits
        out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
        m = out.metrics
        ttfts.append(m.first_token_time - m.arrival_time)
        if output_len > 1:
            decodes.append((output_len - 1) / (m.last_token_time - m.first_token_time))
        totals.append(m.finished_time - m.arrival_time)
    ttft = statistics.median(ttfts)
    after = llm.stats()
    engine = llm.engine  # the KV cache's bytes per token of context, every layer's K and V (this rank's heads)
    kv_bytes_per_token = engine.runner.kv_bytes_per_block() // engine.config.block_size
    coordination = {**collective_figures(before, after), **spec_decode_figures(before, after)}
    llm.close()
    return {
        "bench": "latency",
        "input_len": input_len,
        "output_len": output_len,
        "runs": runs,
        "ttft_ms": round(ttft * 1000, 2),
        "prefill_tok_s": round(input_len / ttft, 2),
        "decode_tok_s": round(statistics.median(decodes), 2) if decodes else None,
        "end_to_end_s": round(statistics.median(totals), 3),
        "kv_bytes_per_token": kv_bytes_per_token,
        **coordination,
        "load_seconds": round(load_s, 3),
        "options": {k: v for k, v in llm_kwargs.items() if v is not None},
        "machine": machine(),
    }
