"""What a request produces: RequestOutput with one CompletionOutput per sample, plus its timings. No torch."""

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int  # 1 = the most likely token
    decoded_token: str | None = None


# One position's log-probabilities: token id -> Logprob (the chosen token and the top-k).
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str  # everything produced so far (stop strings cut off, a possible stop-string prefix held back)
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    # "stop", "length", "abort" or "error" (its structured-output constraint failed mid-way: see `error`); None
    # while running
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    delta_text: str = ""  # text added since the previous output of this request
    delta_token_ids: list[int] = field(default_factory=list)
    error: str | None = None  # with finish_reason "error": what failed

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Times are time.monotonic() seconds; derived figures in seconds."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # when each output token (of sample 0) appeared
    num_prefill_chunks: int = 0  # steps that computed part of the prompt (several when it is prefilled in chunks)

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def inter_token_latencies(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:], strict=False)]

    @property
    def end_to_end(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    embedding: list[float] | None = None  # an embedding request's vector (tokenmill.PoolingParams), once finished
    # the prompt tokens whose K/V are in the cache so far, read or computed (SamplingParams.report_prompt_progress)
    num_computed_prompt_tokens: int = 0
