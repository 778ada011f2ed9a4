"""The APIs beside OpenAI's completions, each through its own official client against a real server: OpenAI's
embeddings, Ollama's API (the `ollama` client), Anthropic's Messages API (the `anthropic` client) and OpenAI's
Responses API; bad input on each gets that API's own error shape."""

import base64
import datetime
import json
import re
import socket
import subprocess
import sys
from pathlib import Path

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
    proc = start_server("--model", "smollm2-135m")  # `auto`, as a user starts it, naming the bundled model
    yield proc
    assert proc.stop() == 0


def test_the_name_the_server_was_started_with_is_an_alias(
    server: ServerProcess, client: openai.OpenAI, ollama_client, anthropic_client
) -> None:
    """`--model smollm2-135m` serves the file's id, SmolLM2-135M-Instruct; a client that sends the name the user
    typed is served too, on every API, and /v1/models lists both (as vLLM lists --served-model-name's)."""
    assert [m.id for m in client.models.list().data] == ["SmolLM2-135M-Instruct", "smollm2-135m"]
    assert client.models.retrieve("smollm2-135m").id == "smollm2-135m"
    ask = [{"role": "user", "content": "Hi"}]
    assert client.chat.completions.create(model="smollm2-135m", messages=ask, max_tokens=2).usage.completion_tokens
    assert client.embeddings.create(model="smollm2-135m", input="Hi").data
    assert ollama_client.chat("smollm2-135m", ask, options={"num_predict": 2}).message.role == "assistant"
    assert anthropic_client.messages.create(model="smollm2-135m", max_tokens=2, messages=ask).content
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gemma3-270m", messages=ask, max_tokens=2)


# ---- OpenAI: /v1/embeddings -----------------------------------------------------------------------------------


def test_embeddings_through_the_openai_client(client: openai.OpenAI, model: str, offline: LLM) -> None:
    """The client asks for base64 unless told otherwise and decodes it; floats on request; a batch in input
    order; the same vectors as the offline engine's."""
    expected = offline.embed(TEXTS)
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
    (last,) = offline.embed({"prompt_token_ids": [1, 2, 3]}, PoolingParams("last"))
    raw = client.embeddings.with_raw_response.create(model=model, input=[[1, 2, 3]], extra_body={"pooling": "last"})
    wire = raw.http_response.json()["data"][0]["embedding"]
    assert np.allclose(np.frombuffer(base64.b64decode(wire), dtype="<f4"), last, atol=1e-5)


def test_chat_content_parts_are_the_text_they_hold(client: openai.OpenAI, model: str) -> None:
    """OpenAI's content parts ([{"type": "text", "text": ...}, ...]) read as their texts, one a line (as vLLM
    joins them for a template that takes text)."""
    parts = [{"type": "text", "text": "Name three colours."}, {"type": "text", "text": "Be brief."}]
    as_parts = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": parts}], max_tokens=10, temperature=0
    )
    as_text = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Name three colours.\nBe brief."}],
        max_tokens=10,
        temperature=0,
    )
    assert as_parts.choices[0].message.content == as_text.choices[0].message.content
    assert as_parts.usage.prompt_tokens == as_text.usage.prompt_tokens


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"input": ""}, "input", "the input is empty"),
        ({"input": []}, "input", "the input list is empty"),
        ({"input": [[1, -2]]}, "input", "token id -2"),
        ({"input": "hi", "dimensions": 100000}, "dimensions", "at most the model's 576"),
        ({"input": "hi", "encoding_format": "int8"}, "encoding_format", "float"),
        ({"input": "hi", "pooling": "cls"}, "pooling", "mean"),
        ({"input": [[10**6]]}, "prompt", "out of vocabulary"),
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
    from tokenmill.parsers.reply import ReplyFormat, ReplyParser
    from tokenmill.server.ollama import _Reply

    functions = [{"name": "get_weather", "parameters": {"type": "object"}}]
    reply = _Reply("m", ReplyParser(ReplyFormat("", "constrained"), "", functions), as_chat=True)
    held = [reply.delta(part) for part in ['{"name": "get_', 'weather", "arguments": ', '{"city": "Paris"}']]
    assert all(not delta for delta in held)
    last = reply.delta("}", "stop")
    metrics = RequestMetrics(arrival_time=0.0, first_token_time=0.5, finished_time=1.0)
    out = RequestOutput("r", None, [1, 2], [CompletionOutput(0, "", [5, 6, 7], finish_reason="stop")], True, metrics)
    final = reply.final(out, last)
    assert final["message"] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
    }
    assert final["done"] and final["eval_count"] == 3 and final["total_duration"] == 1_000_000_000
    words = _Reply("m", ReplyParser(ReplyFormat("", "constrained"), "", functions), as_chat=True)
    assert words.delta("The weather").text == "The weather"


def test_ollama_embed(ollama_client, model: str, offline: LLM) -> None:
    answer = ollama_client.embed(model=model, input=TEXTS)
    assert torch.allclose(torch.tensor(answer.embeddings), torch.tensor(offline.embed(TEXTS)), atol=1e-5)
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


# ---- Anthropic: /v1/messages through the anthropic client -------------------------------------------------------


@pytest.fixture(scope="module")
def anthropic_client(server: ServerProcess):
    import anthropic

    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


