"""How each weight of a model is built from its file, chosen before anything is read (gpt-fast's way: the
kernel of every linear is decided, then its bytes are read once, one tensor at a time).

- `quantization=None` (`none`): every weight dequantized to the compute dtype (exact float32 results).
- the quantized modes: each projection and the LM head go straight from the file's blocks to the native products'
  layout (layers/quantized_linear.py's NativeLinear, tokenmill/native), with no float copy of them at any point:
  `auto` keeps every tensor in its own type (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, MXFP4: no re-coding),
  `int4` keeps the 4-bit ones (Q4_0, Q4_1, Q4_K, MXFP4) and makes the finer ones 4-bit (Q4_1), `int8` uses torch's
  int8 kernel (from a float copy of one tensor at a time). A float tensor (a Hugging Face checkpoint, an F16 GGUF)
  becomes Q4_1 blocks as it is read (the LM head Q8_0), one tensor at a time. The embedding table is looked up from
  its blocks (only the rows asked for are dequantized), from the tied head's own blocks where they are the file's.

Once a tensor is built, its pages of the memory-mapped file are handed back (`release`), so the process holds the
model once: resident memory while loading stays near the size of the weights as built."""

from collections.abc import Callable

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from torch import nn

from tokenmill import native
from tokenmill.layers.linear import Linear
from tokenmill.layers.quantized_linear import (
    ACTIVATION_PASSES,
    NATIVE_TYPES,
    BFloat16Head,
    BlockEmbedding,
    Int4Linear,
    Int8Linear,
    NativeLinear,
    gguf_rows_from_float,
)
from tokenmill.loader.dequantize import dequantize
from tokenmill.loader.experts import expert_tensor
from tokenmill.loader.gguf_file import GGUFTensor
from tokenmill.loader.weight_cache import IN_MEMORY, InMemoryWeights

FOUR_BIT_TYPES = frozenset(GGMLQuantizationType[name] for name in ("Q4_0", "Q4_1", "Q4_K", "MXFP4"))  # int4 keeps these
QUANTIZED_MODES = ("auto", "int4", "int8")
# raw rows uint8 [rows, bytes per row] (a view of the file, or LazyRows) and their type
NativePart = tuple["np.ndarray | LazyRows", GGMLQuantizationType]

# (tensor name, its number of rope heads when its rows are stored permuted for ggml's rope, else None)
TensorSource = tuple[str, int | None]


