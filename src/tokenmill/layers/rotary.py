"""Rotary position embedding, "neox" layout: the two halves of each head are rotated against each other.

GGUF llama files store Q/K rows permuted for ggml's interleaved rope; the loader undoes that permutation
(model/llama.py), so every architecture goes through this one implementation.

Per step the tables are looked up once for all layers: cos_full = [cos | cos] and sin_signed = [-sin | sin],
so that rotating x = [x1 | x2] is x * cos_full + roll(x, half) * sin_signed = [x1 cos - x2 sin | x2 cos + x1 sin]:
three tensor ops per layer, for Q and K together.
"""

import torch
from torch import nn

RopeTables = tuple[torch.Tensor, torch.Tensor]  # cos_full, sin_signed: [T, 1, rotary_dim]


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, rotary_dim: int, max_position: int, base: float):
        super().__init__()
        if rotary_dim > head_dim or rotary_dim % 2:
            raise ValueError(f"rotary dimension {rotary_dim} must be even and at most the head size {head_dim}")
        self.rotary_dim = rotary_dim
        self.half = rotary_dim // 2
        inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
        angles = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)  # [max_pos, rot/2]
        cos, sin = angles.cos(), angles.sin()
        self.register_buffer("cos_full", torch.cat([cos, cos], dim=-1), persistent=False)  # [max_pos, rot]
        self.register_buffer("sin_signed", torch.cat([-sin, sin], dim=-1), persistent=False)

    def tables(self, positions: torch.Tensor) -> RopeTables:
        """positions [T] -> the step's tables, [T, 1, rot] each."""
        return self.cos_full[positions].unsqueeze(1), self.sin_signed[positions].unsqueeze(1)

    def forward(self, tables: RopeTables, x: torch.Tensor) -> torch.Tensor:
        """x [T, heads, D] (Q and K heads together) -> rotated copy."""
        cos, sin = tables
        if self.rotary_dim == x.shape[-1]:
            return torch.addcmul(x * cos.to(x.dtype), x.roll(self.half, dims=-1), sin.to(x.dtype))
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        rotated = torch.addcmul(rot * cos.to(x.dtype), rot.roll(self.half, dims=-1), sin.to(x.dtype))
        return torch.cat([rotated, rest], dim=-1)
