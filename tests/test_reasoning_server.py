"""Reasoning models through each API's own client against a real server: tiny random-weight models that carry the
real chat templates of Qwen3, DeepSeek-R1-Distill-Qwen and gpt-oss (tests/data/templates, with their licences) and
the bundled SmolLM2's tokenizer, whose reply is forced to a known text by a scripted logits processor
(tests/scripted_logits.py, loaded with --logits-processors; the request names the script in vllm_xargs). The
tokenizer has no <think> or harmony tokens, so every tag arrives split over several steps: each API must return
the thinking, the answer and the calls split exactly, whole and streamed."""

import json
from pathlib import Path

import httpx
import openai
import pytest

from tests.gguf_builder import TinyModel, write_tiny_gguf
from tests.server_utils import ServerProcess, start_server
from tokenmill.loader.gguf_file import GGUFFile
from tokenmill.loader.model_path import bundled_model_path
from tokenmill.tokenizer.gguf_tokenizer import Tokenizer

pytestmark = [pytest.mark.slow, pytest.mark.server]

TEMPLATES = Path(__file__).parent / "data" / "templates"
PROCESSOR = "tests.scripted_logits:ScriptedReply"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_gguf(GGUFFile(bundled_model_path()))


def script(tokenizer: Tokenizer, text: str, end: bool = True) -> dict:
    """vllm_xargs that force the reply to `text` (then EOS, unless `end` is false)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return {"script": ids + ([tokenizer.eos_token_id] if end else [])}


def serve(tmp_path_factory, template: str, *args: str) -> ServerProcess:
    path = tmp_path_factory.mktemp(template) / f"{template}.gguf"
    source = (TEMPLATES / f"{template}.jinja").read_text()
    model = TinyModel(vocab_size=49152, context=4096)
    write_tiny_gguf(path, model, tokenizer_from=bundled_model_path(), chat_template=source)
    return start_server("--model", str(path), "--logits-processors", PROCESSOR, *args)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    proc = serve(tmp_path_factory, "qwen3")
    yield proc
    assert proc.stop() == 0


@pytest.fixture(scope="module")
def client(qwen3: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{qwen3.url}/v1", api_key="unused", max_retries=0, timeout=120)


def model_of(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


THOUGHT = "<think>\nThe user greets me. I should answer <briefly>.\n</think>\n\nHello there."
ASK = [{"role": "user", "content": "Hi"}]


def test_the_tags_arrive_split(tokenizer: Tokenizer) -> None:
    """What the other tests rely on: this tokenizer writes each tag in several tokens."""
    for tag in ("<think>", "</think>", "<tool_call>", "<|channel|>", "<|message|>"):
        assert len(tokenizer.encode(tag)) > 1


def test_openai_chat_splits_thinking_whole_and_streamed(client: openai.OpenAI, tokenizer: Tokenizer) -> None:
    model = model_of(client)
    body = {"vllm_xargs": script(tokenizer, THOUGHT)}
    whole = client.chat.completions.create(model=model, messages=ASK, max_tokens=100, extra_body=body)
    message = whole.choices[0].message
    assert message.reasoning_content == "The user greets me. I should answer <briefly>."
    assert message.content == "Hello there." and whole.choices[0].finish_reason == "stop"
    details = whole.usage.completion_tokens_details
    assert 0 < details.reasoning_tokens < whole.usage.completion_tokens
    stream = client.chat.completions.create(
        model=model,
        messages=ASK,
        max_tokens=100,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={**body, "return_token_ids": True},
    )
    thinking, content, carried, usage = [], [], [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            delta = choice.delta.model_dump()
            thinking.append(delta.get("reasoning_content") or "")
            content.append(delta.get("content") or "")
            carried.append(len(choice.model_extra.get("token_ids") or []))
    assert "".join(thinking) == message.reasoning_content and "".join(content) == "Hello there."
    assert not any("think>" in c or "</" in c for c in content)  # no piece of a tag in the answer
    # token by token, not at the end: each chunk that carried a token of the thinking's text shows thinking (a
    # busy server may put several tokens in one chunk)
    ids = tokenizer.encode(THOUGHT)
    inside = range(len(tokenizer.encode("<think>\n")), ids.index(tokenizer.encode("</")[0]) - 1)  # 'The' .. '>.'
    assert tokenizer.decode(ids[inside.start : inside.stop]) == message.reasoning_content
    ends = [sum(carried[: i + 1]) for i in range(len(carried))]
    chunks = zip(thinking, carried, ends, strict=True)
    showing = [bool(t) for t, n, end in chunks if any(end - n <= p < end for p in inside)]
    assert showing and all(showing)
    # counted token by token however the stream's outputs grouped them: the same count, the tags' tokens included
    assert usage.completion_tokens_details.reasoning_tokens == details.reasoning_tokens
    assert details.reasoning_tokens == ids.index(tokenizer.encode("</")[0]) + 3  # up to the closing tag's '>'


def test_enable_thinking_false_renders_without_thinking(client: openai.OpenAI, tokenizer: Tokenizer) -> None:
    body = {"vllm_xargs": script(tokenizer, "Plain."), "return_token_ids": True}
    off = client.chat.completions.create(
        model=model_of(client),
        messages=ASK,
        max_tokens=20,
        extra_body={**body, "chat_template_kwargs": {"enable_thinking": False}},
    )
    prompt = tokenizer.decode(off.model_extra["prompt_token_ids"])
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert off.choices[0].message.content == "Plain." and off.choices[0].message.reasoning_content is None


CALL = (
    "<think>\nThe user wants the weather.\n</think>\n\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
)


def test_a_qwen3_tool_call_in_its_own_syntax(client: openai.OpenAI, tokenizer: Tokenizer) -> None:
    model = model_of(client)
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    body = {"vllm_xargs": script(tokenizer, CALL)}
    for tool_choice in ("auto", {"type": "function", "function": {"name": "get_weather"}}):
        whole = client.chat.completions.create(
            model=model, messages=ask, tools=[WEATHER], tool_choice=tool_choice, max_tokens=100, extra_body=body
        )
        choice = whole.choices[0]
        assert choice.finish_reason == "tool_calls" and not choice.message.content
        assert choice.message.reasoning_content == "The user wants the weather."
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
        chunks = list(
            client.chat.completions.create(
                model=model,
                messages=ask,
                tools=[WEATHER],
                tool_choice=tool_choice,
                max_tokens=100,
                stream=True,
                extra_body=body,
            )
        )
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        assert not any(d.content for d in deltas)  # tool_calls deltas only, no wrapper text
        calls = [t for d in deltas for t in d.tool_calls or []]
        assert [(t.function.name, json.loads(t.function.arguments)) for t in calls] == [
            ("get_weather", {"city": "Paris"})
        ]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # the conversation goes on: the call and its result render through Qwen3's own template
    follow = [
        *ask,
        {"role": "assistant", "content": "", "tool_calls": [call.model_dump()], "reasoning_content": "x"},
        {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "clear"}'},
    ]
    after = client.chat.completions.create(
        model=model,
        messages=follow,
        tools=[WEATHER],
        max_tokens=20,
        extra_body={"vllm_xargs": script(tokenizer, "<think>\nok\n</think>\n\nClear."), "return_token_ids": True},
    )
    prompt = tokenizer.decode(after.model_extra["prompt_token_ids"])
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert '<tool_response>\n{"sky": "clear"}\n</tool_response>' in prompt
    assert after.choices[0].message.content == "Clear."


def test_a_call_cut_off_by_max_tokens_is_an_incomplete_call(client: openai.OpenAI, tokenizer: Tokenizer) -> None:
    """As vLLM sends it: no wrapper text in content; the call as far as it was written, finish "length"."""
    model = model_of(client)
    forced = script(tokenizer, CALL)
    cut = len(tokenizer.encode(CALL.split('"Paris"')[0]))  # inside the arguments
    named = {"type": "function", "function": {"name": "get_weather"}}
    for stream in (False, True):
        kwargs = dict(
            model=model,
            messages=ASK,
            tools=[WEATHER],
            tool_choice=named,
            max_tokens=cut,
            extra_body={"vllm_xargs": forced},
        )
        if not stream:
            choice = client.chat.completions.create(**kwargs).choices[0]
            content, calls, finish = choice.message.content, choice.message.tool_calls, choice.finish_reason
        else:
            chunks = [c for c in client.chat.completions.create(**kwargs, stream=True) if c.choices]
            content = "".join(c.choices[0].delta.content or "" for c in chunks)
            calls = [t for c in chunks for t in c.choices[0].delta.tool_calls or []]
            finish = chunks[-1].choices[0].finish_reason
        assert finish == "length" and not content
        (call,) = calls
        assert call.function.name == "get_weather" and call.function.arguments.startswith('{"city"')


def test_structured_output_constrains_only_the_answer(client: openai.OpenAI, tokenizer: Tokenizer) -> None:
    text = '<think>\nA JSON answer.\n</think>\n\n{"city": "Oslo"}'
    reply = client.chat.completions.create(
        model=model_of(client),
        messages=ASK,
        max_tokens=60,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "c", "schema": WEATHER["function"]["parameters"]},
        },
        extra_body={"vllm_xargs": script(tokenizer, text)},
    )
    message = reply.choices[0].message
    assert message.reasoning_content == "A JSON answer." and json.loads(message.content) == {"city": "Oslo"}


def test_anthropic_thinking_blocks_whole_and_streamed(qwen3: ServerProcess, tokenizer: Tokenizer) -> None:
    import anthropic

    client = anthropic.Anthropic(base_url=qwen3.url, api_key="unused", max_retries=0)
    kwargs = dict(
        model=model_of(openai.OpenAI(base_url=f"{qwen3.url}/v1", api_key="x")),
        max_tokens=100,
        messages=ASK,
        thinking={"type": "enabled", "budget_tokens": 1024},
        extra_body={"vllm_xargs": script(tokenizer, THOUGHT)},
    )
    whole = client.messages.create(**kwargs)
    assert [b.type for b in whole.content] == ["thinking", "text"]
    assert whole.content[0].thinking == "The user greets me. I should answer <briefly>."
    assert whole.content[1].text == "Hello there." and whole.stop_reason == "end_turn"
    with client.messages.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.delta.type for e in events if e.type == "content_block_delta"]
    assert "thinking_delta" in kinds and "text_delta" in kinds
    assert [b.model_dump(exclude={"signature"}) for b in final.content] == [
        b.model_dump(exclude={"signature"}) for b in whole.content
    ]


def test_ollama_think_whole_and_streamed(qwen3: ServerProcess, tokenizer: Tokenizer) -> None:
    import ollama

    client = ollama.Client(host=qwen3.url)
    name = model_of(openai.OpenAI(base_url=f"{qwen3.url}/v1", api_key="x"))
    options = {"num_predict": 100, "vllm_xargs": script(tokenizer, THOUGHT)}
    whole = client.chat(model=name, messages=ASK, think=True, options=options)
    assert whole.message.thinking == "The user greets me. I should answer <briefly>."
    assert whole.message.content == "Hello there."
    parts = list(client.chat(model=name, messages=ASK, think=True, options=options, stream=True))
    assert "".join(p.message.thinking or "" for p in parts) == whole.message.thinking
    assert "".join(p.message.content for p in parts) == "Hello there."
    hidden = client.chat(model=name, messages=ASK, think=False, options=options)
    assert not hidden.message.thinking  # think: false shows none


def test_responses_reasoning_items_and_a_continued_turn(client: openai.OpenAI, tokenizer: Tokenizer) -> None:
    model = model_of(client)
    first = client.responses.create(
        model=model, input="Hi", max_output_tokens=100, extra_body={"vllm_xargs": script(tokenizer, THOUGHT)}
    )
    kinds = [item.type for item in first.output]
    assert kinds == ["reasoning", "message"]
    assert first.output[0].content[0].text == "The user greets me. I should answer <briefly>."
    assert first.output_text == "Hello there." and first.usage.output_tokens_details.reasoning_tokens > 0
    events = list(
        client.responses.create(
            model=model,
            input="Hi",
            max_output_tokens=100,
            stream=True,
            extra_body={"vllm_xargs": script(tokenizer, THOUGHT)},
        )
    )
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    answer = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert (reasoning, answer) == (first.output[0].content[0].text, "Hello there.")
    second = client.responses.create(
        model=model,
        input="And now?",
        previous_response_id=first.id,
        max_output_tokens=20,
        extra_body={"vllm_xargs": script(tokenizer, "<think>\nagain\n</think>\n\nStill here.")},
    )
    assert second.output_text == "Still here."


def test_responses_logprobs_are_the_answers_tokens(client: openai.OpenAI, tokenizer: Tokenizer) -> None:
    """With include's output_text.logprobs, the message's entries and the text deltas' are those of the answer's
    tokens: none of the thinking's or of its tags (which arrive split: tokens that make nothing yet)."""
    model = model_of(client)
    asked = {"model": model, "input": "Hi", "max_output_tokens": 100, "include": ["message.output_text.logprobs"]}
    xargs = {"vllm_xargs": script(tokenizer, THOUGHT)}
    whole = client.responses.create(**asked, extra_body=xargs)
    entries = whole.output[1].content[0].logprobs
    assert "".join(e.token for e in entries).strip() == "Hello there."  # (after the blank line the tag leaves)
    events = list(client.responses.create(**asked, stream=True, extra_body=xargs))
    streamed = [e for event in events if event.type == "response.output_text.delta" for e in event.logprobs]
    assert [e.token for e in streamed] == [e.token for e in entries]


