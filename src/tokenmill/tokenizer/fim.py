"""A model's fill-in-the-middle tokens, as llama.cpp finds them: GGUF's tokenizer.ggml.fim_* ids (or the older
prefix/suffix/middle ids), else the token texts FIM-trained vocabularies use. A code model is prompted with
<prefix> PREFIX <suffix> SUFFIX <middle> and writes what goes between (llama.cpp's /infill)."""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# role -> (GGUF keys, token texts), in the order llama.cpp tries them
_ROLES = {
    "prefix": (("fim_pre_token_id", "prefix_token_id"), ("<fim_prefix>", "<|fim_prefix|>", "<fim-prefix>", "<PRE>")),
    "suffix": (("fim_suf_token_id", "suffix_token_id"), ("<fim_suffix>", "<|fim_suffix|>", "<fim-suffix>", "<SUF>")),
    "middle": (("fim_mid_token_id", "middle_token_id"), ("<fim_middle>", "<|fim_middle|>", "<fim-middle>", "<MID>")),
    "separator": (("fim_sep_token_id",), ("<file_sep>", "<|file_sep|>", "<|file_separator|>")),
}


@dataclass(frozen=True)
class FimTokens:
    prefix: int
    suffix: int
    middle: int
    separator: int | None  # between the repository's other files (input_extra), when the vocabulary has one


def find_fim_tokens(get: Callable[[str, Any], Any], token_to_id: Callable[[str], int | None]) -> FimTokens | None:
    """`get`: the model source's metadata lookup; None when the model has no prefix, suffix and middle tokens."""
    found: dict[str, int | None] = {}
    for role, (keys, texts) in _ROLES.items():
        ids = [get(f"tokenizer.ggml.{key}", None) for key in keys] + [token_to_id(text) for text in texts]
        found[role] = next((int(i) for i in ids if i is not None and int(i) >= 0), None)
    if found["prefix"] is None or found["suffix"] is None or found["middle"] is None:
        return None
    return FimTokens(found["prefix"], found["suffix"], found["middle"], found["separator"])
