"""Model files: finding them, reading GGUF, dequantizing tensors and building weights."""
