"""Per-request parameters of an embedding: how the prompt's final hidden states become one vector. No torch here.

An embedding request computes its whole prompt (no prefix-cache hit: mean pooling needs every row) and samples
nothing; the vector is the final norm's output, pooled over the prompt's tokens.
"""

from dataclasses import dataclass
from typing import Literal

from tokenmill.errors import InvalidParameterError
from tokenmill.sampling_params import check_truncation

POOLING_TYPES = ("mean", "last")


@dataclass(frozen=True)
class PoolingParams:
    pooling: Literal["mean", "last"] = "mean"  # the mean of every token's hidden state, or the last token's
    normalize: bool = True  # scaled to unit length (cosine similarity = dot product)
    dimensions: int | None = None  # keep the first this many values (Matryoshka models), before normalizing
    # vLLM's: the input cut to this many tokens first (-1: as many as the context allows), keeping its start
    # ("right": the end is cut, the default for embeddings) or its end ("left")
    truncate_prompt_tokens: int | None = None
    truncation_side: Literal["left", "right"] = "right"

    n = 1  # one vector per prompt (a request's samples, for the code that counts them)

    def __post_init__(self) -> None:
        if self.pooling not in POOLING_TYPES:
            raise InvalidParameterError(
                f"pooling must be one of {', '.join(POOLING_TYPES)}, not {self.pooling!r}", "pooling"
            )
        if self.dimensions is not None and (
            isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int) or self.dimensions < 1
        ):
            raise InvalidParameterError(f"dimensions must be a positive integer, not {self.dimensions!r}", "dimensions")
        check_truncation(self.truncate_prompt_tokens, self.truncation_side)
