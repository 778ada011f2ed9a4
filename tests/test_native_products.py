"""The native products over GGUF blocks (NativeLinear; tokenmill/native/repack.c and products.c): every type the
file formats have, exact up to the activations' quantization, the same bits for a row in any call, weights of
several parts, and the AVX2 and portable builds."""

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType

from tests.gguf_builder import BLOCK_HALVES, random_blocks
from tests.vector_paths import OTHER_PATHS, rerun_on_path
from tokenmill import native
from tokenmill.layers.quantized_linear import NativeLinear, gguf_rows_from_float, q4_blocks
from tokenmill.loader.dequantize import dequantize

lib = native.load()
TYPES = list(BLOCK_HALVES)  # Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, MXFP4
pytestmark = pytest.mark.skipif(lib is None, reason="the native kernels did not build")


def reference(raw: np.ndarray, type_name: str, rows: int, k: int) -> torch.Tensor:
    """gguf.quants' dequantization (ggml's reference): float32 [rows, k]"""
    return torch.from_numpy(gguf.quants.dequantize(raw, GGMLQuantizationType[type_name])).reshape(rows, k)


def activation_group(type_name: str, passes: int) -> int:
    """Values per activation scale: 256 with one pass into a K-quant (as llama.cpp's Q8_K), else 32."""
    return 256 if passes == 1 and type_name.endswith("_K") else 32


def quantized_activations(x: torch.Tensor, passes: int, group: int = 32) -> torch.Tensor:
    """The values the kernels compute with (products.c's header), as float64: per row and group of values,
    s = max|x| / 127, hi = round(x / s), lo = round((x / s - hi) * 254); s * hi (one pass) or s * (hi + lo / 254)."""
    blocks = x.reshape(x.shape[0], -1, group)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    v = blocks * torch.where(amax > 0, 127.0 / amax, 0.0)
    hi = v.round().clamp(-127, 127)
    values = hi.double()
    if passes == 2:
        values = values + ((v - hi) * 254).round().clamp(-127, 127).double() / 254
    return ((amax / 127).double() * values).reshape(x.shape)


def activations(rows: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, k, generator=g) * torch.linspace(0.1, 4.0, k)  # blocks of different ranges


def assert_exact_up_to_activations(
    out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, passes: int, group: int
) -> None:
    """out is the float64 product of W with x's quantized values, up to float32 rounding of the sums: within
    1e-5 of sum |w| |x| per output."""
    values = quantized_activations(x, passes, group)
    bound = 1e-5 * (values.abs() @ w.double().abs().T) + 1e-6
    assert ((out.double() - values @ w.double().T).abs() <= bound).all()


@pytest.mark.parametrize("type_name", TYPES)
def test_rows_are_the_reference_dequantization_exactly(type_name: str) -> None:
    """The repacked weight keeps the file's codes and scales: its rows are gguf.quants' values bit for bit (and
    tokenmill's loader's), a padded last group included."""
    rows, k = 40, 512
    raw = random_blocks(type_name, rows, k, np.random.default_rng(1))
    w = reference(raw, type_name, rows, k)
    layer = NativeLinear.from_gguf([(raw, GGMLQuantizationType[type_name])], k)
    ids = torch.tensor([0, 39, 15, 16, 17, 3, 3])
    assert torch.equal(layer.rows(ids), w[ids])
    assert torch.equal(layer.rows(torch.arange(rows)), dequantize(raw, GGMLQuantizationType[type_name], (rows, k)))
    with pytest.raises(IndexError):
        layer.rows(torch.tensor([40]))


