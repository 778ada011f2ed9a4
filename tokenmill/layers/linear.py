"""Linear layers. Weights are [out_features, in_features] like torch.nn.Linear."""

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    """A dense linear layer without bias over weights already in the compute dtype."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)