WEATHER_TOOL = {
    "name": "get_weather",
    "description": "Get the weather in a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def test_anthropic_messages_whole_and_streamed(anthropic_client, client: openai.OpenAI, model: str) -> None:
    ask = [{"role": "user", "content": "Name three colours."}]
    system = "You are a terse assistant."
    expected = client.chat.completions.create(
        model=model, messages=[{"role": "system", "content": system}, *ask], temperature=0, max_tokens=12
    ).choices[0]
    greedy = {"temperature": 0}  # older clients' field (today's Messages API has no sampling fields)
    message = anthropic_client.messages.create(
        model=model, max_tokens=12, messages=ask, system=system, extra_body=greedy
    )
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert [b.type for b in message.content] == ["text"] and message.content[0].text == expected.message.content
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 12
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens > 10
    with anthropic_client.messages.stream(
        model=model, max_tokens=12, messages=ask, system=system, extra_body=greedy
    ) as s:
        pieces = list(s.text_stream)
        final = s.get_final_message()
    assert len(pieces) > 2 and "".join(pieces) == expected.message.content
    assert final.content[0].text == expected.message.content and final.stop_reason == "max_tokens"
    # a stop sequence ends it and is named
    words = expected.message.content.split()
    stopped = anthropic_client.messages.create(
        model=model, max_tokens=12, messages=ask, system=system, extra_body=greedy, stop_sequences=[words[1]]
    )
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == words[1]
    assert words[1] not in stopped.content[0].text
    counted = anthropic_client.messages.count_tokens(model=model, messages=ask, system=system)
    assert counted.input_tokens == message.usage.input_tokens + message.usage.cache_read_input_tokens


def test_anthropic_streams_usage_with_cache_reads_from_the_start(anthropic_client, model: str) -> None:
    """message_start's usage carries cache_read_input_tokens and cache_creation_input_tokens, as Anthropic's API:
    the second of two same prompts reads most of it from the prefix cache."""
    ask = [{"role": "user", "content": "Tell me about the prefix cache of this server, please."}]
    counted = anthropic_client.messages.count_tokens(model=model, messages=ask).input_tokens
    starts = []
    for _ in range(2):
        with anthropic_client.messages.stream(model=model, max_tokens=3, messages=ask) as s:
            starts += [e.message.usage for e in s if e.type == "message_start"]
    first, second = starts
    assert first.cache_creation_input_tokens == second.cache_creation_input_tokens == 0
    assert first.input_tokens + first.cache_read_input_tokens == counted
    assert second.cache_read_input_tokens >= 16 and second.input_tokens + second.cache_read_input_tokens == counted


def test_anthropic_tool_use_whole_and_streamed(anthropic_client, model: str, server: ServerProcess) -> None:
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    forced = {"type": "tool", "name": "get_weather"}
    message = anthropic_client.messages.create(
        model=model,
        max_tokens=60,
        messages=ask,
        tools=[WEATHER_TOOL],
        tool_choice=forced,
        extra_headers={"X-Request-Id": "anthropic-tool-use"},
    )
    assert message.stop_reason == "tool_use"
    # the request log says the finish the API reported: a call, not "stop"
    (line,) = server.log_lines("msg-anthropic-tool-use ")
    assert "msg-anthropic-tool-use /v1/messages 200: " in line and "finish tool_calls," in line
    (use,) = [b for b in message.content if b.type == "tool_use"]
    assert use.name == "get_weather" and isinstance(use.input["city"], str) and use.id.startswith("toolu_")
    with anthropic_client.messages.stream(
        model=model, max_tokens=60, messages=ask, tools=[WEATHER_TOOL], tool_choice={"type": "any"}
    ) as s:
        streamed = s.get_final_message()
    assert streamed.stop_reason == "tool_use" and streamed.content[-1].input == use.input
    # a JSON schema for the reply (output_config.format)
    colours = {"type": "string", "enum": ["red", "green", "blue"]}
    schema = {
        "type": "object",
        "properties": {"colour": colours},
        "required": ["colour"],
        "additionalProperties": False,
    }
    shaped = anthropic_client.messages.create(
        model=model,
        max_tokens=40,
        messages=[{"role": "user", "content": "Pick a colour."}],
        output_config={"format": {"type": "json_schema", "schema": schema}},
    )
    assert json.loads(shaped.content[0].text)["colour"] in colours["enum"]
    # the call and its result in the history: the model answers in words
    history = [
        *ask,
        {"role": "assistant", "content": [{"type": "tool_use", "id": use.id, "name": use.name, "input": use.input}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny, 21 C"}]},
    ]
    answer = anthropic_client.messages.create(
        model=model, max_tokens=10, messages=history, tools=[WEATHER_TOOL], tool_choice={"type": "none"}
    )
    assert answer.content[0].type == "text" and answer.content[0].text


@pytest.mark.parametrize(
    ("kwargs", "status", "kind", "words"),
    [
        ({"model": "claude-x"}, 404, "not_found_error", "does not exist"),
        ({"extra_body": {"temperature": 1.5}}, 400, "invalid_request_error", "temperature"),
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, 400, "invalid_request_error", "think"),
        ({"output_config": {"effort": "high"}}, 400, "invalid_request_error", "effort"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "x"}}]}]},
            400,
            "invalid_request_error",
            "'image'",
        ),
        ({"tool_choice": {"type": "any"}}, 400, "invalid_request_error", "needs tools"),
    ],
)
def test_anthropic_errors_are_anthropics(
    anthropic_client, model: str, kwargs: dict, status: int, kind: str, words: str
) -> None:
    import anthropic

    body = {"model": model, "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], **kwargs}
    with pytest.raises(anthropic.APIStatusError) as error:
        anthropic_client.messages.create(**body)
    assert error.value.status_code == status
    assert error.value.body["type"] == "error" and error.value.body["error"]["type"] == kind
    assert words in error.value.body["error"]["message"], error.value.body


# ---- OpenAI: /v1/responses ---------------------------------------------------------------------------------------

WEATHER_FUNCTION = {
    "type": "function",
    "name": "get_weather",
    "description": "Get the weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def test_responses_whole_streamed_and_continued(client: openai.OpenAI, model: str) -> None:
    ask = "Name three colours."
    expected = client.chat.completions.create(
        model=model,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": ask}],
        temperature=0,
        max_tokens=12,
    ).choices[0]
    response = client.responses.create(
        model=model, input=ask, instructions="Be brief.", temperature=0, max_output_tokens=12
    )
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.output_text == expected.message.content
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 12 and response.usage.total_tokens > 12
    events = list(
        client.responses.create(
            model=model, input=ask, instructions="Be brief.", temperature=0, max_output_tokens=12, stream=True
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.incomplete"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 2 and "".join(deltas) == expected.message.content
    assert events[-1].response.output_text == expected.message.content
    # the next turn continues the stored conversation
    # (instructions are not carried over: given again, the first turn's prompt is a prefix of this one)
    follow = client.responses.create(
        model=model, input="And one more?", previous_response_id=response.id, instructions="Be brief.",
        temperature=0, max_output_tokens=6,
    )  # fmt: skip
    assert follow.previous_response_id == response.id
    assert follow.usage.input_tokens > response.usage.input_tokens + 3
    assert follow.usage.input_tokens_details.cached_tokens > 0  # the first turn's prompt, from the prefix cache
    assert client.responses.retrieve(follow.id).output_text == follow.output_text
    client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=model, input="x", previous_response_id=response.id)


def test_responses_function_calls_and_their_outputs(client: openai.OpenAI, model: str) -> None:
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    response = client.responses.create(
        model=model, input=ask, tools=[WEATHER_FUNCTION], tool_choice="required", temperature=0, max_output_tokens=60
    )
    (call,) = [item for item in response.output if item.type == "function_call"]
    assert call.name == "get_weather" and isinstance(json.loads(call.arguments)["city"], str)
    events = list(
        client.responses.create(
            model=model, input=ask, tools=[WEATHER_FUNCTION], tool_choice={"type": "function", "name": "get_weather"},
            temperature=0, max_output_tokens=60, stream=True,
        )
    )  # fmt: skip
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert json.loads(done.arguments) == json.loads(call.arguments)
    answer = client.responses.create(
        model=model,
        input=[*ask, call.model_dump(), {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}],
        tools=[WEATHER_FUNCTION],
        tool_choice="none",
        max_output_tokens=8,
    )
    assert answer.output[0].type == "message" and answer.output_text
    colours = {"type": "string", "enum": ["red", "green", "blue"]}
    schema = {
        "type": "object",
        "properties": {"colour": colours},
        "required": ["colour"],
        "additionalProperties": False,
    }
    shaped = client.responses.create(
        model=model,
        input="Pick a colour.",
        text={"format": {"type": "json_schema", "name": "pick", "schema": schema}},
        max_output_tokens=40,
    )
    assert json.loads(shaped.output_text)["colour"] in colours["enum"]


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input", "input_image"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools", "web_search"),
        ({"input": "hi", "reasoning": {"effort": "high"}}, "reasoning", "reason"),
        ({"input": "hi", "background": True}, "background", ""),
        ({"input": "hi", "truncation": "auto"}, "truncation", ""),
        ({"input": "hi", "previous_response_id": "resp_nope"}, "previous_response_id", "no response"),
    ],
)
def test_bad_responses_requests_get_openai_errors(server: ServerProcess, body: dict, param: str, words: str) -> None:
    response = httpx.post(f"{server.url}/v1/responses", json=body, timeout=60)
    assert response.status_code in (400, 404), response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error


