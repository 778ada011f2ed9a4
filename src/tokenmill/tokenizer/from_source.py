"""A model source's tokenizer (loader/model_source.py): a GGUF file's from its metadata (gguf_tokenizer.py), a
Hugging Face checkpoint's from its tokenizer.json (hf_tokenizer.py). The loader reads files and knows nothing of
tokenizers; the tokenizer is built from what it read."""

from tokenmill.loader.hf_checkpoint import HFCheckpoint
from tokenmill.loader.model_source import ModelSource
from tokenmill.tokenizer.gguf_tokenizer import Tokenizer


def load_tokenizer(source: ModelSource) -> Tokenizer:
    if isinstance(source, HFCheckpoint):
        from tokenmill.tokenizer.hf_tokenizer import tokenizer_from_checkpoint

        return tokenizer_from_checkpoint(source)
    return Tokenizer.from_gguf(source)
