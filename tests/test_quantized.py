"""Quantized modes: kernels agree with float32, and the bundled model keeps the reference's greedy tokens."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.test_golden import greedy
from tokenmill import LLM, native
from tokenmill.errors import InvalidParameterError
from tokenmill.layers.quantized_linear import (
    AutoLinear,
    BFloat16Head,
    Int4Linear,
    Int8Linear,
    Q8Embedding,
    Q8Linear,
    four_bit_linear,
    q4_blocks_from_gguf,
    q8_blocks_from_gguf,
)
from tokenmill.loader.dequantize import dequantize
from tokenmill.loader.gguf_file import GGUFFile


def q4_1_grid_weight(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Weights on a Q4_1 grid (q * d + m per block of 32, every block using codes 0 and 15), with d and m
    exactly representable in bfloat16, as GGUF Q4_1 blocks are after conversion."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (rows, cols // 32, 32), generator=g).float()
    q[..., 0], q[..., 1] = 0, 15
    d = (torch.rand(rows, cols // 32, 1, generator=g) * 0.05 + 0.01).bfloat16().float()
    m = (-torch.rand(rows, cols // 32, 1, generator=g) * 0.3).bfloat16().float()
    return (q * d + m).reshape(rows, cols)


def test_int4_keeps_q4_1_weights_exactly() -> None:
    w = q4_1_grid_weight(64, 128)
    layer = Int4Linear(w)
    eye = torch.eye(128)
    recovered = layer(eye).T  # each unit vector reads one column of the weight
    assert torch.allclose(recovered, w, atol=1e-2, rtol=0)  # bfloat16 activations: the rest is output rounding
    x = torch.randn(3, 128)
    assert torch.allclose(layer(x), F.linear(x, w), rtol=0.02, atol=0.05)


def test_int8_and_bf16_head_are_close_to_float32() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 64, generator=g) * 0.1
    x = torch.randn(5, 64, generator=g)
    ref = F.linear(x, w)
    # bfloat16 activations and outputs (8 significant bits) plus int8 weights: about 1% of the output's range
    # (1.4% at worst over 300 random draws); a wrong kernel is off by the whole range
    tolerance = 0.02 * ref.abs().max()
    assert (Int8Linear(w)(x) - ref).abs().max() < tolerance
    assert (BFloat16Head(w)(x) - ref).abs().max() < tolerance
    assert (BFloat16Head(w)(x[:1]) - ref[:1]).abs().max() < tolerance  # the single-row torch.mv path


@pytest.mark.parametrize("dense_bfloat16", [False, True])
def test_auto_linear_is_dense_for_any_rows_and_keeps_4bit_weights_for_the_native_decoder(dense_bfloat16: bool) -> None:
    """The torch path (prompt tokens) computes every row count with the dense weight: which kernel a row meets
    never depends on how many rows share its step."""
    w = q4_1_grid_weight(64, 128, seed=1)
    auto = AutoLinear(w, dense_bfloat16=dense_bfloat16)
    for rows in (1, 4, 5, 33):
        x = torch.randn(rows, 128)
        dense = F.linear(x.bfloat16(), w.bfloat16()).float() if dense_bfloat16 else F.linear(x, w)
        assert torch.equal(auto(x), dense)
    assert (auto.packed is not None) == (native.load() is not None)
    if auto.packed is not None:
        x = torch.randn(3, 128)
        assert torch.equal(auto.packed(x), four_bit_linear(w)(x))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["int8", "int4", "auto"])
def test_quantized_modes_keep_the_reference_tokens(mode: str, smollm2_reference: dict) -> None:
    """First token equal to HF float32's after every reference prompt; the first 8 agree on all but one."""
    llm = LLM(quantization=mode)
    gens = smollm2_reference["generations"]
    outs = llm.generate([{"prompt_token_ids": g["prompt_ids"]} for g in gens], greedy(8), use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outs]
    expected = [g["hf_fp32_greedy"][:8] for g in gens]
    assert all(t[0] == e[0] for t, e in zip(tokens, expected, strict=True))
    assert sum(t != e for t, e in zip(tokens, expected, strict=True)) <= 1
    if mode == "int4":
        # the file's own 4-bit weights, as HF's float32 has them, so the drift is the activations' quantization
        # (two int8 passes: 0.0033 at most; one pass, as llama.cpp's, moved them by 0.1-0.24)
        for out, g in zip(outs, gens, strict=True):
            first = out.outputs[0].logprobs[0]
            for token, expected_logprob in zip(g["hf_fp32_top10_ids"], g["hf_fp32_top10_logprobs"], strict=True):
                assert abs(first[token].logprob - expected_logprob) < 0.01


