"""Linear layers whose weights stay quantized (decode reads every weight per token; prompt chunks are integer
compute-bound), with no dense float copy.

- NativeLinear: tokenmill's native kernels (tokenmill/native/repack.c, products.c) over GGUF blocks as the file
  has them: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, MXFP4, in parts of different types (a fused QKV),
  multiplied with integer dot products against activations quantized per block of 32 in one int8 pass (llama.cpp's
  scheme) or two (error below 1/64,516 of the block's largest value). On the bundled models' references
  (benchmarks/accuracy.py) two passes move HF float32's top-10 log-probabilities by at most 0.0023 and keep all
  32 greedy tokens; one pass by 0.09-0.24 (llama.cpp on the same files: 0.13-0.41). gguf_rows_from_float makes
  Q8_0 or Q4_1 rows of a float checkpoint's weight for it. Speeds: benchmarks/quant_products.py.
- Int4Linear: 4-bit weights in groups of 32 along the input (Q4_1's scheme) through torch's
  `_weight_int4pack_mm_for_cpu` (bfloat16 compute), and Int8Linear: int8 weights with one scale per output row
  through `_weight_int8pack_mm`: where the native kernels cannot be built, and `--quantization int8`.
- BFloat16Head: the LM head in bfloat16 where the native kernels are missing.
- BlockEmbedding: a token table left in the file's blocks, the rows looked up dequantized.

(fbgemm's dynamic int8 linear quantizes activations per tensor; on SmolLM2 that moved the top log-probabilities
by up to 2.8 and broke greedy agreement at the first token, so it is not used.) These are CPU kernels; on CUDA
tokenmill runs the dequantized weights.
"""

import ctypes
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from torch import nn

from tokenmill import native
from tokenmill.loader.dequantize import dequantize
from tokenmill.loader.weight_cache import IN_MEMORY, InMemoryWeights

INT4_GROUP_SIZE = 32
# int8 activation passes of every projection's product, prompt and generated tokens alike (one kernel: a token's
# bits do not depend on whether it is computed in a prompt chunk, a decode step, a recomputation after preemption
# or a speculative verification). One pass, as llama.cpp: prompt chunks are integer compute-bound and take 1.77x
# as long with two (SmolLM2-1.7B's 24 layers at 512 rows, 3.8 against 6.7 s); on the bundled models' references
# it moves HF float32's top-10 log-probabilities by 0.09-0.24 (llama.cpp on the same files: 0.13-0.41), two passes
# by at most 0.0023 (benchmarks/accuracy.py). The LM head always takes two: its logits decide every token.
ACTIVATION_PASSES = 1


