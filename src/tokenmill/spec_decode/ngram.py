"""Prompt lookup: propose the tokens that followed the most recent earlier occurrence of the sequence's last n
tokens (n from prompt_lookup_max down to prompt_lookup_min), anywhere in its prompt or output. Costs no model
pass: copy-heavy answers (quoting, editing, code) repeat long runs of their context."""

import numpy as np


def propose_ngram(token_ids: list[int], max_ngram: int, min_ngram: int, max_tokens: int) -> list[int]:
    """Up to max_tokens proposed next tokens ([] when no suffix n-gram occurred before)."""
    if max_tokens <= 0 or len(token_ids) < min_ngram + 1:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(max_ngram, len(tokens) - 1), min_ngram - 1, -1):
        suffix = tokens[-n:]
        # windows starting at 0 .. len - n - 1: every earlier occurrence, not the suffix itself
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
        starts = np.flatnonzero((windows == suffix).all(axis=1))
        if starts.size:
            follow = int(starts[-1]) + n  # the most recent occurrence
            return tokens[follow : follow + max_tokens].tolist()
    return []
