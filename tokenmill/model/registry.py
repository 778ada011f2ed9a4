"""Architecture name (GGUF `general.architecture`) -> model class, and building a loaded model."""

from typing import TYPE_CHECKING

import torch
from torch import nn

from tokenmill.distributed.shard import ShardedGGUF, ShardPlan
from tokenmill.errors import UnsupportedModelError
from tokenmill.loader.gguf_file import GGUFFile
from tokenmill.model.config import ModelConfig, model_config_from_gguf
from tokenmill.model.llama import LlamaForCausalLM

if TYPE_CHECKING:
    from tokenmill.distributed.group import ParallelGroup

# one decoder for every architecture: what differs is declared in ModelConfig (model/config.py)
_ARCHITECTURES: dict[str, type[nn.Module]] = {
    "llama": LlamaForCausalLM,
    "gemma3": LlamaForCausalLM,
}
SUPPORTED_ARCHITECTURES = tuple(sorted(_ARCHITECTURES))


def model_class_for(gguf: GGUFFile) -> type[nn.Module]:
    arch = gguf.architecture
    model_class = _ARCHITECTURES.get(arch)
    if model_class is None:
        raise UnsupportedModelError(
            f"{gguf.path}: architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    return model_class


def build_model(
    gguf: GGUFFile,
    dtype: torch.dtype,
    device: torch.device,
    quantization: str | None = None,
    parallel: "tuple[ShardPlan, ParallelGroup] | None" = None,
) -> tuple[nn.Module, ModelConfig]:
    """Instantiate the architecture of `gguf`, load its weights (quantized in `quantization` mode) onto `device`.
    With `parallel`, only this rank's shard of every weight is read and held. Returns the model and the whole
    model's config."""
    model_class = model_class_for(gguf)
    config = model_config_from_gguf(gguf)
    if parallel is None:
        model = model_class(config, dtype)
    else:
        plan, group = parallel
        gguf = ShardedGGUF(gguf, plan)  # type: ignore[assignment]
        model = model_class(plan.local_config, dtype)
        model.parallel, model.vocab_start = group, plan.vocab[0]
    model.load_gguf(gguf)
    if quantization is not None:
        model.quantize(quantization, gguf)
    return model.to(device).eval(), config
