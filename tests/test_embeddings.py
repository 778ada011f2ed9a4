"""Embeddings through the engine (PoolingParams): the same vector whatever runs beside it, however the prompt is
prefilled, and after the same prompt was cached; parameters checked. Against transformers: test_golden.py."""

import pytest
import torch

from tokenmill import LLM, PoolingParams, SamplingParams
from tokenmill.errors import InvalidParameterError

TEXTS = ["The cat sat on the mat. " * 12, "Quarterly revenue grew by twelve percent.", "x"]


@pytest.fixture(scope="module")
def chunked() -> LLM:
    """Prompts prefilled 16 tokens a step: an embedding's rows come in several chunks."""
    return LLM(max_num_batched_tokens=16, max_num_seqs=4)


@pytest.mark.slow
def test_an_embedding_does_not_depend_on_chunks_batches_or_the_prefix_cache(llm: LLM, chunked: LLM) -> None:
    alone = [llm.embed(t)[0] for t in TEXTS]
    for vector in alone:
        assert len(vector) == llm.engine.model_config.hidden_size
        assert abs(torch.tensor(vector).norm().item() - 1) < 1e-5
    # in chunks of 16 tokens, beside generations, twice (the second time its prompt is in the prefix cache)
    engine = chunked.engine
    generating = [engine.add_request(None, t, SamplingParams(max_tokens=8, temperature=0)) for t in TEXTS]
    embedding = [engine.add_request(None, t, PoolingParams()) for t in TEXTS + TEXTS]
    done: dict[str, object] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    engine.check_integrity()
    for i, rid in enumerate(embedding):
        out = done[rid]
        assert out.outputs[0].token_ids == [] and out.outputs[0].finish_reason == "stop"
        assert out.num_cached_tokens == 0  # every prompt row computed: none from the cache
        assert torch.allclose(torch.tensor(out.embedding), torch.tensor(alone[i % len(TEXTS)]), atol=1e-4)
    assert all(len(done[rid].outputs[0].token_ids) == 8 for rid in generating)


def test_pooling_options(llm: LLM) -> None:
    (mean,) = llm.embed(TEXTS[1], PoolingParams(normalize=False))
    (last,) = llm.embed(TEXTS[1], PoolingParams("last", normalize=False))
    assert mean != last and abs(torch.tensor(mean).norm().item() - 1) > 0.1
    (short,) = llm.embed(TEXTS[1], PoolingParams(dimensions=32))
    expected = torch.nn.functional.normalize(torch.tensor(mean[:32]), dim=0)
    assert torch.allclose(torch.tensor(short), expected, atol=1e-5)


@pytest.mark.parametrize(
    ("make", "param"),
    [
        (lambda: PoolingParams("cls"), "pooling"),
        (lambda: PoolingParams(dimensions=0), "dimensions"),
        (lambda: PoolingParams(dimensions=100_000), "dimensions"),
    ],
)
def test_bad_pooling_parameters_name_themselves(llm: LLM, make, param: str) -> None:
    with pytest.raises(InvalidParameterError) as error:
        llm.embed("hello", make())
    assert error.value.param == param


def test_an_empty_or_too_long_prompt_is_refused(llm: LLM) -> None:
    with pytest.raises(InvalidParameterError, match="empty"):
        llm.embed({"prompt_token_ids": []})
    with pytest.raises(InvalidParameterError, match="max_model_len"):
        llm.embed({"prompt_token_ids": [5] * llm.engine.max_model_len})
    assert not llm.engine.has_unfinished_requests()
