"""Rotary position embedding, "neox" layout: the two halves of each head are rotated against each other.

GGUF llama files store Q/K rows permuted for ggml's interleaved rope; the loader undoes that permutation
(loader/llama_weights.py), so every architecture goes through this one implementation.
"""

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, rotary_dim: int, max_position: int, base: float):
        super().__init__()
        if rotary_dim > head_dim or rotary_dim % 2:
            raise ValueError(f"rotary dimension {rotary_dim} must be even and at most the head size {head_dim}")
        self.rotary_dim = rotary_dim
        inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
        angles = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)  # [max_pos, rot/2]
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, 1, rot/2]; computed once per step and shared by every layer."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    def forward(
        self, cos_sin: tuple[torch.Tensor, torch.Tensor], q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, H, D], k [T, KVH, D] -> rotated q, k (same shapes and dtype)."""
        cos, sin = cos_sin
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        x1, x2 = rot.float().chunk(2, dim=-1)
        rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
        return rotated if rest.shape[-1] == 0 else torch.cat([rotated, rest], dim=-1)
