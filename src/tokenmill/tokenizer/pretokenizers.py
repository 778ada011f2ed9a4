"""Byte-level BPE pre-tokenizer regexes, by the name in `tokenizer.ggml.pre`.

These are the split expressions llama.cpp uses for each name (src/llama-vocab.cpp); each expression splits the
pieces left by the previous one, keeping matches and the text between them ("isolated" in `tokenizers`).
"""

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# name -> (regexes, ignore_merges)
PRE_TOKENIZERS: dict[str, tuple[list[str], bool]] = {
    "default": ([r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"], False),
    "gpt-2": ([_GPT2], False),
    "gpt2": ([_GPT2], False),
    "phi-2": ([_GPT2], False),
    "roberta-bpe": ([_GPT2], False),
    "mpt": ([_GPT2], False),
    "olmo": ([_GPT2], False),
    "jais": ([_GPT2], False),
    "llama3": ([_LLAMA3], True),
    "llama-v3": ([_LLAMA3], True),
    "llama-bpe": ([_LLAMA3], True),
    "falcon3": ([_LLAMA3], True),
    "dbrx": ([_LLAMA3], False),
    "smaug-bpe": ([_LLAMA3], False),
    "chatglm-bpe": ([_LLAMA3], False),
    "qwen2": ([_QWEN2], False),
    "stablelm2": ([_QWEN2], False),
    "megrez": ([_QWEN2], False),
    "smollm": ([r"\p{N}", _GPT2], False),
    "starcoder": ([r"\p{N}", _GPT2], False),
    "refact": ([r"\p{N}", _GPT2], False),
    "command-r": ([r"\p{N}", _GPT2], False),
    "codeshell": ([r"\p{N}", _GPT2], False),
    "exaone": ([r"\p{N}", _GPT2], False),
    "minerva-7b": ([r"\p{N}", _GPT2], False),
    "falcon": ([r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]"], False),
    "deepseek-coder": ([r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", r"[一-龥ࠀ-一가-퟿]+", r"\p{N}"], False),
}
