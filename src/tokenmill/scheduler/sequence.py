"""One sequence being generated: its tokens, how many are in the KV cache, and its blocks."""

import enum

from tokenmill.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    def __init__(
        self,
        seq_id: int,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        sample_index: int = 0,
        max_tokens: int | None = None,
        group: str | None = None,
    ):
        self.seq_id = seq_id
        self.request_id = request_id
        # the sequences of one API call share a group; waiting groups take turns at admission (waiting_queue.py)
        self.group = group if group is not None else request_id
        self.params = params
        self.sample_index = sample_index  # which of the request's n samples this is
        self.token_ids: list[int] = list(prompt_token_ids)  # prompt, then generated tokens
        self.num_prompt_tokens = len(prompt_token_ids)
        self.max_tokens = max_tokens if max_tokens is not None else params.max_tokens
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache
        self.block_table: list[int] = []
        # the sliding-window layers' blocks, when the model has them (block_manager.WindowBlockManager)
        self.local_block_table: list[int] = []
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at first admission
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        self.ever_scheduled = False
        self.cumulative_logprob = 0.0
        # speculative decoding: how many proposed tokens the next step should compute after the last one (the
        # engine fills them in once the scheduler has given them slots)
        self.num_lookahead_tokens = 0
        self.pools = False  # an embedding request's: it needs every prompt row computed, and samples nothing
        # its LoRA adapter's id (0: none): its rows use it, and its prefix-cache blocks are keyed by it
        self.lora_id = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None

    @property
    def computes_whole_prompt(self) -> bool:
        """Whether every prompt token must be computed here, none taken from the prefix cache (its prompt's
        log-probabilities, an embedding's pooled hidden states, or a request that asks so)."""
        return self.wants_prompt_logprobs or self.pools or self.params.skip_reading_prefix_cache

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, request={self.request_id!r}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={self.block_table}, {self.status.value})"
        )
