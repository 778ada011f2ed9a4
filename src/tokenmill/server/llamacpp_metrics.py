"""llama-server's Prometheus metrics (its llamacpp:* names), added to /metrics beside tokenmill's own.

Written by hand, not through prometheus_client: llama-server names a counter's TYPE line with its `_total`
suffix ("# TYPE llamacpp:prompt_tokens_total counter"), which prometheus_client's exposition never does, and
dashboards made for llama-server read those names."""

import time
from dataclasses import dataclass, field
from typing import Any

from tokenmill.outputs import RequestOutput


@dataclass
class LlamaCounters:
    """Counted over every finished request, whatever its API (as llama-server counts every task)."""

    started_unix: int = field(default_factory=lambda: int(time.time()))
    prompt_tokens: int = 0  # computed (not read from the prefix cache)
    prompt_tokens_cached: int = 0
    prompt_seconds: float = 0.0
    tokens_predicted: int = 0
    predicted_seconds: float = 0.0  # after each request's first token (which comes with its prompt's last step)
    n_tokens_max: int = 0  # the longest request seen: prompt and output

    def observe(self, out: RequestOutput, count_generated: bool = True) -> None:
        m = out.metrics
        generated = sum(len(o.token_ids) for o in out.outputs) if count_generated else 0
        self.prompt_tokens += len(out.prompt_token_ids) - out.num_cached_tokens
        self.prompt_tokens_cached += out.num_cached_tokens
        self.tokens_predicted += generated
        start = m.first_scheduled_time or m.arrival_time
        if m.first_token_time is not None:
            self.prompt_seconds += m.first_token_time - start
            self.predicted_seconds += (m.last_token_time or m.first_token_time) - m.first_token_time
        self.n_tokens_max = max(self.n_tokens_max, len(out.prompt_token_ids) + generated)


def llamacpp_metrics_text(c: LlamaCounters, stats: dict[str, Any] | None) -> str:
    """The llamacpp:* lines (Prometheus text format), with HELP and TYPE lines as llama-server writes them."""
    s = stats or {}
    steps = s.get("num_steps", 0)
    rows = [
        ("counter", "prompt_tokens_total", "Number of prompt tokens processed.", c.prompt_tokens),
        (
            "counter",
            "prompt_tokens_cached_total",
            "Number of prompt tokens read from the cache.",
            c.prompt_tokens_cached,
        ),
        ("counter", "prompt_seconds_total", "Prompt process time", c.prompt_seconds),
        ("counter", "tokens_predicted_total", "Number of generation tokens processed.", c.tokens_predicted),
        ("counter", "tokens_predicted_seconds_total", "Predict process time", c.predicted_seconds),
        ("counter", "n_decode_total", "Total number of llama_decode() calls (engine steps)", steps),
        ("counter", "n_tokens_max", "Largest observed n_tokens.", c.n_tokens_max),
        ("counter", "spec_decode_num_draft_tokens_total", "Tokens drafted", s.get("spec_decode_num_draft_tokens", 0)),
        (
            "counter",
            "spec_decode_num_accepted_tokens_total",
            "Drafted tokens accepted",
            s.get("spec_decode_num_accepted_tokens", 0),
        ),
        ("counter", "spec_decode_num_drafts_total", "Drafts verified", s.get("spec_decode_num_drafts", 0)),
        (
            "gauge",
            "prompt_tokens_seconds",
            "Average prompt throughput in tokens/s.",
            c.prompt_tokens / c.prompt_seconds if c.prompt_seconds else 0.0,
        ),
        (
            "gauge",
            "predicted_tokens_seconds",
            "Average generation throughput in tokens/s.",
            c.tokens_predicted / c.predicted_seconds if c.predicted_seconds else 0.0,
        ),
        ("gauge", "requests_processing", "Number of requests processing.", s.get("num_running", 0)),
        ("gauge", "requests_deferred", "Number of requests deferred.", s.get("num_waiting", 0)),
        (
            "gauge",
            "n_busy_slots_per_decode",
            "Busy slots (sequences in the running batch) now",
            s.get("num_running", 0),
        ),
    ]
    lines = []
    for kind, name, what, value in rows:
        lines += [f"# HELP llamacpp:{name} {what}", f"# TYPE llamacpp:{name} {kind}", f"llamacpp:{name} {value}"]
    return "\n".join(lines) + "\n"