def q4_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[out, in] -> (codes uint8 [out, in/32, 32] in 0..15, scale [out, in/32], min [out, in/32]) with
    w = code * scale + min per block of 32 (Q4_1's scheme: exact for weights that came from Q4_1 or Q4_0). The
    scales and minimums are rounded to half floats first, as Q4_1 stores them, and the codes fit the rounded ones."""
    out_features, in_features = weight.shape
    if in_features % INT4_GROUP_SIZE:
        raise ValueError(f"4-bit weights need in_features divisible by {INT4_GROUP_SIZE}, got {in_features}")
    groups = weight.float().reshape(out_features, -1, INT4_GROUP_SIZE)
    low = groups.amin(dim=-1).half().float()
    scale = ((groups.amax(dim=-1) - low) / 15.0).clamp(min=2**-14).half().float()  # at least half's smallest normal
    codes = ((groups - low.unsqueeze(-1)) / scale.unsqueeze(-1)).round().clamp(0, 15).to(torch.uint8)
    return codes, scale, low


Q8Blocks = tuple[torch.Tensor, torch.Tensor]  # (codes int8 [out, in], half-float scale [out, in/32])
NATIVE_GROUP = 16  # output rows per group in the native kernels' interleaved weight layouts
# GGUF types the native products take as they are (tokenmill/native/repack.c)
NATIVE_TYPES = frozenset(
    GGMLQuantizationType[name] for name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "MXFP4")
)
# uint8 [rows, bytes per row]: a GGUF tensor's rows as stored (or an object with `shape`, `ndim` and `__array__`
# that makes them on demand: model/weights.py's LazyRows)
RawRows = torch.Tensor | np.ndarray


def _padded(rows: int) -> int:
    return -(-rows // NATIVE_GROUP) * NATIVE_GROUP


class NativeLinear(nn.Module):
    """A linear layer over GGUF blocks as the file has them (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, MXFP4:
    no re-coding; memory the file's bytes, +2.8% for Q4_K and +2.3% for Q5_K), through tokenmill's native integer
    products (tokenmill/native/products.c). The weight may be several parts of different types stacked along the
    outputs (a fused QKV whose V is Q6_K and Q/K Q4_K; gate + up): `parts` lists each part's raw rows and type, in
    output order.

    forward(x [m, in_features] float) -> float32 [m, out_features]: x @ W.T with W the reference dequantization of
    the blocks (gguf.quants'), the activations quantized per row and block of 32 in `passes` int8 passes (1: as
    llama.cpp's Q8 activations; 2: error below 1/64,516 of the block's largest value). A row's result is the same
    bits whatever the other rows of the call. rows(ids) gives W's rows (the reference's float32 values exactly:
    a tied embedding's lookup from the head's blocks). Each part is padded to whole groups of 16 rows inside its
    buffer; forward and rows hide that padding (`c_weight`, for the native decoder, has it: there every part's
    rows must be a multiple of 16)."""

    def __init__(
        self,
        parts: Sequence[tuple[RawRows, GGMLQuantizationType]],
        in_features: int,
        passes: int = 1,
        lib=None,
        store: InMemoryWeights = IN_MEMORY,
    ):
        """`store` gives the repacked buffers (loader/weight_cache.py: made in memory, or mapped from a cache file,
        when the raw rows are not read at all)."""
        super().__init__()
        self._lib = lib if lib is not None else native.load()
        if self._lib is None:
            raise RuntimeError("the native kernels are not built here (see the log of `python -m tokenmill.native`)")
        if passes not in (1, 2):
            raise ValueError(f"passes must be 1 or 2, got {passes}")
        if not 1 <= len(parts) <= native.MAX_PARTS:
            raise ValueError(f"a native weight has 1 to {native.MAX_PARTS} parts, got {len(parts)}")
        self.in_features, self.passes = in_features, passes
        self.part_types = [GGMLQuantizationType(t) for _, t in parts]
        self.part_rows = [int(raw.shape[0]) for raw, _ in parts]
        self.out_features = sum(self.part_rows)
        c_parts = []
        for i, ((raw, _), ggml_type, rows) in enumerate(zip(parts, self.part_types, self.part_rows, strict=True)):
            buffer = self._repack(raw, ggml_type, rows, store)  # uint8 [repacked bytes]
            self.register_buffer(f"part{i}", buffer, persistent=False)
            c_parts.append(native.Part(int(ggml_type), _padded(rows), in_features, buffer.data_ptr()))
        self.c_weight = native.Weight(len(c_parts), (native.Part * native.MAX_PARTS)(*c_parts))
        # where each real row sits among the padded outputs: [out_features]
        starts = np.cumsum([0] + [_padded(r) for r in self.part_rows])[:-1]
        self._padded_ids = torch.from_numpy(
            np.concatenate([s + np.arange(r) for s, r in zip(starts, self.part_rows, strict=True)])
        )
        self._padded_out = sum(_padded(r) for r in self.part_rows)
        self._plain = self._padded_out == self.out_features or all(r % NATIVE_GROUP == 0 for r in self.part_rows[:-1])

    @classmethod
    def from_gguf(
        cls, parts: Sequence[tuple[RawRows, GGMLQuantizationType]], in_features: int, passes: int = 1
    ) -> "NativeLinear":
        """parts: (raw rows uint8 [rows, bytes per row] as the GGUF file stores them, their type) in output order."""
        return cls(parts, in_features, passes)

    @classmethod
    def from_float(
        cls, weight: torch.Tensor, ggml_type: GGMLQuantizationType, passes: int = 2, lib=None
    ) -> "NativeLinear":
        """A float weight [out, in] quantized to Q8_0 or Q4_1 blocks (gguf_rows_from_float)."""
        return cls([(gguf_rows_from_float(weight, ggml_type), ggml_type)], weight.shape[1], passes, lib)

    def _repack(self, raw: RawRows, ggml_type: GGMLQuantizationType, rows: int, store: InMemoryWeights) -> torch.Tensor:
        if ggml_type not in NATIVE_TYPES:
            raise ValueError(f"the native products do not take {ggml_type.name} weights")
        values, block_bytes = GGML_QUANT_SIZES[ggml_type]
        row_bytes = self.in_features // values * block_bytes
        if self.in_features % values or raw.ndim != 2 or raw.shape[1] != row_bytes:
            raise ValueError(
                f"{ggml_type.name} rows of {self.in_features} inputs are {row_bytes} bytes: {tuple(raw.shape)}"
            )

        def fill(address: int) -> None:  # reads the raw rows only when the store has no copy of the result
            if isinstance(raw, torch.Tensor):
                keep = raw.contiguous().view(torch.uint8)
                pointer = keep.data_ptr()
            else:  # straight from the file's pages (no copy unless not contiguous), or rows made on demand
                keep = np.ascontiguousarray(raw).view(np.uint8)
                pointer = keep.ctypes.data
            if self._lib.tm_repack(int(ggml_type), pointer, rows, self.in_features, address) != 0:
                raise ValueError(f"cannot repack {ggml_type.name} rows of {self.in_features} inputs")

        size = self._lib.tm_repack_bytes(int(ggml_type), rows, self.in_features)
        return store.buffer(int(ggml_type), rows, self.in_features, size, fill)

    @property
    def nbytes(self) -> int:
        """Bytes of the repacked weight."""
        return sum(getattr(self, f"part{i}").nbytes for i in range(len(self.part_rows)))

    def _real_columns(self, out: torch.Tensor) -> torch.Tensor:
        """[m, padded outputs] -> [m, out_features]"""
        if self._padded_out == self.out_features:
            return out
        if self._plain:  # only the last part has padding: it is at the end
            return out[:, : self.out_features].contiguous()
        return out.index_select(1, self._padded_ids)

    def forward(self, x: torch.Tensor, passes: int | None = None) -> torch.Tensor:
        """x [m, in_features] -> float32 [m, out_features]; `passes` overrides the layer's for this call."""
        if x.ndim != 2 or x.shape[1] != self.in_features:
            raise ValueError(f"a native product takes [rows, {self.in_features}] inputs, got {tuple(x.shape)}")
        passes = self.passes if passes is None else passes
        if passes not in (1, 2):
            raise ValueError(f"passes must be 1 or 2, got {passes}")
        x32 = x.float().contiguous()  # [m, in_features]
        out = torch.empty(x32.shape[0], self._padded_out, dtype=torch.float32)  # [m, padded outputs]
        rc = self._lib.tm_qmatmul(ctypes.byref(self.c_weight), x32.data_ptr(), x32.shape[0], passes, out.data_ptr())
        if rc == -2:
            raise MemoryError("native quantized product: out of memory")
        if rc != 0:
            raise ValueError(f"native quantized product failed ({rc}): x is {tuple(x.shape)}")
        return self._real_columns(out)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """[T] row indices -> float32 [T, in_features]: W's rows, dequantized exactly as the reference does."""
        padded = self._padded_ids[ids.reshape(-1)].contiguous()  # [T] int64
        out = torch.empty(padded.shape[0], self.in_features, dtype=torch.float32)
        if self._lib.tm_weight_rows(ctypes.byref(self.c_weight), padded.data_ptr(), padded.shape[0], out.data_ptr()):
            raise IndexError("row index out of range")
        return out


def gguf_rows_from_float(weight: torch.Tensor, ggml_type: GGMLQuantizationType) -> torch.Tensor:
    """A float weight [out, in] as GGUF raw rows (uint8 [out, bytes per row]), for a float checkpoint's weights to
    go through NativeLinear: Q8_0 (per 32 inputs, d = max|w| / 127 rounded to a half float, codes round(w / d), so
    Q8_0 weights come back exactly) or Q4_1 (per 32 inputs, d and m from min/max rounded to half floats, the codes
    fitted to the rounded ones: q4_blocks)."""
    out_features, in_features = weight.shape
    if in_features % INT4_GROUP_SIZE:
        raise ValueError(f"GGUF blocks need in_features divisible by {INT4_GROUP_SIZE}, got {in_features}")
    blocks = in_features // INT4_GROUP_SIZE
    if ggml_type == GGMLQuantizationType.Q8_0:
        codes, scale = _q8_blocks(weight)
        d = scale.reshape(out_features, blocks, 1).view(torch.uint8)  # [out, blocks, 2]
        q = codes.reshape(out_features, blocks, INT4_GROUP_SIZE).view(torch.uint8)
        return torch.cat([d, q], dim=-1).reshape(out_features, -1)
    if ggml_type == GGMLQuantizationType.Q4_1:
        codes, scale, low = q4_blocks(weight)
        packed = (codes[..., :16] | (codes[..., 16:] << 4)).contiguous()  # byte i: code i, code i + 16
        return _q4_1_rows(packed, scale, low)
    raise ValueError(f"float weights become Q8_0 or Q4_1 rows, not {ggml_type.name}")


def _q8_blocks(weight: torch.Tensor) -> Q8Blocks:
    """[out, in] -> (codes int8 [out, in], scales float16 [out, in/32]): Q8_0 blocks whose half-float scales the
    codes are fitted to (so a Q8_0 embedding's codes come back exactly)."""
    out_features = weight.shape[0]
    groups = weight.float().reshape(out_features, -1, INT4_GROUP_SIZE)
    scale = (groups.abs().amax(dim=-1) / 127.0).to(torch.float16)  # [out, in/32]
    safe = scale.float().clamp(min=1e-30).unsqueeze(-1)
    codes = (groups / safe).round().clamp(-127, 127).to(torch.int8).reshape(out_features, -1)
    return codes, scale


def _q4_1_rows(packed: torch.Tensor, scale: torch.Tensor, low: torch.Tensor) -> torch.Tensor:
    """Q4_1 blocks (packed codes uint8 [out, blocks, 16], scale and min [out, blocks]) -> raw rows [out, blocks * 20]"""
    d = scale.half().contiguous().unsqueeze(-1).view(torch.uint8)  # [out, blocks, 2]
    m = low.half().contiguous().unsqueeze(-1).view(torch.uint8)
    return torch.cat([d, m, packed.to(torch.uint8)], dim=-1).reshape(packed.shape[0], -1)


class BlockEmbedding(nn.Module):
    """A token embedding table left in the file's blocks (any GGUF type: a view of its memory map, or of a
    checkpoint's), only the rows looked up dequantized: the same float32 values as the whole table dequantized,
    without holding it (Gemma 3's 262,144-row table: 4 bytes a value in float32)."""

    def __init__(self, raw: np.ndarray, ggml_type: GGMLQuantizationType, hidden_size: int):
        super().__init__()
        self.raw = raw  # uint8 [vocab, bytes per row], read-only: it stays where the file has it
        self.ggml_type = ggml_type
        self.hidden_size = hidden_size

    @classmethod
    def of(cls, tensor) -> "BlockEmbedding":
        """From a GGUFTensor of shape [vocab, hidden]."""
        raw = np.asarray(tensor.data).reshape(tensor.shape[0], -1).view(np.uint8)
        return cls(raw, tensor.ggml_type, tensor.shape[1])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] -> float32 [T, hidden]"""
        rows = torch.from_numpy(self.raw[input_ids.numpy()])  # [T, bytes per row]: a copy of just these rows
        return dequantize(rows, self.ggml_type, (input_ids.shape[0], self.hidden_size))


class Int8Linear(nn.Module):
    """int8 weights, one scale per output row, through `_weight_int8pack_mm` (bfloat16 activations)."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        w = weight.float()
        scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)  # [out]
        self.register_buffer("qweight", (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8), persistent=False)
        self.register_buffer("scale", scale.to(torch.bfloat16), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int8pack_mm(x.to(torch.bfloat16), self.qweight, self.scale).to(x.dtype)


class Int4Linear(nn.Module):
    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        codes, scale, low = q4_blocks(weight)  # w = code * scale + low, as Q4_1
        q = codes.to(torch.int32).reshape(self.out_features, -1)
        self.register_buffer("packed", torch._convert_weight_to_int4pack_for_cpu(q, 1), persistent=False)
        # the kernel computes (q - 8) * scale + zero, so zero = low + 8 * scale; [in/32, out, 2]
        scales_zeros = torch.stack([scale, low + 8 * scale], dim=-1).transpose(0, 1)
        self.register_buffer("scales_zeros", scales_zeros.contiguous().to(torch.bfloat16), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), self.packed, INT4_GROUP_SIZE, self.scales_zeros)
        return out.to(x.dtype)


class BFloat16Head(nn.Module):
    """The LM head in bfloat16: half the bytes of float32 to read per decoded token. One row goes through
    torch.mv, which is about 3x faster than float32 here (1.6 ms against 4.6 ms for 49152 x 576)."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.register_buffer("weight", weight.to(torch.bfloat16).contiguous(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xb = x.to(torch.bfloat16)
        if x.shape[0] == 1:
            return torch.mv(self.weight, xb[0]).unsqueeze(0).float()
        return F.linear(xb, self.weight).float()
