"""gpt-oss: a tiny random-weight model (tests/gguf_builder.py: sinks, biases on every attention projection and
expert, the router's top k then softmax, the clamped SwiGLU, sliding-window layers between full ones, YaRN) as
llama.cpp's converter writes it (float, or its experts MXFP4) and as the Hub ships it (transformers' float
checkpoint, or the experts as MXFP4 `*_blocks`/`*_scales`) gives HF transformers' float32 logits and greedy tokens."""

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers

from tests.gguf_builder import TinyModel, write_tiny_gguf
from tests.moe_cases import (
    GPT_OSS,
    GREEDY_TOKENS,
    LLAMACPP_VOCAB,
    PROMPT,
    gpt_oss_hf_config,
    tensor_digests,
    write_mxfp4_checkpoint,
)
from tokenmill import LLM, SamplingParams
from tokenmill.distributed.shard import ShardPlan
from tokenmill.layers.attention import attention_with_sinks
from tokenmill.layers.moe import route
from tokenmill.loader.gguf_file import GGUFFile
from tokenmill.loader.hf_checkpoint import HFCheckpoint
from tokenmill.model.config_from_source import model_config_from_source
from tokenmill.runner.model_runner import ModelRunner, StepChunk
from tokenmill.tokenizer.gguf_tokenizer import Tokenizer


def hf_model(model: TinyModel, truncate: bool = True) -> torch.nn.Module:
    config = gpt_oss_hf_config(model, truncate)
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    hf.load_state_dict({n: torch.from_numpy(np.ascontiguousarray(w)) for n, w in model.weights.items()}, strict=True)
    return hf


def hf_outputs(hf: torch.nn.Module) -> tuple[torch.Tensor, list[int], torch.Tensor]:
    """HF's prompt logits, greedy continuation and the log-probabilities along it."""
    with torch.no_grad():
        logits = hf(torch.tensor([PROMPT])).logits[0]
        out = hf.generate(
            torch.tensor([PROMPT]), max_new_tokens=GREEDY_TOKENS, min_new_tokens=GREEDY_TOKENS, do_sample=False
        )
        logprobs = torch.log_softmax(hf(out).logits[0], dim=-1)
    return logits, out[0, len(PROMPT) :].tolist(), logprobs


@pytest.fixture(scope="module")
def case(tmp_path_factory) -> dict:
    """The model's GGUF files (float; experts MXFP4), HF's model and outputs, and its two checkpoint directories."""
    root = tmp_path_factory.mktemp("gpt-oss")
    model = replace(GPT_OSS, weights={})
    path = write_tiny_gguf(root / "gpt-oss.gguf", model)
    mxfp4_path = write_tiny_gguf(root / "gpt-oss-mxfp4.gguf", model, expert_type="MXFP4")
    hf = hf_model(model)
    logits, greedy, logprobs = hf_outputs(hf)
    float_dir, mxfp4_dir = root / "hf", root / "hf-mxfp4"
    hf.save_pretrained(float_dir)
    Tokenizer.from_gguf(GGUFFile(path)).backend.save(str(float_dir / "tokenizer.json"))
    write_mxfp4_checkpoint(model, float_dir, mxfp4_dir)
    return {
        "model": model, "path": path, "mxfp4_path": mxfp4_path, "hf": hf, "logits": logits, "greedy": greedy,
        "lp": logprobs, "float_dir": float_dir, "mxfp4_dir": mxfp4_dir,
    }  # fmt: skip


def prompt_logits(source, quantization: str | None = None) -> torch.Tensor:
    runner = ModelRunner(source, torch.float32, torch.device("cpu"), 4, quantization=quantization)
    runner.allocate_kv_cache(16)
    return runner.execute([StepChunk(PROMPT, 0, list(range(10)), want_all_logits=True)]).all_logits[0]


def assert_close(ours: torch.Tensor, expected: torch.Tensor, atol: float = 1e-4) -> None:
    assert torch.allclose(ours, expected, atol=atol, rtol=0), (ours - expected).abs().max()


