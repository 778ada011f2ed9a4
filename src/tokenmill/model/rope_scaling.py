"""YaRN's rope scaling as numbers (no torch): the divisor of each rope frequency and the factor on cos and sin.
ModelConfig holds them (rope_freq_factors, rope_attention_factor), read from GGUF (model/config.py) or config.json
(model/hf_config.py); layers/rotary.py turns them into the tables every layer and the native decoder read."""

import math


def yarn_frequency_factors(
    rotary_dim: int,
    base: float,
    factor: float,
    original_context: int,
    beta_fast: float = 32.0,
    beta_slow: float = 1.0,
    ext_factor: float = 1.0,
    truncate: bool = True,
) -> tuple[float, ...]:
    """YaRN's rope scaling as one divisor per frequency [rotary_dim / 2]: frequencies that turn fewer than beta_slow
    times over the original context are divided by `factor` (interpolated), those that turn more than beta_fast
    times are kept (extrapolated), and the ones between are mixed along a linear ramp over the frequency index,
    its ends floored and ceiled unless not `truncate` (transformers' `_compute_yarn_parameters`, ggml's
    `ggml_rope_yarn_corr_dims`). `ext_factor` scales the kept share (llama.cpp's yarn_ext_factor; 1 for YaRN)."""

    def correction_index(rotations: float) -> float:  # the frequency index that turns `rotations` times
        return rotary_dim * math.log(original_context / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_index(beta_fast), correction_index(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # no division by zero (as both references)
    factors = []
    for i in range(rotary_dim // 2):
        kept = (1.0 - min(max((i - low) / (high - low), 0.0), 1.0)) * ext_factor  # share of the kept frequency
        factors.append(1.0 / ((1.0 - kept) / factor + kept))
    return tuple(factors)


def yarn_attention_factor(factor: float, mscale: float | None = None, mscale_all_dim: float | None = None) -> float:
    """YaRN's factor on cos and sin (so the attention logits grow by its square): 0.1 ln(factor) + 1, or with
    DeepSeek's mscale and mscale_all_dim the ratio of two such terms (transformers' get_mscale)."""

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if mscale and mscale_all_dim:
        return get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
    return get_mscale(factor)
