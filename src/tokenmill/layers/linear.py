"""Linear layers. Weights are [out_features, in_features] like torch.nn.Linear."""

import torch
import torch.nn.functional as F
from torch import nn

ROW_QUANTUM = 16


def padded_rows(rows: int) -> int:
    """The row count a reduced-precision CPU product runs with: one row as is (a matrix-vector product), more
    rows up to a multiple of 16.

    oneDNN compiles a GEMM for every row count it meets and keeps it for good (about 300 KiB each): steps with
    prompt tokens have a new row count almost every time; four weight shapes at random row counts up to 512 kept
    610 MiB that way.
    33 row counts per weight up to 512 rows keep that to about 45 MiB (benchmarks/README.md, "Reliability"); a
    few rows cost about what 16 do (the product reads every weight either way)."""
    return rows if rows == 1 else -(-rows // ROW_QUANTUM) * ROW_QUANTUM


def dense_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear over [rows, in] x; a bfloat16/float16 product on the CPU runs with padded_rows(rows) rows (the
    padding is zeros, and its rows are dropped)."""
    rows = x.shape[0]
    padded = padded_rows(rows)
    if weight.dtype == torch.float32 or weight.device.type != "cpu" or padded == rows:
        return F.linear(x, weight)
    return F.linear(F.pad(x, (0, 0, 0, padded - rows)), weight)[:rows]


class Linear(nn.Module):
    """A dense linear layer without bias over weights already in the compute dtype."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype = torch.float32, device=None):
        """`device="meta"`: a placeholder of the right shape, with no memory, until the loader builds the layer."""
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=dtype, device=device), requires_grad=False
        )

    @classmethod
    def of(cls, weight: torch.Tensor) -> "Linear":
        """A layer that adopts `weight` [out, in] (no copy)."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.out_features, layer.in_features = weight.shape
        layer.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dense_linear(x, self.weight)