def test_config_reads_gpt_oss(case: dict) -> None:
    for source in (GGUFFile(case["path"]), HFCheckpoint(case["float_dir"]), HFCheckpoint(case["mxfp4_dir"])):
        c = model_config_from_source(source)
        assert (c.num_experts, c.experts_per_token, c.expert_intermediate_size) == (4, 2, 32)
        assert c.local_layers == (True, False, True, False) and c.sliding_window == 8
        assert c.attention_sinks and c.attention_bias and c.attention_output_bias and c.expert_biases
        assert c.activation == "swiglu_oai" and c.expert_softmax_after_topk and c.local_rope_theta is None


@pytest.mark.parametrize("file", ["path", "mxfp4_path"])
def test_prompt_logits_match_hf(case: dict, file: str) -> None:
    """The converter's float file, and the one whose experts are MXFP4 blocks (dequantized: the same values)."""
    assert_close(prompt_logits(GGUFFile(case[file])), case["logits"])


def test_greedy_tokens_match_hf(case: dict) -> None:
    """Through the engine: the prompt in 16-token chunks (the later ones attend through the cache, the sliding
    layers to their window only), then decodes, each with HF's log-probabilities."""
    llm = LLM(str(case["mxfp4_path"]), max_num_batched_tokens=16, num_kv_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS, ignore_eos=True, logprobs=5)
    out = llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == case["greedy"]
    for i, top in enumerate(out.logprobs):
        expected = case["lp"][len(PROMPT) - 1 + i]
        assert max(abs(lp.logprob - expected[token].item()) for token, lp in top.items()) < 1e-4, i


@pytest.mark.parametrize("directory", ["float_dir", "mxfp4_dir"])
def test_checkpoints_match_hf(case: dict, directory: str) -> None:
    """transformers' own checkpoint (fused experts, inputs by outputs, gate and up interleaved) and the Hub's MXFP4
    layout of the same weights."""
    assert_close(prompt_logits(HFCheckpoint(case[directory])), case["logits"])


def test_yarn_without_truncation_from_the_checkpoint(case: dict, tmp_path: Path) -> None:
    """The released config's `truncate: false` (YaRN's ramp not rounded to whole dimensions) is HF's."""
    hf = hf_model(case["model"], truncate=False)
    hf.save_pretrained(tmp_path)
    (tmp_path / "tokenizer.json").write_bytes((case["float_dir"] / "tokenizer.json").read_bytes())
    expected = hf_outputs(hf)[0]
    assert not torch.allclose(expected, case["logits"], atol=1e-4, rtol=0)  # it does change the model
    assert_close(prompt_logits(HFCheckpoint(tmp_path)), expected)


def test_route_top_k_then_softmax() -> None:
    logits = torch.tensor([[2.0, 0.0, 1.0, -1.0], [0.0, 3.0, 3.0, 1.0]])
    weights, ids = route(logits, 2, normalize=False, softmax_after_topk=True)
    assert ids.tolist() == [[0, 2], [1, 2]]
    assert torch.allclose(weights, torch.softmax(logits.gather(1, ids), dim=-1))


