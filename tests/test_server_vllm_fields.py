"""vLLM's request extensions on the OpenAI endpoints, through the official `openai` client (extra_body) against a
real server, checked by their values: prompt_logprobs, stream_options.continuous_usage_stats,
return_tokens_as_token_ids, allowed_token_ids, logprob_token_ids, truncate_prompt_tokens with truncation_side,
continue_final_message (chat and /tokenize) with chat's echo, and roles beyond OpenAI's."""

import math

import httpx
import openai
import pytest

from tests.gguf_builder import TinyModel, write_tiny_gguf
from tests.server_utils import ServerProcess, start_server
from tests.test_chat_template import LLAMA31_ROLES
from tokenmill import LLM, SamplingParams
from tokenmill.loader.model_path import bundled_model_path

pytestmark = [pytest.mark.slow, pytest.mark.server]

PROMPT = "The capital of France is"
ASK = [{"role": "user", "content": "Name a color."}]


@pytest.fixture(scope="module")
def server(default_server: ServerProcess) -> ServerProcess:
    return default_server  # as tests/test_server.py's: the bundled model under `auto`, shared (conftest.py)


def tokenize(server: ServerProcess, **body) -> list[int]:
    r = httpx.post(f"{server.url}/tokenize", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def detokenize(server: ServerProcess, tokens: list[int]) -> str:
    return httpx.post(f"{server.url}/detokenize", json={"tokens": tokens}, timeout=60).json()["prompt"]


def refused(call, param: str) -> str:
    """The message of the 400 that `call` gets, which must name `param`."""
    with pytest.raises(openai.BadRequestError) as info:
        call()
    assert info.value.body["param"] == param, info.value.body  # type: ignore[index]
    return info.value.body["message"]  # type: ignore[index]


def test_prompt_logprobs_on_completions(client: openai.OpenAI, model: str, offline: LLM) -> None:
    """Each prompt token's log-probability, rank and text, and the top ones at its position, first entry null: the
    engine's values, per prompt of a batch; null when not asked; with echo and logprobs too (as vLLM's)."""
    resp = client.completions.create(
        model=model, prompt=[PROMPT, "Hello"], max_tokens=1, temperature=0, extra_body={"prompt_logprobs": 2}
    )
    want = offline.generate(PROMPT, SamplingParams(max_tokens=1, prompt_logprobs=2), use_tqdm=False)[0]
    scored = resp.choices[0].prompt_logprobs
    assert scored[0] is None and len(scored) == len(want.prompt_token_ids)
    for token, position, theirs in zip(want.prompt_token_ids[1:], want.prompt_logprobs[1:], scored[1:], strict=True):
        assert list(theirs)[0] == str(token)  # the prompt's token first, then the top 2
        assert 2 <= len(theirs) <= 3
        for tid, entry in theirs.items():
            assert math.isclose(entry["logprob"], position[int(tid)].logprob, abs_tol=1e-3)
            assert entry["rank"] == position[int(tid)].rank
            assert entry["decoded_token"] == offline.get_tokenizer().decode([int(tid)])
    assert resp.choices[1].prompt_logprobs[0] is None and len(resp.choices[1].prompt_logprobs) >= 1
    plain = client.completions.create(model=model, prompt=PROMPT, max_tokens=1)
    assert plain.choices[0].prompt_logprobs is None
    echoed = client.completions.create(model=model, prompt=PROMPT, max_tokens=1, echo=True, logprobs=1)
    assert len(echoed.choices[0].prompt_logprobs) == len(want.prompt_token_ids)
    # streamed prompt log-probabilities are refused, as vLLM's; -1 (the whole vocabulary at each position) too,
    # beyond the default --max-logprobs of 20 (test_the_whole_vocabulary_with_max_logprobs_unlimited)
    stream = {"stream": True}
    message = refused(
        lambda: client.completions.create(model=model, prompt=PROMPT, extra_body={"prompt_logprobs": 1}, **stream),
        "prompt_logprobs",
    )
    assert "stream" in message
    whole = {"prompt_logprobs": -1}
    refused(lambda: client.completions.create(model=model, prompt=PROMPT, extra_body=whole), "prompt_logprobs")


def test_prompt_logprobs_on_chat(client: openai.OpenAI, model: str, server: ServerProcess) -> None:
    resp = client.chat.completions.create(
        model=model, messages=ASK, max_tokens=1, extra_body={"prompt_logprobs": 0, "return_token_ids": True}
    )
    scored = resp.prompt_logprobs  # at the top of the response, as vLLM's
    prompt = resp.prompt_token_ids
    assert scored[0] is None and len(scored) == len(prompt) == resp.usage.prompt_tokens
    assert all(list(p) == [str(t)] and p[str(t)]["logprob"] <= 0 for p, t in zip(scored[1:], prompt[1:], strict=True))
    assert client.chat.completions.create(model=model, messages=ASK, max_tokens=1).prompt_logprobs is None


def test_continuous_usage_stats(client: openai.OpenAI, model: str) -> None:
    """With include_usage, every chunk carries the usage so far (its choice's output tokens); the final usage chunk
    as without it; without include_usage, none (vLLM's)."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(
        client.completions.create(
            model=model, prompt=PROMPT, max_tokens=5, temperature=0, stream=True, stream_options=options
        )
    )
    counted = [c.usage.completion_tokens for c in chunks[:-1]]
    assert counted == sorted(counted) and counted[-1] == 5 and counted[0] >= 1
    assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in chunks)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
    assert len({c.usage.prompt_tokens for c in chunks}) == 1
    chunks = list(
        client.chat.completions.create(
            model=model, messages=ASK, max_tokens=4, temperature=0, stream=True, stream_options=options
        )
    )
    assert chunks[0].usage.completion_tokens == 0 and chunks[0].choices[0].delta.role == "assistant"
    counted = [c.usage.completion_tokens for c in chunks[1:-1]]
    assert counted == sorted(counted) and 1 <= counted[-1] == chunks[-1].usage.completion_tokens <= 4
    quiet = {"include_usage": False, "continuous_usage_stats": True}
    stream = client.completions.create(model=model, prompt=PROMPT, max_tokens=3, stream=True, stream_options=quiet)
    assert all(c.usage is None for c in stream)


def test_return_tokens_as_token_ids(client: openai.OpenAI, model: str) -> None:
    extra = {"return_tokens_as_token_ids": True, "return_token_ids": True}
    resp = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2, echo=True, extra_body=extra
    )
    choice = resp.choices[0]
    ids = choice.prompt_token_ids + choice.token_ids
    assert choice.logprobs.tokens == [f"token_id:{t}" for t in ids]
    assert all(all(k.startswith("token_id:") for k in top) for top in choice.logprobs.top_logprobs[1:])
    assert choice.text.startswith(PROMPT)  # the text stays text; its offsets index it
    assert choice.logprobs.text_offset[len(choice.prompt_token_ids)] == len(PROMPT)
    chat = client.chat.completions.create(
        model=model, messages=ASK, max_tokens=3, temperature=0, logprobs=True, top_logprobs=2, extra_body=extra
    )
    content = chat.choices[0].logprobs.content
    assert [c.token for c in content] == [f"token_id:{t}" for t in chat.choices[0].token_ids]
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].token.startswith("token_id:") for c in content)


def test_allowed_token_ids(client: openai.OpenAI, model: str, server: ServerProcess) -> None:
    """Only the listed tokens are sampled, greedy or not, on both endpoints; ids outside the vocabulary and an
    empty list are refused."""
    allowed = tokenize(server, prompt=" red green blue", add_special_tokens=False)
    for temperature in (0, 1.0):
        resp = client.completions.create(
            model=model,
            prompt=PROMPT,
            max_tokens=6,
            temperature=temperature,
            extra_body={"allowed_token_ids": allowed, "return_token_ids": True, "ignore_eos": True},
        )
        assert len(resp.choices[0].token_ids) == 6 and set(resp.choices[0].token_ids) <= set(allowed)
    chat = client.chat.completions.create(
        model=model, messages=ASK, max_tokens=4, extra_body={"allowed_token_ids": allowed, "return_token_ids": True}
    )
    assert chat.choices[0].token_ids and set(chat.choices[0].token_ids) <= set(allowed)
    for bad in ([], [10**7]):
        refused(
            lambda bad=bad: client.completions.create(
                model=model, prompt=PROMPT, extra_body={"allowed_token_ids": bad}
            ),
            "allowed_token_ids",
        )


def test_logprob_token_ids(client: openai.OpenAI, model: str, server: ServerProcess) -> None:
    """The listed tokens' log-probabilities at every position, with the sampled one's, in place of the top ones
    (vLLM 0.33: whatever top_logprobs says); their values are those the top ones report."""
    top = client.completions.create(model=model, prompt=PROMPT, max_tokens=1, temperature=0, logprobs=5)
    natural = top.choices[0].logprobs.top_logprobs[0]  # the five most likely first tokens
    names = list(natural)
    ids = [tokenize(server, prompt=name, add_special_tokens=False) for name in names]
    listed = [t[0] for t in ids if len(t) == 1][-2:]  # two of the less likely ones, single tokens
    extra = {"logprob_token_ids": listed, "return_tokens_as_token_ids": True, "return_token_ids": True}
    resp = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=2, temperature=0, logprobs=5, extra_body=extra
    )
    sampled = resp.choices[0].token_ids
    first = resp.choices[0].logprobs.top_logprobs[0]
    assert set(first) == {f"token_id:{t}" for t in [sampled[0], *listed]}
    for t in listed:
        name = names[[i[0] if len(i) == 1 else None for i in ids].index(t)]
        assert math.isclose(first[f"token_id:{t}"], natural[name], abs_tol=1e-4)
    assert set(resp.choices[0].logprobs.top_logprobs[1]) == {f"token_id:{t}" for t in [sampled[1], *listed]}
    chat = client.chat.completions.create(
        model=model, messages=ASK, max_tokens=2, temperature=0, logprobs=True, top_logprobs=5, extra_body=extra
    )
    for position, token in zip(chat.choices[0].logprobs.content, chat.choices[0].token_ids, strict=True):
        shown = [e.token for e in position.top_logprobs]
        assert shown[0] == f"token_id:{token}" and set(shown) == {f"token_id:{t}" for t in [token, *listed]}
    message = refused(
        lambda: client.chat.completions.create(model=model, messages=ASK, extra_body={"logprob_token_ids": listed}),
        "logprob_token_ids",
    )
    assert "logprobs" in message
    body = {"logprob_token_ids": listed}
    refused(lambda: client.completions.create(model=model, prompt=PROMPT, extra_body=body), "logprob_token_ids")


def test_truncate_prompt_tokens(client: openai.OpenAI, model: str, server: ServerProcess, tiny: ServerProcess) -> None:
    """The prompt's last N tokens ("left", the default) or first N ("right"), text or token ids, on both
    endpoints and embeddings; -1: a prompt longer than the context runs, cut to fit, and more than max_model_len is
    a 400 (on the tiny model, whose context is short: quick to fill)."""
    ids = tokenize(server, prompt="one two three four five six seven eight nine ten")
    for side, kept in (("left", ids[-4:]), ("right", ids[:4])):
        extra = {"truncate_prompt_tokens": 4, "truncation_side": side, "return_token_ids": True}
        for prompt in (ids, detokenize(server, ids)):
            resp = client.completions.create(model=model, prompt=prompt, max_tokens=1, echo=True, extra_body=extra)
            assert resp.choices[0].prompt_token_ids == kept and resp.usage.prompt_tokens == 4
            assert resp.choices[0].text.startswith(detokenize(server, kept))  # echo: what ran
    small = openai.OpenAI(base_url=f"{tiny.url}/v1", api_key="unused", max_retries=0, timeout=60)
    name, limit = (lambda card: (card.id, card.model_extra["max_model_len"]))(small.models.list().data[0])
    long = " ".join(f"w{i}" for i in range(limit))  # more tokens than the context holds
    refused(lambda: small.completions.create(model=name, prompt=long, max_tokens=1), "prompt")
    whole = {"truncate_prompt_tokens": -1, "return_token_ids": True}
    resp = small.completions.create(model=name, prompt=long, max_tokens=1, extra_body=whole)
    assert resp.usage.prompt_tokens == limit - 1 and resp.choices[0].finish_reason == "length"
    assert resp.choices[0].prompt_token_ids == tokenize(tiny, prompt=long)[-(limit - 1) :]
    over = {"truncate_prompt_tokens": limit + 1}
    refused(lambda: small.completions.create(model=name, prompt=PROMPT, extra_body=over), "truncate_prompt_tokens")
    chat_ids = tokenize(server, messages=ASK)
    chat = client.chat.completions.create(
        model=model, messages=ASK, max_tokens=1, extra_body={"truncate_prompt_tokens": 5, "return_token_ids": True}
    )
    assert chat.prompt_token_ids == chat_ids[-5:] and chat.usage.prompt_tokens == 5
    vectors = client.embeddings.create(model=model, input=[ids, ids[:4]], extra_body={"truncate_prompt_tokens": 4})
    assert vectors.usage.prompt_tokens == 8
    assert all(math.isclose(a, b, abs_tol=1e-5) for a, b in zip(*(d.embedding for d in vectors.data), strict=True))


SAYING = "Here is a common saying about apples. An apple a day, keeps"
CONTINUING = [{"role": "user", "content": "Tell me a common saying."}, {"role": "assistant", "content": SAYING}]


def test_continue_final_message(client: openai.OpenAI, model: str, server: ServerProcess, offline: LLM) -> None:
    """The final message is left open (no end of turn after it) and the reply goes on with it: its prompt is what
    /tokenize answers for the same request, and its greedy tokens what the engine writes after that prompt. echo
    puts the message before the reply. Both with add_generation_prompt (true unless sent false): 400."""
    open_ids = tokenize(server, messages=CONTINUING, add_generation_prompt=False, continue_final_message=True)
    closed_ids = tokenize(server, messages=CONTINUING, add_generation_prompt=False)
    assert detokenize(server, open_ids).endswith(SAYING) and len(closed_ids) > len(open_ids)
    extra = {"continue_final_message": True, "add_generation_prompt": False, "return_token_ids": True}
    resp = client.chat.completions.create(
        model=model, messages=CONTINUING, max_tokens=8, temperature=0, extra_body=extra
    )
    assert resp.prompt_token_ids == open_ids
    want = offline.generate(
        {"prompt_token_ids": open_ids}, offline.get_default_sampling_params(temperature=0, max_tokens=8), use_tqdm=False
    )[0].outputs[0]
    assert resp.choices[0].token_ids == want.token_ids and resp.choices[0].message.content == want.text
    echoed = client.chat.completions.create(
        model=model, messages=CONTINUING, max_tokens=8, temperature=0, extra_body={**extra, "echo": True}
    )
    assert echoed.choices[0].message.content == SAYING + want.text
    stream = client.chat.completions.create(
        model=model, messages=CONTINUING, max_tokens=8, temperature=0, stream=True, extra_body={**extra, "echo": True}
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream) == SAYING + want.text
    for sent in ({"continue_final_message": True}, {"continue_final_message": True, "add_generation_prompt": True}):
        message = refused(
            lambda sent=sent: client.chat.completions.create(model=model, messages=CONTINUING, extra_body=sent),
            "continue_final_message",
        )
        assert "add_generation_prompt" in message
    r = httpx.post(f"{server.url}/tokenize", json={"messages": CONTINUING, "continue_final_message": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"


def test_tokenize_takes_tools_as_chat_shows_them(client: openai.OpenAI, model: str, server: ServerProcess) -> None:
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    with_tools = tokenize(server, messages=ASK, tools=tools)
    resp = client.chat.completions.create(
        model=model, messages=ASK, tools=tools, max_tokens=1, extra_body={"return_token_ids": True}
    )
    assert resp.prompt_token_ids == with_tools and len(with_tools) > len(tokenize(server, messages=ASK))


def test_any_role_reaches_the_template(client: openai.OpenAI, model: str, server: ServerProcess) -> None:
    """Roles beyond OpenAI's (Llama 3.1's ipython, any string) go to the chat template as sent (SmolLM2's writes
    any role)."""
    messages = [*ASK, {"role": "ipython", "content": "42"}, {"role": "narrator", "content": "Later."}]
    resp = client.chat.completions.create(
        model=model, messages=messages, max_tokens=2, extra_body={"return_token_ids": True}
    )
    text = detokenize(server, resp.prompt_token_ids)
    assert "<|im_start|>ipython\n42<|im_end|>\n<|im_start|>narrator\nLater.<|im_end|>" in text


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> ServerProcess:
    """A tiny random model (the bundled tokenizer, a 256-token context) whose chat template takes roles as Llama
    3.1's does (ipython yes, others raise), started with --max-logprobs -1 (no limit)."""
    path = tmp_path_factory.mktemp("roles") / "roles.gguf"
    write_tiny_gguf(path, TinyModel(vocab_size=49152), tokenizer_from=bundled_model_path(), chat_template=LLAMA31_ROLES)
    proc = start_server("--model", str(path), "--max-logprobs", "-1")
    yield proc
    assert proc.stop() == 0


