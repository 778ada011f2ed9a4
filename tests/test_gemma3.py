"""Gemma 3 (270M, from its GGUF) through the shared decoder in float32: the reference continuations and
log-probabilities, a prompt longer than two sliding windows against HF transformers on the same file
(tests/data/hf_extra.json), mixed batches with prefix caching, the chat format, and the server."""

from pathlib import Path

import numpy as np
import pytest

from tests.conftest import load_reference
from tests.test_engine import token_lists
from tests.test_golden import check_greedy, greedy
from tokenmill import LLM, SamplingParams


@pytest.fixture(scope="module")
def gemma(gemma3_path: Path) -> LLM:
    engine = LLM(str(gemma3_path), max_num_batched_tokens=256)  # long prompts in chunks
    yield engine
    engine.engine.check_integrity()


def long_prompt_text() -> str:
    """About 1,200 tokens: more than two of the local layers' 512-token windows."""
    items = " ".join(
        f"Item {i}: the {['red', 'blue', 'green', 'old', 'new'][i % 5]} box holds {i * 7 % 13} stones."
        for i in range(90)
    )
    return items + " Question: which item holds the most stones? Answer:"


def long_prompt(gemma: LLM) -> list[int]:
    return gemma.get_tokenizer().encode(long_prompt_text())


def test_architecture_traits(gemma: LLM) -> None:
    c = gemma.engine.model_config
    assert (c.activation, c.qk_norm, c.sandwich_norms, c.sliding_window) == ("gelu_tanh", True, True, 512)
    assert [c.is_local(i) for i in range(7)] == [True] * 5 + [False, True]  # one global layer in six
    assert gemma.engine.runner.decode_backend is None  # float32: the torch path computes every token


@pytest.mark.slow
def test_reference_greedy_and_logprobs(gemma: LLM, gemma3_reference: dict) -> None:
    gens = gemma3_reference["generations"]
    outs = gemma.generate([{"prompt_token_ids": g["prompt_ids"]} for g in gens], greedy(32), use_tqdm=False)
    check_greedy(token_lists(outs), [g["hf_fp32_greedy"] for g in gens])
    for g, out in zip(gens, outs, strict=True):
        first = out.outputs[0].logprobs[0]
        for token, expected in zip(g["hf_fp32_top10_ids"], g["hf_fp32_top10_logprobs"], strict=True):
            assert token in first and abs(first[token].logprob - expected) < 2e-3


def test_reference_prompts_from_text(gemma: LLM, gemma3_reference: dict) -> None:
    for g in gemma3_reference["generations"]:
        out = gemma.generate(g["prompt"], greedy(8), use_tqdm=False)[0]
        assert out.prompt_token_ids == g["prompt_ids"]  # BOS added, SentencePiece pieces
        assert out.outputs[0].token_ids == g["hf_fp32_greedy"][:8]


