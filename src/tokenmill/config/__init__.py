"""The engine's options as one tree, validated when made: engine.py (`EngineConfig`: the names `LLM(...)` and
`tokenmill serve` accept) and speculative.py (`SpeculativeConfig`, its `speculative_config`). No torch here."""

from tokenmill.config.engine import KV_CACHE_DTYPE_NAMES, EngineConfig, parse_memory
from tokenmill.config.speculative import SpeculativeConfig

__all__ = ["KV_CACHE_DTYPE_NAMES", "EngineConfig", "SpeculativeConfig", "parse_memory"]