def unpermute_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's conversion permutation of Q/K projection rows.

    llama.cpp reorders each head's rows from [first half | second half] (HF, "neox" rope) to interleaved pairs
    (ggml's rope): GGUF row h*D + 2j + s holds HF row h*D + s*D/2 + j. Works on any [rows, ...] tensor, including
    raw quantized rows, since it only moves whole rows.
    """
    rows = weight.shape[0]
    head_dim = rows // num_heads
    return weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


class LazyRows:
    """Raw rows uint8 [rows, bytes per row] made only when read (np.asarray): a copy or a conversion that a weight
    cache's hit never needs (loader/weight_cache.py)."""

    def __init__(self, shape: tuple[int, int], make: Callable[[], np.ndarray]):
        self.shape, self.ndim, self.make = shape, 2, make

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        rows = self.make()
        assert rows.shape == self.shape, f"rows made {rows.shape}, announced {self.shape}"
        return rows if dtype is None else rows.astype(dtype)


def _joined(parts: list[NativePart]) -> list[NativePart]:
    """Neighbouring parts of one type as one (the native products take a few parts; fewer run faster)."""
    joined: list[NativePart] = []
    for rows, ggml_type in parts:
        if joined and joined[-1][1] == ggml_type:
            both = (joined[-1][0], rows)
            shape = (both[0].shape[0] + rows.shape[0], rows.shape[1])
            joined[-1] = (LazyRows(shape, lambda both=both: np.concatenate([np.asarray(r) for r in both])), ggml_type)
        else:
            joined.append((rows, ggml_type))
    return joined


class WeightLoader:
    """Builds a model's modules from `source` (a GGUF file, a checkpoint, or one rank's shard of either) for
    quantization `mode` (None, or one of QUANTIZED_MODES), in `dtype`."""

    def __init__(self, source, mode: str | None, dtype: torch.dtype, store: InMemoryWeights = IN_MEMORY):
        """`store`: where the native kernels' buffers come from (loader/weight_cache.py)."""
        if mode is not None and mode not in QUANTIZED_MODES:
            raise ValueError(f"unknown quantization mode {mode!r}")
        self.source = source
        self.mode = mode
        self.dtype = dtype
        self.store = store

    # ---- reading -------------------------------------------------------------------------------------------------

    def _tensor(self, name: str) -> GGUFTensor:
        return self.source.tensor(name)

    def _release(self, tensor: GGUFTensor) -> None:
        """The file's pages under `tensor` are not needed any more (the built module holds its own copy)."""
        release = getattr(self.source, "release", None)
        if release is not None:
            release(tensor)

    def float_tensor(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A tensor dequantized, in `dtype` (default: the compute dtype): norms, biases, dense weights."""
        t = self._tensor(name)
        value = self._float_of(t, dtype)
        self._release(t)
        return value

    def _float_of(self, t: GGUFTensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        return dequantize(t.data, t.ggml_type, t.shape).to(dtype or self.dtype)

    def _raw(self, t: GGUFTensor, heads: int | None) -> "np.ndarray | LazyRows":
        """A tensor's raw rows as stored (uint8 [rows, bytes per row]: a view of the file, or with rope rows put back
        in HF's order a copy made when read)."""
        rows = np.asarray(t.data).reshape(t.shape[0], -1).view(np.uint8)
        if heads:
            return LazyRows(rows.shape, lambda: unpermute_rope_rows(torch.from_numpy(rows.copy()), heads).numpy())
        return rows

    def float_rows(self, name: str, heads: int | None) -> torch.Tensor:
        """A tensor dequantized, rope rows put back in HF's order."""
        t = self._tensor(name)
        rows = self._float_rows_of(t, heads)
        self._release(t)
        return rows

    def _float_rows_of(self, t: GGUFTensor, heads: int | None) -> torch.Tensor:
        rows = self._float_of(t)
        return unpermute_rope_rows(rows, heads) if heads else rows

    # ---- modules -------------------------------------------------------------------------------------------------

    def linear(self, sources: list[TensorSource]) -> nn.Module:
        """One projection made of `sources` stacked by rows (a fused Q/K/V or gate/up), in the kernel its mode and
        the file's types call for."""
        tensors = [self._tensor(name) for name, _ in sources]
        layer = self._linear_of([(t, heads) for t, (_, heads) in zip(tensors, sources, strict=True)])
        for t in tensors:  # built (dequantized or repacked): the file's copy is not needed any more
            self._release(t)
        return layer

    def experts(self, names: list[str]) -> list[nn.Module]:
        """The experts of a mixture: for each, one projection of its parts of the 3-D tensors `names` stacked by
        rows (gate + up; down), built as `linear` builds a projection (its own kernel over its own blocks)."""
        tensors = [self._tensor(name) for name in names]
        count = tensors[0].shape[0]
        layers = [self._linear_of([(expert_tensor(t, e), None) for t in tensors]) for e in range(count)]
        for t in tensors:
            self._release(t)
        return layers

    def _linear_of(self, sources: list[tuple[GGUFTensor, int | None]]) -> nn.Module:
        float_weight = lambda: self._stacked([self._float_rows_of(t, heads) for t, heads in sources])  # noqa: E731
        if self.mode is None:
            return Linear.of(float_weight())
        lib = native.load()
        if self.mode == "int8" or lib is None:  # torch's kernels, from float: one projection at a time
            return Int8Linear(float_weight()) if self.mode == "int8" else Int4Linear(float_weight())
        parts = [self._native_part(t, heads, self.mode) for t, heads in sources]
        return NativeLinear(_joined(parts), sources[0][0].shape[-1], ACTIVATION_PASSES, lib, self.store)

    def _native_part(self, t: GGUFTensor, heads: int | None, mode: str) -> NativePart:
        """One source tensor as raw rows of a type the native products read: the file's own blocks where the mode
        keeps them (auto: every native type; int4: the 4-bit ones), else the float values made into Q4_1 rows
        (auto: float tensors; int4: anything finer)."""
        keep = NATIVE_TYPES if mode == "auto" else FOUR_BIT_TYPES
        if t.ggml_type in keep:
            return self._raw(t, heads), t.ggml_type
        q4_1 = GGMLQuantizationType.Q4_1
        shape = (t.shape[0], t.shape[-1] // GGML_QUANT_SIZES[q4_1][0] * GGML_QUANT_SIZES[q4_1][1])
        return LazyRows(shape, lambda: gguf_rows_from_float(self._float_rows_of(t, heads), q4_1).numpy()), q4_1

    def _stacked(self, parts: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def head(self, name: str) -> nn.Module:
        """The LM head: dense in float mode, else the file's blocks through the native products (a float or
        unsupported head made into Q8_0), with two activation passes: its logits decide every sampled token."""
        if self.mode is None:
            return Linear.of(self.float_tensor(name))
        lib = native.load()
        tensor = self._tensor(name)
        if lib is None:
            return BFloat16Head(self.float_tensor(name))
        if tensor.ggml_type in NATIVE_TYPES:
            part = self._native_part(tensor, None, "auto")
        else:
            q8_0 = GGMLQuantizationType.Q8_0
            shape = (tensor.shape[0], tensor.shape[-1] // GGML_QUANT_SIZES[q8_0][0] * GGML_QUANT_SIZES[q8_0][1])
            part = (LazyRows(shape, lambda: gguf_rows_from_float(self._float_of(tensor), q8_0).numpy()), q8_0)
        head = NativeLinear([part], tensor.shape[-1], 2, lib, self.store)
        self._release(tensor)
        return head

    def embedding(self, name: str, head: nn.Module | None) -> Callable[[torch.Tensor], torch.Tensor] | torch.Tensor:
        """The token embedding: in float mode the whole table (a tensor, which a tied dense head shares); in the
        quantized modes a lookup [T] ids -> float32 [T, hidden] that dequantizes only the rows asked for: from a
        tied head's own blocks when they are the table's as the file has them, else from the file's blocks."""
        if self.mode is None:
            return self.float_tensor(name)
        tensor = self._tensor(name)
        if isinstance(head, NativeLinear) and head.part_types == [tensor.ggml_type]:  # the file's own blocks
            return head.rows
        return BlockEmbedding.of(tensor)
