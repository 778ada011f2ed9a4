"""The bundled model in float32 against HF transformers float32 on the same GGUF: the shared reference data,
then other prompts and texts (transformers' numbers in tests/data/hf_extra.json, tests/data/make_hf_extra.py).

HF's reference continuations never stop at EOS (generation was forced to 32 tokens), so we ask for
min_tokens=32, which bans EOS the same way; llama.cpp's continuations instead run on past EOS (ignore_eos)."""

import pytest
import torch

from tests.conftest import load_reference
from tokenmill import LLM, PoolingParams, SamplingParams

OTHER_CHATS = [
    "Explain what a KV cache is in one paragraph.",
    "Write a Python function that reverses a string.",
    "What is the capital of France?",
    "List three uses of magnets.",
]
OTHER_RAW = [
    "The three primary colors are",
    "def fibonacci(n):\n",
    "In 1969, humans first",
]
OTHER_NEW_TOKENS = 24
SCORED_TEXT = "Tokenizers split text into pieces; the model then predicts the next piece, one at a time. 🚀"
EMBEDDED_TEXTS = [SCORED_TEXT, "The cat sat on the mat.", "x"]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, logprobs=10)


def agreeing_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def check_greedy(ours: list[list[int]], expected: list[list[int]]) -> None:
    prefixes = [agreeing_prefix(a, b) for a, b in zip(ours, expected, strict=True)]
    assert all(p >= 1 for p in prefixes), f"first token differs: {prefixes}"
    assert sum(p < 16 for p in prefixes) <= 1, f"tokens agreeing per prompt: {prefixes}"


def test_reference_greedy_and_logprobs(llm: LLM, smollm2_reference: dict) -> None:
    gens = smollm2_reference["generations"]
    outs = llm.generate([{"prompt_token_ids": g["prompt_ids"]} for g in gens], greedy(32), use_tqdm=False)
    check_greedy([o.outputs[0].token_ids for o in outs], [g["hf_fp32_greedy"] for g in gens])
    for g, out in zip(gens, outs, strict=True):
        first = out.outputs[0].logprobs[0]  # raw log-probabilities after the prompt
        for token, expected in zip(g["hf_fp32_top10_ids"], g["hf_fp32_top10_logprobs"], strict=True):
            assert token in first, f"{token} not in our top 10"
            assert abs(first[token].logprob - expected) < 2e-3