def test_r1_distill_starts_inside_its_thinking(tmp_path_factory, tokenizer: Tokenizer) -> None:
    proc = serve(tmp_path_factory, "deepseek-r1-distill-qwen")
    try:
        client = openai.OpenAI(base_url=f"{proc.url}/v1", api_key="unused", max_retries=0, timeout=120)
        reply = client.chat.completions.create(
            model=model_of(client),
            messages=ASK,
            max_tokens=60,
            extra_body={
                "vllm_xargs": script(tokenizer, "Short thought.\n</think>\n\nAnswer."),
                "chat_template_kwargs": {"enable_thinking": True},
                "return_token_ids": True,
            },
        )
        assert tokenizer.decode(reply.model_extra["prompt_token_ids"]).endswith("<｜Assistant｜><think>\n")
        message = reply.choices[0].message
        assert (message.reasoning_content, message.content) == ("Short thought.", "Answer.")
        # Anthropic's budget_tokens: a scripted thought longer than the budget is closed after 6 tokens (the budget
        # overrides the script; the script's later tokens then make the answer)
        import anthropic

        long = script(tokenizer, "Alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu.")
        messages = anthropic.Anthropic(base_url=proc.url, api_key="unused", max_retries=0).messages.create(
            model=model_of(client),
            max_tokens=40,
            messages=ASK,
            thinking={"type": "enabled", "budget_tokens": 6},
            extra_body={"vllm_xargs": long},
        )
        assert [b.type for b in messages.content[:2]] == ["thinking", "text"]
        assert messages.content[0].thinking == tokenizer.decode(long["script"][:6]).strip()
        # vLLM's thinking_token_budget on the chat API: the same limit; -1 is no limit; others are refused
        think = {"vllm_xargs": long, "chat_template_kwargs": {"enable_thinking": True}}
        budgeted = client.chat.completions.create(
            model=model_of(client), messages=ASK, max_tokens=40, extra_body={**think, "thinking_token_budget": 6}
        )
        assert budgeted.choices[0].message.reasoning_content == messages.content[0].thinking
        unlimited = client.chat.completions.create(
            model=model_of(client), messages=ASK, max_tokens=40, extra_body={**think, "thinking_token_budget": -1}
        )
        assert unlimited.choices[0].message.reasoning_content.endswith("lambda mu.")  # the whole thought
        for bad in (-2, 0.6, 10.5):
            with pytest.raises(openai.BadRequestError, match="thinking_token_budget"):
                client.chat.completions.create(
                    model=model_of(client), messages=ASK, max_tokens=5, extra_body={"thinking_token_budget": bad}
                )
    finally:
        assert proc.stop() == 0


