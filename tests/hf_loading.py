"""Loading transformers' reference models and tokenizers from GGUF files, faster."""

from contextlib import contextmanager


@contextmanager
def fast_gguf_reading():
    """transformers reads a GGUF file with gguf-py's GGUFReader, which slices its memory map element by element
    (20 s of Gemma 3's 40 s load is the 262k-token vocabulary's metadata, read twice). Within this block it gets
    tokenmill's cheaper `_get` (a plain array view of the same bytes): the same fields, parts and tensors, and so
    the same model and tokenizer (transformers' reference stays its own model code)."""
    import gguf

    from tokenmill.loader.gguf_file import _FastArrayReader

    class Reader(gguf.GGUFReader):
        _plain = None
        _get = _FastArrayReader._get

    original = gguf.GGUFReader
    gguf.GGUFReader = Reader
    try:
        yield
    finally:
        gguf.GGUFReader = original
