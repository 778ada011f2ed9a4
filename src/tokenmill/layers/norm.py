"""RMSNorm, computed in float32 the way HF transformers computes it (torch's fused rms_norm gives the same
float32 results as HF's pow/mean/rsqrt sequence, in one call)."""

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, scale_in_float32: bool = False):
        """`scale_in_float32`: in a lower-precision model, multiply by the weight before rounding (Gemma), not
        after (llama); the same in float32."""
        super().__init__()
        self.scale_in_float32 = scale_in_float32
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps
        self.shape = (hidden_size,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.shape, self.weight, self.eps)
        if self.scale_in_float32:
            return F.rms_norm(x.float(), self.shape, self.weight, self.eps).to(x.dtype)
        normed = F.rms_norm(x.float(), self.shape, None, self.eps).to(x.dtype)
        return (self.weight * normed).to(x.dtype)  # the float32 weight: bfloat16's product, exactly
