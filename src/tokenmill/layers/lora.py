"""LoRA's low-rank products for a batch whose rows use different adapters, or none (S-LoRA's and Punica's batching):
the base projection runs once over every row, quantized or not, then each adapter present adds
x[rows] @ A^T @ B^T * scale to its own rows only (rows gathered by adapter, the sums scattered back).

    x [T, in] --base--> out [T, out]           (every row, the layer's own kernel)
    rows of adapter k: out[rows_k] += (x[rows_k] @ A_k^T) @ (B_k * scale)^T      ([n_k, R_k], then [n_k, out])

A fused projection (Q/K/V, gate/up) stacks its parts' A ([R, in], R the parts' ranks together) and holds their B
as one block-diagonal matrix (zeros outside each part's block: q's B meets q's rank rows only), so an adapter
costs three operations a projection however many parts it changes: gather, the two products, scatter. (A B per
part, scattered into column slices of `out`, took index_add_'s slow path for strided tensors: 3x the whole step.)
Adapter weights stay in float32 or bfloat16 beside the base's quantized blocks.

Batch invariance: on the CPU, float32 adapters' products are native/lowrank.c's, whose rows' bits do not depend on
the other rows of the call (torch's float32 GEMM picks its kernel and its threads' split of a sum by the row count:
an adapter row's log-probabilities moved by up to 0.01 between a batch and alone, benchmarks/lora_invariance.py).
Gathering and the scatter's adds are exact, so a row gets the same bits in any batch, as the base's native products
give it. Elsewhere (bfloat16, a GPU) torch's matmul.
"""

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from tokenmill import native

COLUMN_BLOCK = 64  # native/lowrank.c's block of output columns


@dataclass
class LoRAProjection:
    """One adapter on one fused projection. B is held transposed in blocks of COLUMN_BLOCK output columns, each
    block's ranks contiguous (what lowrank.c reads in its inner loop: with B^T's rows 24 KiB apart it ran at half
    the speed)."""

    a: torch.Tensor  # [R, in]: the A of every part, stacked (R = the parts' ranks together)
    # [ceil(out / 64), R, 64]: the parts' B, block-diagonal, the scale folded in, transposed and cut into blocks of
    # 64 columns (zeros past out)
    b_blocks: torch.Tensor
    out_features: int

    @classmethod
    def of(cls, a: torch.Tensor, b: torch.Tensor) -> "LoRAProjection":
        """a [R, in], b [out, R] (the scale folded in): their layout here."""
        out_features, rank = b.shape
        blocks = -(-out_features // COLUMN_BLOCK)
        padded = F.pad(b.T, (0, blocks * COLUMN_BLOCK - out_features))  # [R, blocks * 64]
        return cls(
            a.contiguous(), padded.reshape(rank, blocks, COLUMN_BLOCK).transpose(0, 1).contiguous(), out_features
        )

    def add_to(self, out: torch.Tensor, x: torch.Tensor, rows: "torch.Tensor | slice") -> None:
        """out [T, out] (contiguous) += this adapter's product of x [T, in] at `rows`: a run of rows (a view, no
        copy) or an index (gathered, then scattered back)."""
        xs = x[rows] if isinstance(rows, slice) else x.index_select(0, rows)  # [n, in]
        delta = self.product(xs).to(out.dtype)  # [n, out]
        if isinstance(rows, slice):
            out[rows] += delta
        else:
            out.index_add_(0, rows, delta)

    def product(self, xs: torch.Tensor) -> torch.Tensor:
        """xs [n, in] -> (xs @ A^T) @ B^T [n, out], in the adapter's dtype; each row's bits its own on the CPU
        (float32 adapters: native/lowrank.c)."""
        lib = native.load() if xs.device.type == "cpu" and self.a.dtype == torch.float32 else None
        n, in_features = xs.shape
        if lib is None:
            t = xs.to(self.a.dtype) @ self.a.T  # [n, R]
            return torch.einsum("nr,brc->nbc", t, self.b_blocks).reshape(n, -1)[:, : self.out_features]
        x32 = xs.float().contiguous()  # [n, in]
        rank = self.a.shape[0]
        y = torch.empty(n, self.out_features)  # [n, out] float32
        rc = lib.tm_lowrank_rows(
            x32.data_ptr(), n, in_features, self.a.data_ptr(), rank, self.b_blocks.data_ptr(), self.out_features,
            y.data_ptr()
        )  # fmt: skip
        if rc == -2:
            raise MemoryError("LoRA product: out of memory")
        if rc != 0:
            raise ValueError(f"LoRA product failed ({rc}): x {tuple(xs.shape)}, A {tuple(self.a.shape)}")
        return y


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
