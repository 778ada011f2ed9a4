"""Architecture name (GGUF `general.architecture`) -> model class, and building a loaded model."""

import torch
from torch import nn

from tokenmill.errors import UnsupportedModelError
from tokenmill.loader.gguf_file import GGUFFile
from tokenmill.model.config import ModelConfig, model_config_from_gguf
from tokenmill.model.llama import LlamaForCausalLM

_ARCHITECTURES: dict[str, type[nn.Module]] = {
    "llama": LlamaForCausalLM,
}
SUPPORTED_ARCHITECTURES = tuple(sorted(_ARCHITECTURES))


def build_model(
    gguf: GGUFFile, dtype: torch.dtype, device: torch.device, quantization: str | None = None
) -> tuple[nn.Module, ModelConfig]:
    """Instantiate the architecture of `gguf`, load its weights (quantized in `quantization` mode) onto `device`."""
    arch = gguf.architecture
    model_class = _ARCHITECTURES.get(arch)
    if model_class is None:
        raise UnsupportedModelError(
            f"{gguf.path}: architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    config = model_config_from_gguf(gguf)
    model = model_class(config, dtype)
    model.load_gguf(gguf)
    if quantization is not None:
        model.quantize(quantization, gguf)
    return model.to(device).eval(), config
