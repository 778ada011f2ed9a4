"""Model architectures. Each knows its layers and how to read its weights, nothing of batching or HTTP.

config.py: what a GGUF's metadata says of the model (a ModelConfig, config/model_shape.py: the shape, which
tensor parallelism's plan reads too, below this package); hf_config.py: the same from a Hugging Face config.json;
config_from_source.py: either; llama.py: the one decoder for every architecture; weights.py: its weights from the
file; registry.py: which architectures build it. This package's __init__ imports none of them, so that reading a
config does not import the model.
"""
