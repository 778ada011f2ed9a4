"""LoRA's low-rank products for a batch whose rows use different adapters, or none (S-LoRA's and Punica's batching):
the base projection runs once over every row, quantized or not, then each adapter present adds
x[rows] @ A^T @ B^T * scale to its own rows only (rows gathered by adapter, the sums scattered back).

    x [T, in] --base--> out [T, out]           (every row, the layer's own kernel)
    rows of adapter k: out[rows_k] += (x[rows_k] @ A_k^T) @ (B_k * scale)^T      ([n_k, R_k], then [n_k, out])

A fused projection (Q/K/V, gate/up) stacks its parts' A ([R, in], R the parts' ranks together) and holds their B
as one block-diagonal [out, R] (zeros outside each part's block: q's B meets q's rank rows only), so an adapter
costs four operations a projection however many parts it changes: gather, two products, scatter. (A B per part,
scattered into column slices of `out`, took index_add_'s slow path for strided tensors: 3x the whole step.)
Adapter weights stay in float32 or bfloat16 beside the base's quantized blocks. A row's products are computed from
that row alone (gathered rows, one small product each), as the base's are.
"""

from dataclasses import dataclass
from typing import NamedTuple

import torch


@dataclass
class LoRAProjection:
    """One adapter on one fused projection."""

    a: torch.Tensor  # [R, in]: the A of every part, stacked (R = the parts' ranks together)
    b: torch.Tensor  # [out, R]: the parts' B, block-diagonal, the scale folded in

    def add_to(self, out: torch.Tensor, x: torch.Tensor, rows: "torch.Tensor | slice") -> None:
        """out [T, out] (contiguous) += this adapter's product of x [T, in] at `rows`: a run of rows (a view, no
        copy) or an index (gathered, then scattered back)."""
        xs = x[rows] if isinstance(rows, slice) else x.index_select(0, rows)  # [n, in]
        delta = ((xs.to(self.a.dtype) @ self.a.T) @ self.b.T).to(out.dtype)  # [n, R] -> [n, out]
        if isinstance(rows, slice):
            out[rows] += delta
        else:
            out.index_add_(0, rows, delta)


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
    # the same as a slice where they are one run (a decode step's sequence, a prompt chunk: no gather, no scatter),
    # else as an int64 tensor on the model's device
    index: torch.Tensor | slice


class LoRABatch(NamedTuple):
    """Which rows of a step's flat [T] layout use which adapter; rows using none are left out. Made once a step
    (`of`): every layer's projections reuse its row indices."""

    groups: list[LoRAGroup]
    device: torch.device
    num_rows: int

    @classmethod
    def of(cls, rows: list[tuple[AdapterWeights, list[int]]], device: torch.device, num_rows: int) -> "LoRABatch":
        groups = [LoRAGroup(a, r, _index(r, device)) for a, r in rows if r]
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


def _index(rows: list[int], device: torch.device) -> torch.Tensor | slice:
    if rows[-1] - rows[0] == len(rows) - 1:  # ascending and distinct: one run
        return slice(rows[0], rows[-1] + 1)
    return torch.tensor(rows, dtype=torch.int64, device=device)
