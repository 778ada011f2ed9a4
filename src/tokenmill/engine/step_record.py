"""What a step did, in plain data: its size and time (the explorer shows the last one at page load) and, while
the explorer watches, each sequence's part in it (streamed to browsers)."""

import time
from typing import TYPE_CHECKING, Any

from tokenmill.engine.request import Request
from tokenmill.scheduler.scheduler import SchedulerOutput

if TYPE_CHECKING:
    from tokenmill.executor.runner import TensorParallelRunner


def step_header(sched: SchedulerOutput, num_steps: int, ranks: int) -> dict[str, Any]:
    """The number and size of the step being run (num_steps counts those done)."""
    return {
        "step": num_steps + 1,
        "num_tokens": sched.num_batched_tokens,
        "batch_size": len(sched.scheduled),
        "ranks": ranks,  # processes that compute this step
    }


def step_time(num_steps: int, start: float, tp: "TensorParallelRunner | None") -> dict[str, Any]:
    """The step just done (counted in num_steps): its number and time, its collectives' share under tensor
    parallelism."""
    return {
        "step": num_steps,
        "duration_ms": round((time.monotonic() - start) * 1000, 3),
        "collective_ms": round(tp.last_step_collective_s * 1000, 3) if tp is not None else 0.0,
    }


def describe_step(sched: SchedulerOutput, summary: dict[str, Any], requests: dict[str, Request]) -> dict[str, Any]:
    """What this step did, per sequence."""
    batch = []
    for s in sched.scheduled:
        seq = s.seq
        prefill = s.start < seq.num_prompt_tokens
        metrics = requests[seq.request_id].metrics
        batch.append(
            {
                "request_id": seq.request_id,
                "sample": seq.sample_index,
                "kind": "prefill" if prefill else "decode",
                "start": s.start,
                "tokens": s.num_new_tokens,
                "prompt_tokens": seq.num_prompt_tokens,
                "cached_tokens": seq.num_cached_tokens,
                # the request's prefill chunks so far, this one included (the engine's own count)
                "prefill_chunk": metrics.num_prefill_chunks if prefill else None,
                # speculative decoding: tokens proposed after the last one, and (once verified) how many held
                "proposed": len(s.draft_token_ids),
                "accepted": None,
                "blocks": len(seq.block_table),
                "allowed_tokens": None,  # a constrained sequence: how many tokens its mask allowed
            }
        )
    return {**summary, "batch": batch, "preempted": [seq.request_id for seq in sched.preempted]}
