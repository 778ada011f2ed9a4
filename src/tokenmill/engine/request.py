"""A request: its prompt, its n sequences with their detokenizers, timings, and what was already reported."""

from dataclasses import dataclass, field
from typing import Any

from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.outputs import CompletionOutput, PositionLogprobs, RequestMetrics, RequestOutput
from tokenmill.pooling_params import PoolingParams
from tokenmill.sampling_params import SamplingParams
from tokenmill.scheduler.sequence import Sequence


@dataclass
class SampleState:
    """Per-sequence output state kept by the engine (the scheduler's Sequence holds the tokens)."""

    seq: Sequence
    detokenizer: IncrementalDetokenizer
    logprobs: list[PositionLogprobs] | None
    sent_text_len: int = 0
    sent_token_count: int = 0
    grammar: Any = None  # an llguidance matcher when the request's output is constrained (structured outputs)
    allowed_tokens: int | None = None  # how many tokens the constraint allowed at the last sampled position
    error: str | None = None  # why the sequence ended with finish_reason "error" (its constraint failed)


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    samples: list[SampleState] = field(default_factory=list)
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    forked: bool = False
    aborted: bool = False
    pooling: PoolingParams | None = None  # an embedding request: its prompt's hidden states pooled, nothing sampled
    pooled: Any = None  # while its prompt is computed: the sum (mean) or the last row (float32 [hidden] tensor)
    embedding: list[float] | None = None  # once it is

    @property
    def finished(self) -> bool:
        return len(self.samples) == self.params.n and all(s.seq.is_finished for s in self.samples)

    def make_output(self) -> RequestOutput:
        """Cumulative output, with deltas since the previous call (which this call marks as sent)."""
        outputs = []
        for sample in sorted(self.samples, key=lambda s: s.seq.sample_index):
            seq = sample.seq
            text = sample.detokenizer.visible_text(seq.is_finished)
            token_ids = seq.output_token_ids
            outputs.append(
                CompletionOutput(
                    index=seq.sample_index,
                    text=text,
                    token_ids=token_ids,
                    cumulative_logprob=seq.cumulative_logprob,
                    logprobs=None if sample.logprobs is None else list(sample.logprobs),
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                    error=sample.error,
                    delta_text=text[sample.sent_text_len :],
                    delta_token_ids=token_ids[sample.sent_token_count :],
                )
            )
            sample.sent_text_len = len(text)
            sample.sent_token_count = len(token_ids)
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=outputs,
            finished=self.finished,
            metrics=self.metrics,
            prompt_logprobs=self.prompt_logprobs,
            num_cached_tokens=self.samples[0].seq.num_cached_tokens if self.samples else 0,
            embedding=self.embedding,
            num_computed_prompt_tokens=self._computed_prompt_tokens(),
        )

    def _computed_prompt_tokens(self) -> int:
        if not self.samples:
            return 0
        seq = self.samples[0].seq
        return len(self.prompt_token_ids) if seq.num_output_tokens else min(seq.num_computed_tokens, seq.num_tokens)
