"""Engine options (the names `LLM(...)` and `tokenmill serve` accept), validated when made. No torch here."""

import re
from dataclasses import dataclass, fields
from typing import Any

from tokenmill.config.speculative import SpeculativeConfig
from tokenmill.errors import InvalidParameterError

KV_CACHE_DTYPE_NAMES = ("auto", "float32", "float16", "bfloat16")  # runner/kv_cache.py resolves them
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2, "mib": 1024**2}
_UNITS.update({"g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4, "tb": 1000**4, "tib": 1024**4})


def parse_memory(value: str | int | float) -> int:
    """ "1GiB", "512MiB", "2GB", 1073741824 -> bytes."""
    if isinstance(value, bool):
        raise InvalidParameterError(f"memory size {value!r} is not a size", "kv_cache_memory")
    if isinstance(value, int | float):
        size = int(value)
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise InvalidParameterError(
                f"memory size {value!r} is not understood (examples: '1GiB', '512MiB', '2GB')", "kv_cache_memory"
            )
        size = int(float(match.group(1)) * _UNITS[unit])
    if size <= 0:
        raise InvalidParameterError(f"memory size {value!r} must be positive", "kv_cache_memory")
    return size


@dataclass
class EngineConfig:
    block_size: int = 16  # tokens per KV block
    num_kv_blocks: int | None = None  # explicit cache size in blocks (wins over kv_cache_memory)
    kv_cache_memory: str | int | None = None  # e.g. "1GiB"; default: a share of free memory (see kv_cache.py)
    # the KV cache's element type: "auto" (float16 under the native decoder, else the model's), "float32",
    # "float16" or "bfloat16" (runner/kv_cache.py)
    kv_cache_dtype: str = "auto"
    enable_prefix_caching: bool = True
    max_num_seqs: int = 64  # sequences in one step
    max_num_batched_tokens: int = 512  # tokens in one step (prefill chunks + decodes)
    max_model_len: int | None = None  # prompt + output limit; default: the model's context, capped by the cache
    device: str | None = None  # None/"auto": CUDA when available, else CPU
    seed: int = 0  # seeds the sampler of requests without their own seed
    tensor_parallel_size: int = 1  # ranks (processes, one per device) the model is split over
    collective_timeout_s: float = 15.0  # a rank that does not answer a step's collective within this has failed
    # sampling defaults for fields a request leaves unset: "auto" (the model's recommendation,
    # model/generation_defaults.py), "tokenmill" (SamplingParams' own), or a generation_config.json / its folder
    generation_config: str = "auto"
    # speculative decoding (tokenmill.spec_decode): a SpeculativeConfig, a dict of its fields or their JSON
    speculative_config: Any = None
    # structured outputs: the largest constraint compiled (bytes of its schema, regex, grammar or choices), and how
    # long a compile may take; above either, the request is refused (tokenmill/structured/grammars.py)
    max_constraint_bytes: int = 1024 * 1024
    max_constraint_compile_seconds: float = 10.0

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size"):
            _positive_int(name, getattr(self, name))
        _positive_int("max_constraint_bytes", self.max_constraint_bytes)
        _positive_number("max_constraint_compile_seconds", self.max_constraint_compile_seconds)
        for name in ("num_kv_blocks", "max_model_len"):
            if getattr(self, name) is not None:
                _positive_int(name, getattr(self, name))
        if self.kv_cache_memory is not None:
            parse_memory(self.kv_cache_memory)
        if self.kv_cache_dtype not in KV_CACHE_DTYPE_NAMES:
            raise InvalidParameterError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPE_NAMES)}, got {self.kv_cache_dtype!r}",
                "kv_cache_dtype",
            )
        _positive_number("collective_timeout_s", self.collective_timeout_s)
        if not isinstance(self.generation_config, str) or not self.generation_config:
            raise InvalidParameterError(
                "generation_config must be 'auto', 'tokenmill' or a path to a generation_config.json",
                "generation_config",
            )
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        if not isinstance(self.enable_prefix_caching, bool):
            raise InvalidParameterError("enable_prefix_caching must be true or false", "enable_prefix_caching")

    @classmethod
    def from_options(cls, options: dict) -> "EngineConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise InvalidParameterError(
                f"unknown engine option(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})", unknown[0]
            )
        return cls(**options)


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidParameterError(f"{name} must be a positive integer, got {value!r}", name)


def _positive_number(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise InvalidParameterError(f"{name} must be a positive number, got {value!r}", name)
