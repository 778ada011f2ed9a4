"""RMSNorm, computed in float32 the way HF transformers computes it (torch's fused rms_norm gives the same
float32 results as HF's pow/mean/rsqrt sequence, in one call)."""

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps
        self.shape = (hidden_size,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.shape, self.weight, self.eps)
        normed = F.rms_norm(x.float(), self.shape, None, self.eps).to(x.dtype)
        return self.weight * normed
