"""Linear layers whose weights stay quantized, for the memory-bound paths (decode reads every weight per token).

- Q4Linear / Q8Linear: tokenmill's native kernels (tokenmill/native/products.c): GGUF's Q4_1 and Q8_0 blocks
  as the file has them (Q4_0 and Q4_K converted exactly, up to half-float rounding of Q4_K's sub-block scales),
  multiplied with integer dot products; activations are quantized per block of 32 in two
  int8 passes (error below 1/64,516 of the block's largest value): on the references, all 32 greedy tokens
  of HF float32 and top-10 log-probabilities within 0.0033, where one int8 pass, as llama.cpp's, kept 3 to 32
  tokens and moved the log-probabilities by 0.1-0.24 (benchmarks/activation_quantization.py).
- Int4Linear: 4-bit weights in groups of 32 along the input (the layout of GGUF's Q4_0/Q4_1 blocks, so those
  convert without further loss, up to bfloat16 scales) through `_weight_int4pack_mm_for_cpu`, which computes in
  bfloat16: the 4-bit kernel where the native ones cannot be built. Fastest at a few rows.
- Int8Linear: int8 weights with one scale per output row through `_weight_int8pack_mm` (bfloat16 activations).
- AutoLinear: a dense GEMM (bfloat16 where the CPU has it in hardware, float32 where it does not) for prompt
  tokens, and the 4-bit weight the native decoder uses for generated tokens.

- BFloat16Head: the LM head in bfloat16, where the native kernels are missing (int8 and int4 heads through
  torch's kernels cost far more accuracy: the tied embedding is Q8_0, per-row int8 moved top log-probabilities
  by 0.2 and int4 by 1.1).

(fbgemm's dynamic int8 linear is faster still at every batch size, but it quantizes activations per tensor;
on SmolLM2 that moved the top log-probabilities by up to 2.8 and broke greedy agreement at the first token,
so it is not used.) These are CPU kernels; on CUDA tokenmill runs the dequantized weights.
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from torch import nn

from tokenmill import native
from tokenmill.layers.linear import dense_linear
from tokenmill.loader.dequantize import k_scales_mins

INT4_GROUP_SIZE = 32


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


# GGUF blocks taken as they are: (packed codes uint8 [out, in/32, 16], scale [out, in/32], min [out, in/32]),
# scales and minimums as the file's half floats
Q4Blocks = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
Q8Blocks = tuple[torch.Tensor, torch.Tensor]  # (codes int8 [out, in], half-float scale [out, in/32])


def q4_blocks_from_gguf(raw: torch.Tensor, ggml_type: GGMLQuantizationType) -> Q4Blocks | None:
    """Raw rows of a Q4_1, Q4_0 or Q4_K tensor ([rows, bytes], as stored) -> blocks: Q4_1 is (d, m, 16 bytes of
    codes) per block, Q4_0 is (d, codes) with m = -8 d; Q4_K's 256-weight super-blocks are 8 blocks of 32 with
    w = (d * sc) * code - dmin * mn, i.e. Q4_1 blocks of scale d * sc and minimum -dmin * mn, which are rounded to
    half floats (relative error below 2^-11; the codes are the file's)."""
    rows = raw.shape[0]
    if ggml_type == GGMLQuantizationType.Q4_K:
        b = raw.reshape(-1, 144)  # [super-blocks, 144]: d, dmin, 12 bytes of 6-bit scales and mins, 128 of codes
        d, dmin = b[:, 0:2].contiguous().view(torch.float16).float(), b[:, 2:4].contiguous().view(torch.float16).float()
        sc, mn = k_scales_mins(b[:, 4:16])  # [super-blocks, 8] each
        # code bytes j*32 .. j*32+31 hold block 2j in their low nibbles and block 2j+1 in their high ones
        qs = b[:, 16:].reshape(-1, 4, 1, 32)
        codes = torch.cat([qs & 0x0F, qs >> 4], dim=2).reshape(-1, 8, 32)  # [super-blocks, 8, 32]
        packed = (codes[..., :16] | (codes[..., 16:] << 4)).reshape(rows, -1, 16)
        scale = (d * sc.float()).half().reshape(rows, -1)
        low = (-(dmin * mn.float())).half().reshape(rows, -1)
        return packed.contiguous(), scale, low
    if ggml_type == GGMLQuantizationType.Q4_1:
        b = raw.reshape(rows, -1, 20)
        return b[..., 4:].contiguous(), _half(b[..., 0:2]), _half(b[..., 2:4])
    if ggml_type == GGMLQuantizationType.Q4_0:
        b = raw.reshape(rows, -1, 18)
        d = _half(b[..., 0:2])
        return b[..., 2:].contiguous(), d, -8.0 * d
    return None


def q8_blocks_from_gguf(raw: torch.Tensor, ggml_type: GGMLQuantizationType) -> Q8Blocks | None:
    """Raw rows of a Q8_0 tensor -> (codes, scales): (d, 32 int8 codes) per block."""
    if ggml_type != GGMLQuantizationType.Q8_0:
        return None
    b = raw.reshape(raw.shape[0], -1, 34)
    return b[..., 2:].contiguous().view(torch.int8).reshape(raw.shape[0], -1), _half(b[..., 0:2])


def _half(pairs: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 2] little-endian half floats -> float16 [...] (the native kernels keep them as they are)"""
    return pairs.contiguous().view(torch.float16).squeeze(-1)


NATIVE_GROUP = 16  # output rows per group in the native kernels' interleaved weight layouts


def _native_product(rows: int, out_features: int, product: Callable[[int, int], int]) -> torch.Tensor:
    """Run `product(padded_out_features, out_pointer)`, a native product that writes [rows, padded] float32 (the
    output size rounded up to whole groups), and keep the first `out_features` columns."""
    padded = -(-out_features // NATIVE_GROUP) * NATIVE_GROUP
    out = torch.empty(rows, padded, dtype=torch.float32)
    if product(padded, out.data_ptr()) != 0:
        raise MemoryError("native quantized product: out of memory")
    return out if padded == out_features else out[:, :out_features].contiguous()


class Q4Linear(nn.Module):
    """4-bit weights in GGUF's Q4_1 scheme (half-float block scales and minimums) through tokenmill's native kernel,
    which quantizes activations per block of 32 in two int8 passes (error below 1/64,516 of the block's largest
    value; see products.c). Built from GGUF's own blocks when the file has Q4_0/Q4_1 (`blocks`), else from a
    float weight (min/max per block, which recovers Q4 blocks exactly). The kernel's layout interleaves 16 output
    rows; a last partial group is padded with zero rows."""

    def __init__(self, weight: torch.Tensor | None, lib, blocks: Q4Blocks | None = None):
        super().__init__()
        if blocks is None:
            assert weight is not None
            codes, scale, low = q4_blocks(weight)
            # two codes per byte, as GGUF packs Q4 blocks: byte i holds code i (low nibble) and code i + 16 (high)
            blocks = ((codes[..., :16] | (codes[..., 16:] << 4)).contiguous(), scale, low)
        qs, scale, low = blocks[0].contiguous(), blocks[1].half().contiguous(), blocks[2].half().contiguous()
        self.out_features, num_blocks = qs.shape[0], qs.shape[1]
        self.in_features = num_blocks * INT4_GROUP_SIZE
        groups = -(-self.out_features // NATIVE_GROUP)
        # [groups, blocks, 256] codes and [groups, blocks, 16] half-float scales and minimums
        self.register_buffer("qs", torch.empty(groups, num_blocks, 256, dtype=torch.uint8), persistent=False)
        self.register_buffer("scale", torch.empty(groups, num_blocks, NATIVE_GROUP, dtype=torch.half), persistent=False)
        self.register_buffer("low", torch.empty(groups, num_blocks, NATIVE_GROUP, dtype=torch.half), persistent=False)
        lib.tm_q4_interleave(
            qs.data_ptr(),
            scale.data_ptr(),
            low.data_ptr(),
            self.out_features,
            num_blocks,
            self.qs.data_ptr(),
            self.scale.data_ptr(),
            self.low.data_ptr(),
        )
        self._lib = lib

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float().contiguous()
        rows = x32.shape[0]
        weights = (self.qs.data_ptr(), self.scale.data_ptr(), self.low.data_ptr())
        out = _native_product(
            rows,
            self.out_features,
            lambda n, y: self._lib.tm_q4_matmul(x32.data_ptr(), rows, self.in_features, *weights, n, y),
        )
        return out.to(x.dtype)


class Q8Linear(nn.Module):
    """8-bit weights as GGUF's Q8_0 (int8 codes, one half-float scale per 32 inputs) through the native kernel,
    activations quantized as Q4Linear's. The quantized modes' LM head (exact for a Q8_0 embedding, as the bundled
    model's is: 30 MB read per decoded token instead of 113), and `auto`'s projections whose file type is finer
    than 4 bits (Q5_0, Q6_K, Q8_0: Gemma 3's). The kernel's layout interleaves 16 output rows (a partial last
    group is padded with zero rows)."""

    def __init__(self, weight: torch.Tensor, lib, blocks: Q8Blocks | None = None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        if blocks is not None:
            codes, scale = blocks
        else:
            groups = weight.float().reshape(self.out_features, -1, INT4_GROUP_SIZE)
            # Q8_0's scales are half floats; rounding them so recovers a Q8_0 embedding's codes exactly
            scale = (groups.abs().amax(dim=-1) / 127.0).to(torch.float16)  # [out, in/32]
            safe = scale.float().clamp(min=1e-30).unsqueeze(-1)
            codes = (groups / safe).round().clamp(-127, 127).to(torch.int8).reshape(self.out_features, -1)
        codes, scale = codes.contiguous(), scale.half().contiguous()
        num_blocks, groups = self.in_features // INT4_GROUP_SIZE, -(-self.out_features // NATIVE_GROUP)
        # [groups, blocks, 512] codes and [groups, blocks, 16] half-float scales
        self.register_buffer("qs", torch.empty(groups, num_blocks, 512, dtype=torch.int8), persistent=False)
        self.register_buffer("scale", torch.empty(groups, num_blocks, NATIVE_GROUP, dtype=torch.half), persistent=False)
        lib.tm_q8_interleave(
            codes.data_ptr(),
            scale.data_ptr(),
            self.out_features,
            num_blocks,
            self.qs.data_ptr(),
            self.scale.data_ptr(),
        )
        self._lib = lib

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """[T] row indices -> float32 [T, in_features]: the weight's rows, code * scale (a tied embedding's lookup
        straight from the head's codes: no second copy of the table)."""
        groups, num_blocks = self.qs.shape[0], self.qs.shape[1]
        group, j = ids // NATIVE_GROUP, ids % NATIVE_GROUP
        # the interleaved layout: byte u * 64 + j * 4 + i of a block holds code 4u + i of the group's row j
        codes = self.qs.view(groups, num_blocks, INT4_GROUP_SIZE // 4, NATIVE_GROUP, 4)[group, :, :, j, :]
        scale = self.scale[group, :, j]  # [T, blocks]
        values = codes.reshape(ids.shape[0], num_blocks, INT4_GROUP_SIZE).float() * scale.float().unsqueeze(-1)
        return values.view(ids.shape[0], -1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float().contiguous()
        rows = x32.shape[0]
        return _native_product(
            rows,
            self.out_features,
            lambda n, y: self._lib.tm_q8_matmul(
                x32.data_ptr(), rows, self.in_features, self.qs.data_ptr(), self.scale.data_ptr(), n, y
            ),
        )


class Q8Embedding(nn.Module):
    """A token embedding table kept as GGUF's Q8_0 blocks (int8 codes, a half-float scale per 32 values), only
    the looked-up rows dequantized: the same float32 values as the whole table dequantized (code * scale, each
    exact in float32), in a quarter of its memory (SmolLM2-135M: 27 instead of 108 MiB)."""

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor):
        super().__init__()
        self.register_buffer("codes", codes.contiguous(), persistent=False)  # int8 [vocab, hidden]
        self.register_buffer("scale", scale.half().contiguous(), persistent=False)  # [vocab, hidden / 32]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] -> float32 [T, hidden]"""
        codes = self.codes[input_ids].view(input_ids.shape[0], -1, INT4_GROUP_SIZE).float()
        return (codes * self.scale[input_ids].float().unsqueeze(-1)).view(input_ids.shape[0], -1)


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


def cpu_has_native_bfloat16() -> bool:
    """AVX512-BF16 or AMX: bfloat16 GEMMs run in hardware (on this project's Xeon, 3x float32 at 512 rows)."""
    cpu = getattr(torch, "cpu", None)
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(bool(getattr(cpu, name, lambda: False)()) for name in checks)


class AutoLinear(nn.Module):
    """`auto`'s projection: a dense weight for the torch path, which computes prompt tokens (bfloat16 where the
    CPU has it in hardware, float32 elsewhere), and the 4-bit (or 8-bit) weight (`packed`, where the native
    kernels are built) that the native decoder reads for generated tokens. Which kernel computes a token depends
    only on whether it is a prompt token or a generated one, never on how many rows its step has: a request's
    numbers do not depend on what else is in the batch."""

    def __init__(
        self,
        weight: torch.Tensor,
        dense_bfloat16: bool | None = None,
        blocks: Q4Blocks | None = None,
        eight_bit: Q8Blocks | bool = False,
    ):
        """`eight_bit`: the native decoder's weight in 8 bits (the file's Q8_0 blocks, or True to quantize)."""
        super().__init__()
        lib = native.load()
        self.packed: Q4Linear | Q8Linear | None = None
        if lib is not None and eight_bit is not False:
            self.packed = Q8Linear(weight, lib, None if eight_bit is True else eight_bit)
        elif lib is not None:
            self.packed = Q4Linear(weight, lib, blocks)
        use_bf16 = cpu_has_native_bfloat16() if dense_bfloat16 is None else dense_bfloat16
        self.dense_dtype = torch.bfloat16 if use_bf16 else weight.dtype
        self.register_buffer("dense", weight.to(self.dense_dtype).contiguous(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dense_linear(x.to(self.dense_dtype), self.dense).to(x.dtype)


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


def quantized_head(weight: torch.Tensor, blocks: Q8Blocks | None = None) -> nn.Module:
    """The LM head of the quantized modes: Q8_0 through the native kernel, else bfloat16."""
    lib = native.load()
    return Q8Linear(weight, lib, blocks) if lib is not None else BFloat16Head(weight)


def four_bit_linear(weight: torch.Tensor, blocks: Q4Blocks | None = None) -> nn.Module:
    """tokenmill's native 4-bit kernel where it could be built, torch's int4 kernel otherwise."""
    lib = native.load()
    return Q4Linear(weight, lib, blocks) if lib is not None else Int4Linear(weight)


def quantized_linear(
    weight: torch.Tensor, mode: str, blocks: Q4Blocks | None = None, eight_bit: Q8Blocks | bool = False
) -> nn.Module:
    """`blocks`: the GGUF file's own 4-bit blocks for this weight, when it has them. `eight_bit` (auto only): the
    file stores this weight finer than 4 bits; its 8-bit blocks when they are Q8_0, else True."""
    if mode == "int8":
        return Int8Linear(weight)
    if mode == "int4":
        return four_bit_linear(weight, blocks)
    if mode == "auto":
        return AutoLinear(weight, blocks=blocks, eight_bit=eight_bit)
    raise ValueError(f"unknown quantization mode {mode!r}")
