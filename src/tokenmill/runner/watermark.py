"""Output watermarking as vLLM does it (--watermark-config; vllm/v1/watermarking): a sampler stage for the rows
that draw at random. Gumbel-max with keyed noise: a row takes argmax(logits + g), where logits are its processed
ones (penalties, bias, masks, temperature, top-k, top-p, min-p) and g_t = -log(-log(u_t)) with u_t the keyed
pseudo-random number of (the last `context_width` generated tokens, t) (watermark_prf.py). Each token is still
drawn from the row's distribution, but the key's holder can tell (watermark_detect.py): the chosen tokens' numbers
are high far more often than chance.

As vLLM: greedy rows and requests with `watermarking=False` are not watermarked; a row whose context already occurred
in its history (deduplicate_contexts) is drawn as usual instead, so that one context does not force one token again
and again; dual_key_gumbel takes key B for a share `alpha` of tokens (drawn from the row's generator), key A
otherwise, both derived from the configured key.
"""

from dataclasses import dataclass, field

import torch

from tokenmill.config.watermark import WatermarkConfig, derive_watermark_key
from tokenmill.runner.watermark_prf import vocabulary_uniform
from tokenmill.sampling_params import SamplingParams

TINY = torch.finfo(torch.float32).tiny  # a number of 0 would make the noise infinite


def watermark_keys(config: WatermarkConfig) -> tuple[int, ...]:
    """gumbel: the key; dual_key_gumbel: keys A and B."""
    if config.algorithm == "gumbel":
        return (config.key,)
    return derive_watermark_key(config.key, b"key_a"), derive_watermark_key(config.key, b"key_b")


def reply_context(output_token_ids: list[int], width: int) -> list[int]:
    """The generated tokens a position's draw is keyed by: the last `width`, -1 before the reply's start."""
    return ([-1] * width + output_token_ids)[-width:]


@dataclass
class _History:
    """The contexts a sequence's history has shown so far, each with the last position it was seen at."""

    seen: dict[tuple[int, ...], int] = field(default_factory=dict)
    length: int = 0  # the history positions read into `seen`


class Watermarker:
    def __init__(self, config: WatermarkConfig):
        self.config = config
        self.keys = watermark_keys(config)
        self._histories: dict[int, _History] = {}  # seq_id -> what deduplication has read of its history

    def marks(self, params: SamplingParams) -> bool:
        """Whether a request's random draws are watermarked (greedy ones never are)."""
        return params.watermarking is not False and not params.greedy

    def release(self, seq_id: int) -> None:
        self._histories.pop(seq_id, None)

    def repeated(self, seq_id: int, prompt_token_ids: list[int], output_token_ids: list[int]) -> bool:
        """Whether the row's context occurred before in its history (searched as deduplicate_contexts says), so
        that this draw goes unwatermarked. Incremental: each history position is read once per sequence."""
        c = self.config
        width = c.context_width
        if c.deduplicate_contexts == "none":
            return False
        include_prompt = c.deduplicate_contexts == "all"
        if include_prompt and len(output_token_ids) < width:  # a context reaching into the prompt: never marked
            return True
        history = self._histories.setdefault(seq_id, _History())
        # the tokens whose contexts are searched: the reply's, after the prompt's when "all"
        tokens = prompt_token_ids + output_token_ids if include_prompt else output_token_ids
        for position in range(history.length, len(tokens)):  # the context at a position: the `width` tokens before
            before = tokens[max(0, position - width) : position]
            history.seen[tuple([-1] * (width - len(before)) + before)] = position
        history.length = len(tokens)
        last = history.seen.get(tuple(reply_context(output_token_ids, width)))
        if last is None:
            return False
        window = c.deduplicate_contexts_max_history
        return window is None or last >= len(tokens) - window

    def key_for(self, generator: torch.Generator, device: torch.device) -> int:
        """The key of one draw: dual_key_gumbel's B with probability alpha (A when alpha is 0, B when it is 1)."""
        if len(self.keys) == 1 or self.config.alpha == 0:
            return self.keys[0]
        if self.config.alpha == 1:
            return self.keys[1]
        coin = torch.rand(1, generator=generator, device=device)
        return self.keys[1] if float(coin) < self.config.alpha else self.keys[0]

    def sample(self, logits: torch.Tensor, contexts: torch.Tensor, keys: list[int]) -> torch.Tensor:
        """logits [R, V] processed (-inf: cannot be drawn), contexts [R, W], one key per row -> tokens [R]."""
        tokens = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
        for key in set(keys):
            rows = torch.tensor([i for i, k in enumerate(keys) if k == key], device=logits.device)
            u = vocabulary_uniform(key, contexts[rows], logits.shape[-1]).clamp_min(TINY)  # [r, V]
            tokens[rows] = (logits[rows] - torch.log(-torch.log(u))).argmax(dim=-1)
        return tokens