# ---- llama.cpp: /infill, and /version ---------------------------------------------------------------------------

FIM = {90: "<fim_prefix>", 91: "<fim_suffix>", 92: "<fim_middle>", 93: "<file_sep>"}


@pytest.fixture(scope="module")
def fim_model(tmp_path_factory) -> Path:
    """A tiny random llama whose vocabulary has fill-in-the-middle tokens."""
    from tests.gguf_builder import TinyModel, write_tiny_gguf

    return write_tiny_gguf(tmp_path_factory.mktemp("fim") / "tiny-fim.gguf", TinyModel(special_tokens=dict(FIM)))


def test_an_infill_prompt_is_prefix_suffix_middle(fim_model: Path) -> None:
    from tokenmill.server.infill import InfillRequest, infill_prompt
    from tokenmill.server.served_model import ServedModel

    model = ServedModel(LLM(str(fim_model)).engine)
    encode = model.tokenizer.encode
    req = InfillRequest(input_prefix="ab", input_suffix="b", prompt="a", input_extra=[{"filename": "x", "text": "b"}])
    ids = infill_prompt(model, req)
    bos = [model.tokenizer.bos_token_id] if model.tokenizer.add_bos else []
    assert ids == [*bos, 93, *encode("x\nb"), 90, *encode("ab"), 91, *encode("b"), 92, *encode("a")]


