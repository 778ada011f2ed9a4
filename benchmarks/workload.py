"""The workload definition for the peers' scripts (which run outside tokenmill's environment).

Re-exports tokenmill.entrypoints.bench.workload when tokenmill is importable; otherwise the same function, kept
identical (tests/test_bench.py checks both against the canonical definition, tests/data/workload.py).
"""

try:
    from tokenmill.entrypoints.bench.workload import make_workload, parse_range
except ImportError:  # the peers' virtual environment has no tokenmill
    import numpy as np

    def make_workload(n=32, input_len=(32, 256), output_len=(16, 128), seed=0):
        rng = np.random.default_rng(seed)
        plens = rng.integers(input_len[0], input_len[1] + 1, size=n)
        olens = rng.integers(output_len[0], output_len[1] + 1, size=n)
        return [(rng.integers(100, 10000, size=int(p)).tolist(), int(o)) for p, o in zip(plens, olens, strict=True)]

    def parse_range(text):
        low, _, high = text.partition(":")
        return int(low), int(high or low)


__all__ = ["make_workload", "parse_range"]