@pytest.mark.parametrize(("kv_cache_dtype", "drift"), [("float16", 0.01), ("bfloat16", 0.06)])
def test_reference_greedy_with_a_16_bit_kv_cache(smollm2_reference: dict, kv_cache_dtype: str, drift: float) -> None:
    """K/V kept in 16 bits (float32 weights): the reference's greedy tokens unchanged, all 32 of every prompt
    (measured), and the first step's top-10 log-probabilities within `drift` of HF float32 (measured 0.0043 with
    float16, 0.028 with bfloat16, against 3e-5 with a float32 cache)."""
    llm = LLM(kv_cache_dtype=kv_cache_dtype, num_kv_blocks=64)
    assert llm.engine.runner.kv_dtype == getattr(torch, kv_cache_dtype)
    gens = smollm2_reference["generations"]
    outs = llm.generate([{"prompt_token_ids": g["prompt_ids"]} for g in gens], greedy(32), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [g["hf_fp32_greedy"] for g in gens]
    for g, out in zip(gens, outs, strict=True):
        first = out.outputs[0].logprobs[0]
        for token, expected in zip(g["hf_fp32_top10_ids"], g["hf_fp32_top10_logprobs"], strict=True):
            assert abs(first[token].logprob - expected) < drift


def test_reference_with_an_int8_kv_cache(smollm2_reference: dict) -> None:
    """K/V in int8 with a float32 scale per token and head (float32 weights): the first step's top-10
    log-probabilities within 0.25 of HF float32 (measured 0.17 at most, median 0.13 on Intel, 0.23 at most on AMD
    Zen 4; llama.cpp's q8_0 K/V moves its own by -0.01 to +0.1 at the median: benchmarks/accuracy.py --kv-int8), and
    the greedy tokens of at least four of the six prompts agree for 8 or more (measured 9, 28-32, 32, 29, 0, 11 on
    Intel, 6, 17, 32, 32, 0, 11 on Zen 4: prompt 4's first token is a near-tie). HF's ninth and tenth of prompt 4
    are near-tied with its eleventh, and on Zen 4 the ninth ranks eleventh here, so 20 are asked for and HF's ten
    looked up among them. A quarter of float32's bytes plus the scales."""
    llm = LLM(kv_cache_dtype="int8", num_kv_blocks=64)
    assert llm.engine.runner.kv_dtype == torch.int8
    gens = smollm2_reference["generations"]
    params = SamplingParams(temperature=0.0, max_tokens=32, min_tokens=32, logprobs=20)
    outs = llm.generate([{"prompt_token_ids": g["prompt_ids"]} for g in gens], params, use_tqdm=False)
    agree = [agreeing_prefix(o.outputs[0].token_ids, g["hf_fp32_greedy"]) for o, g in zip(outs, gens, strict=True)]
    assert sum(n >= 8 for n in agree) >= 4, agree
    for g, out in zip(gens, outs, strict=True):
        first = out.outputs[0].logprobs[0]
        for token, expected in zip(g["hf_fp32_top10_ids"], g["hf_fp32_top10_logprobs"], strict=True):
            assert token in first and abs(first[token].logprob - expected) < 0.25


def test_reference_prompts_from_text(llm: LLM, smollm2_reference: dict) -> None:
    """The same prompts given as text (chat through LLM.chat) produce the same tokens."""
    for g in smollm2_reference["generations"][:3]:
        if g["kind"] == "chat":
            out = llm.chat([{"role": "user", "content": g["prompt"]}], greedy(16))[0]
        else:
            out = llm.generate(g["prompt"], greedy(16), use_tqdm=False)[0]
        assert out.prompt_token_ids == g["prompt_ids"]
        assert out.outputs[0].token_ids == g["hf_fp32_greedy"][:16]


@pytest.fixture(scope="module")
def hf_extra() -> dict:
    """HF transformers float32 on the prompts and texts above (tests/data/make_hf_extra.py makes it again)."""
    return load_reference("hf_extra")


@pytest.mark.slow
def test_other_prompts_against_hf(llm: LLM, hf_extra: dict) -> None:
    tokenizer = llm.get_tokenizer()
    prompts = [llm.engine.encode_chat([{"role": "user", "content": c}]) for c in OTHER_CHATS]
    prompts += [tokenizer.encode(r, add_special_tokens=True) for r in OTHER_RAW]
    expected = hf_extra["smollm2_other"]
    assert prompts == [e["prompt_ids"] for e in expected]  # rendered and encoded as when HF was run
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(OTHER_NEW_TOKENS), use_tqdm=False)
    for e, out in zip(expected, outs, strict=True):
        ours = out.outputs[0].logprobs[0]
        for token, lp in zip(e["top_ids"], e["top_logprobs"], strict=True):
            assert abs(ours[token].logprob - lp) < 2e-3
    check_greedy([o.outputs[0].token_ids for o in outs], [e["greedy"] for e in expected])


@pytest.mark.slow
def test_prompt_logprobs_against_hf(llm: LLM, hf_extra: dict) -> None:
    ids = llm.get_tokenizer().encode(SCORED_TEXT)
    expected = hf_extra["smollm2_scored"]
    assert ids == expected["ids"]
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    assert out.prompt_logprobs[0] is None
    for pos in range(1, len(ids)):
        ours = out.prompt_logprobs[pos][ids[pos]].logprob
        assert abs(ours - expected["next_logprobs"][pos - 1]) < 2e-3, pos


@pytest.mark.slow
def test_embeddings_are_hf_final_hidden_states_pooled(llm: LLM, hf_extra: dict) -> None:
    """An embedding is the final norm's output (transformers' last_hidden_state) pooled over the prompt: the mean
    or the last token's, normalized or not."""
    tokenizer = llm.get_tokenizer()
    means = llm.embed(EMBEDDED_TEXTS)
    lasts = llm.embed(EMBEDDED_TEXTS, PoolingParams("last", normalize=False))
    for e, text, mean, last in zip(hf_extra["smollm2_embeddings"], EMBEDDED_TEXTS, means, lasts, strict=True):
        assert tokenizer.encode(text, add_special_tokens=True) == e["ids"]
        assert torch.allclose(torch.tensor(mean), torch.tensor(e["mean"]), atol=2e-4), text
        assert torch.allclose(torch.tensor(last), torch.tensor(e["last"]), rtol=1e-3, atol=2e-3), text