def test_a_role_the_template_refuses_is_a_400(tiny: ServerProcess) -> None:
    small = openai.OpenAI(base_url=f"{tiny.url}/v1", api_key="unused", max_retries=0, timeout=60)
    name = small.models.list().data[0].id
    ok = [{"role": "user", "content": "6*7?"}, {"role": "ipython", "content": "42"}]
    assert small.chat.completions.create(model=name, messages=ok, max_tokens=1).choices
    message = refused(
        lambda: small.chat.completions.create(model=name, messages=[{"role": "narrator", "content": "x"}]), "messages"
    )
    assert "Unknown role: narrator" in message


def test_the_whole_vocabulary_with_max_logprobs_unlimited(tiny: ServerProcess) -> None:
    """--max-logprobs -1: a request's -1 (top_logprobs, prompt_logprobs) returns every token of the vocabulary at a
    position, as vLLM's suite asks of a server started with --max-logprobs at the vocabulary's size."""
    small = openai.OpenAI(base_url=f"{tiny.url}/v1", api_key="unused", max_retries=0, timeout=120)
    name = small.models.list().data[0].id
    chat = small.chat.completions.create(
        model=name, messages=ASK, max_tokens=1, logprobs=True, extra_body={"top_logprobs": -1}
    )
    top = chat.choices[0].logprobs.content[0].top_logprobs
    assert len(top) == 49152 and len({t.token for t in top}) > 40000
    assert [t.logprob for t in top] == sorted((t.logprob for t in top), reverse=True)
    assert math.isclose(sum(math.exp(t.logprob) for t in top), 1.0, rel_tol=1e-3)
    prompt = small.completions.create(model=name, prompt=[1, 2], max_tokens=1, extra_body={"prompt_logprobs": -1})
    positions = prompt.choices[0].prompt_logprobs
    assert positions[0] is None and len(positions[1]) == 49152


def test_more_log_probabilities_than_max_logprobs_are_refused(client: openai.OpenAI, model: str) -> None:
    """The default --max-logprobs is 20: more, or -1 (the whole vocabulary), is a 400 naming the option, and the
    field the request sent (chat's top_logprobs, which the engine runs as its logprobs)."""
    message = refused(
        lambda: client.chat.completions.create(model=model, messages=ASK, max_tokens=1, logprobs=True, top_logprobs=21),
        "top_logprobs",
    )
    assert message.startswith("top_logprobs 21 ") and "--max-logprobs" in message and "20" in message
    message = refused(
        lambda: client.completions.create(model=model, prompt=PROMPT, max_tokens=1, logprobs=-1), "logprobs"
    )
    assert "whole vocabulary" in message