def test_infill_through_a_server(fim_model: Path, server: ServerProcess) -> None:
    fim_server = start_server("--model", str(fim_model))
    try:
        body = {"input_prefix": "ab", "input_suffix": "b", "n_predict": 4, "temperature": 0}
        whole = httpx.post(f"{fim_server.url}/infill", json=body, timeout=60).json()
        assert whole["stop"] and whole["stop_type"] == "limit" and whole["tokens_predicted"] == 4
        assert whole["tokens_evaluated"] >= 5 and isinstance(whole["content"], str)
        with httpx.stream("POST", f"{fim_server.url}/infill", json={**body, "stream": True}, timeout=60) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1]["stop"] and not any(e["stop"] for e in events[:-1])
        assert "".join(e["content"] for e in events) == whole["content"]
    finally:
        assert fim_server.stop() == 0
    # the bundled model has no FIM tokens: a 400 that says so
    refused = httpx.post(f"{server.url}/infill", json={"input_prefix": "def f():"}, timeout=60)
    assert refused.status_code == 400 and "fill-in-the-middle" in refused.json()["error"]["message"]
    from tokenmill import __version__

    assert httpx.get(f"{server.url}/version").json() == {"version": __version__}


# ---- llama.cpp's own API (httpx, as its web UI and tools call it) ----------------------------------------------


def llama(server: ServerProcess, path: str, body: dict | None = None) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=120)


def test_llamacpp_completion_answers_in_its_shape(server: ServerProcess) -> None:
    """/completion: content, the generated ids on request, stop_type, timings, generation_settings as sent; the same
    greedy text as /v1/completions; /completions is the same endpoint (llama-server's, not OpenAI's)."""
    body = {"prompt": "I believe the meaning of life is", "n_predict": 6, "temperature": 0, "return_tokens": True}
    r = llama(server, "/completion", body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["stop"] is True and out["stop_type"] == "limit" and out["tokens_predicted"] == 6
    assert len(out["tokens"]) == 6 and out["tokens_evaluated"] == out["timings"]["prompt_n"] + out["timings"]["cache_n"]
    assert out["timings"]["predicted_n"] == 6 and out["timings"]["prompt_ms"] > 0
    assert out["generation_settings"]["n_predict"] == 6 and out["generation_settings"]["temperature"] == 0
    openai_body = {"prompt": body["prompt"], "max_tokens": 6, "temperature": 0}
    oai = httpx.post(f"{server.url}/v1/completions", json=openai_body, timeout=120).json()
    assert out["content"] == oai["choices"][0]["text"]
    assert llama(server, "/completions", body).json()["content"] == out["content"]
    assert "tokens" in llama(server, "/completion", {**body, "return_tokens": False}).json()
    assert llama(server, "/completion", {**body, "return_tokens": False}).json()["tokens"] == []


def test_llamacpp_completion_stream_stop_words_and_fields(server: ServerProcess) -> None:
    """A stream of `data:` lines (no [DONE]) whose pieces make the whole answer; a stop word ends it as "word";
    response_fields picks fields by path."""
    body = {"prompt": "Count: 1, 2, 3,", "n_predict": 8, "temperature": 0}
    whole = llama(server, "/completion", body).json()["content"]
    with httpx.stream("POST", f"{server.url}/completion", json={**body, "stream": True}, timeout=120) as r:
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines) and "[DONE]" not in lines[-1]
    events = [json.loads(line[6:]) for line in lines]
    assert [e["stop"] for e in events] == [False] * (len(events) - 1) + [True]
    assert all(e["tokens"] for e in events[:-1])
    assert "".join(e["content"] for e in events) == whole
    word = whole.strip()[:2]
    stopped = llama(server, "/completion", {**body, "stop": [word]}).json()
    assert stopped["stop_type"] == "word" and stopped["stopping_word"] == word and word not in stopped["content"]
    picked = llama(server, "/completion", {**body, "response_fields": ["content", "generation_settings/n_predict"]})
    assert picked.json() == {"content": whole, "generation_settings/n_predict": 8}


def test_llamacpp_prompt_shapes(server: ServerProcess) -> None:
    """A prompt as text, as its token ids, as {"prompt_string"}, mixed ids and text (one prompt), and a batch (a list
    answer); bad shapes are 400s."""
    text = "The capital of France is"
    ids = httpx.post(f"{server.url}/tokenize", json={"content": text, "add_special": True}).json()["tokens"]
    greedy = {"n_predict": 4, "temperature": 0}
    first = llama(server, "/completion", {"prompt": text, **greedy}).json()["content"]
    assert llama(server, "/completion", {"prompt": ids, **greedy}).json()["content"] == first
    assert llama(server, "/completion", {"prompt": {"prompt_string": text}, **greedy}).json()["content"] == first
    mixed = llama(server, "/completion", {"prompt": [*ids[:-1], text.split()[-1]], **greedy})
    assert mixed.status_code == 200 and isinstance(mixed.json()["content"], str)
    batch = llama(server, "/completion", {"prompt": [ids, text], **greedy}).json()
    assert [b["content"] for b in batch] == [first, first] and [b["index"] for b in batch] == [0, 1]
    for bad in ([1.5], {"prompt_string": 3}, {"prompt_string": text, "multimodal_data": "aGk="}):
        assert llama(server, "/completion", {"prompt": bad, **greedy}).status_code == 400
    assert llama(server, "/completion", {"prompt": text, "n_predict": -2}).status_code == 400


