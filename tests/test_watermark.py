"""Output watermarking as vLLM does it (--watermark-config): the scheme bit for bit (vLLM's Philox vector and its
goldens: the tokens its watermarker draws over scripted logits, and its detector's scores), the sampler stage that
draws with it, and a real server started with vLLM's option, through the openai client, whose text the key detects."""

import json
import math

import openai
import pytest
import torch

from tests.conftest import DATA
from tests.server_utils import start_server
from tokenmill.config.watermark import WatermarkConfig
from tokenmill.errors import InvalidParameterError
from tokenmill.runner.sampler import Sampler, SamplingRow
from tokenmill.runner.watermark import Watermarker, reply_context
from tokenmill.runner.watermark_detect import detect
from tokenmill.runner.watermark_prf import uniform
from tokenmill.sampling_params import SamplingParams

GOLDENS = json.loads((DATA / "vllm_watermark_goldens.json").read_text())["candidates"]


def test_philox_matches_vllms_vector() -> None:
    """vLLM's tests/watermarking/test_prf.py: the 24-bit mantissas of two (context, token) pairs under key 42."""
    contexts = torch.tensor([[1, 2, 3, 4], [4, 5, 6, 7]])
    mantissas = torch.tensor([[1661833, 10571167], [9742331, 13375724]], dtype=torch.float64)
    assert torch.equal(uniform(42, contexts, torch.tensor([7, 8])), ((mantissas + 1) / (2**24 + 1)).float())


def fixture_logits(fixture: dict, position: int) -> torch.Tensor:
    """The goldens' scripted logits at a position ([1, vocab])."""
    ids = torch.arange(fixture["vocabulary_size"], dtype=torch.int64)
    values = (ids * 37 + position * 17) % fixture["logit_modulus"] - 56
    if fixture["dominant_token"] is not None:
        values[fixture["dominant_token"]] += fixture["dominant_bias"]
    return (values.float() / fixture["logit_denominator"]).unsqueeze(0)


@pytest.mark.parametrize("name", sorted(GOLDENS))
def test_vllms_goldens(name: str) -> None:
    """Each token is the watermark's draw, or the argmax where the context repeats (the goldens' stand-in for an
    ordinary draw); the detector scores the tokens as vLLM's does."""
    case = GOLDENS[name]
    config = WatermarkConfig(
        key=case["key"],
        algorithm=case["algorithm"],
        alpha=case["generation_alpha"],
        context_width=case["context_width"],
        deduplicate_contexts=case["deduplicate_contexts"],
        deduplicate_contexts_max_history=case["deduplicate_contexts_max_history"],
    )
    marker = Watermarker(config)
    fixture, generated = case["fixture"], []
    for position in range(fixture["num_tokens"]):
        logits = fixture_logits(fixture, position)
        if marker.repeated(0, fixture["prompt"], generated):
            generated.append(int(logits.argmax()))
            continue
        context = torch.tensor([reply_context(generated, config.context_width)])
        key = marker.key_for(torch.Generator(), logits.device)
        generated.append(int(marker.sample(logits, context, [key])[0]))
    assert generated == case["generation"]

    detector = WatermarkConfig(
        key=case["detection_key"],
        algorithm=case["algorithm"],
        alpha=case["detection_alpha"],
        context_width=case["context_width"],
    )
    found = detect(generated, detector, deduplicate=case["detection_deduplicate_contexts"])
    want = case["detection"]
    assert found.num_scored_tokens == want["num_scored_tokens"]
    assert math.isclose(found.score, want["score"], rel_tol=1e-9)
    assert math.isclose(found.p_value, want["p_value"], rel_tol=1e-6)


def test_the_config_takes_vllms_json_and_refuses_what_it_lacks() -> None:
    config = WatermarkConfig.parse('{"algorithm": "gumbel", "key": 42}')
    assert config == WatermarkConfig(key=42) and config.context_width == 4
    for bad, words in [
        ('{"algorithm": "gumbel"}', "key"),
        ('{"key": 42, "algorithm": "kirchenbauer"}', "algorithm"),
        ('{"key": 18446744073709551616}', r"2\*\*64"),
        ('{"key": 1, "salt": 2}', "salt"),
        ("{key: 1}", "JSON"),
    ]:
        with pytest.raises(InvalidParameterError, match=words):
            WatermarkConfig.parse(bad)


def sampling_row(seq_id: int, params: SamplingParams, output: list[int]) -> SamplingRow:
    return SamplingRow(seq_id, 0, params, [1, 2, 3], output, [], None)


def test_the_sampler_draws_the_watermarked_token_where_it_applies() -> None:
    """A random row takes the watermark's token (the same for any generator); greedy rows, rows that opt out and a
    repeated context are drawn as without it."""
    config = WatermarkConfig(key=7)
    sampler = Sampler(torch.device("cpu"), watermarker=Watermarker(config))
    logits = torch.randn(1, 300)
    output = [5, 6, 7, 8, 9]
    marked = sampling_row(1, SamplingParams(temperature=0.8), output)
    want = Watermarker(config).sample(logits / 0.8, torch.tensor([reply_context(output, 4)]), [7])
    assert [sampler.sample(logits, [marked])[0].token_id for _ in range(5)] == [int(want[0])] * 5
    greedy = sampling_row(2, SamplingParams(temperature=0), output)
    assert sampler.sample(logits, [greedy])[0].token_id == int(logits.argmax())
    opted_out = sampling_row(3, SamplingParams(temperature=0.8, watermarking=False), output)
    drawn = {sampler.sample(logits, [opted_out])[0].token_id for _ in range(20)}
    assert len(drawn) > 1  # an ordinary draw: not the same token every time
    repeating = sampling_row(4, SamplingParams(temperature=0.8), [5, 6, 7, 8, 5, 6, 7, 8])  # context (5, 6, 7, 8) seen
    assert len({sampler.sample(logits, [repeating])[0].token_id for _ in range(20)}) > 1


@pytest.fixture(scope="module")
def server():
    proc = start_server("--watermark-config", '{"algorithm":"gumbel","key":42}')  # as vLLM's own test starts it
    yield proc
    assert proc.stop() == 0


@pytest.mark.slow
@pytest.mark.server
def test_a_watermarked_servers_text_is_detected_by_its_key(client: openai.OpenAI, model: str) -> None:
    tokens = client.completions.create(
        model=model,
        prompt="Once upon a time",
        max_tokens=48,
        temperature=1.0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    ).choices[0]
    ids = tokens.token_ids
    assert len(ids) == 48
    assert detect(ids, WatermarkConfig(key=42)).p_value < 1e-4
    assert detect(ids, WatermarkConfig(key=43)).p_value > 1e-4  # another key sees unmarked text
    assert tokens.text  # a reply like any other
    opted_out = client.completions.create(
        model=model,
        prompt="Once upon a time",
        max_tokens=48,
        temperature=1.0,
        extra_body={"ignore_eos": True, "return_token_ids": True, "watermarking": False},
    ).choices[0]
    assert detect(opted_out.token_ids, WatermarkConfig(key=42)).p_value > 1e-4
