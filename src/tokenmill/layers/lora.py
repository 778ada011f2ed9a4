"""LoRA's low-rank products for a batch whose rows use different adapters, or none (S-LoRA's and Punica's batching):
the base projection runs once over every row, quantized or not, then each adapter present adds
x[rows] @ A^T @ B^T * scale to its own rows only (rows gathered by adapter, the sums scattered back).

    x [T, in] --base--> out [T, out]           (every row, the layer's own kernel)
    rows of adapter k: x[rows_k] @ A_k^T -> h [n_k, R_k]
                       per part: out[rows_k, o0:o1] += h[:, r0:r1] @ (B * scale)^T

A fused projection (Q/K/V, gate/up) takes one product with the stacked A of its parts, then one B per part.
Adapter weights stay in float32 or bfloat16 beside the base's quantized blocks. A row's products are computed from
that row alone (gathered rows, one small product each), as the base's are.
"""

from dataclasses import dataclass, field
from typing import NamedTuple

import torch


@dataclass
class LoRAProjection:
    """One adapter on one fused projection."""

    a: torch.Tensor  # [R, in]: the A of every part, stacked (R = the parts' ranks together)
    # (first output column, last + 1, first row of `a`, last + 1, B with the scale folded in [o1 - o0, r1 - r0])
    parts: list[tuple[int, int, int, int, torch.Tensor]] = field(default_factory=list)

    def add_to(self, out: torch.Tensor, x: torch.Tensor, rows: torch.Tensor | None) -> None:
        """out [T, out] += this adapter's product of x [T, in], at `rows` only (None: every row)."""
        xs = x if rows is None else x.index_select(0, rows)  # [n, in]
        h = xs.to(self.a.dtype) @ self.a.T  # [n, R]
        for o0, o1, r0, r1, b in self.parts:
            delta = (h[:, r0:r1] @ b.T).to(out.dtype)  # [n, o1 - o0]
            if rows is None:
                out[:, o0:o1] += delta
            else:
                out[:, o0:o1].index_add_(0, rows, delta)


@dataclass
class AdapterWeights:
    """An adapter as one model (or one tensor-parallel rank's shard of it) applies it: (layer, projection
    attribute: "qkv_proj", "o_proj", "gate_up_proj", "down_proj") -> its products there."""

    projections: dict[tuple[int, str], LoRAProjection]
    rank: int
    nbytes: int


class LoRAGroup(NamedTuple):
    adapter: AdapterWeights
    rows: list[int]  # its rows in the step's flat layout, ascending
    index: torch.Tensor | None  # the same as an int64 tensor on the model's device; None: every row of the step


class LoRABatch(NamedTuple):
    """Which rows of a step's flat [T] layout use which adapter; rows using none are left out. Made once a step
    (`of`): every layer's projections reuse its row indices."""

    groups: list[LoRAGroup]
    device: torch.device
    num_rows: int

    @classmethod
    def of(cls, rows: list[tuple[AdapterWeights, list[int]]], device: torch.device, num_rows: int) -> "LoRABatch":
        groups = [
            LoRAGroup(a, r, None if len(r) == num_rows else torch.tensor(r, dtype=torch.int64, device=device))
            for a, r in rows
            if r
        ]
        return cls(groups, device, num_rows)

    def apply(self, out: torch.Tensor, x: torch.Tensor, layer: int, projection: str) -> torch.Tensor:
        """out [T, out] (the base projection of x [T, in]) plus each row's adapter product; returns out."""
        for group in self.groups:
            lora = group.adapter.projections.get((layer, projection))
            if lora is not None:
                lora.add_to(out, x, group.index)
        return out

    def piece(self, start: int, stop: int) -> "LoRABatch":
        """The batch of rows [start, stop) alone, numbered from 0 (an MLP computed in pieces of rows)."""
        rows = [(g.adapter, [r - start for r in g.rows if start <= r < stop]) for g in self.groups]
        return LoRABatch.of(rows, self.device, stop - start)
