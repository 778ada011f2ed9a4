"""The APIs beside OpenAI's completions, each through its own official client against a real server: OpenAI's
embeddings, Ollama's API (the `ollama` client), Anthropic's Messages API (the `anthropic` client) and OpenAI's
Responses API; bad input on each gets that API's own error shape."""

import base64

import httpx
import numpy as np
import openai
import pytest
import torch

from tests.server_utils import ServerProcess, start_server
from tokenmill import LLM, PoolingParams

pytestmark = [pytest.mark.slow, pytest.mark.server]

TEXTS = ["The cat sat on the mat.", "A cat is sitting on a mat.", "Quarterly revenue grew by twelve percent."]


@pytest.fixture(scope="module")
def server():
    proc = start_server("--quantization", "none")  # exact float32, to compare with the offline engine
    yield proc
    assert proc.stop() == 0


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


# ---- OpenAI: /v1/embeddings -----------------------------------------------------------------------------------


def test_embeddings_through_the_openai_client(client: openai.OpenAI, model: str, llm: LLM) -> None:
    """The client asks for base64 unless told otherwise and decodes it; floats on request; a batch in input
    order; the same vectors as the offline engine's."""
    expected = llm.embed(TEXTS)
    answer = client.embeddings.create(model=model, input=TEXTS)  # base64 on the wire
    assert [d.index for d in answer.data] == [0, 1, 2]
    assert answer.usage.prompt_tokens == answer.usage.total_tokens > len(TEXTS)
    got = torch.tensor([d.embedding for d in answer.data])
    assert torch.allclose(got, torch.tensor(expected), atol=1e-5)
    floats = client.embeddings.create(model=model, input=TEXTS[0], encoding_format="float")
    assert torch.allclose(torch.tensor(floats.data[0].embedding), got[0], atol=1e-6)
    cosine = got @ got.T
    assert cosine[0, 1] > cosine[0, 2]  # the two cat sentences are nearer each other than revenue
    short = client.embeddings.create(model=model, input=[[1, 2, 3]], dimensions=16, encoding_format="float")
    assert len(short.data[0].embedding) == 16
    (last,) = llm.embed({"prompt_token_ids": [1, 2, 3]}, PoolingParams("last"))
    raw = client.embeddings.with_raw_response.create(model=model, input=[[1, 2, 3]], extra_body={"pooling": "last"})
    wire = raw.http_response.json()["data"][0]["embedding"]
    assert np.allclose(np.frombuffer(base64.b64decode(wire), dtype="<f4"), last, atol=1e-5)


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"input": ""}, "input", "the input is empty"),
        ({"input": []}, "input", "the input list is empty"),
        ({"input": [[1, -2]]}, "input", "token id -2"),
        ({"input": "hi", "dimensions": 100000}, "dimensions", "at most the model's 576"),
        ({"input": "hi", "encoding_format": "int8"}, "encoding_format", "float"),
        ({"input": "hi", "pooling": "cls"}, "pooling", "mean"),
        ({"input": [[10**6]]}, "prompt", "outside the vocabulary"),
        ({"input": "hi", "model": "gpt-4"}, "model", "does not exist"),
    ],
)
def test_bad_embedding_requests_get_openai_errors(server: ServerProcess, body: dict, param: str, words: str) -> None:
    response = httpx.post(f"{server.url}/v1/embeddings", json=body, timeout=60)
    assert response.status_code in (400, 404), response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error
