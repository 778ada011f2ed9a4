"""`watermark_config`, vLLM's option in its names: {"key": K} with optional "algorithm" ("gumbel" or
"dual_key_gumbel"), "alpha", "context_width", "deduplicate_contexts" ("none", "single_turn", "all"),
"deduplicate_contexts_max_history" and "prf" ("philox"). The scheme itself: runner/watermark.py. No torch here."""

import hashlib
from dataclasses import dataclass, field
from typing import Any

from tokenmill.config.json_option import json_object_fields
from tokenmill.errors import InvalidParameterError

ALGORITHMS = ("gumbel", "dual_key_gumbel")
PRFS = ("philox",)
CONTEXT_SCOPES = ("none", "single_turn", "all")
MAX_KEY = 2**64 - 1  # Philox takes a 64-bit key


def derive_watermark_key(key: int, domain: bytes) -> int:
    """One of dual-key Gumbel's two keys from the configured one (vLLM's derive_watermark_key)."""
    digest = hashlib.sha256(domain + key.to_bytes(8, "big")).digest()
    return int.from_bytes(digest[:8], "big")


@dataclass(frozen=True)
class WatermarkConfig:
    key: int = field(repr=False)  # the secret: whoever holds it can detect the watermark (kept out of logs)
    algorithm: str = "gumbel"
    alpha: float = 0.1  # dual_key_gumbel: the chance that a token takes key B
    context_width: int = 4  # the generated tokens before a token that seed its pseudo-random draw
    # which history is searched for a repeated context (a repeated one is sampled without the watermark, so that
    # the same context does not force the same token into a loop): none, this reply's tokens (single_turn), or the
    # prompt's too (all: the reply's first context_width tokens are then not watermarked)
    deduplicate_contexts: str = "single_turn"
    deduplicate_contexts_max_history: int | None = 8192  # the most recent positions searched (None: all)
    prf: str = "philox"
    allow_target_only_watermarking: bool = False  # vLLM's, for speculative decoding, which is refused here

    def __post_init__(self) -> None:
        if isinstance(self.key, bool) or not isinstance(self.key, int) or not 0 <= self.key <= MAX_KEY:
            raise _error(f"key must be an integer from 0 to 2**64 - 1, got {self.key!r}")
        if self.algorithm not in ALGORITHMS:
            raise _error(f"algorithm {self.algorithm!r} is not supported (supported: {', '.join(ALGORITHMS)})")
        if self.prf not in PRFS:
            raise _error(f"prf {self.prf!r} is not supported (supported: {', '.join(PRFS)})")
        if self.deduplicate_contexts not in CONTEXT_SCOPES:
            raise _error(f"deduplicate_contexts must be one of {', '.join(CONTEXT_SCOPES)}")
        alpha = self.alpha
        if isinstance(alpha, bool) or not isinstance(alpha, int | float) or not 0 <= alpha <= 1:
            raise _error(f"alpha must be a number from 0 to 1, got {alpha!r}")
        _positive("context_width", self.context_width)
        if self.deduplicate_contexts_max_history is not None:
            _positive("deduplicate_contexts_max_history", self.deduplicate_contexts_max_history)

    @classmethod
    def parse(cls, value: "WatermarkConfig | dict[str, Any] | str | None") -> "WatermarkConfig | None":
        """A WatermarkConfig, a dict of its fields, or their JSON (the command line's form); None: none."""
        if value is None or isinstance(value, WatermarkConfig):
            return value
        value = json_object_fields(cls, value, "watermark_config")
        if "key" not in value:
            raise _error('needs "key": the secret the watermark is drawn with')
        return cls(**value)


def _positive(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _error(f"{name} must be a positive integer, got {value!r}")


def _error(message: str) -> InvalidParameterError:
    return InvalidParameterError(f"watermark_config: {message}", "watermark_config")
