"""The 8-bit KV cache's rows: each head's K (or V) as int8 values with one float32 scale per token and head.

A cache of dtype torch.int8 holds [slots, kv_heads, head_dim + 4]: a head's head_dim values, symmetric
(round(x / scale), scale = max |x| / 127), then the 4 bytes of its float32 scale. Keeping the scale in the row makes
a slot self-contained, so whatever moves slots (block copies, gathers, tensor parallelism's heads per rank) moves the
scales with them. A quarter of float32's bytes and half of 16-bit ones at head size 64 and up (68 against 128 bytes a
head at 64). The native decoder (native/kv_elements.h) writes and reads the same layout with the same arithmetic: a
token's row has the same bits whichever path wrote it.
"""

import torch

SCALE_BYTES = 4  # a float32 after each head's int8 values
_ONE_127TH = torch.tensor(1.0 / 127.0, dtype=torch.float32)  # C's (1.0f / 127.0f)


def head_width(head_dim: int, dtype: torch.dtype) -> int:
    """The cache's last dimension for heads of head_dim values stored as dtype."""
    return head_dim + SCALE_BYTES if dtype == torch.int8 else head_dim


def encode(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] (any float type) -> int8 [..., D + 4]: the values times 1 / scale, scale = max |x| * (1 / 127),
    rounded to nearest even, and that scale's bytes (0 for a row of zeros, whose values are 0). Products and one
    reciprocal, in float32, as the native decoder computes them (kv_elements.h)."""
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True) * _ONE_127TH  # [..., 1] float32
    inverse = 1.0 / torch.where(scale > 0, scale, torch.ones_like(scale))
    values = torch.round(x * inverse).clamp_(-127, 127).to(torch.int8)
    return torch.cat([values, scale.view(torch.int8)], dim=-1)


def decode(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 [..., D + 4] rows -> [..., D] of dtype: each value times its row's scale (in float32)."""
    scale = rows[..., -SCALE_BYTES:].contiguous().view(torch.float32)  # [..., 1]
    return (rows[..., :-SCALE_BYTES].float() * scale).to(dtype)