def test_mxfp4_rows_are_the_reference_for_every_exponent() -> None:
    """MXFP4's scale 2^(e - 128) for each of the 256 exponent bytes, the ends included: e = 0 and 1 (ggml's
    denormals 2^-128 and 2^-127), 254 and 255 (2^127: its codes +-12 are infinite in the reference and here)."""
    rows, k = 32, 256
    raw = random_blocks("MXFP4", rows, k, np.random.default_rng(11))
    raw.reshape(rows, k // 32, 17)[..., 0] = np.arange(256).reshape(rows, k // 32)  # row 0: e = 0 .. 7
    with np.errstate(over="ignore"):
        w = reference(raw, "MXFP4", rows, k)
    layer = NativeLinear.from_gguf([(raw, GGMLQuantizationType.MXFP4)], k)
    assert torch.equal(layer.rows(torch.arange(rows)), w)
    assert (w[0, :64] != 0).any() and w[0, :64].abs().max() < 2**-122  # the denormal blocks' values
    assert w[-1, -32:].isinf().any()


@pytest.mark.parametrize("passes", [1, 2])
@pytest.mark.parametrize("type_name", TYPES)
def test_products_are_exact_up_to_the_activations_quantization(type_name: str, passes: int) -> None:
    """y = x @ W.T with W the reference dequantization: the only error is the activations' (1 or 2 int8 passes;
    one pass into a K-quant with a scale per 256 values, else per 32)."""
    rows, k = 48, 512
    raw = random_blocks(type_name, rows, k, np.random.default_rng(2))
    w = reference(raw, type_name, rows, k)
    layer_parts = [(raw, GGMLQuantizationType[type_name])]
    layer = NativeLinear.from_gguf(layer_parts, k, passes=passes)
    for m in (1, 2, 5, 9, 20):
        x = activations(m, k, seed=m)
        out = layer(x)
        assert out.shape == (m, rows) and out.dtype == torch.float32
        assert_exact_up_to_activations(out, x, w, passes, activation_group(type_name, passes))
    # the check tells the passes and the groups apart: each other is off by far more than float32 rounding
    group = activation_group(type_name, passes)
    others = [(3 - passes, activation_group(type_name, 3 - passes)), (passes, 256 + 32 - group)]
    for other_passes, other_group in others:
        values_other = quantized_activations(x, other_passes, other_group)
        assert ((out.double() - values_other @ w.double().T).abs() > 1e-4).any(), (other_passes, other_group)
    assert torch.equal(layer(x, passes=3 - passes), NativeLinear.from_gguf(layer_parts, k, passes=3 - passes)(x))


@pytest.mark.parametrize("type_name", ["Q4_K", "Q5_K", "Q6_K"])
def test_prompt_rows_over_unpacked_panels_are_the_rows_alone(type_name: str) -> None:
    """One pass into a K-quant with more rows than a tile: the AVX-512 build unpacks each group's codes a panel of
    super-blocks at a time for the tiles of a block of rows (products.c, run_panels). 5 super-blocks leave a
    panel short; each row is exact up to its activations and the same bits as alone (decode's tiles, no panels)."""
    rows, k = 32, 5 * 256
    raw = random_blocks(type_name, rows, k, np.random.default_rng(5))
    layer = NativeLinear.from_gguf([(raw, GGMLQuantizationType[type_name])], k, passes=1)
    x = activations(43, k, seed=6)
    out = layer(x)
    assert_exact_up_to_activations(out, x, reference(raw, type_name, rows, k), passes=1, group=256)
    alone = torch.cat([layer(x[i : i + 1]) for i in range(x.shape[0])])
    assert torch.equal(out, alone)


@pytest.mark.parametrize("type_name", TYPES)
def test_a_row_gets_the_same_bits_in_any_call(type_name: str) -> None:
    """Batch invariance: each row alone, and inside calls of 1 to 17, 64 and 512 rows at any position among other
    rows, gives the same bits (tiles of up to 8 rows, blocks of rows over all groups, two threads)."""
    rows, k = 32, 2048  # k = 2048: the 512-row calls run in several blocks of rows
    raw = random_blocks(type_name, rows, k, np.random.default_rng(3))
    for passes in (1, 2):
        layer = NativeLinear.from_gguf([(raw, GGMLQuantizationType[type_name])], k, passes=passes)
        x = activations(512, k, seed=4)
        alone = torch.cat([layer(x[i : i + 1]) for i in (*range(17), 63, 200, 511)])
        for m in range(2, 18):
            assert torch.equal(layer(x[:m]), alone[:m]), (passes, m)
            assert torch.equal(layer(x[17 - m : 17])[-1], alone[16]), (passes, m)  # the same row, other neighbours
        assert torch.equal(layer(x[:64])[:17], alone[:17])
        assert torch.equal(layer(x[:64])[63], alone[17])
        whole = layer(x)
        assert torch.equal(whole[:17], alone[:17]) and torch.equal(whole[[63, 200, 511]], alone[17:])


def test_parts_of_different_types_are_outputs_side_by_side() -> None:
    """A fused QKV: Q and K as Q4_K, V as Q6_K; the outputs are the parts' outputs in order, each the same bits as
    its own weight's product; parts whose rows are not a multiple of 16 are padded inside and the padding hidden."""
    k, rng = 512, np.random.default_rng(5)
    parts = [("Q4_K", 32), ("Q4_K", 16), ("Q6_K", 16)]
    raws = [(random_blocks(t, n, k, rng), GGMLQuantizationType[t]) for t, n in parts]
    fused = NativeLinear.from_gguf(raws, k, passes=1)
    alone = [NativeLinear.from_gguf([raw], k, passes=1) for raw in raws]
    x = activations(7, k, seed=6)
    assert torch.equal(fused(x), torch.cat([layer(x) for layer in alone], dim=1))
    assert fused.out_features == 64 and fused.nbytes == sum(layer.nbytes for layer in alone)
    # 24 + 8 rows: each part padded to 32 and 16 rows inside; outputs and rows are the real ones
    raws = [(random_blocks("Q8_0", 24, k, rng), GGMLQuantizationType.Q8_0)]
    raws.append((random_blocks("Q5_K", 8, k, rng), GGMLQuantizationType.Q5_K))
    fused = NativeLinear.from_gguf(raws, k, passes=2)
    w = torch.cat([reference(raws[0][0], "Q8_0", 24, k), reference(raws[1][0], "Q5_K", 8, k)])
    out = fused(x)
    assert out.shape == (7, 32)
    assert_exact_up_to_activations(out, x, w, passes=2, group=32)
    assert torch.equal(fused.rows(torch.arange(32)), w)
    # one pass into a weight with a K-quant part: a scale per 256 values for all of its parts
    assert_exact_up_to_activations(NativeLinear.from_gguf(raws, k, passes=1)(x), x, w, passes=1, group=256)


@pytest.mark.parametrize("type_name", TYPES)
def test_memory_is_the_files_bytes(type_name: str) -> None:
    """Repacked, a weight takes its file bytes (Q4_K and Q5_K: 4 bytes more per 256 values, for their 6-bit
    scales and minimums unpacked)."""
    raw = random_blocks(type_name, 64, 512, np.random.default_rng(7))
    layer = NativeLinear.from_gguf([(raw, GGMLQuantizationType[type_name])], 512)
    extra = {"Q4_K": 4 / 144, "Q5_K": 4 / 176}.get(type_name, 0.0)
    assert layer.nbytes == round(raw.nbytes * (1 + extra))


def test_bad_weights_and_arguments_are_refused() -> None:
    raw = random_blocks("Q4_0", 16, 64, np.random.default_rng(8))
    with pytest.raises(ValueError, match="bytes"):
        NativeLinear.from_gguf([(raw[:, :-1], GGMLQuantizationType.Q4_0)], 64)
    with pytest.raises(ValueError, match="F16"):
        NativeLinear.from_gguf([(raw, GGMLQuantizationType.F16)], 64)
    with pytest.raises(ValueError, match="passes"):
        NativeLinear.from_gguf([(raw, GGMLQuantizationType.Q4_0)], 64, passes=3)
    with pytest.raises(ValueError, match="parts"):
        NativeLinear.from_gguf([(raw, GGMLQuantizationType.Q4_0)] * 5, 64)
    layer = NativeLinear.from_gguf([(raw, GGMLQuantizationType.Q4_0)], 64)
    with pytest.raises(ValueError):
        layer(torch.randn(2, 32))


def test_float_weights_become_q8_0_and_q4_1_rows() -> None:
    """gguf_rows_from_float: Q8_0 rows that recover a Q8_0 grid weight exactly, and Q4_1 rows whose values are
    q4_blocks' (codes * half-float scale + half-float minimum)."""
    g = torch.Generator().manual_seed(9)
    codes = torch.randint(-127, 128, (32, 4, 32), generator=g).float()
    codes[..., 0] = 127  # each block reaches 127, so its scale is max / 127
    d = (torch.rand(32, 4, 1, generator=g) * 0.02 + 0.001).half().float()
    w8 = (codes * d).reshape(32, 128)
    raw8 = gguf_rows_from_float(w8, GGMLQuantizationType.Q8_0)
    assert raw8.shape == (32, 4 * 34)
    assert torch.equal(reference(raw8.numpy(), "Q8_0", 32, 128), w8)
    w = torch.randn(32, 128, generator=g)
    raw4 = gguf_rows_from_float(w, GGMLQuantizationType.Q4_1)
    q, scale, low = q4_blocks(w)
    assert torch.equal(
        reference(raw4.numpy(), "Q4_1", 32, 128), (q * scale.unsqueeze(-1) + low.unsqueeze(-1)).view(32, 128)
    )
    layer = NativeLinear.from_gguf([(raw4, GGMLQuantizationType.Q4_1)], 128, passes=2)
    x = activations(3, 128, seed=10)
    assert_exact_up_to_activations(layer(x), x, reference(raw4.numpy(), "Q4_1", 32, 128), passes=2, group=32)


@pytest.mark.slow
@pytest.mark.parametrize(("march", "path"), OTHER_PATHS)
def test_the_avx2_and_portable_paths_pass_these_tests(march: str, path: str) -> None:
    """This machine builds the AVX-512 path; older CPUs get the AVX2 or the plain C one: build those and run this
    file's tests against them."""
    rerun_on_path(__file__, march, path, "not avx2_and_portable")  # the child runs all but this test
    assert lib is not None
