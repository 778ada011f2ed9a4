"""A model's config from either kind of source: a GGUF file's metadata (model/config.py) or a Hugging Face
checkpoint's config.json (model/hf_config.py), each of which knows only its own."""

from tokenmill.config.model_shape import ModelConfig
from tokenmill.loader.gguf_file import GGUFFile
from tokenmill.loader.hf_checkpoint import HFCheckpoint
from tokenmill.model.config import model_config_from_gguf
from tokenmill.model.hf_config import model_config_from_hf


def model_config_from_source(source: GGUFFile | HFCheckpoint) -> ModelConfig:
    """The config of a GGUF file or a Hugging Face checkpoint."""
    if isinstance(source, HFCheckpoint):
        return model_config_from_hf(source)
    return model_config_from_gguf(source)
