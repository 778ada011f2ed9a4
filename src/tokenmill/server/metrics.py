"""Prometheus metrics: request histograms and counters observed by the server, engine figures read at scrape time."""

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from tokenmill.outputs import RequestOutput
from tokenmill.server.llamacpp_metrics import LlamaCounters

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80)
_E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1, 1.5, 2, 2.5, 5, 10, 15, 20, 30, 40, 50, 60, 120, 240, 480)


class _EngineCollector(Collector):
    """Engine counters and gauges, read from the engine's stats snapshot when Prometheus scrapes."""

    def __init__(self, stats: Callable[[], dict[str, Any] | None]):
        self._stats = stats

    def collect(self) -> Iterator:
        s = self._stats()
        if s is None:
            return
        yield CounterMetricFamily(
            "tokenmill:num_preemptions", "Sequences preempted for lack of KV blocks", value=s["num_preemptions"]
        )
        yield CounterMetricFamily(
            "tokenmill:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache",
            value=s["prefix_cache_query_tokens"],
        )
        yield CounterMetricFamily(
            "tokenmill:prefix_cache_hits",
            "Prompt tokens served from the prefix cache",
            value=s["prefix_cache_hit_tokens"],
        )
        yield GaugeMetricFamily(
            "tokenmill:num_requests_running", "Sequences in the running batch", value=s["num_running"]
        )
        yield GaugeMetricFamily(
            "tokenmill:num_requests_waiting", "Sequences waiting to be scheduled", value=s["num_waiting"]
        )
        yield GaugeMetricFamily(
            "tokenmill:kv_cache_usage_perc", "Fraction of KV blocks in use (0-1)", value=s["kv_cache_usage"]
        )
        yield GaugeMetricFamily("tokenmill:kv_blocks_total", "KV blocks in the cache", value=s["kv_blocks_total"])
        yield CounterMetricFamily("tokenmill:engine_steps", "Engine steps run", value=s["num_steps"])
        yield GaugeMetricFamily(
            "tokenmill:tensor_parallel_size", "Ranks the model is split over", value=s["tensor_parallel_size"]
        )
        yield CounterMetricFamily(
            "tokenmill:collective_seconds",
            "Time rank 0 spent in tensor-parallel collectives (step broadcasts, all-reduces, the logits' gather); "
            "per step: its rate over tokenmill:engine_steps_total's",
            value=s["collective_seconds_total"],
        )
        yield GaugeMetricFamily(
            "tokenmill:last_step_collective_seconds",
            "Time in collectives during the last step",
            value=s["last_step_collective_ms"] / 1000,
        )
        # speculative decoding, in vLLM's names (acceptance rate: accepted over draft tokens)
        for name, what in (
            ("num_drafts", "Sequence-steps that verified proposed tokens"),
            ("num_draft_tokens", "Tokens proposed"),
            ("num_accepted_tokens", "Proposed tokens accepted"),
            ("num_emitted_tokens", "Tokens emitted by steps that verified proposals (accepted + 1 each)"),
        ):
            yield CounterMetricFamily(f"tokenmill:spec_decode_{name}", what, value=s[f"spec_decode_{name}"])
        yield GaugeMetricFamily(
            "tokenmill:spec_decode_enabled",
            "1 while the engine proposes tokens this step (speculative decoding on and few sequences running)",
            value=s["spec_decode_active"],
        )


class ServerMetrics:
    def __init__(self, stats: Callable[[], dict[str, Any] | None]):
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(
            "tokenmill:time_to_first_token_seconds", "Time to first token", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "tokenmill:inter_token_latency_seconds", "Time between output tokens", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.e2e = Histogram(
            "tokenmill:e2e_request_latency_seconds", "Arrival to last token", buckets=_E2E_BUCKETS, registry=r
        )
        self.queue = Histogram(
            "tokenmill:request_queue_time_seconds", "Arrival to first scheduled", buckets=_E2E_BUCKETS, registry=r
        )
        self.prompt_tokens = Counter("tokenmill:prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter("tokenmill:generation_tokens", "Tokens generated", registry=r)
        self.requests = Counter(
            "tokenmill:request_success", "Finished requests by finish reason", ["finished_reason"], registry=r
        )
        self.internal_errors = Counter(
            "tokenmill:internal_errors", "Requests answered by the handler of last resort (a bug)", registry=r
        )
        r.register(_EngineCollector(stats))
        ProcessCollector(registry=r)  # process_resident_memory_bytes, CPU seconds, open files
        self.llama = LlamaCounters()
        self.engine_stats = stats

    def observe(self, out: RequestOutput, count_generated: bool = True) -> None:
        """A finished request; `count_generated` False: its tokens were not output (echo with max_tokens 0)."""
        m = out.metrics
        if m.time_to_first_token is not None:
            self.ttft.observe(m.time_to_first_token)
        for gap in m.inter_token_latencies:
            self.itl.observe(gap)
        if m.end_to_end is not None:
            self.e2e.observe(m.end_to_end)
        if m.queue_time is not None:
            self.queue.observe(m.queue_time)
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        self.llama.observe(out, count_generated)
        for o in out.outputs:
            if count_generated:
                self.generation_tokens.inc(len(o.token_ids))
            self.requests.labels(finished_reason=o.finish_reason or "abort").inc()
