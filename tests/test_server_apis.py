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


# ---- Ollama: /api/* through the ollama client -------------------------------------------------------------------


@pytest.fixture(scope="module")
def ollama_client(server: ServerProcess):
    import ollama

    return ollama.Client(host=server.url, timeout=120)


def greedy_options(n: int) -> dict:
    return {"temperature": 0, "num_predict": n, "seed": 1}


def test_ollama_lists_shows_and_reports_the_model(ollama_client, model: str, server: ServerProcess) -> None:
    (listed,) = ollama_client.list().models
    assert listed.model == f"{model}:latest"
    assert listed.details.format == "gguf" and listed.details.family == "llama"
    assert listed.details.parameter_size == "135M" and listed.details.quantization_level == "Q4_1"
    assert listed.size > 50_000_000
    shown = ollama_client.show(model)
    assert "<|im_start|>" in shown.template and "completion" in shown.capabilities
    assert shown.modelinfo["llama.embedding_length"] == 576
    (running,) = ollama_client.ps().models
    assert running.model == f"{model}:latest" and running.context_length > 0
    version = httpx.get(f"{server.url}/api/version").json()
    assert version["version"].count(".") == 2


def test_ollama_chat_streamed_and_not_is_the_openai_chat(ollama_client, client: openai.OpenAI, model: str) -> None:
    messages = [{"role": "user", "content": "Name three colours."}]
    expected = client.chat.completions.create(
        model=model, messages=messages, temperature=0, max_tokens=12, seed=1
    ).choices[0]
    whole = ollama_client.chat(model=model, messages=messages, options=greedy_options(12))
    assert whole.message.role == "assistant" and whole.message.content == expected.message.content
    assert whole.done and whole.done_reason == expected.finish_reason
    assert whole.eval_count == 12 and whole.prompt_eval_count > 10 and whole.total_duration > 0
    parts = list(
        ollama_client.chat(model=f"{model}:latest", messages=messages, options=greedy_options(12), stream=True)
    )
    assert len(parts) > 2 and all(not p.done for p in parts[:-1]) and parts[-1].done
    assert "".join(p.message.content for p in parts) == expected.message.content


def test_ollama_generate_streams_and_continues_its_context(ollama_client, model: str) -> None:
    parts = list(
        ollama_client.generate(model=model, prompt="Why is the sky blue?", options=greedy_options(10), stream=True)
    )
    final = parts[-1]
    assert final.done and final.eval_count == 10 and len(parts) > 2
    text = "".join(p.response for p in parts)
    assert text and final.context[-10:] and len(final.context) == final.prompt_eval_count + 10
    again = ollama_client.generate(model=model, prompt="Why is the sky blue?", options=greedy_options(10))
    assert again.response == text  # greedy: the same whole as in parts
    follow = ollama_client.generate(
        model=model, prompt="And at night?", context=final.context, options=greedy_options(4)
    )
    assert follow.prompt_eval_count > len(final.context)
    raw = ollama_client.generate(model=model, prompt="1, 2, 3,", raw=True, options=greedy_options(3))
    assert raw.prompt_eval_count <= 8  # no chat template around it
    loaded = ollama_client.generate(model=model)  # no prompt: Ollama's way to load a model
    assert loaded.done and loaded.done_reason == "load"


