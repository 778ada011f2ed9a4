"""`speculative_config`, in vLLM's names: {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": N,
"prompt_lookup_min": M, "disable_by_batch_size": B}, or {"method": "draft_model", "model": PATH_OR_NAME,
"num_speculative_tokens": K, "quantization": Q}; and tokenmill's "verify_row_cost": C. No torch here."""

from dataclasses import dataclass
from typing import Any

from tokenmill.config.json_option import json_object_fields
from tokenmill.config.quantization import QUANTIZATIONS
from tokenmill.errors import InvalidParameterError

METHODS = ("ngram", "draft_model")
DRAFT_QUANTIZATIONS = (None, *QUANTIZATIONS)
MAX_SPECULATIVE_TOKENS = 16
# a verified row's extra time as a share of a one-row decode step: 4 more rows cost 0.67 of a step under `auto`
# (benchmarks/verify_cost.py, 2026-12-01); for the float32 model with a 4-bit draft a proposal costs a draft row
# (about a tenth of the float32 step) and a verified row
ROW_COST = 0.17  # spec_decode/acceptance.py says what it sets


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int  # K: tokens proposed per sequence and step (the pass computes K + 1 rows)
    prompt_lookup_max: int = 4  # the longest suffix n-gram looked up in the sequence's earlier tokens
    prompt_lookup_min: int = 2  # the shortest one
    # speculate only while at most this many sequences run: a larger batch already keeps the cores busy, and
    # rejected proposals would cost compute it needs (measured: benchmarks/README.md, "Speculative decoding": at
    # 16 sequences even a copying workload gains nothing)
    disable_by_batch_size: int = 8
    # a verified row's extra time as a share of a one-row step: sets how many proposals pay, by each sequence's
    # acceptance rate and the batch's size (spec_decode/acceptance.py); 0: always as many as the method offers
    verify_row_cost: float = ROW_COST
    # draft_model: the smaller model that proposes (a path, or a name as --model takes; it must share the target's
    # tokenizer), and its weights' format (as LLM's quantization; "auto": 4-bit, the fastest to run here)
    model: str | None = None
    quantization: str | None = "auto"

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise InvalidParameterError(
                f"speculative_config: method {self.method!r} is not supported (supported: {', '.join(METHODS)})",
                "speculative_config",
            )
        for name, low, high in (
            ("num_speculative_tokens", 1, MAX_SPECULATIVE_TOKENS),
            ("prompt_lookup_max", 1, 64),
            ("prompt_lookup_min", 1, 64),
            ("disable_by_batch_size", 1, None),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low or (high and value > high):
                bound = f"at least {low}" if high is None else f"between {low} and {high}"
                raise InvalidParameterError(
                    f"speculative_config: {name} must be an integer {bound}, got {value!r}", "speculative_config"
                )
        if self.method == "draft_model" and not (isinstance(self.model, str) and self.model):
            raise InvalidParameterError(
                'speculative_config: method "draft_model" needs "model": the draft model\'s path or name',
                "speculative_config",
            )
        if self.method == "ngram" and self.model is not None:
            raise InvalidParameterError(
                'speculative_config: "model" is for method "draft_model" (ngram proposes from the sequence itself)',
                "speculative_config",
            )
        if self.quantization not in DRAFT_QUANTIZATIONS:
            raise InvalidParameterError(
                f"speculative_config: quantization {self.quantization!r} is not supported (none, int8, int4 or auto)",
                "speculative_config",
            )
        cost = self.verify_row_cost
        if isinstance(cost, bool) or not isinstance(cost, int | float) or not 0 <= cost <= 10:
            raise InvalidParameterError(
                f"speculative_config: verify_row_cost must be a number from 0 to 10, got {cost!r}", "speculative_config"
            )
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise InvalidParameterError(
                f"speculative_config: prompt_lookup_min ({self.prompt_lookup_min}) must not exceed prompt_lookup_max "
                f"({self.prompt_lookup_max})",
                "speculative_config",
            )

    @classmethod
    def parse(cls, value: "SpeculativeConfig | dict[str, Any] | str | None") -> "SpeculativeConfig | None":
        """A SpeculativeConfig, a dict of its fields, or their JSON (the command line's form); None: none."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        value = json_object_fields(cls, value, "speculative_config")
        if "method" not in value or "num_speculative_tokens" not in value:
            raise InvalidParameterError(
                "speculative_config needs method and num_speculative_tokens", "speculative_config"
            )
        return cls(**value)
