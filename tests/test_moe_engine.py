"""The engine's features over mixtures of experts (tiny random Qwen3-MoE and gpt-oss GGUFs with the bundled SmolLM2
tokenizer, so that the bundled model can draft for them): speculative decoding (n-gram and a dense draft model)
gives the tokens plain decoding gives; structured output and a required tool call hold under the native decoder;
an int8 KV cache, continuous batching and the prefix cache keep each sequence's tokens."""

import json
import re
from dataclasses import replace
from pathlib import Path

import jsonschema
import pytest
import torch

from tests.gguf_builder import write_tiny_gguf
from tests.moe_cases import CASES, GPT_OSS, LLAMACPP_VOCAB
from tests.test_golden import agreeing_prefix
from tokenmill import LLM, SamplingParams, StructuredOutputsParams
from tokenmill.loader.model_path import bundled_model_path
from tokenmill.structured import tools

# every proposal the method offers (tests/test_spec_decode.py's): what is tested is that they never change outputs
ALWAYS = {"num_speculative_tokens": 4, "disable_by_batch_size": 64, "verify_row_cost": 0}
PROMPTS = [[1204, 339, 5021, 28, 9876, 412] * 4, [504, 1450, 970, 288, 835, 6256], [19556, 905, 30, 2114]]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
# 48 tokens a prompt: the tiny models' greedy outputs repeat a token or two within that (measured: each model's
# second prompt does), whence n-gram lookup down to 1-grams proposes
LONG = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root, smollm2 = tmp_path_factory.mktemp("moe-engine"), Path(bundled_model_path())
    qwen3moe, gpt_oss = (replace(m, vocab_size=LLAMACPP_VOCAB, weights={}) for m in (CASES["qwen3moe"], GPT_OSS))
    return {
        "qwen3moe": write_tiny_gguf(root / "qwen3moe.gguf", qwen3moe, tokenizer_from=smollm2),
        "gpt-oss": write_tiny_gguf(root / "gpt-oss.gguf", gpt_oss, expert_type="MXFP4", tokenizer_from=smollm2),
    }


def generate(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen3moe", "gpt-oss"])
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculation_keeps_a_mixtures_tokens(files: dict, name: str, method: str) -> None:
    """In float32 (the torch path for target and verification alike), n-gram lookup and the bundled model's 4-bit
    copy drafting for a mixture give plain greedy decoding's tokens, with proposals made and verified; gpt-oss's
    window of 8 on every other layer is passed many times in 72 tokens (its window layers keep their own pool, the
    draft reads the full-attention layers' block tables)."""
    path = str(files[name])
    expected = generate(LLM(path, num_kv_blocks=64), PROMPTS, LONG)
    config = {"method": method, **ALWAYS}
    if method == "draft_model":
        config |= {"model": "smollm2-135m", "quantization": "auto"}
    else:
        config |= {"prompt_lookup_min": 1}
    spec = LLM(path, num_kv_blocks=64, speculative_config=config)
    assert generate(spec, PROMPTS, LONG) == expected
    assert spec.stats()["spec_decode_num_draft_tokens"] > 0


@pytest.mark.parametrize("name", ["qwen3moe", "gpt-oss"])
def test_constrained_output_and_a_tool_call_from_a_mixture(files: dict, name: str) -> None:
    """Under `auto` (generated tokens through the native decoder's mixture) a regex and a required tool call's JSON
    schema hold on sampled tokens, and the call reads back as the function with valid arguments."""
    llm = LLM(str(files[name]), quantization="auto", num_kv_blocks=64)
    assert llm.engine.runner.decode_backend is not None
    pattern = r"[0-9]{3}-[a-z]{2}"
    for seed in range(3):
        params = SamplingParams(temperature=1.0, seed=seed, max_tokens=20, structured_outputs={"regex": pattern})
        out = llm.generate({"prompt_token_ids": PROMPTS[1]}, params, use_tqdm=False)[0].outputs[0]
        assert out.finish_reason == "stop" and re.fullmatch(pattern, out.text), out.text
    unit = {"type": "object", "properties": {"unit": {"enum": ["C", "F"]}}, "required": ["unit"]}
    functions = tools.check_tools(
        [{"type": "function", "function": {"name": "weather", "parameters": {**unit, "additionalProperties": False}}}]
    )
    schema = tools.call_schema(functions)
    params = SamplingParams(
        temperature=1.0, seed=7, max_tokens=40, structured_outputs=StructuredOutputsParams(json=schema)
    )
    out = llm.generate({"prompt_token_ids": PROMPTS[2]}, params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop", out.text
    jsonschema.validate(json.loads(out.text), schema)
    calls = tools.parse_tool_calls(out.text, functions)
    assert calls is not None and [c.name for c in calls] == ["weather"]
    assert json.loads(calls[0].arguments)["unit"] in ("C", "F")


@pytest.mark.parametrize("name", ["qwen3moe", "gpt-oss"])
def test_a_mixtures_batch_int8_cache_and_prefix_cache(files: dict, name: str) -> None:
    """Under `auto`: the prompts decoded together give each one's tokens alone (a row's bits do not depend on its
    step, experts shared or not), again once their prefixes are cached (prefix cache hits counted); an int8 KV
    cache holds int8 and its greedy tokens follow the float32 cache's (a quarter of the bytes; measured 24, 24, 24
    of 24 on Qwen3-MoE, 17, 1, 24 on gpt-oss, whose second prompt's second token is a near-tie: held to the first
    token of every prompt and 8 or more on two)."""
    path = str(files[name])
    llm = LLM(path, quantization="auto", num_kv_blocks=64, kv_cache_dtype="float32")
    together = generate(llm, PROMPTS)
    assert together == [generate(llm, [p])[0] for p in PROMPTS]
    assert llm.stats()["prefix_cache_hit_tokens"] > 0
    int8 = LLM(path, quantization="auto", num_kv_blocks=64, kv_cache_dtype="int8")
    assert int8.engine.runner.kv_dtype == torch.int8
    agree = [agreeing_prefix(a, b) for a, b in zip(generate(int8, PROMPTS), together, strict=True)]
    assert all(n >= 1 for n in agree) and sum(n >= 8 for n in agree) >= 2, agree
