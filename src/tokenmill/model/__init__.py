"""Model architectures. Each knows its layers and how to read its weights, nothing of batching or HTTP."""

from tokenmill.model.config import ModelConfig, model_config_from_gguf
from tokenmill.model.registry import SUPPORTED_ARCHITECTURES, build_model

__all__ = ["ModelConfig", "model_config_from_gguf", "SUPPORTED_ARCHITECTURES", "build_model"]