def test_unknown_quantization_is_rejected() -> None:
    with pytest.raises(InvalidParameterError, match="quantization 'fp8'"):
        LLM(quantization="fp8")


def test_q8_embedding_looks_up_exactly_the_dequantized_table(bundled_path) -> None:
    """The quantized modes keep a Q8_0 embedding as its blocks (a quarter of the memory): every looked-up row must
    be the very float32 values of the whole table dequantized."""
    t = GGUFFile(bundled_path).tensor("token_embd.weight")
    table = dequantize(t.data, t.ggml_type, t.shape)
    blocks = q8_blocks_from_gguf(torch.from_numpy(np.array(t.data, copy=True)).view(torch.uint8), t.ggml_type)
    embedding = Q8Embedding(*blocks)
    ids = torch.tensor([0, 1, 2020, 49151, 2020, 17])
    assert torch.equal(embedding(ids), table[ids])
    assert embedding.codes.nbytes + embedding.scale.nbytes < table.nbytes / 3  # 1.06 bytes a value, not 4


def test_a_tied_q8_head_gives_the_embedding_rows(bundled_path) -> None:
    """A tied Q8_0 table is looked up from the head's interleaved codes (no second copy): the same values."""
    lib = native.load()
    assert lib is not None
    t = GGUFFile(bundled_path).tensor("token_embd.weight")
    table = dequantize(t.data, t.ggml_type, t.shape)
    blocks = q8_blocks_from_gguf(torch.from_numpy(np.array(t.data, copy=True)).view(torch.uint8), t.ggml_type)
    head = Q8Linear(table, lib, blocks)
    ids = torch.tensor([0, 15, 16, 2020, 49151, 2020])
    assert torch.equal(head.rows(ids), table[ids])
    llm = LLM(quantization="auto")
    model = llm.engine.runner.model
    assert model.token_rows == model.lm_head.rows and model.embed_tokens.numel() == 0
    assert torch.equal(model.embed(ids), table[ids])


def test_reduced_precision_products_run_with_few_row_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    """oneDNN keeps a compiled GEMM per row count for good: bfloat16 products run with 1 or a multiple of 16 rows
    (zero padding, dropped after); float32 ones (MKL, nothing kept) as they are."""
    import tokenmill.layers.linear as linear

    real = F.linear
    seen: list[int] = []
    monkeypatch.setattr(linear.F, "linear", lambda x, weight: seen.append(x.shape[0]) or real(x, weight))
    w = torch.randn(64, 32)
    for rows in (1, 2, 15, 16, 17, 100):
        x = torch.randn(rows, 32)
        out = linear.dense_linear(x.bfloat16(), w.bfloat16())
        assert out.shape == (rows, 64)
        assert torch.allclose(out.float(), real(x, w), rtol=0.05, atol=0.1)
    assert seen == [1, 16, 16, 16, 32, 112]
    seen.clear()
    linear.dense_linear(torch.randn(17, 32), w)
    assert seen == [17]


def test_q4_k_becomes_4_bit_blocks_with_the_files_codes(gemma3_path) -> None:
    """Q4_K super-blocks (8 blocks of 32 with 6-bit scales and minimums) are Q4_1 blocks: the file's codes, the
    scales d * sc and minimums -dmin * mn rounded to half floats; dequantized, they differ from the file's values
    by that rounding alone (relative 2^-11 of a block's range)."""
    from gguf import GGMLQuantizationType

    t = GGUFFile(gemma3_path).tensor("blk.0.attn_output.weight")
    assert t.ggml_type == GGMLQuantizationType.Q4_K
    packed, scale, low = q4_blocks_from_gguf(torch.from_numpy(np.array(t.data)), t.ggml_type)
    codes = torch.cat([packed & 0x0F, packed >> 4], dim=-1).float()  # [rows, blocks, 32]
    ours = (codes * scale.float().unsqueeze(-1) + low.float().unsqueeze(-1)).reshape(t.shape)
    exact = dequantize(t.data, t.ggml_type, t.shape)
    block_range = (15 * scale.float().abs() + low.float().abs()).repeat_interleave(32, dim=1)  # [rows, in]
    assert ((ours - exact).abs() <= block_range * 2**-11).all()
    assert (ours - exact).abs().max() > 0  # the rounding is real: not dequantized twice by the same code