def test_ollama_format_and_tools(ollama_client, model: str) -> None:
    import json

    colours = {"type": "string", "enum": ["red", "green", "blue"]}
    schema = {
        "type": "object",
        "properties": {"colour": colours},
        "required": ["colour"],
        "additionalProperties": False,
    }
    answer = ollama_client.chat(
        model=model, messages=[{"role": "user", "content": "Pick a colour."}], format=schema, options=greedy_options(40)
    )
    assert json.loads(answer.message.content)["colour"] in colours["enum"]
    # any JSON object: its start is one (a small model may not close it within the tokens given)
    anything = ollama_client.generate(model=model, prompt="Describe a cat.", format="json", options=greedy_options(12))
    assert anything.response.lstrip().startswith("{")

    def get_weather(city: str) -> str:
        """Get the weather in a city.

        Args:
          city: the city's name
        """
        return "sunny"

    # the small model answers in words under Ollama's auto tool choice; either way the answer is well formed
    reply = ollama_client.chat(
        model=model,
        messages=[{"role": "user", "content": "What is the weather in Paris? Call get_weather."}],
        tools=[get_weather],
        options=greedy_options(20),
    )
    assert reply.message.content or reply.message.tool_calls
    # a history with a call and its result (the client sends the call's arguments as an object)
    call = {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    followed = ollama_client.chat(
        model=model,
        messages=[
            {"role": "user", "content": "What is the weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "content": "sunny", "tool_name": "get_weather"},
        ],
        tools=[get_weather],
        options=greedy_options(8),
    )
    assert followed.message.content and followed.eval_count == 8


def test_an_ollama_reply_that_calls_a_tool_carries_it_as_ollama_does() -> None:
    """A reply that is a call (bare JSON, or split over deltas) goes out as message.tool_calls with the arguments
    as an object; text that cannot be a call goes out as content."""
    from tokenmill.outputs import CompletionOutput, RequestMetrics, RequestOutput
    from tokenmill.server.ollama import _Reply

    functions = [{"name": "get_weather", "parameters": {"type": "object"}}]
    reply = _Reply("m", functions, as_chat=True)
    held = [
        reply.delta(part, finished=False) for part in ['{"name": "get_', 'weather", "arguments": ', '{"city": "Paris"}']
    ]
    assert held == [("", None)] * 3
    text, calls = reply.delta("}", finished=True)
    metrics = RequestMetrics(arrival_time=0.0, first_token_time=0.5, finished_time=1.0)
    out = RequestOutput("r", None, [1, 2], [CompletionOutput(0, "", [5, 6, 7], finish_reason="stop")], True, metrics)
    final = reply.final(out, calls, text)
    assert final["message"] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
    }
    assert final["done"] and final["eval_count"] == 3 and final["total_duration"] == 1_000_000_000
    words = _Reply("m", functions, as_chat=True)
    assert words.delta("The weather", finished=False) == ("The weather", None)


def test_ollama_embed(ollama_client, model: str, llm: LLM) -> None:
    answer = ollama_client.embed(model=model, input=TEXTS)
    assert torch.allclose(torch.tensor(answer.embeddings), torch.tensor(llm.embed(TEXTS)), atol=1e-5)
    assert answer.prompt_eval_count > len(TEXTS)
    single = ollama_client.embed(model=model, input=TEXTS[0], dimensions=8)
    assert len(single.embeddings) == 1 and len(single.embeddings[0]) == 8
    legacy = ollama_client.embeddings(model=model, prompt=TEXTS[0])  # not normalized, as Ollama's
    assert abs(torch.tensor(legacy.embedding).norm().item() - 1) > 0.1


@pytest.mark.parametrize(
    ("call", "status", "words"),
    [
        (lambda c, m: c.chat(model="llama3", messages=[{"role": "user", "content": "hi"}]), 404, "not found"),
        (
            lambda c, m: c.chat(model=m, messages=[{"role": "user", "content": "hi"}], options={"num_gpu": 1}),
            400,
            "num_gpu",
        ),
        (
            lambda c, m: c.chat(model=m, messages=[{"role": "user", "content": "hi"}], options={"mirostat": 2}),
            400,
            "mirostat",
        ),
        (lambda c, m: c.generate(model=m, prompt="hi", options={"temperature": -1}), 400, "temperature"),
        (lambda c, m: c.generate(model=m, prompt="hi", options={"num_ctx": 4}), 400, "num_ctx"),
        (lambda c, m: c.generate(model=m, prompt="hi", suffix="there"), 400, "/infill"),
        (lambda c, m: c.generate(model=m, prompt="hi", think=True), 400, "think"),
        (
            lambda c, m: c.chat(
                model=m, messages=[{"role": "user", "content": "hi"}], stream=True, options={"stop": 5}
            ).__next__(),
            400,
            "stop",
        ),
    ],
)
def test_ollama_errors_are_ollamas(ollama_client, model: str, call, status: int, words: str) -> None:
    import ollama

    with pytest.raises(ollama.ResponseError) as error:
        call(ollama_client, model)
    assert error.value.status_code == status and words in error.value.error, error.value.error
