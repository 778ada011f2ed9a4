"""Counters of speculative decoding, as vLLM's spec_decode metrics name them."""

from dataclasses import dataclass


@dataclass
class SpecDecodeStats:
    num_drafts: int = 0  # sequence-steps that verified proposals
    num_draft_tokens: int = 0  # tokens proposed
    num_accepted_tokens: int = 0  # proposed tokens the model's own sampling confirmed
    num_emitted_tokens: int = 0  # tokens those steps gave: the accepted ones plus one sampled after them
    active: bool = False  # whether the last step proposed (speculation on, and few enough sequences running)

    def record(self, num_proposed: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_proposed
        self.num_accepted_tokens += num_accepted
        self.num_emitted_tokens += num_accepted + 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def as_stats(self) -> dict[str, int | float]:
        return {
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
            "spec_decode_num_emitted_tokens": self.num_emitted_tokens,
        }
