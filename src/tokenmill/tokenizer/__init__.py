"""Tokenizers built from GGUF metadata (the `tokenizers` library does the work) and chat templates."""

from tokenmill.tokenizer.chat_template import ChatTemplate
from tokenmill.tokenizer.gguf_tokenizer import Tokenizer

__all__ = ["ChatTemplate", "Tokenizer"]
