"""Whether a text's tokens carry the watermark of a key (vLLM's GumbelWatermarkDetector and its dual-key sibling):
each token t after context c scores -log(1 - u(c, t)), an Exp(1) draw for text written without the key and larger
for watermarked text; a repeated context scores once (its number is the same draw again). The sum of n scores of
unwatermarked text is Gamma(n, 1), whose survival function at the sum is the p-value."""

import math
from dataclasses import dataclass

import torch

from tokenmill.config.watermark import WatermarkConfig
from tokenmill.runner.watermark import reply_context, watermark_keys
from tokenmill.runner.watermark_prf import uniform


@dataclass(frozen=True)
class WatermarkDetection:
    score: float
    p_value: float  # the chance that text without the watermark scores this high
    num_scored_tokens: int
    is_watermarked: bool  # p_value at most the threshold asked for


def gamma_survival(score: float, shape: int) -> float:
    """P(X > score) for X ~ Gamma(shape, 1), an integer shape: exp(-score) * sum of score^k / k! for k < shape."""
    if shape <= 0 or score <= 0:
        return 1.0
    log_terms = [k * math.log(score) - math.lgamma(k + 1) for k in range(shape)]
    top = max(log_terms)
    log_sum = top + math.log(sum(math.exp(term - top) for term in log_terms))
    return min(1.0, math.exp(min(0.0, log_sum - score)))


def detect(
    token_ids: list[int], config: WatermarkConfig, p_value_threshold: float = 0.01, deduplicate: bool = True
) -> WatermarkDetection:
    """Score a reply's tokens (from its first generated token) against the configured key."""
    width = config.context_width
    contexts, targets, seen = [], [], set()
    for i, token in enumerate(token_ids):
        context = tuple(reply_context(token_ids[:i], width))
        if deduplicate and context in seen:
            continue
        seen.add(context)
        contexts.append(context)
        targets.append(token)
    if not targets:
        return WatermarkDetection(0.0, 1.0, 0, False)
    context_tensor = torch.tensor(contexts, dtype=torch.int64)
    target_tensor = torch.tensor(targets, dtype=torch.int64).unsqueeze(-1)
    scores = [
        -torch.log1p(-uniform(key, context_tensor, target_tensor).squeeze(-1).double())
        for key in watermark_keys(config)
    ]
    n = len(targets)
    if len(scores) == 1:
        score = float(scores[0].sum())
        p_value = gamma_survival(score, n)
    else:  # dual key: the two keys' scores weighted by how often each was used
        alpha = config.alpha
        score = float((scores[0] * (1 - alpha) + scores[1] * alpha).sum())
        variance = (1 - alpha) ** 2 + alpha**2
        if alpha in (0, 0.5, 1):
            p_value = gamma_survival(score / variance, round(n / variance))
        else:
            shape = torch.tensor(n / variance, dtype=torch.float64)
            p_value = float(torch.special.gammaincc(shape, torch.tensor(score / variance, dtype=torch.float64)))
    return WatermarkDetection(score, p_value, n, p_value <= p_value_threshold)
