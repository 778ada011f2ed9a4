"""Quantized modes: kernels agree with float32, and the bundled model keeps the reference's greedy tokens."""

import statistics

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.test_golden import greedy
from tokenmill import LLM, SamplingParams, native
from tokenmill.errors import InvalidParameterError
from tokenmill.layers.linear import Linear
from tokenmill.layers.quantized_linear import BFloat16Head, BlockEmbedding, Int4Linear, Int8Linear, NativeLinear
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


def test_auto_holds_no_float_copy_of_a_weight(bundled_path) -> None:
    """Every projection and the LM head of `auto` run from the file's blocks (NativeLinear): the float tensors
    left are the norms' weights and the rope tables, a few percent of the file."""
    llm = LLM(quantization="auto")
    model = llm.engine.runner.model
    kinds = {type(m) for m in model.modules() if isinstance(m, Linear | NativeLinear)}
    assert kinds == {NativeLinear}
    floats = [t for t in [*model.parameters(), *model.buffers()] if t.is_floating_point()]
    assert sum(t.nbytes for t in floats) < 0.05 * bundled_path.stat().st_size
    llm.close()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["int8", "int4", "auto"])
def test_quantized_modes_keep_the_reference_tokens(mode: str, smollm2_reference: dict) -> None:
    """Greedy tokens agree with HF float32's at least as long as llama.cpp's on the same file (the reference's):
    the median over the 6 prompts of the tokens (of 32) before the first difference. llama.cpp: 6, 32, 11, 32, 0,
    11 (median 11). With one int8 activation pass, where a prompt leaves HF's tokens is decided by near-ties that
    any change of the arithmetic's last bits moves (prompt 4's first token is one that llama.cpp misses too): `auto`
    measured 6, 1, 32, 32, 15, 32 with torch's prompt attention and 3, 21, 32, 29, 0, 32 with the native one
    (benchmarks/accuracy.py), whose top-10 log-probability drift is no larger (max 0.266 against 0.312). A sum over
    the first 8 tokens, this test's measure until then, swung with one such prompt (39 against 35, llama.cpp 38)."""
    llm = LLM(quantization=mode)
    gens = smollm2_reference["generations"]
    outs = llm.generate([{"prompt_token_ids": g["prompt_ids"]} for g in gens], greedy(32), use_tqdm=False)
    ours = [agreement(o.outputs[0].token_ids, g["hf_fp32_greedy"]) for o, g in zip(outs, gens, strict=True)]
    theirs = [agreement(g["llamacpp_greedy"], g["hf_fp32_greedy"]) for g in gens]
    assert statistics.median(ours) >= statistics.median(theirs), (ours, theirs)
    if mode == "auto":
        # the file's own blocks, as HF's float32 has them dequantized, so the drift of the log-probabilities after
        # the prompt is the activations' quantization: one int8 pass (the default, as llama.cpp's)
        # measured 0.09-0.24 (llama.cpp on this file: 0.14-0.27); two passes at most 0.0023
        prompts = [{"prompt_token_ids": g["prompt_ids"]} for g in gens]
        top20 = SamplingParams(temperature=0, max_tokens=1, logprobs=20)  # HF's top 10 among them
        assert max_top10_drift(llm.generate(prompts, top20, use_tqdm=False), gens) < 0.35
        for module in llm.engine.runner.model.modules():
            if isinstance(module, NativeLinear):
                module.passes = 2
        llm.engine.block_manager.reset_prefix_cache()
        assert max_top10_drift(llm.generate(prompts, top20, use_tqdm=False), gens) < 0.01


def agreement(tokens: list[int], reference: list[int]) -> int:
    """How many tokens agree before the first difference."""
    return next((i for i, (a, b) in enumerate(zip(tokens, reference, strict=False)) if a != b), len(reference))


def max_top10_drift(outs: list, gens: list[dict]) -> float:
    """The largest |log p - log p_HF| over HF's top-10 tokens after each prompt."""
    drifts = []
    for out, g in zip(outs, gens, strict=True):
        first = out.outputs[0].logprobs[0]
        pairs = zip(g["hf_fp32_top10_ids"], g["hf_fp32_top10_logprobs"], strict=True)
        drifts += [abs(first[token].logprob - expected) for token, expected in pairs]
    return max(drifts)


def test_unknown_quantization_is_rejected() -> None:
    with pytest.raises(InvalidParameterError, match="quantization 'fp8'"):
        LLM(quantization="fp8")


def test_block_embedding_looks_up_exactly_the_dequantized_table(bundled_path) -> None:
    """The quantized modes leave the embedding in the file's blocks: every looked-up row must be the very float32
    values of the whole table dequantized, and the table is the file's bytes (a view), not a float copy."""
    t = GGUFFile(bundled_path).tensor("token_embd.weight")
    table = dequantize(t.data, t.ggml_type, t.shape)
    embedding = BlockEmbedding.of(t)
    ids = torch.tensor([0, 1, 2020, 49151, 2020, 17])
    assert torch.equal(embedding(ids), table[ids])
    assert embedding.raw.nbytes < table.nbytes / 3  # Q8_0: 1.06 bytes a value, not 4


def test_a_tied_head_gives_the_embedding_rows(bundled_path) -> None:
    """A tied table is looked up from the head's interleaved blocks (no second copy): the same values."""
    lib = native.load()
    assert lib is not None
    t = GGUFFile(bundled_path).tensor("token_embd.weight")
    table = dequantize(t.data, t.ggml_type, t.shape)
    raw = np.asarray(t.data).reshape(t.shape[0], -1).view(np.uint8)
    head = NativeLinear.from_gguf([(raw, t.ggml_type)], t.shape[1], passes=2)
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
