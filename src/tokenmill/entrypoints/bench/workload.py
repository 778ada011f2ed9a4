"""The canonical offline workload, drawn exactly as the peers' scripts draw it
(its definition is kept in tests/data/workload.py, and tests/test_bench.py checks this against it).

n requests as (prompt_token_ids, max_tokens): prompt and output lengths uniform over the inclusive ranges, token
ids uniform over [100, 10000), all from numpy's default_rng(seed) in that order. "offline-32" is n=32,
input_len=(32, 256), output_len=(16, 128), seed=0: 4,803 prompt tokens and 2,277 output tokens.
"""

import numpy as np


def make_workload(
    n: int = 32, input_len: tuple[int, int] = (32, 256), output_len: tuple[int, int] = (16, 128), seed: int = 0
) -> list[tuple[list[int], int]]:
    rng = np.random.default_rng(seed)
    plens = rng.integers(input_len[0], input_len[1] + 1, size=n)
    olens = rng.integers(output_len[0], output_len[1] + 1, size=n)
    return [(rng.integers(100, 10000, size=int(p)).tolist(), int(o)) for p, o in zip(plens, olens, strict=True)]


def parse_range(text: str) -> tuple[int, int]:
    """ "32:256" -> (32, 256); "128" -> (128, 128)."""
    low, _, high = text.partition(":")
    return int(low), int(high or low)
