"""The engine's options as one tree, validated when made: model.py (`ModelOptions`: the model, dtype and
quantization), engine.py (`EngineConfig`: the names `LLM(...)` and `tokenmill serve` accept), speculative.py
(`SpeculativeConfig`, its `speculative_config`), watermark.py (`WatermarkConfig`, its `watermark_config`) and
quantization.py (what a quantization option means). The command line is generated from their fields, and
`tokenmill serve`'s own options from server.py's (`ServerSettings`). Beside them, model_shape.py: `ModelConfig`,
what a model file says of the model's shape. No torch here."""

from tokenmill.config.engine import KV_CACHE_DTYPE_NAMES, EngineConfig, parse_memory
from tokenmill.config.model import ModelOptions
from tokenmill.config.speculative import SpeculativeConfig
from tokenmill.config.watermark import WatermarkConfig

__all__ = [
    "KV_CACHE_DTYPE_NAMES",
    "EngineConfig",
    "ModelOptions",
    "SpeculativeConfig",
    "WatermarkConfig",
    "parse_memory",
]
