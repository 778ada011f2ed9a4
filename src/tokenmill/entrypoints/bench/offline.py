"""Offline throughput: the whole workload submitted at once to LLM.generate (load and warm-up timed apart)."""

import platform
import time
from typing import Any

from tokenmill.entrypoints.bench.workload import make_workload
from tokenmill.entrypoints.llm import LLM
from tokenmill.sampling_params import SamplingParams


def machine() -> dict[str, Any]:
    import os

    import torch

    return {
        "cpu": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
    }


def collective_figures(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """The cost of tensor-parallel coordination between two stats snapshots: rank 0's time in collectives."""
    steps = after["num_steps"] - before["num_steps"]
    seconds = after["collective_seconds_total"] - before["collective_seconds_total"]
    return {
        "tensor_parallel_size": after["tensor_parallel_size"],
        "steps": steps,
        "collective_ms_per_step": round(seconds * 1000 / max(steps, 1), 3),
    }


def spec_decode_figures(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Speculative decoding between two stats snapshots: proposals, acceptance, tokens per verifying step."""

    def delta(name: str) -> int:
        return after[f"spec_decode_{name}"] - before[f"spec_decode_{name}"]

    drafts, proposed, accepted = delta("num_drafts"), delta("num_draft_tokens"), delta("num_accepted_tokens")
    return {
        "spec_decode_drafts": drafts,
        "spec_decode_draft_tokens": proposed,
        "spec_decode_accepted_tokens": accepted,
        "spec_decode_acceptance_rate": round(accepted / proposed, 4) if proposed else None,
        "spec_decode_tokens_per_draft_step": round(delta("num_emitted_tokens") / drafts, 3) if drafts else None,
    }


def run_offline(
    llm_kwargs: dict[str, Any], num_prompts: int, input_len: tuple[int, int], output_len: tuple[int, int], seed: int
) -> dict[str, Any]:
    start = time.monotonic()
    llm = LLM(**llm_kwargs)
    load_s = time.monotonic() - start
    workload = make_workload(num_prompts, input_len, output_len, seed)
    prompts = [{"prompt_token_ids": p} for p, _ in workload]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for _, m in workload]

    start = time.monotonic()
    warm = make_workload(4, (32, 96), (4, 8), seed + 1)  # different tokens: no prefix-cache help for the real run
    llm.generate(
        [{"prompt_token_ids": p} for p, _ in warm],
        [SamplingParams(max_tokens=m, ignore_eos=True) for _, m in warm],
        use_tqdm=False,
    )
    warmup_s = time.monotonic() - start

    before = llm.stats()
    start = time.monotonic()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.monotonic() - start
    after = llm.stats()
    coordination = {**collective_figures(before, after), **spec_decode_figures(before, after)}
    llm.close()
    prompt_tokens = sum(len(p) for p, _ in workload)
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "bench": "offline",
        "num_prompts": num_prompts,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "seconds": round(seconds, 3),
        "output_tok_s": round(output_tokens / seconds, 2),
        "total_tok_s": round((prompt_tokens + output_tokens) / seconds, 2),
        "load_seconds": round(load_s, 3),
        "warmup_seconds": round(warmup_s, 3),
        "num_preemptions": llm.stats()["num_preemptions"],
        **coordination,
        "options": {k: v for k, v in llm_kwargs.items() if v is not None},
        "machine": machine(),
    }
