"""Our dequantization (torch, and the native library for Q4_1 and Q8_0) equals gguf.quants.dequantize bit for bit,
on random blocks of every type."""

import gguf
import numpy as np
import pytest
import torch

from tokenmill import native
from tokenmill.loader.dequantize import dequantize

QUANT_TYPES = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "MXFP4"]
# byte offsets of the float16 scale fields inside one block, per type
F16_FIELDS = {
    "Q8_0": [0],
    "Q4_0": [0],
    "Q4_1": [0, 2],
    "Q5_0": [0],
    "Q5_1": [0, 2],
    "Q4_K": [0, 2],
    "Q5_K": [0, 2],
    "Q6_K": [208],
    "MXFP4": [],  # its exponent byte: any value is a power of two
}


def random_blocks(qtype: gguf.GGMLQuantizationType, rows: int, blocks_per_row: int, seed: int) -> np.ndarray:
    """Random bytes, with the float16 scales replaced by finite random halves (random bits could be NaN/inf)."""
    _, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows * blocks_per_row, type_size), dtype=np.uint8)
    for offset in F16_FIELDS[qtype.name]:
        scales = (rng.standard_normal(rows * blocks_per_row) * 0.05).astype(np.float16)
        raw[:, offset : offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, blocks_per_row * type_size)


@pytest.mark.parametrize("name", QUANT_TYPES)
@pytest.mark.parametrize("seed", [0, 1])
def test_block_types_match_gguf(name: str, seed: int) -> None:
    qtype = gguf.GGMLQuantizationType[name]
    raw = random_blocks(qtype, rows=6, blocks_per_row=3, seed=seed)
    expected = gguf.quants.dequantize(raw, qtype)
    ours = dequantize(raw, qtype, expected.shape)
    assert ours.dtype == torch.float32
    assert np.array_equal(ours.numpy(), expected)


@pytest.mark.parametrize("name", ["Q4_1", "Q8_0"])
def test_native_and_torch_paths_match_gguf(name: str) -> None:
    """The bundled model's formats go through the native library from a file's bytes (numpy) and through torch
    from a tensor: both bit for bit as gguf, including zero, subnormal and large half-float scales."""
    qtype = gguf.GGMLQuantizationType[name]
    raw = random_blocks(qtype, rows=4, blocks_per_row=40, seed=7)
    special = np.array([0.0, -0.0, 6e-8, -3e-6, 6.1e-5, 1000.0, -65504.0], dtype=np.float16).view(np.uint8)
    blocks = raw.reshape(-1, gguf.GGML_QUANT_SIZES[qtype][1])
    for offset in F16_FIELDS[name]:
        blocks[: len(special) // 2, offset : offset + 2] = special.reshape(-1, 2)
    expected = gguf.quants.dequantize(raw, qtype)
    assert native.load() is not None  # the native path is the one taken for numpy input
    assert np.array_equal(dequantize(raw, qtype, expected.shape).numpy(), expected)
    assert np.array_equal(dequantize(torch.from_numpy(raw), qtype, expected.shape).numpy(), expected)


@pytest.mark.parametrize("name", ["F32", "F16", "BF16"])
def test_float_types(name: str) -> None:
    qtype = gguf.GGMLQuantizationType[name]
    values = np.random.default_rng(0).standard_normal((5, 64)).astype(np.float32)
    typed = {"F32": values, "F16": values.astype(np.float16), "BF16": gguf.quants.quantize(values, qtype)}[name]
    raw = np.ascontiguousarray(typed).view(np.uint8)
    expected = gguf.quants.dequantize(raw, qtype).reshape(5, 64)
    ours = dequantize(raw, qtype, (5, 64))
    assert np.array_equal(ours.numpy(), expected)
    assert np.abs(ours.numpy() - values).max() <= (0.0 if name == "F32" else 0.02)


def test_round_trip_is_close_to_the_original() -> None:
    """Quantize real-looking weights with gguf, dequantize with us: the error is the format's, not ours."""
    values = np.random.default_rng(3).standard_normal((4, 512)).astype(np.float32)
    for name, tol in [("Q8_0", 0.02), ("Q4_0", 0.35), ("Q5_1", 0.15)]:
        qtype = gguf.GGMLQuantizationType[name]
        ours = dequantize(gguf.quants.quantize(values, qtype), qtype, values.shape).numpy()
        assert np.abs(ours - values).max() < tol, name


def test_mxfp4_exponents_at_both_ends() -> None:
    """MXFP4's two smallest exponents are denormal halves (ggml_e8m0_to_fp32_half), the largest 2^126."""
    qtype = gguf.GGMLQuantizationType.MXFP4
    raw = random_blocks(qtype, rows=4, blocks_per_row=2, seed=5).reshape(-1, 17)
    raw[:, 0] = [0, 1, 2, 127, 128, 200, 254, 255][: len(raw)]
    expected = gguf.quants.dequantize(raw, qtype)
    with np.errstate(over="ignore"):  # 2^127 x 12 is infinite in both
        assert np.array_equal(dequantize(raw, qtype, expected.shape).numpy(), expected)


def test_unsupported_type_is_a_clear_error() -> None:
    from tokenmill.errors import UnsupportedModelError

    with pytest.raises(UnsupportedModelError, match="IQ2_XXS"):
        dequantize(np.zeros((1, 66), dtype=np.uint8), gguf.GGMLQuantizationType.IQ2_XXS, (1, 256))
