"""Structured outputs' cost: decode tokens/s with and without a JSON-schema constraint, at 1 and 32 concurrent
requests, alternating in one process; the schema's compile time and the time spent computing masks.

Every request samples (temperature 1, seeded) output-len tokens after a short chat prompt; the constraint (an
array of 20 strings of 20-40 characters) cannot end before that, so both kinds generate the same count.
"""

import statistics
import time
from typing import Any

from tokenmill.entrypoints.bench.offline import machine
from tokenmill.entrypoints.bench.schemas import TYPICAL_SCHEMA
from tokenmill.entrypoints.llm import LLM
from tokenmill.sampling_params import SamplingParams
from tokenmill.structured import StructuredOutputsParams

LONG_ARRAY = {
    "type": "array",
    "items": {"type": "string", "minLength": 20, "maxLength": 40},
    "minItems": 20,
    "maxItems": 20,
}


def _decode_tok_s(llm: LLM, concurrency: int, output_len: int, constrained: bool, seed: int) -> float:
    """Output tokens per second of `concurrency` requests run together, from their first token to the last."""
    messages = [{"role": "user", "content": "List twenty short sentences about the sea as a JSON array."}]
    constraint = StructuredOutputsParams(json=LONG_ARRAY) if constrained else None
    params = [
        SamplingParams(
            temperature=1.0,
            seed=seed + i,
            max_tokens=output_len,
            min_tokens=0 if constrained else output_len,
            structured_outputs=constraint,
        )
        for i in range(concurrency)
    ]
    outs = llm.chat([messages] * concurrency, params, use_tqdm=False)
    first = min(o.metrics.first_token_time for o in outs)
    last = max(o.metrics.last_token_time for o in outs)
    tokens = sum(len(o.outputs[0].token_ids) - 1 for o in outs)
    return tokens / (last - first)


def run_structured(
    llm_kwargs: dict[str, Any], concurrencies: list[int], output_len: int, reps: int, seed: int
) -> dict[str, Any]:
    llm = LLM(**llm_kwargs)
    grammars = llm.engine.grammars  # made here: its tokenizer setup is not a compile
    start = time.perf_counter()
    grammars.compile(StructuredOutputsParams(json=TYPICAL_SCHEMA))
    compile_ms = (time.perf_counter() - start) * 1e3
    start = time.perf_counter()
    grammars.matcher(grammars.compile(StructuredOutputsParams(json=TYPICAL_SCHEMA)))
    matcher_ms = (time.perf_counter() - start) * 1e3
    # the time spent in masks: every call to the compiler's `allowed`, and the rows it computed
    mask_time, mask_rows = [0.0], [0]
    allowed = grammars.allowed

    def timed_allowed(matchers):
        t = time.perf_counter()
        out = allowed(matchers)
        mask_time[0] += time.perf_counter() - t
        mask_rows[0] += len(matchers)
        return out

    grammars.allowed = timed_allowed  # type: ignore[method-assign]
    _decode_tok_s(llm, 2, 8, True, seed)  # warm-up: both paths
    _decode_tok_s(llm, 2, 8, False, seed)
    results: dict[str, Any] = {}
    for c in concurrencies:
        free, constrained = [], []
        for r in range(reps):  # alternating, so both see the same machine
            free.append(_decode_tok_s(llm, c, output_len, False, seed + 100 * r))
            constrained.append(_decode_tok_s(llm, c, output_len, True, seed + 100 * r))
        f, s = statistics.median(free), statistics.median(constrained)
        results[f"concurrency_{c}"] = {
            "free_decode_tok_s": round(f, 2),
            "constrained_decode_tok_s": round(s, 2),
            "constrained_over_free": round(s / f, 3),
        }
    llm.close()
    return {
        "bench": "structured",
        "output_len": output_len,
        "reps": reps,
        **results,
        "compile_ms_typical_schema": round(compile_ms, 2),
        "matcher_ms_cached_schema": round(matcher_ms, 3),
        "mask_us_per_row": round(mask_time[0] / max(mask_rows[0], 1) * 1e6, 1),
        "options": {k: v for k, v in llm_kwargs.items() if v is not None},
        "machine": machine(),
    }
