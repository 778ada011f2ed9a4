"""A tiny random llama written as GGUF (Q/K rows permuted the way llama.cpp converts them) must give the same
logits in tokenmill as in HF transformers' LlamaForCausalLM holding the original weights: proves the rope
un-permutation, GQA, untied and tied heads, and the paged attention paths (prefill, chunks, decode, batches)."""

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers  # a test extra (`make test-deps`, which `make test` runs)

from tests.gguf_builder import TinyLlama, write_tiny_llama
from tokenmill.loader.gguf_file import GGUFFile
from tokenmill.runner.model_runner import ModelRunner, StepChunk


def hf_model(model: TinyLlama, matrix_type: str) -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=model.vocab_size,
        hidden_size=model.hidden,
        intermediate_size=model.intermediate,
        num_hidden_layers=model.layers,
        num_attention_heads=model.heads,
        num_key_value_heads=model.kv_heads,
        max_position_embeddings=model.context,
        rms_norm_eps=model.eps,
        rope_theta=model.rope_theta,
        tie_word_embeddings=model.tie_embeddings,
    )
    hf = transformers.LlamaForCausalLM(config).eval()
    qtype = gguf.GGMLQuantizationType[matrix_type]
    state = {}
    for name, w in model.weights.items():
        if w.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            w = gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype)
        state[name] = torch.from_numpy(np.ascontiguousarray(w))
    if model.tie_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    hf.load_state_dict(state, strict=True)
    return hf


def runner_for(path: Path, block_size: int = 4, num_blocks: int = 64) -> ModelRunner:
    runner = ModelRunner(GGUFFile(path), torch.float32, torch.device("cpu"), block_size)
    runner.allocate_kv_cache(num_blocks)
    return runner


@pytest.mark.parametrize("matrix_type,tie", [("F32", False), ("F32", True), ("Q8_0", False), ("F16", True)])
def test_prefill_logits_match_hf(tmp_path: Path, matrix_type: str, tie: bool) -> None:
    model = TinyLlama(tie_embeddings=tie, seed=7)
    path = write_tiny_llama(tmp_path / "tiny.gguf", model, matrix_type)
    runner = runner_for(path)
    hf = hf_model(model, matrix_type)
    ids = list(np.random.default_rng(1).integers(0, model.vocab_size, size=23))
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0]  # [T, V]
    out = runner.execute([StepChunk(ids, 0, list(range(6)), want_all_logits=True)])
    assert torch.allclose(out.all_logits[0], expected, atol=2e-4), (out.all_logits[0] - expected).abs().max()
    assert torch.allclose(out.last_logits[0], expected[-1], atol=2e-4)


def test_chunks_decodes_and_batches_match_hf(tmp_path: Path) -> None:
    model = TinyLlama(seed=3)
    path = write_tiny_llama(tmp_path / "tiny.gguf", model)
    runner = runner_for(path)
    hf = hf_model(model, "F32")
    rng = np.random.default_rng(2)
    a = [int(x) for x in rng.integers(0, model.vocab_size, size=19)]
    b = [int(x) for x in rng.integers(0, model.vocab_size, size=7)]
    with torch.no_grad():
        ref_a = hf(torch.tensor([a])).logits[0]
        ref_b = hf(torch.tensor([b])).logits[0]
    table_a, table_b = [9, 3, 12, 5, 20], [40, 41]  # scattered physical blocks of 4 slots
    # step 1: sequence a's first chunk (10 tokens) with sequence b's whole prompt
    out = runner.execute([StepChunk(a[:10], 0, table_a), StepChunk(b[:6], 0, table_b)])
    assert torch.allclose(out.last_logits[0], ref_a[9], atol=2e-4)
    assert torch.allclose(out.last_logits[1], ref_b[5], atol=2e-4)
    # step 2: a's second chunk together with b's decode of its 7th token
    out = runner.execute([StepChunk(a[10:18], 10, table_a), StepChunk(b[6:7], 6, table_b)])
    assert torch.allclose(out.last_logits[0], ref_a[17], atol=2e-4)
    assert torch.allclose(out.last_logits[1], ref_b[6], atol=2e-4)
    # step 3: a decodes alone
    out = runner.execute([StepChunk(a[18:19], 18, table_a)])
    assert torch.allclose(out.last_logits[0], ref_a[18], atol=2e-4)


def test_block_copy(tmp_path: Path) -> None:
    """copy_blocks duplicates K/V, so a sequence continued on the copy gives the same logits."""
    model = TinyLlama(seed=5)
    runner = runner_for(write_tiny_llama(tmp_path / "tiny.gguf", model))
    ids = list(range(3, 13))
    runner.execute([StepChunk(ids[:9], 0, [1, 2, 3])])
    runner.copy_blocks([(3, 7)])
    on_original = runner.execute([StepChunk(ids[9:10], 9, [1, 2, 3])]).last_logits[0]
    on_copy = runner.execute([StepChunk(ids[9:10], 9, [1, 2, 7])]).last_logits[0]
    assert torch.equal(on_original, on_copy)


def test_a_prompt_longer_than_the_mlp_pieces_matches_hf_and_its_own_unsplit_mlp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """250 prompt tokens: the MLP runs in pieces of MLP_ROWS (model/llama.py). Dense float32 logits still match
    HF's; with the native products (Q8_0 under `auto`) they are the same bits as one MLP over all rows."""
    from tokenmill.model import llama

    model = TinyLlama(seed=3)
    ids = list(np.random.default_rng(2).integers(0, model.vocab_size, size=250))
    assert len(ids) > 1.5 * llama.MLP_ROWS
    path = write_tiny_llama(tmp_path / "tiny.gguf", model, "F32")
    with torch.no_grad():
        expected = hf_model(model, "F32")(torch.tensor([ids])).logits[0]  # [T, V]
    out = runner_for(path).execute([StepChunk(ids, 0, list(range(63)), want_all_logits=True)])
    assert torch.allclose(out.all_logits[0], expected, atol=2e-4), (out.all_logits[0] - expected).abs().max()

    path = write_tiny_llama(tmp_path / "tiny-q8.gguf", model, "Q8_0")

    def native_logits() -> torch.Tensor:
        runner = ModelRunner(GGUFFile(path), torch.float32, torch.device("cpu"), 4, "auto")
        runner.allocate_kv_cache(64)
        return runner.execute([StepChunk(ids, 0, list(range(63)), want_all_logits=True)]).all_logits[0]

    split = native_logits()
    monkeypatch.setattr(llama, "MLP_ROWS", 10**9)
    assert torch.equal(split, native_logits())
