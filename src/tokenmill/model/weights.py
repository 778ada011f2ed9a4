"""How each weight of a model is built from its file, chosen before anything is read (gpt-fast's way: the
kernel of every linear is decided, then its bytes are read once, one tensor at a time).

- `quantization=None` (`none`): every weight dequantized to the compute dtype (exact float32 results).
- the quantized modes: each projection and the LM head go straight from the file's blocks to the native kernels'
  layout (tokenmill/native), with no float copy of them at any point: `auto` keeps every tensor in its own type
  where a native kernel reads it (4-bit blocks as 4-bit, Q8_0 as 8-bit; the other types of finer precision as 8-bit
  blocks for now), `int4` makes every projection 4-bit, `int8` uses torch's int8 kernel (from a float copy of one
  tensor at a time). A float tensor (a Hugging Face checkpoint, an F16 GGUF) is quantized as it is read, one at a
  time. The embedding table is looked up from its blocks (only the rows asked for are dequantized), from the
  tied head's own codes where it can be.

Once a tensor is built, its pages of the memory-mapped file are handed back (`release`), so the process holds the
model once: resident memory while loading stays near the size of the weights as built."""

from collections.abc import Callable

import numpy as np
import torch
from gguf import GGMLQuantizationType
from torch import nn

from tokenmill.layers.linear import Linear
from tokenmill.layers.quantized_linear import (
    BlockEmbedding,
    Q8Linear,
    q4_blocks_from_gguf,
    q8_blocks_from_gguf,
    quantized_head,
    quantized_linear,
)
from tokenmill.loader.dequantize import dequantize
from tokenmill.loader.gguf_file import GGUFTensor

# file types whose weights `auto` keeps in 8 bits for the native decoder (4 bits would lose what they hold)
FINER_THAN_4_BITS = frozenset(GGMLQuantizationType[name] for name in ("Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0"))
FLOAT_TYPES = frozenset(GGMLQuantizationType[name] for name in ("F32", "F16", "BF16"))
QUANTIZED_MODES = ("auto", "int4", "int8")

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


class WeightLoader:
    """Builds a model's modules from `source` (a GGUF file, a checkpoint, or one rank's shard of either) for
    quantization `mode` (None, or one of QUANTIZED_MODES), in `dtype`."""

    def __init__(self, source, mode: str | None, dtype: torch.dtype):
        if mode is not None and mode not in QUANTIZED_MODES:
            raise ValueError(f"unknown quantization mode {mode!r}")
        self.source = source
        self.mode = mode
        self.dtype = dtype

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
        value = dequantize(t.data, t.ggml_type, t.shape).to(dtype or self.dtype)
        self._release(t)
        return value

    def _raw(self, name: str, heads: int | None) -> tuple[torch.Tensor, GGUFTensor]:
        """A tensor's raw rows as stored (uint8 [rows, bytes per row], a copy), rope rows put back in HF's order."""
        t = self._tensor(name)
        data = np.asarray(t.data).reshape(t.shape[0], -1).view(np.uint8)
        rows = torch.from_numpy(np.array(data, copy=True))
        return (unpermute_rope_rows(rows, heads) if heads else rows), t

    def float_rows(self, name: str, heads: int | None) -> torch.Tensor:
        """A tensor dequantized, rope rows put back in HF's order."""
        rows = self.float_tensor(name)
        return unpermute_rope_rows(rows, heads) if heads else rows

    # ---- modules -------------------------------------------------------------------------------------------------

    def linear(self, sources: list[TensorSource]) -> nn.Module:
        """One projection made of `sources` stacked by rows (a fused Q/K/V or gate/up), in the kernel its mode and
        the file's types call for."""
        types = {self._tensor(name).ggml_type for name, _ in sources}
        float_weight = lambda: self._stacked(self.float_rows, sources)  # noqa: E731 - read only where needed
        if self.mode is None:
            return Linear.of(float_weight())
        if self.mode == "int8" or types <= FLOAT_TYPES:  # from float, one projection at a time
            return quantized_linear(float_weight(), self.mode)
        eight_bit = self.mode == "auto" and bool(types & FINER_THAN_4_BITS)
        if len(types) > 1:  # raw rows of mixed types do not stack: made from their float values
            return quantized_linear(float_weight(), self.mode, None, eight_bit)
        (ggml_type,) = types
        raws = [self._raw(name, heads) for name, heads in sources]
        stacked = torch.cat([rows for rows, _ in raws]) if len(raws) > 1 else raws[0][0]
        for _, tensor in raws:
            self._release(tensor)
        if eight_bit:
            blocks8 = q8_blocks_from_gguf(stacked, ggml_type)
            return quantized_linear(None if blocks8 else float_weight(), self.mode, None, blocks8 or True)
        blocks4 = q4_blocks_from_gguf(stacked, ggml_type)
        return quantized_linear(None if blocks4 else float_weight(), self.mode, blocks4)

    def _stacked(self, read: Callable[[str, int | None], torch.Tensor], sources: list[TensorSource]) -> torch.Tensor:
        parts = [read(name, heads) for name, heads in sources]
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def head(self, name: str) -> nn.Module:
        """The LM head: dense in float mode, else from the file's Q8_0 blocks (or 8 bits made from it)."""
        if self.mode is None:
            return Linear.of(self.float_tensor(name))
        rows, tensor = self._raw(name, None)
        blocks = q8_blocks_from_gguf(rows, tensor.ggml_type)
        weight = None if blocks is not None else self.float_tensor(name)
        self._release(tensor)
        return quantized_head(weight, blocks)

    def embedding(self, name: str, head: nn.Module | None) -> Callable[[torch.Tensor], torch.Tensor] | torch.Tensor:
        """The token embedding: in float mode the whole table (a tensor, which a tied dense head shares); in the
        quantized modes a lookup [T] ids -> float32 [T, hidden] that dequantizes only the rows asked for: from a
        tied 8-bit head's own codes when the table is the head's Q8_0 blocks, else from the file's blocks."""
        if self.mode is None:
            return self.float_tensor(name)
        tensor = self._tensor(name)
        if isinstance(head, Q8Linear) and head.exact_blocks and tensor.ggml_type == GGMLQuantizationType.Q8_0:
            return head.rows
        return BlockEmbedding.of(tensor)