def test_llamacpp_n_probs(server: ServerProcess) -> None:
    """n_probs: each token with its log-probability, bytes and the n most likely tokens, whole and streamed."""
    body = {"prompt": "I believe the meaning of life is", "n_predict": 3, "temperature": 0, "n_probs": 4}
    probs = llama(server, "/completion", body).json()["completion_probabilities"]
    assert len(probs) == 3
    for tok in probs:
        assert tok["logprob"] <= 0 and bytes(tok["bytes"]).decode() == tok["token"]
        assert len(tok["top_logprobs"]) == 4 and tok["top_logprobs"][0]["id"] == tok["id"]  # greedy: the best
        assert [t["logprob"] for t in tok["top_logprobs"]] == sorted(
            (t["logprob"] for t in tok["top_logprobs"]), reverse=True
        )
    with httpx.stream("POST", f"{server.url}/completion", json={**body, "stream": True}, timeout=120) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line]
    streamed = [p for e in events if not e["stop"] for p in e["completion_probabilities"]]
    assert [p["id"] for p in streamed] == [p["id"] for p in probs]


def test_llamacpp_post_sampling_probs(server: ServerProcess) -> None:
    """post_sampling_probs: probabilities ("prob", "top_probs") of the distribution each token was drawn from,
    after temperature, top-k, top-p and min-p: no token it could not draw, and they sum to 1 once all are shown;
    a greedy token's probability is 1."""
    body = {"prompt": "Today was the day. Today I would finally become a", "n_probs": 10, "n_predict": 4}
    sampled = {**body, "temperature": 1.0, "top_k": 5, "top_p": 1.0, "min_p": 0.0, "post_sampling_probs": True}
    out = llama(server, "/completion", sampled).json()
    assert out["generation_settings"]["post_sampling_probs"] is True
    for tok in out["completion_probabilities"]:
        assert 0 < tok["prob"] <= 1 and "logprob" not in tok
        top = tok["top_probs"]
        assert len(top) == 5 and all(0 < t["prob"] <= 1 for t in top)  # top_k 5: only 5 could be drawn
        assert sum(t["prob"] for t in top) == pytest.approx(1.0, abs=1e-4)
        assert tok["id"] in [t["id"] for t in top]
    greedy = llama(server, "/completion", {**sampled, "temperature": 0}).json()["completion_probabilities"]
    assert all(t["prob"] == 1.0 and [p["id"] for p in t["top_probs"]] == [t["id"]] for t in greedy)
    raw = llama(server, "/completion", {**body, "temperature": 0}).json()["completion_probabilities"]
    assert [t["id"] for t in raw] == [t["id"] for t in greedy] and all(t["logprob"] < 0 for t in raw)


def test_llamacpp_prompt_progress_and_timings_per_token(server: ServerProcess) -> None:
    """return_progress: a prompt_progress event before the prompt starts, then after each step that computed
    part of it (chunks of --max-num-batched-tokens), with its timings; timings_per_token: timings in every
    event."""
    prompt = "the quick brown fox jumps over the lazy dog " * 80  # about 720 tokens: over a step's 512
    body = {"prompt": prompt, "n_predict": 2, "stream": True, "return_progress": True, "timings_per_token": True}
    with httpx.stream("POST", f"{server.url}/completion", json={**body, "cache_prompt": False}, timeout=120) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line]
    progress = [e["prompt_progress"] for e in events if "prompt_progress" in e]
    assert len(progress) >= 3 and progress[0]["processed"] == 0 and progress[-1]["processed"] == progress[0]["total"]
    assert [p["processed"] for p in progress] == sorted({p["processed"] for p in progress})
    first = next(e for e in events if "prompt_progress" in e)["timings"]
    assert first["prompt_n"] == 0 and first["prompt_ms"] == 0.0 and first["predicted_n"] == 0
    times = [e["timings"]["prompt_ms"] for e in events if "prompt_progress" in e]
    assert times == sorted(times) and times[-1] > 0
    assert all("timings" in e for e in events)
    plain = llama(server, "/completion", {**body, "stream": False}).json()
    assert "prompt_progress" not in plain


def test_llamacpp_ignore_eos_bans_the_end_tokens(server: ServerProcess) -> None:
    """ignore_eos: every end-of-generation token is banned (shown in generation_settings' logit_bias with a null
    bias, llama-server's -inf), so the output runs to n_predict."""
    body = {"prompt": "Say hi.", "n_predict": 24, "temperature": 0}
    ignoring = llama(server, "/completion", {**body, "ignore_eos": True}).json()
    bans = ignoring["generation_settings"]["logit_bias"]
    assert bans and all(b["bias"] is None for b in bans)
    assert ignoring["tokens_predicted"] == 24 and ignoring["stop_type"] == "limit"
    assert llama(server, "/completion", body).json()["generation_settings"]["logit_bias"] == []