@pytest.mark.slow
def test_a_prompt_longer_than_the_window_matches_hf(gemma: LLM) -> None:
    """1,193 tokens in 256-token chunks: local layers see only their window (a layer that saw everything would
    move the log-probabilities far more than 1e-3). HF's tokens and log-probabilities: tests/data/hf_extra.json."""
    expected = load_reference("hf_extra")["gemma3_long"]
    ids = long_prompt(gemma)
    assert ids == expected["prompt_ids"] and len(ids) > 2 * gemma.engine.model_config.sliding_window
    out = gemma.generate({"prompt_token_ids": ids}, greedy(12), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == expected["greedy"]
    hf_logprobs = dict(zip(expected["top_ids"], expected["top_logprobs"], strict=True))
    assert set(out.logprobs[0]) <= set(hf_logprobs)  # our top 10 (and the chosen token) among HF's top 20
    for token, lp in out.logprobs[0].items():
        assert abs(lp.logprob - hf_logprobs[token]) < 1e-3


@pytest.mark.slow
def test_mixed_batches_with_windows_and_prefix_caching(gemma: LLM) -> None:
    """Long prompts sharing a 1,000-token prefix (prefix-cache hits past the window) and short ones, in one
    batch: each gets the tokens it gets alone."""
    base = long_prompt(gemma)
    rng = np.random.default_rng(3)
    prompts = [base[:1000] + rng.integers(1000, 20000, size=n).tolist() for n in (5, 200)]
    prompts += [rng.integers(1000, 20000, size=n).tolist() for n in (3, 600)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    hits = gemma.stats()["prefix_cache_hit_tokens"]
    together = token_lists(gemma.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False))
    assert gemma.stats()["prefix_cache_hit_tokens"] > hits
    alone = LLM(gemma.engine.model_path.as_posix(), enable_prefix_caching=False)
    assert together == [
        token_lists(alone.generate({"prompt_token_ids": p}, params, use_tqdm=False))[0] for p in prompts
    ]


def test_chat_uses_gemmas_turns_and_stops_at_end_of_turn(gemma: LLM) -> None:
    """The GGUF has no template: Gemma's turn format, with the system message before the first user turn."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a color."}]
    text = gemma.engine.chat_template.render(messages)
    assert text == "<bos><start_of_turn>user\nBe brief.\n\nName a color.<end_of_turn>\n<start_of_turn>model\n"
    ids = gemma.engine.encode_chat(messages)
    assert ids[0] == gemma.get_tokenizer().bos_token_id and ids.count(gemma.get_tokenizer().bos_token_id) == 1
    # <end_of_turn> ends the answer (forced here: this 270M model is a base model, it rarely ends its turns)
    end_of_turn = gemma.get_tokenizer().token_to_id("<end_of_turn>")
    forced = SamplingParams(temperature=0, max_tokens=16, logit_bias={end_of_turn: 100.0})
    out = gemma.chat(messages, forced)[0].outputs[0]
    assert (out.finish_reason, out.token_ids, out.text) == ("stop", [end_of_turn], "")


@pytest.mark.slow
@pytest.mark.server
def test_the_server_streams_gemma_chat(gemma3_path: Path) -> None:
    import httpx
    from openai import OpenAI

    from tests.server_utils import start_server

    server = start_server("--model", str(gemma3_path))
    try:
        client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        model = client.models.list().data[0].id
        stream = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Say hello."}], max_tokens=24, stream=True
        )
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text.strip() and chunks[-1].choices[0].finish_reason in ("stop", "length")
        # a base model (no chat template in its file): the log says so, and the explorer starts in raw-text mode
        assert "no chat template in its file, so it is most likely a base model" in server.output()
        info = httpx.get(f"{server.url}/explorer/info").json()
        assert "base model" in info["base_model_note"] and info["sampling_defaults"]["top_k"] == 64
    finally:
        server.stop()


@pytest.mark.slow
def test_two_ranks_give_one_ranks_tokens(gemma: LLM, gemma3_reference: dict) -> None:
    """Tensor parallelism serves this architecture too: 4 heads over 2 ranks, its one KV head replicated."""
    prompts = [{"prompt_token_ids": g["prompt_ids"]} for g in gemma3_reference["generations"]]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    two = LLM(gemma.engine.model_path.as_posix(), tensor_parallel_size=2)
    try:
        assert token_lists(two.generate(prompts, params, use_tqdm=False)) == token_lists(
            gemma.generate(prompts, params, use_tqdm=False)
        )
    finally:
        two.close()


def agreement(tokens: list[int], reference: list[int]) -> int:
    """How many tokens agree before the first difference."""
    return next((i for i, (a, b) in enumerate(zip(tokens, reference, strict=False)) if a != b), len(reference))


@pytest.mark.slow
def test_auto_decodes_natively_and_keeps_the_reference_tokens(gemma3_path: Path, gemma3_reference: dict) -> None:
    """`auto`: generated tokens through the native decoder (GeGLU, QK-norm, sandwich norms, local layers with
    their own rope base), every projection from the file's own blocks (Q5_0, Q8_0, Q4_K, Q6_K: no re-coding):
    over the first 10 greedy tokens of the reference prompts, as many agree with HF float32 before the first
    difference as llama.cpp's on the same file (measured with one activation pass: 10, 4, 10 and 10 of 10;
    llama.cpp 10, 4, 10 and 8)."""
    from gguf import GGMLQuantizationType as T

    from tokenmill.layers.quantized_linear import NativeLinear

    auto = LLM(str(gemma3_path), quantization="auto")
    assert auto.engine.runner.decode_backend is not None
    layer = auto.engine.runner.model.layers[0]
    assert isinstance(layer.mlp.gate_up_proj, NativeLinear)
    assert layer.mlp.gate_up_proj.part_types == [T.Q5_0]  # as in the file
    assert layer.self_attn.o_proj.part_types == [T.Q4_K]
    gens = gemma3_reference["generations"]
    outs = auto.generate([{"prompt_token_ids": g["prompt_ids"]} for g in gens], greedy(10), use_tqdm=False)
    ours = sum(agreement(o.outputs[0].token_ids, g["hf_fp32_greedy"][:10]) for o, g in zip(outs, gens, strict=True))
    assert ours >= sum(agreement(g["llamacpp_greedy"][:10], g["hf_fp32_greedy"][:10]) for g in gens)


@pytest.mark.slow
def test_native_decoder_computes_what_the_torch_path_does(gemma: LLM, gemma3_path: Path) -> None:
    """int4 (the same 4-bit kernels on both paths): the native decoder's tokens equal the torch path's, also
    after a prompt longer than two windows, where its local layers must skip what left their window."""
    int4 = LLM(str(gemma3_path), quantization="int4", max_num_batched_tokens=512)
    native = int4.engine.runner.decode_backend
    assert native is not None
    prompts = [{"prompt_token_ids": long_prompt(gemma)}, {"prompt_token_ids": long_prompt(gemma)[:40]}]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with_native = token_lists(int4.generate(prompts, params, use_tqdm=False))
    int4.engine.runner.decode_backend = None
    assert token_lists(int4.generate(prompts, params, use_tqdm=False)) == with_native


@pytest.mark.slow
def test_a_2000_token_sequence_holds_only_its_windows_blocks(gemma: LLM) -> None:
    """The 15 local layers keep their K/V in a pool of their own, and a block goes back to it once it left the
    512-token window: a 2,000-token sequence holds 126 blocks of the 3 global layers' pool but at most 33 of
    the local one (one pool for all 18 layers: 126 blocks of every layer, 71 MiB against 23 MiB here)."""
    engine = gemma.engine
    wm = engine.window_manager
    assert wm is not None and engine.runner.num_local_blocks == wm.num_blocks
    ids = (long_prompt(gemma) * 2)[:2000]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine.add_request("long", {"prompt_token_ids": ids}, params)
    held = []
    while engine.has_unfinished_requests():
        engine.step()
        held += [(len(s.block_table), wm.held_blocks(s)) for s in engine.scheduler.running]
    assert held[-1][0] == 126  # 2,003 tokens with K/V in the cache
    assert max(local for _, local in held) <= 512 // 16 + 1
    assert engine.stats()["kv_local_blocks_in_use"] == 0
    engine.check_integrity()


@pytest.mark.slow
def test_speculation_across_the_window_gives_the_same_tokens(gemma: LLM) -> None:
    """n-gram speculation on Gemma: accepted proposals advance both pools (the window pool releases what left
    the 512-token window), and the greedy tokens are plain decoding's, past the window's edge."""
    path = gemma.engine.model_path.as_posix()
    plain = LLM(path, quantization="auto")  # auto for CI's time: the pools work the same way
    spec = LLM(path, quantization="auto", speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    ids = long_prompt(gemma)[:490]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected = plain.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0].outputs[0].token_ids
    assert spec.generate({"prompt_token_ids": ids}, params, use_tqdm=False)[0].outputs[0].token_ids == expected
    assert spec.stats()["spec_decode_num_accepted_tokens"] > 0
    spec.engine.check_integrity()
