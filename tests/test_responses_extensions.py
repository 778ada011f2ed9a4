"""OpenAI's Responses API beyond text, through the official `openai` client against a real server: the text's
log-probabilities (`include: ["message.output_text.logprobs"]` with `top_logprobs`), whole and streamed, and vLLM's
`enable_response_messages` (the raw prompt and reply, as text and token ids)."""

import httpx
import openai
import pytest

from tests.server_utils import ServerProcess

pytestmark = [pytest.mark.slow, pytest.mark.server]

ASK = "Name three colours."
LOGPROBS = ["message.output_text.logprobs"]


@pytest.fixture(scope="module")
def server(default_server: ServerProcess) -> ServerProcess:
    return default_server  # the bundled model under `auto`, shared (conftest.py)


def chat_logprobs(client: openai.OpenAI, model: str, max_tokens: int) -> list:
    """What chat says of the same conversation's tokens: the reference for the Responses API's entries."""
    choice = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": ASK}],
        temperature=0,
        max_tokens=max_tokens,
        logprobs=True,
        top_logprobs=3,
    ).choices[0]
    return [entry.model_dump() for entry in choice.logprobs.content]


def test_the_texts_logprobs_whole_and_streamed(client: openai.OpenAI, model: str) -> None:
    expected = chat_logprobs(client, model, 10)
    response = client.responses.create(
        model=model, input=ASK, temperature=0, max_output_tokens=10, include=LOGPROBS, top_logprobs=3
    )
    (part,) = response.output[0].content
    whole = [entry.model_dump() for entry in part.logprobs]
    assert whole == expected and len(whole) == response.usage.output_tokens == 10
    assert all(len(entry["top_logprobs"]) == 3 for entry in whole)
    assert "".join(entry["token"] for entry in whole) == part.text

    events = list(
        client.responses.create(
            model=model, input=ASK, temperature=0, max_output_tokens=10, include=LOGPROBS, top_logprobs=3, stream=True
        )
    )
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert deltas and all(e.logprobs for e in deltas)  # each delta carries the entries of the tokens that made it
    streamed = [entry for e in deltas for entry in e.logprobs]
    assert [(e.token, e.logprob) for e in streamed] == [(e["token"], e["logprob"]) for e in expected]
    assert [[t.token for t in e.top_logprobs] for e in streamed] == [
        [t["token"] for t in e["top_logprobs"]] for e in expected
    ]
    (done,) = [e for e in events if e.type == "response.output_text.done"]
    assert [entry.model_dump() for entry in done.logprobs] == expected
    assert [entry.model_dump() for entry in events[-1].response.output[0].content[0].logprobs] == expected


def test_logprobs_only_when_included(client: openai.OpenAI, model: str, server: ServerProcess) -> None:
    plain = client.responses.create(model=model, input=ASK, temperature=0, max_output_tokens=4, top_logprobs=3)
    assert plain.output[0].content[0].logprobs == []
    chosen_only = client.responses.create(model=model, input=ASK, temperature=0, max_output_tokens=4, include=LOGPROBS)
    entries = chosen_only.output[0].content[0].logprobs
    assert len(entries) == 4 and all(entry.top_logprobs == [] and entry.logprob <= 0 for entry in entries)
    refused = httpx.post(
        f"{server.url}/v1/responses", json={"input": ASK, "include": ["reasoning.encrypted_content"]}, timeout=60
    )
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "include", refused.text


def test_enable_response_messages(client: openai.OpenAI, model: str, server: ServerProcess) -> None:
    response = client.responses.create(
        model=model, input=ASK, temperature=0, max_output_tokens=8, extra_body={"enable_response_messages": True}
    )
    prompt = httpx.post(
        f"{server.url}/tokenize", json={"messages": [{"role": "user", "content": ASK}]}, timeout=60
    ).json()["tokens"]
    (given,) = response.input_messages
    assert given["type"] == "raw_message_tokens" and given["tokens"] == prompt
    assert ASK in given["message"] and "<|im_start|>assistant" in given["message"]  # the template's rendering
    (made,) = response.output_messages
    assert made["type"] == "raw_message_tokens" and len(made["tokens"]) == response.usage.output_tokens == 8
    assert made["message"] == response.output_text
    plain = client.responses.create(model=model, input=ASK, max_output_tokens=2)
    assert getattr(plain, "input_messages", None) is None and getattr(plain, "output_messages", None) is None