def test_llamacpp_cache_prompt_and_slots(server: ServerProcess) -> None:
    """A repeated prompt is read from the prefix cache (timings' cache_n) unless cache_prompt is false; the slot
    named by id_slot remembers it (GET /slots) until erased, and then its blocks are computed again."""
    prompt = "A long and winding road leads to the old mill by the river, " * 4
    body = {"prompt": prompt, "n_predict": 2, "temperature": 0, "id_slot": 1}
    llama(server, "/completion", body)
    cached = llama(server, "/completion", body).json()["timings"]
    assert cached["cache_n"] >= 32 and cached["cache_n"] + cached["prompt_n"] > cached["cache_n"]
    fresh = llama(server, "/completion", {**body, "cache_prompt": False}).json()["timings"]
    assert fresh["cache_n"] == 0
    slots = httpx.get(f"{server.url}/slots").json()
    assert slots[1]["id"] == 1 and slots[1]["is_processing"] is False and slots[1]["n_prompt_tokens"] > 32
    erased = llama(server, "/slots/1?action=erase").json()
    assert erased["id_slot"] == 1 and erased["n_erased"] > 32
    assert llama(server, "/completion", body).json()["timings"]["cache_n"] == 0
    assert llama(server, "/completion", {**body, "id_slot": 999}).status_code == 400
    assert llama(server, "/slots/1?action=bogus").status_code == 400
    assert llama(server, "/slots/x?action=erase").status_code == 400
    assert llama(server, "/slots/0?action=save", {"filename": "a.bin"}).status_code == 501