HARMONY_CALL = (
    "<|channel|>analysis<|message|>Need the weather tool.<|end|><|start|>assistant<|channel|>commentary "
    'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}'
)


def test_gpt_oss_harmony_thinking_calls_and_effort(tmp_path_factory, tokenizer: Tokenizer) -> None:
    proc = serve(tmp_path_factory, "gpt-oss")
    try:
        client = openai.OpenAI(base_url=f"{proc.url}/v1", api_key="unused", max_retries=0, timeout=120)
        model = model_of(client)
        answer = "<|channel|>analysis<|message|>Greet back.<|end|><|start|>assistant<|channel|>final<|message|>Hi!"
        reply = client.chat.completions.create(
            model=model,
            messages=ASK,
            max_tokens=80,
            reasoning_effort="high",
            extra_body={"vllm_xargs": script(tokenizer, answer), "return_token_ids": True},
        )
        prompt = tokenizer.decode(reply.model_extra["prompt_token_ids"])
        assert "Reasoning: high" in prompt and prompt.endswith("<|start|>assistant")
        message = reply.choices[0].message
        assert (message.reasoning_content, message.content) == ("Greet back.", "Hi!")
        chunks = client.chat.completions.create(
            model=model, messages=ASK, max_tokens=80, stream=True, extra_body={"vllm_xargs": script(tokenizer, answer)}
        )
        deltas = [c.choices[0].delta.model_dump() for c in chunks if c.choices]
        assert "".join(d.get("reasoning_content") or "" for d in deltas) == "Greet back."
        assert "".join(d.get("content") or "" for d in deltas) == "Hi!"  # no header text, however it was split
        called = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Weather in Paris?"}],
            tools=[WEATHER],
            max_tokens=100,
            extra_body={"vllm_xargs": script(tokenizer, HARMONY_CALL)},
        )
        choice = called.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.reasoning_content == "Need the weather tool."
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
        # a named function: harmony's own call syntax, after the analysis, enforced by a grammar (its markers are
        # text to this tokenizer; the script keeps <|end|> a token boundary, as gpt-oss's special tokens are)
        pieces = HARMONY_CALL.partition("<|end|>")
        forced = [t for p in pieces for t in tokenizer.encode(p)] + [tokenizer.eos_token_id]
        named = client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Weather in Paris?"}],
            tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            max_tokens=100,
            extra_body={"vllm_xargs": {"script": forced}},
        )
        choice = named.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.reasoning_content == "Need the weather tool."
        assert json.loads(choice.message.tool_calls[0].function.arguments) == {"city": "Paris"}
        # harmony's rule: an earlier turn's analysis is dropped once a final answer follows it
        history = [
            *ASK,
            {"role": "assistant", "content": "Hi!", "reasoning_content": "OLD ANALYSIS"},
            {"role": "user", "content": "Again"},
        ]
        again = client.chat.completions.create(
            model=model,
            messages=history,
            max_tokens=20,
            extra_body={"vllm_xargs": script(tokenizer, answer), "return_token_ids": True},
        )
        prompt = tokenizer.decode(again.model_extra["prompt_token_ids"])
        assert "OLD ANALYSIS" not in prompt and "<|channel|>final<|message|>Hi!<|end|>" in prompt
    finally:
        assert proc.stop() == 0


def test_unknown_parser_names_fail_at_start() -> None:
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "tokenmill.entrypoints.cli", "serve", "--reasoning-parser", "magic"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and "no reasoning parser 'magic'" in out.stderr


def test_a_thinking_model_takes_the_request_a_plain_one_refuses(qwen3: ServerProcess) -> None:
    """Ollama's think: true, which the bundled SmolLM2 (no thinking in its template) answers with a 400
    (test_server_apis.py), is accepted by a model whose template thinks."""
    reply = httpx.post(
        f"{qwen3.url}/api/chat",
        json={
            "model": model_of(openai.OpenAI(base_url=f"{qwen3.url}/v1", api_key="x")),
            "messages": ASK,
            "think": True,
            "stream": False,
            "options": {"num_predict": 3},
        },
        timeout=60,
    )
    assert reply.status_code == 200