def test_attention_with_sinks() -> None:
    """Each head's softmax has exp(sink) more in its sum and nothing more in its output: transformers' eager
    formula; a sink of -inf is plain attention."""
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 5, 16), torch.randn(2, 2, 7, 16), torch.randn(2, 2, 7, 16)
    mask = torch.rand(2, 1, 5, 7) > 0.3
    mask[..., 0] = True
    sinks = torch.randn(4)
    ours = attention_with_sinks(q, k, v, mask, 0.25, sinks)
    keys, values = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    scores = (q @ keys.transpose(-1, -2) * 0.25).masked_fill(~mask, float("-inf"))
    combined = torch.cat([scores, sinks.view(1, 4, 1, 1).expand(2, 4, 5, 1)], dim=-1)
    expected = torch.softmax(combined, dim=-1)[..., :-1] @ values
    assert torch.allclose(ours, expected, atol=1e-6)
    plain = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.25, enable_gqa=True)
    assert torch.allclose(attention_with_sinks(q, k, v, mask, 0.25, torch.full((4,), float("-inf"))), plain, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("source", ["gguf", "mxfp4-checkpoint", "mxfp4-gguf-native"])
def test_two_ranks_give_one_ranks_tokens(source: str, tmp_path: Path) -> None:
    """Tensor parallelism over gloo in float32: each rank holds its query heads' Q/K/V biases and sinks and a slice
    of every expert's width with its gate/up biases (64 = 2 ranks x 32-weight blocks); the output projection's bias
    is added once after the sum over ranks, and the experts' down biases are rank 0's. The greedy tokens are one
    rank's, from the GGUF and from the Hub's MXFP4 checkpoint. Under `auto` (MXFP4 experts, the native decoder on
    each rank) the ranks' sums add in another order, so a near-tie may fall otherwise: measured 16 of 16 tokens
    the same, held to the first 8."""
    model = replace(GPT_OSS, expert_intermediate=64, weights={})
    path = write_tiny_gguf(tmp_path / "gpt-oss.gguf", model, expert_type="MXFP4" if source.endswith("native") else None)
    quantization = "auto" if source.endswith("native") else None
    where = str(path)
    if source == "mxfp4-checkpoint":
        hf = hf_model(model)
        hf.save_pretrained(tmp_path / "hf")
        Tokenizer.from_gguf(GGUFFile(path)).backend.save(str(tmp_path / "hf" / "tokenizer.json"))
        write_mxfp4_checkpoint(model, tmp_path / "hf", tmp_path / "hf-mxfp4")
        where = str(tmp_path / "hf-mxfp4")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompt = {"prompt_token_ids": PROMPT}
    single = LLM(where, quantization=quantization)
    assert (single.engine.runner.decode_backend is not None) == (quantization == "auto")  # as on each rank
    one = single.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    two = LLM(where, quantization=quantization, tensor_parallel_size=2)
    try:
        tokens = two.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
        assert tokens == one if quantization is None else tokens[:8] == one[:8], (tokens, one)
    finally:
        two.close()


def test_each_rank_holds_its_share_of_the_biases_and_sinks(case: dict) -> None:
    """The plan's cuts: Q/K/V biases as their rows, sinks by query head, the experts' gate/up biases by columns of
    each expert's width; the output and router biases whole, the experts' down biases rank 0's."""
    config = replace(model_config_from_source(GGUFFile(case["path"])), expert_intermediate_size=64)
    plan = ShardPlan.for_rank(config, 1, 2)
    d = config.head_dim
    assert plan.cut("blk.0.attn_q.bias") == (0, plan.q_heads[0] * d, plan.q_heads[1] * d)
    assert plan.cut("blk.0.attn_sinks.weight") == (0, *plan.q_heads) == (0, 2, 4)
    assert plan.cut("blk.0.ffn_gate_exps.bias") == (1, 32, 64)
    assert plan.cut("blk.0.ffn_up_exps.weight") == (0, 32, 64)
    for whole in ("blk.0.attn_output.bias", "blk.0.ffn_down_exps.bias", "blk.0.ffn_gate_inp.bias"):
        assert plan.cut(whole) is None


LLAMACPP = Path(__file__).parent / "data" / "moe_llamacpp.json"  # made by tests/data/make_moe_llamacpp.py


def test_the_converters_file_gives_llama_cpps_greedy_tokens(tmp_path: Path) -> None:
    """With SmolLM2's vocabulary: tests/gguf_builder.py writes the file llama.cpp's convert_hf_to_gguf.py writes
    from the Hub's MXFP4 layout of the model with --outtype q8_0 (its experts MXFP4 blocks, every other matrix
    Q8_0, as ggml-org's released gpt-oss files; every tensor's bytes the same), and
    tokenmill's greedy tokens on it through the native MXFP4 products are llama.cpp's, whose MXFP4 products
    quantize the activations to int8 per block of 32 as tokenmill's do (the float model's greedy tokens part from
    both at the fifth: this random model's top logits are that close)."""
    recorded = json.loads(LLAMACPP.read_text())["gpt-oss"]
    model = replace(GPT_OSS, vocab_size=LLAMACPP_VOCAB, weights={})
    path = write_tiny_gguf(tmp_path / "gpt-oss.gguf", model, matrix_type="Q8_0", expert_type="MXFP4")
    assert tensor_digests(path) == recorded["tensors"]
    llm = LLM(str(path), quantization="auto", max_num_batched_tokens=16, num_kv_blocks=64)
    params = SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS, ignore_eos=True)
    assert (
        llm.generate({"prompt_token_ids": PROMPT}, params, use_tqdm=False)[0].outputs[0].token_ids == recorded["greedy"]
    )