def test_llamacpp_tokenize_detokenize_and_template(server: ServerProcess) -> None:
    """/tokenize's content shape (ids, or pieces; BOS only with add_special), /detokenize's content, and
    /apply-template's prompt (the same text /tokenize renders from messages)."""
    content = "emoji 🤗 and 媽"
    ids = httpx.post(f"{server.url}/tokenize", json={"content": content}).json()["tokens"]
    pieces = httpx.post(f"{server.url}/tokenize", json={"content": content, "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == ids
    joined = b"".join(p["piece"].encode() if isinstance(p["piece"], str) else bytes(p["piece"]) for p in pieces)
    assert joined.decode() == content and any(isinstance(p["piece"], list) for p in pieces)
    assert httpx.post(f"{server.url}/detokenize", json={"tokens": ids}).json()["content"] == content
    both = httpx.post(f"{server.url}/tokenize", json={"content": "x", "prompt": "x"})
    assert both.status_code == 400
    for bad in (2**70, -3, 10**6):  # ids mixed into content, outside the vocabulary (2**70 was a 500)
        for with_pieces in (False, True):
            r = httpx.post(f"{server.url}/tokenize", json={"content": ["a", bad], "with_pieces": with_pieces})
            assert r.status_code == 400 and "out of vocabulary" in r.json()["error"]["message"], r.text
    messages = [{"role": "user", "content": "What is today?"}]
    prompt = httpx.post(f"{server.url}/apply-template", json={"messages": messages}).json()["prompt"]
    assert "What is today?" in prompt and prompt.endswith("<|im_start|>assistant\n")
    bare = httpx.post(f"{server.url}/apply-template", json={"messages": messages, "add_generation_prompt": False})
    assert not bare.json()["prompt"].endswith("assistant\n")
    assert httpx.post(f"{server.url}/apply-template", json={"messages": []}).status_code == 400


def test_llamacpp_props_and_metrics(server: ServerProcess) -> None:
    """GET /props as llama-server's; POST /props changes /completion's defaults (and only those it names);
    /metrics carries llamacpp:* with llama-server's TYPE lines and its Process-Start-Time-Unix header."""
    props = httpx.get(f"{server.url}/props").json()
    assert props["model_path"].endswith(".gguf") and props["total_slots"] >= 1
    assert props["default_generation_settings"]["n_ctx"] > 0 and "chat_template" in props
    update = {"default_generation_settings": {"params": {"n_predict": 3}}}
    assert llama(server, "/props", update).json() == {"success": True}
    try:
        assert httpx.get(f"{server.url}/props").json()["default_generation_settings"]["params"]["n_predict"] == 3
        assert llama(server, "/completion", {"prompt": "Hello", "temperature": 0}).json()["tokens_predicted"] == 3
    finally:
        llama(server, "/props", {"default_generation_settings": {"params": {"n_predict": -1}}})
    assert llama(server, "/props", {"default_generation_settings": {"params": {"mirostat": 2}}}).status_code == 400
    r = httpx.get(f"{server.url}/metrics")
    assert int(r.headers["Process-Start-Time-Unix"]) > 0
    # sent in their usual case, not lowercase (llama.cpp's own tests read them from a case-sensitive dict)
    assert (b"Process-Start-Time-Unix", r.headers["process-start-time-unix"].encode()) in r.headers.raw
    assert (b"Content-Type", r.headers["content-type"].encode()) in r.headers.raw
    assert "# TYPE llamacpp:prompt_tokens_total counter" in r.text
    value = next(line for line in r.text.splitlines() if line.startswith("llamacpp:tokens_predicted_total "))
    assert float(value.split()[1]) > 0


def test_llamacpp_completion_without_seed_takes_the_servers(server: ServerProcess) -> None:
    """A /completion that names no seed samples with the server's --seed (shown in generation_settings), as
    llama-server's: sent twice, it answers the same words."""
    body = {"prompt": "Once upon a time", "n_predict": 12, "temperature": 1.0, "top_k": 0, "top_p": 1.0}
    first, second = (llama(server, "/completion", body).json() for _ in range(2))
    assert first["content"] == second["content"] and first["generation_settings"]["seed"] == 0
    assert llama(server, "/completion", {**body, "seed": 7}).json()["generation_settings"]["seed"] == 7
    biased = llama(server, "/completion", {**body, "logit_bias": [[42, -5.0]]}).json()["generation_settings"]
    assert biased["logit_bias"] == [{"bias": -5.0, "token": 42}]  # llama-server's shape


# ---- every API alike --------------------------------------------------------------------------------------------

TOO_LONG = re.compile(
    r"prompt \((\d+) tokens\) \+ max_tokens \(100000\) = (\d+) is more than max_model_len (\d+); lower max_tokens "
    r"to at most (\d+)"
)


def test_the_same_over_long_request_is_refused_alike_on_every_api(
    server: ServerProcess, client: openai.OpenAI, model: str, ollama_client, anthropic_client
) -> None:
    """max_tokens is settled in one place for every API (server/output_limits.py, then the engine's fit_output):
    asking beyond the context in any API's own field is a 400 with one message, in that API's error shape; the same
    conversation (or text) gives the same words, numbers included."""
    import anthropic
    import ollama

    many, hi = 100_000, [{"role": "user", "content": "Hi"}]

    def openai_error(call) -> str:
        with pytest.raises(openai.BadRequestError) as info:
            call()
        body = info.value.body
        assert body["param"] == "max_tokens" and body["code"] == "context_length_exceeded", body  # type: ignore[index]
        return body["message"]  # type: ignore[index]

    def ollama_error(call) -> str:
        with pytest.raises(ollama.ResponseError) as info:
            call()
        assert info.value.status_code == 400
        return info.value.error

    with pytest.raises(anthropic.BadRequestError) as anthropic_info:
        anthropic_client.messages.create(model=model, max_tokens=many, messages=hi)
    chats = {
        "chat": openai_error(lambda: client.chat.completions.create(model=model, messages=hi, max_tokens=many)),
        "chat max_completion_tokens": openai_error(
            lambda: client.chat.completions.create(model=model, messages=hi, max_completion_tokens=many)
        ),
        "responses": openai_error(lambda: client.responses.create(model=model, input="Hi", max_output_tokens=many)),
        "anthropic": anthropic_info.value.body["error"]["message"],  # type: ignore[index]
        "ollama chat": ollama_error(lambda: ollama_client.chat(model, hi, options={"num_predict": many})),
    }
    llama_answer = llama(server, "/completion", {"prompt": "Hi", "n_predict": many})
    assert llama_answer.status_code == 400, llama_answer.text
    texts = {
        "completions": openai_error(lambda: client.completions.create(model=model, prompt="Hi", max_tokens=many)),
        "ollama generate raw": ollama_error(
            lambda: ollama_client.generate(model, "Hi", raw=True, options={"num_predict": many})
        ),
        "llama.cpp": llama_answer.json()["error"]["message"],
    }
    assert len(set(chats.values())) == 1, chats
    assert len(set(texts.values())) == 1, texts
    for message in (*chats.values(), *texts.values()):
        prompt, total, context, room = map(int, TOO_LONG.fullmatch(message).groups())  # type: ignore[union-attr]
        assert total == prompt + many and room == context - prompt


# ---- llama-server's options: slot files, names and tags, a chat template file, --reasoning, --no-metrics, hosts --

THINKING_TEMPLATE = (  # reads enable_thinking and the date, as llama.cpp's templates do
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if not enable_thinking %}<think></think>{% endif %}"
    "{% endif %}[{{ date_string }}]"
)


def ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.fixture(scope="module")
def slot_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("slots")


@pytest.fixture(scope="module")
def llama_server(slot_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    template = tmp_path_factory.mktemp("template") / "thinking.jinja"
    template.write_text(THINKING_TEMPLATE)
    hosts = "127.0.0.1,::1" if ipv6_loopback() else "127.0.0.1"
    proc = start_server(
        *("--slot-save-path", str(slot_dir), "--max-num-seqs", "2", "--host", hosts),
        *("--served-model-name", "mill", "grinder,miller", "--tags", "chat, small"),
        *("--chat-template-file", str(template), "--reasoning", "off", "--no-metrics"),
    )
    yield proc
    assert proc.stop() == 0


def test_llamacpp_slot_save_and_restore(llama_server: ServerProcess, slot_dir: Path) -> None:
    """save writes a slot's tokens and their cached K/V to a file in --slot-save-path; after erase forgot them
    (the prompt is computed again), restore puts them back into the prefix cache: the next prompt reads them and
    answers the same words, in another slot too."""
    url = llama_server.url
    prompt = "A long and winding road leads to the old mill by the river, where the miller grinds the wheat. " * 2
    body = {"prompt": prompt, "n_predict": 8, "temperature": 0, "id_slot": 1}
    first = llama(llama_server, "/completion", body).json()
    assert first["timings"]["cache_n"] == 0
    n_prompt = first["timings"]["prompt_n"]
    saved = llama(llama_server, "/slots/1?action=save", {"filename": "mill.bin"}).json()
    assert saved["id_slot"] == 1 and saved["filename"] == "mill.bin" and saved["n_saved"] == n_prompt + 7
    assert saved["n_written"] == (slot_dir / "mill.bin").stat().st_size and saved["timings"]["save_ms"] > 0
    assert llama(llama_server, "/slots/1?action=erase").json()["n_erased"] == n_prompt + 7
    assert llama(llama_server, "/completion", body).json()["timings"]["cache_n"] == 0  # erased: computed again
    llama(llama_server, "/slots/1?action=erase")
    restored = llama(llama_server, "/slots/0?action=restore", {"filename": "mill.bin"}).json()
    assert restored["n_restored"] == saved["n_saved"] and restored["n_read"] == saved["n_written"]
    slots = httpx.get(f"{url}/slots").json()
    assert slots[0]["is_processing"] is False
    again = llama(llama_server, "/completion", {**body, "id_slot": 0}).json()
    assert again["timings"]["cache_n"] == (n_prompt - 1) // 16 * 16 > 0  # read back, not computed
    assert again["content"] == first["content"] and again["id_slot"] == 0


def test_llamacpp_slot_file_names_and_missing_files(llama_server: ServerProcess, server: ServerProcess) -> None:
    """A file name is a name, never a path (llama.cpp's fs_validate_filename): 400; so is a file that is not
    there (a failed restore leaves the slot empty, as llama-server's); without --slot-save-path the actions answer
    501."""
    for name in ("../escape.bin", "a/b.bin", "..", ".", "", "x\\y", "trailing.", " lead", "nul\x00", "a:b"):
        r = llama(llama_server, "/slots/0?action=save", {"filename": name})
        assert r.status_code == 400, name
    assert llama(llama_server, "/slots/0?action=save", {}).status_code == 400
    missing = llama(llama_server, "/slots/0?action=restore", {"filename": "nothing-here.bin"})
    assert missing.status_code == 400 and "nothing-here.bin" in missing.json()["error"]["message"]
    assert llama(llama_server, "/slots/7?action=save", {"filename": "a.bin"}).status_code == 400  # no slot 7
    r = llama(server, "/slots/0?action=save", {"filename": "a.bin"})
    assert r.status_code == 501 and r.json()["error"]["type"] == "not_supported_error"


def test_model_names_and_tags(llama_server: ServerProcess) -> None:
    """--served-model-name's names (space- or comma-separated): the first is the id, every one is listed and
    accepted, each card carries them all as aliases, with --tags."""
    cards = httpx.get(f"{llama_server.url}/v1/models").json()["data"]
    assert [c["id"] for c in cards] == ["mill", "grinder", "miller"]
    assert all(c["aliases"] == ["mill", "grinder", "miller"] and c["tags"] == ["chat", "small"] for c in cards)
    r = httpx.post(f"{llama_server.url}/v1/completions", json={"model": "miller", "prompt": "Hi", "max_tokens": 1})
    assert r.status_code == 200 and r.json()["model"] == "mill"  # answered under its id


def test_chat_template_file_and_reasoning(llama_server: ServerProcess) -> None:
    """--chat-template-file renders chats instead of the model's template; --reasoning off sets its
    enable_thinking false unless a request sets it; today's date reaches it as date_string, as llama.cpp's."""
    messages = [{"role": "user", "content": "What is today?"}]
    today = datetime.date.today().strftime("%d %b %Y")
    prompt = llama(llama_server, "/apply-template", {"messages": messages}).json()["prompt"]
    assert prompt == f"<|im_start|>user\nWhat is today?<|im_end|>\n<|im_start|>assistant\n<think></think>[{today}]"
    thinking = {"messages": messages, "chat_template_kwargs": {"enable_thinking": True}}
    assert "<think>" not in llama(llama_server, "/apply-template", thinking).json()["prompt"]
    props = httpx.get(f"{llama_server.url}/props").json()
    assert props["chat_template"] == THINKING_TEMPLATE and props["endpoint_metrics"] is False


def test_metrics_can_be_off(llama_server: ServerProcess) -> None:
    r = httpx.get(f"{llama_server.url}/metrics")
    assert r.status_code == 501 and r.json()["error"]["type"] == "not_supported_error"


def test_several_listening_addresses(llama_server: ServerProcess) -> None:
    """--host with several addresses listens on each (IPv6 where the machine has it)."""
    if not ipv6_loopback():
        pytest.skip("no IPv6 loopback here")
    assert httpx.get(f"http://[::1]:{llama_server.port}/health").status_code == 200
    assert httpx.get(f"{llama_server.url}/health").status_code == 200


@pytest.mark.parametrize(
    "flags, words",
    [
        (("--slot-save-path", "/nonexistent/slots"), "--slot-save-path: not a directory"),
        (("--chat-template-file", "/nonexistent/t.jinja"), "cannot read --chat-template-file"),
        (("--reasoning", "maybe"), "invalid choice: 'maybe'"),
        (("--tools", "read_file,nope"), '--tools: unknown tool "nope". available tools: read_file, file_glob_search'),
        (("--tools", "all", "--host", "0.0.0.0"), "run commands on this machine: give --api-key"),
    ],
)
def test_llama_server_flags_that_cannot_work_fail_at_start(flags: tuple[str, ...], words: str) -> None:
    """As llama-server refuses them: before anything loads, status 2 and why."""
    out = subprocess.run(
        [sys.executable, "-m", "tokenmill.entrypoints.cli", "serve", *flags],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and words in out.stderr, out.stderr
