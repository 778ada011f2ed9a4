"""Rotary position embedding, "neox" layout: the two halves of each head are rotated against each other.

GGUF llama files store Q/K rows permuted for ggml's interleaved rope; the loader undoes that permutation
(model/llama.py), so every architecture goes through this one implementation.

Per step the tables are looked up once for all layers: cos_full = [cos | cos] and sin_signed = [-sin | sin],
so that rotating x = [x1 | x2] is x * cos_full + roll(x, half) * sin_signed = [x1 cos - x2 sin | x2 cos + x1 sin]:
three tensor ops per layer, for Q and K together.

Rope scaling changes only the frequencies: each is divided by its factor (Llama 3's per-frequency factors, GGUF's
`rope_freqs` tensor, which ggml's rope divides the frequencies by) and by the linear scale (GGUF's
`rope.scaling.factor`, which ggml multiplies the positions by the inverse of; HF transformers' "linear" rope type
divides the frequencies by it). YaRN is per-frequency factors too (a ramp between interpolated and kept
frequencies), and an attention factor that multiplies cos and sin. The native decoder reads the same tables.
"""

import math
from collections.abc import Sequence

import torch
from torch import nn

RopeTables = tuple[torch.Tensor, torch.Tensor]  # cos_full, sin_signed: [T, 1, rotary_dim]


def inverse_frequencies(
    rotary_dim: int, base: float, scale: float = 1.0, freq_factors: Sequence[float] | None = None
) -> torch.Tensor:
    """float32 [rotary_dim / 2]: base^(-2i / rotary_dim), each divided by its factor, then by `scale` (radians per
    position), computed as HF transformers computes them."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    if freq_factors is not None:
        if len(freq_factors) != rotary_dim // 2:
            raise ValueError(f"{len(freq_factors)} rope frequency factors for {rotary_dim // 2} frequencies")
        inv_freq = inv_freq / torch.tensor(freq_factors, dtype=torch.float32)
    if scale != 1.0:
        inv_freq = inv_freq / scale
    return inv_freq


def llama3_frequency_factors(
    rotary_dim: int,
    base: float,
    factor: float,
    low_freq_factor: float,
    high_freq_factor: float,
    original_context: int,
) -> tuple[float, ...]:
    """Llama 3.1's rope scaling as one divisor per frequency [rotary_dim / 2], the way llama.cpp's converter writes
    it into GGUF's rope_freqs tensor: wavelengths shorter than original_context / high_freq_factor keep their
    frequency (1), those longer than original_context / low_freq_factor are divided by `factor`, and those between
    are interpolated (the same frequencies as transformers' `_compute_llama3_parameters`)."""
    low_freq_wavelen = original_context / low_freq_factor  # in positions
    high_freq_wavelen = original_context / high_freq_factor
    factors = []
    for freq in inverse_frequencies(rotary_dim, base).tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            factors.append(1.0)
        elif wavelen > low_freq_wavelen:
            factors.append(float(factor))
        else:
            smooth = (original_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            factors.append(1.0 / ((1 - smooth) / factor + smooth))
    return tuple(factors)


class RotaryEmbedding(nn.Module):
    def __init__(
        self,
        head_dim: int,
        rotary_dim: int,
        max_position: int,
        base: float,
        scale: float = 1.0,
        freq_factors: Sequence[float] | None = None,
        attention_factor: float = 1.0,
    ):
        """`scale`: linear rope scaling (frequencies divided by it); `freq_factors`: a divisor per frequency;
        `attention_factor`: cos and sin multiplied by it (YaRN's)."""
        super().__init__()
        if rotary_dim > head_dim or rotary_dim % 2:
            raise ValueError(f"rotary dimension {rotary_dim} must be even and at most the head size {head_dim}")
        self.rotary_dim = rotary_dim
        self.half = rotary_dim // 2
        inv_freq = inverse_frequencies(rotary_dim, base, scale, freq_factors)  # [rot/2] radians per position
        angles = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)  # [max_pos, rot/2]
        cos, sin = angles.cos(), angles.sin()
        if attention_factor != 1.0:
            cos, sin = cos * attention_factor, sin * attention_factor
        self.register_buffer("cos_full", torch.cat([cos, cos], dim=-1), persistent=False)  # [max_pos, rot]
        self.register_buffer("sin_signed", torch.cat([-sin, sin], dim=-1), persistent=False)

    def keep_positions(self, count: int) -> None:
        """Keep the tables' first `count` positions only: they are built for the model's whole trained context
        (40,960 positions, 40 MiB for Qwen3-30B-A3B) before the engine knows its max_model_len."""
        if count < self.cos_full.shape[0]:
            self.cos_full = self.cos_full[:count].clone()
            self.sin_signed = self.sin_signed[:count].clone()

    def tables(self, positions: torch.Tensor) -> RopeTables:
        """positions [T] -> the step's tables, [T, 1, rot] each."""
        return self.cos_full[positions].unsqueeze(1), self.sin_signed[positions].unsqueeze(1)

    def forward(self, tables: RopeTables, x: torch.Tensor) -> torch.Tensor:
        """x [T, heads, D] (Q and K heads together) -> rotated copy."""
        cos, sin = tables
        if self.rotary_dim == x.shape[-1]:  # (in place on x * cos: one fewer [T, heads, D] temporary)
            return (x * cos.to(x.dtype)).addcmul_(x.roll(self.half, dims=-1), sin.to(x.dtype))
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        rotated = torch.addcmul(rot * cos.to(x.dtype), rot.roll(self.half, dims=-1), sin.to(x.dtype))
        return torch.cat([rotated, rest], dim=-1)
