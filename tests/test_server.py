"""The OpenAI-compatible server, driven through the official `openai` client against a real process."""

import json
import re
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server_utils import ServerProcess, start_server
from tests.test_constraint_limits import TWO_BRANCHES
from tests.test_structured_output import PERSON, SCORES
from tokenmill import LLM, BeamSearchParams, SamplingParams

pytestmark = [pytest.mark.slow, pytest.mark.server]


@pytest.fixture(scope="module")
def server(default_server: ServerProcess) -> ServerProcess:
    return default_server  # as a user starts it: `auto` (4-bit weights, native kernels), shared (conftest.py)


def metrics(server: ServerProcess) -> dict[str, float]:
    text = httpx.get(f"{server.url}/metrics").text
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = sample.name + (json.dumps(sample.labels, sort_keys=True) if sample.labels else "")
            values[key] = sample.value
    return values


def wait_idle(server: ServerProcess, timeout: float = 10) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(server)
        if m["tokenmill:num_requests_running"] == 0 and m["tokenmill:kv_cache_usage_perc"] == 0:
            return m
        if time.monotonic() > deadline:
            return m
        time.sleep(0.05)


def test_health_is_200_once_ready(server: ServerProcess) -> None:
    """(503 while loading: test_tensor_parallel_server.py, whose ranks take long enough to start to see it.)"""
    assert server.health_codes[-1] == 200 and httpx.get(f"{server.url}/health").json() == {"status": "ok"}


def test_models(client: openai.OpenAI, model: str) -> None:
    assert model == "SmolLM2-135M-Instruct"
    assert client.models.list().data[0].owned_by == "tokenmill"


def test_chat_matches_offline_greedy(client: openai.OpenAI, model: str, offline: LLM) -> None:
    messages = [{"role": "user", "content": "How do GPUs work?"}]
    resp = client.chat.completions.create(model=model, messages=messages, max_tokens=24, temperature=0)
    # the server applies the model's recommended settings to what the request leaves unset, as LLM's defaults do
    offline = offline.chat(messages, offline.get_default_sampling_params(temperature=0, max_tokens=24))[0]
    assert resp.choices[0].message.content == offline.outputs[0].text
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].finish_reason == offline.outputs[0].finish_reason
    assert resp.usage.prompt_tokens == len(offline.prompt_token_ids)
    assert resp.usage.completion_tokens == len(offline.outputs[0].token_ids)
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_completion_matches_offline_greedy(client: openai.OpenAI, model: str, offline: LLM) -> None:
    resp = client.completions.create(
        model=model, prompt="The best way to learn programming is", max_tokens=20, temperature=0
    )
    offline = offline.generate(
        "The best way to learn programming is",
        offline.get_default_sampling_params(temperature=0, max_tokens=20),
        use_tqdm=False,
    )[0]
    assert resp.choices[0].text == offline.outputs[0].text
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 20 and resp.usage.prompt_tokens == len(offline.prompt_token_ids)


def test_streaming_chat_with_usage(client: openai.OpenAI, model: str, offline: LLM) -> None:
    messages = [{"role": "user", "content": "Name three colors."}]
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=20,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert all(c.usage is None for c in chunks[:-1])
    offline = offline.chat(messages, offline.get_default_sampling_params(temperature=0, max_tokens=20))[0].outputs[0]
    assert text == offline.text
    assert chunks[-1].usage.completion_tokens == len(offline.token_ids)


def test_streaming_completion(client: openai.OpenAI, model: str) -> None:
    stream = client.completions.create(
        model=model,
        prompt="Once upon a time",
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    full = client.completions.create(model=model, prompt="Once upon a time", max_tokens=16, temperature=0)
    assert text == full.choices[0].text
    assert chunks[-1].usage.completion_tokens == 16


def test_n_and_seed(client: openai.OpenAI, model: str) -> None:
    resp = client.completions.create(
        model=model, prompt="My favourite animal is", max_tokens=10, n=3, temperature=1.0, seed=7
    )
    assert sorted(c.index for c in resp.choices) == [0, 1, 2]
    assert len({c.text for c in resp.choices}) > 1
    again = client.completions.create(
        model=model, prompt="My favourite animal is", max_tokens=10, n=3, temperature=1.0, seed=7
    )
    assert [c.text for c in again.choices] == [c.text for c in resp.choices]
    assert resp.usage.completion_tokens == sum(1 for _ in resp.choices) * 10
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hi"}], n=2, max_tokens=5, temperature=1.0, seed=3
    )
    assert [c.index for c in chat.choices] == [0, 1]


def test_beam_search_completions_are_the_offline_beams(client: openai.OpenAI, model: str, offline: LLM) -> None:
    """vLLM's use_beam_search: n beams per prompt, best first (two copies of a prompt answer alike, as vLLM's
    test_batch_completions asks), the beams LLM.beam_search finds."""
    prompts = ["Hello, my name is"] * 2
    batch = client.completions.create(
        model=model,
        prompt=prompts,
        n=2,
        max_tokens=5,
        temperature=0.0,
        extra_body={"use_beam_search": True, "return_token_ids": True},
    )
    texts = [c.text for c in batch.choices]
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert texts[0] != texts[1] and texts[:2] == texts[2:]
    (answer,) = offline.beam_search(prompts[0], BeamSearchParams(beam_width=2, max_tokens=5))
    start = len(batch.choices[0].model_extra["prompt_token_ids"])
    expected = [b.tokens[start:-1] if b.finish_reason == "stop" else b.tokens[start:] for b in answer.sequences]
    assert [c.model_extra["token_ids"] for c in batch.choices[:2]] == expected
    assert batch.usage.completion_tokens == 2 * sum(len(t) for t in expected)
    assert all(c.finish_reason in ("stop", "length") for c in batch.choices)


def test_beam_search_chat_is_whole_or_streamed_at_the_end(client: openai.OpenAI, model: str) -> None:
    """A streamed chat with beam search sends each beam whole once the search ends (vLLM's, whose beam search
    yields one output); length_penalty is taken with it."""
    messages = [{"role": "user", "content": "Name a colour."}]
    extra = {"use_beam_search": True, "length_penalty": 0.5}
    whole = client.chat.completions.create(model=model, messages=messages, n=2, max_tokens=8, extra_body=extra)
    replies = [c.message.content for c in whole.choices]
    assert [c.index for c in whole.choices] == [0, 1] and replies[0] != replies[1] and all(replies)
    chunks = list(
        client.chat.completions.create(model=model, messages=messages, n=2, max_tokens=8, extra_body=extra, stream=True)
    )
    texts = [(ch.index, ch.delta.content) for c in chunks for ch in c.choices if ch.delta.content]
    assert sorted(texts) == [(0, replies[0]), (1, replies[1])]  # each reply in one chunk
    finishes = {ch.index: ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason}
    assert finishes == {c.index: c.finish_reason for c in whole.choices}


@pytest.mark.parametrize(
    "api, extra, param",
    [
        ("completions", {"stream": True}, "stream"),  # vLLM refuses it too
        ("completions", {"echo": True, "logprobs": 1}, "echo"),  # no prompt log-probabilities, as vLLM's
        ("chat", {"top_p": 0.5}, "top_p"),  # what vLLM would ignore
        ("chat", {"stop": ["."]}, "stop"),
        ("chat", {"response_format": {"type": "json_object"}}, "response_format"),
        (
            "chat",
            {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"},
            "tool_choice",
        ),
        ("chat", {"n": 11}, "n"),  # 2 * n log-probabilities a round, at most 20
        ("chat", {"use_beam_search": False, "length_penalty": 2.0}, "length_penalty"),  # only with beam search
    ],
)
def test_beam_search_refuses_what_it_would_not_follow(
    server: ServerProcess, model: str, api: str, extra: dict, param: str
) -> None:
    path, body = ("/v1/completions", {"prompt": "Hi"}) if api == "completions" else ("/v1/chat/completions", {})
    body = {"model": model, "max_tokens": 4, "use_beam_search": True, **body, **extra}
    if api == "chat":
        body["messages"] = [{"role": "user", "content": "Hi"}]
    r = httpx.post(f"{server.url}{path}", json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_beam_search_is_for_openais_completions_and_chat_only(server: ServerProcess, model: str) -> None:
    """The other APIs still refuse use_beam_search: true, rather than ignore it."""
    r = httpx.post(f"{server.url}/v1/responses", json={"model": model, "input": "Hi", "use_beam_search": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "use_beam_search"


def test_multiple_prompts(client: openai.OpenAI, model: str) -> None:
    resp = client.completions.create(model=model, prompt=["One", "Two"], max_tokens=4, n=2, temperature=0)
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    assert resp.choices[0].text == resp.choices[1].text  # greedy samples of one prompt agree
    assert resp.usage.completion_tokens == 16


def test_stop(client: openai.OpenAI, model: str) -> None:
    full = client.completions.create(model=model, prompt="Once upon a time", max_tokens=24, temperature=0)
    stop = full.choices[0].text[15:19]
    resp = client.completions.create(model=model, prompt="Once upon a time", max_tokens=24, temperature=0, stop=[stop])
    assert resp.choices[0].finish_reason == "stop"
    assert resp.choices[0].text == full.choices[0].text[: full.choices[0].text.index(stop)]


def test_logprobs(client: openai.OpenAI, model: str) -> None:
    resp = client.completions.create(
        model=model,
        prompt="The capital of France is",
        max_tokens=5,
        temperature=0,
        logprobs=3,
        extra_body={"repetition_penalty": 1.0},  # without the model's penalty, greedy takes the best log-prob
    )
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert "".join(lp.tokens) == resp.choices[0].text
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert top[token] == logprob and logprob == max(top.values())  # greedy: the best one
        assert len(top) >= 3
    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"repetition_penalty": 1.0},
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 2 for c in content)
    assert "".join(c.token for c in content) == chat.choices[0].message.content
    assert bytes(sum((c.bytes for c in content), [])).decode() == chat.choices[0].message.content


@pytest.mark.parametrize("max_tokens", [1, 0])
def test_echo_logprobs_on_token_ids_like_lm_eval(
    client: openai.OpenAI, model: str, offline: LLM, max_tokens: int
) -> None:
    """lm-evaluation-harness scores a continuation with echo + logprobs on a token-id prompt."""
    ids = offline.get_tokenizer().encode("Paris is the capital of France")
    resp = client.completions.create(
        model=model, prompt=ids, max_tokens=max_tokens, temperature=0, echo=True, logprobs=1
    )
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(ids) + max_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    expected = offline.generate(
        {"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False
    )[0].prompt_logprobs
    for i in range(1, len(ids)):
        assert abs(lp.token_logprobs[i] - expected[i][ids[i]].logprob) < 1e-3
    assert resp.choices[0].text.startswith("Paris is the capital of France")
    assert resp.usage.prompt_tokens == len(ids) and resp.usage.completion_tokens == max_tokens


def test_extra_sampling_parameters(client: openai.OpenAI, model: str) -> None:
    resp = client.completions.create(
        model=model,
        prompt="Once upon a time",
        max_tokens=30,
        temperature=0,
        extra_body={"ignore_eos": True, "min_tokens": 30, "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.3},
    )
    assert resp.usage.completion_tokens == 30
    plain = client.completions.create(
        model=model, prompt="Once upon a time", max_tokens=30, temperature=0, extra_body={"repetition_penalty": 1.0}
    )  # (not the model's default 1.1, which gives the same 30 tokens as 1.3 here)
    assert resp.choices[0].text != plain.choices[0].text  # the repetition penalty changed the text


RECIPE = {
    "type": "object",
    "properties": {
        "dish": {"type": "string", "maxLength": 40},
        "servings": {"type": "integer", "minimum": 1, "maximum": 12},
        "steps": {"type": "array", "items": {"type": "string", "maxLength": 60}, "minItems": 1, "maxItems": 3},
    },
    "required": ["dish", "servings", "steps"],
    "additionalProperties": False,
}


def test_response_format_json_schema_and_json_object(client: openai.OpenAI, model: str) -> None:
    import jsonschema

    resp = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "A recipe as JSON."}],
        max_tokens=150,
        temperature=1.0,
        seed=7,
        n=4,
        response_format={"type": "json_schema", "json_schema": {"name": "recipe", "schema": RECIPE, "strict": True}},
    )
    assert [c.finish_reason for c in resp.choices].count("stop") >= 2
    for choice in resp.choices:
        if choice.finish_reason == "stop":
            jsonschema.validate(json.loads(choice.message.content), RECIPE)
    completion = client.completions.create(
        model=model,
        prompt="JSON:",
        max_tokens=40,
        temperature=0,
        extra_body={"response_format": {"type": "json_object"}},
    )
    if completion.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(completion.choices[0].text), dict)
    else:
        assert completion.choices[0].text.startswith("{")


@pytest.mark.parametrize("schema", [PERSON, SCORES], ids=["nested-object", "array-of-objects"])
def test_sampled_json_through_the_client_always_validates(client: openai.OpenAI, model: str, schema: dict) -> None:
    """Temperature 1, eight seeds' worth of samples (n=8) per schema: every one that stops validates."""
    import jsonschema

    resp = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Reply in JSON."}],
        max_tokens=160,
        temperature=1.0,
        seed=3,
        n=8,
        response_format={"type": "json_schema", "json_schema": {"name": "reply", "schema": schema, "strict": True}},
    )
    stopped = [c for c in resp.choices if c.finish_reason == "stop"]
    assert len(stopped) >= 4
    for choice in stopped:
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_vllm_structured_outputs_extra_body(client: openai.OpenAI, model: str) -> None:
    choices = ["red", "green", "blue"]
    resp = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "A color?"}],
        max_tokens=5,
        extra_body={"structured_outputs": {"choice": choices}},
    )
    assert resp.choices[0].message.content in choices and resp.choices[0].finish_reason == "stop"
    stream = client.completions.create(
        model=model, prompt="Date:", max_tokens=20, stream=True, extra_body={"guided_regex": r"20[0-9]{2}-[01][0-9]"}
    )
    text = "".join(c.choices[0].text for c in stream if c.choices)
    assert len(text) == 7 and text.startswith("20") and text[4] == "-"


@pytest.mark.parametrize(
    "extra, param, message",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
            "response_format",
            "cannot be compiled",
        ),
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs", "cannot be compiled"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one of"),
        ({"guided_choice": ["a"], "structured_outputs": {"regex": "b"}}, "guided_choice", "one constraint"),
        ({"structured_outputs": {"xml": "a"}}, None, "xml"),
    ],
)
def test_constraints_that_cannot_compile_get_400(client: openai.OpenAI, model: str, extra, param, message) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=5, extra_body=extra
        )
    assert message in info.value.message
    if param is not None:
        assert info.value.body["param"] == param


@pytest.mark.parametrize(
    "extra, reason",
    [
        ({"structured_outputs": {"regex": "a{1000000}"}}, "too many expressions constructed"),
        ({"guided_regex": "[^\\x00-\\U0010FFFF]"}, "no output can satisfy it"),
        ({"structured_outputs": {"grammar": "start: " + " ".join('"t"' for _ in range(66_000))}}, "grammar symbols"),
        ({"structured_outputs": {"choice": [f"option{i}" for i in range(100_000)]}}, "(max_constraint_bytes)"),
    ],
    ids=["huge-repeat", "empty-class", "too-many-symbols", "over-the-size-bound"],
)
def test_constraints_the_matcher_cannot_follow_get_400_with_a_clean_reason(
    client: openai.OpenAI, model: str, extra: dict, reason: str
) -> None:
    """Each was answered 200 with finish_reason "stop" and text that broke it, or a 400 quoting a Rust panic."""
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt="Hi", max_tokens=5, extra_body=extra)
    assert reason in info.value.message
    assert not any(part in info.value.message for part in ("panic", "backtrace", "<unknown>", "<state>"))


def test_a_constraint_failing_mid_way_is_a_500_naming_the_request_or_an_error_event(
    server: ServerProcess, model: str, llm: LLM
) -> None:
    hash_token = llm.get_tokenizer().encode("#", add_special_tokens=False)[0]
    body = {"prompt": "Go:", "max_tokens": 12, "temperature": 0, "structured_outputs": {"grammar": TWO_BRANCHES}}
    body["logit_bias"] = {str(hash_token): 100}  # onto the branch whose limit only a request meets
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 500, r.text
    error = r.json()["error"]
    assert error["code"] == "constraint_failed" and "max is 2000" in error["message"]
    request_id = re.search(r"request (cmpl-\S+) failed", error["message"]).group(1)
    with httpx.stream("POST", f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=60) as s:
        events = [line.removeprefix("data: ") for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and json.loads(events[-2])["error"]["code"] == "constraint_failed"
    assert not any(json.loads(e).get("choices", [{}])[0].get("finish_reason") == "stop" for e in events[:-2])
    deadline = time.monotonic() + 5
    while f"{request_id}-0 (sample 0) ends with an error" not in server.output() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert f"{request_id}-0 (sample 0) ends with an error" in server.output()
    assert wait_idle(server)["tokenmill:kv_cache_usage_perc"] == 0


def test_a_30000_option_choice_stalls_neither_health_nor_another_stream(server: ServerProcess) -> None:
    """Compiled on the event loop (and, one rule per option, slow to follow), it blocked /health for 2 s and a
    stream for 8 s on the 2-core VM (benchmarks/constraint_stall.py)."""
    wait_idle(server)
    health: list[float] = []
    gaps: list[float] = []
    done = threading.Event()

    def poll() -> None:
        while not done.is_set():
            start = time.monotonic()
            assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200
            health.append(time.monotonic() - start)
            time.sleep(0.02)

    def stream() -> None:
        free = {"prompt": "Count:", "max_tokens": 60, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=free, timeout=60) as r:
            last = time.monotonic()
            for line in r.iter_lines():
                if line:
                    gaps.append(time.monotonic() - last)
                    last = time.monotonic()

    threads = [threading.Thread(target=poll), threading.Thread(target=stream)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    choices = [f"option{i}" for i in range(30_000)]
    body = {"prompt": "Pick one:", "max_tokens": 8, "temperature": 0, "structured_outputs": {"choice": choices}}
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    done.set()
    for t in threads:
        t.join()
    assert r.status_code == 200 and r.json()["choices"][0]["text"] in choices
    assert max(health) < 0.75, f"/health took {max(health):.2f} s while the choice compiled"
    assert max(gaps[1:]) < 2, f"the stream stalled for {max(gaps[1:]):.1f} s"


def test_the_ready_line_counts_from_the_process_start(server: ServerProcess) -> None:
    """It said "ready ... 3284.7 s after start": the machine's uptime (uvicorn's Server.started, True, was
    subtracted)."""
    seconds = float(re.search(r"ready to serve .* ([\d.]+) s after start", server.output()).group(1))
    assert 0 < seconds <= time.monotonic() - server.started


def test_echo_with_max_tokens_0_counts_no_generated_token(server: ServerProcess, model: str) -> None:
    before = metrics(server)["tokenmill:generation_tokens_total"]
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hi there", "max_tokens": 0, "echo": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 0
    assert metrics(server)["tokenmill:generation_tokens_total"] == before  # was one more


@pytest.mark.parametrize(
    "prompt, message",
    [
        (["x"] * 129, "129 prompts in one request; at most 128 are allowed"),
        (["x", 5], "this list mixes a string and an integer"),
        ([[1, 2], [-3]], "prompt 1 holds token id -3"),
        ([[1], ["a"]], "prompt 1 is a list, so it must hold token ids"),
        (["x", ""], "prompt 1 is empty"),
        ({"text": "x"}, "not an object"),
        ([1.5], "this list holds a number"),
    ],
)
def test_a_malformed_prompt_is_told_what_is_wrong(server: ServerProcess, prompt, message: str) -> None:
    """Every shape used to get "prompt.constrained-str: Input should be a valid string"."""
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": prompt, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert message in r.json()["error"]["message"] and "valid string" not in r.json()["error"]["message"]


def test_head_health(server: ServerProcess) -> None:
    r = httpx.head(f"{server.url}/health")
    assert r.status_code == 200 and r.content == b""  # was 405


def test_logit_bias(client: openai.OpenAI, model: str, llm: LLM) -> None:
    token = llm.get_tokenizer().encode(" banana")[0]
    resp = client.completions.create(
        model=model, prompt="I like", max_tokens=3, temperature=0, logit_bias={str(token): 100}
    )
    assert resp.choices[0].text == " banana" * 3


def test_32_concurrent_streaming_clients(server: ServerProcess, model: str, llm: LLM) -> None:
    results: dict[int, tuple[str, int, int]] = {}
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            c = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=300)
            stream = c.completions.create(
                model=model,
                prompt=f"Fact number {i}:",
                max_tokens=8 + i % 9,
                temperature=0.8,
                seed=i,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            text, usage = "", None
            for chunk in stream:
                if chunk.choices:
                    text += chunk.choices[0].text
                if chunk.usage:
                    usage = chunk.usage
            results[i] = (text, usage.prompt_tokens, usage.completion_tokens)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    tok = llm.get_tokenizer()
    for i in range(32):
        text, prompt_tokens, completion_tokens = results[i]
        assert completion_tokens == 8 + i % 9
        assert prompt_tokens == len(tok.encode(f"Fact number {i}:"))
    wait_idle(server)


def test_client_disconnect_frees_blocks(server: ServerProcess, model: str) -> None:
    body = {"model": model, "prompt": "A very long story:", "max_tokens": 2000, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        lines = 0
        for line in response.iter_lines():
            lines += bool(line)
            if lines == 3:
                m = metrics(server)
                assert m["tokenmill:num_requests_running"] == 1 and m["tokenmill:kv_cache_usage_perc"] > 0
                break  # leaving the stream closes the connection
    m = wait_idle(server)
    assert m["tokenmill:num_requests_running"] == 0 and m["tokenmill:kv_cache_usage_perc"] == 0


def test_non_streaming_disconnect_aborts(server: ServerProcess, model: str) -> None:
    body = {"model": model, "prompt": "Another long story:", "max_tokens": 3000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=1.0)
    m = wait_idle(server)
    assert m["tokenmill:num_requests_running"] == 0


def test_a_beam_search_whose_client_leaves_stops(server: ServerProcess, model: str) -> None:
    """The client leaving ends the search: the round running is aborted and no other follows."""
    body = {"model": model, "prompt": "A long story:", "n": 3, "max_tokens": 2000, "ignore_eos": True}
    body["use_beam_search"] = True
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, headers={"X-Request-Id": "beams-left"}, timeout=1.0)
    (line,) = server.log_lines("beams-left /v1/completions")
    assert "beams-left /v1/completions aborted" in line
    for _ in range(3):  # rounds would keep the engine busy; it stays idle
        m = wait_idle(server)
        assert m["tokenmill:num_requests_running"] == 0 and m["tokenmill:kv_cache_usage_perc"] == 0
        time.sleep(0.3)


@pytest.mark.parametrize(
    "body,status,param",
    [
        ({"prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
        ({"prompt": "x", "temperature": -1}, 400, "temperature"),
        ({"prompt": "x", "top_p": 0}, 400, "top_p"),
        ({"prompt": "x", "n": 0}, 400, "n"),
        ({"prompt": "x", "logprobs": 50}, 400, "logprobs"),
        ({"prompt": [1, 2, 3], "max_tokens": 100000}, 400, "max_tokens"),
        ({"prompt": [100] * 9000}, 400, "prompt"),
        ({"prompt": [10**7]}, 400, "prompt"),
        ({"prompt": []}, 400, "prompt"),
        ({"max_tokens": 5}, 400, "prompt"),
        ({"prompt": "x", "model": "gpt-4o"}, 404, "model"),
    ],
)
def test_completion_errors(server: ServerProcess, body: dict, status: int, param: str) -> None:
    r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["message"]


def test_chat_errors(server: ServerProcess) -> None:
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": [{"role": 5, "content": "x"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": "hello"})
    assert r.status_code == 400
    r = httpx.post(
        f"{server.url}/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]


def test_openai_client_sees_errors(client: openai.OpenAI, model: str) -> None:
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model, prompt="x", temperature=5000)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])


def test_metrics_parse_and_move(server: ServerProcess, client: openai.OpenAI, model: str) -> None:
    before = metrics(server)
    client.completions.create(
        model=model, prompt="Count to three:", max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
    )
    after = metrics(server)
    assert after["tokenmill:generation_tokens_total"] - before["tokenmill:generation_tokens_total"] == 6
    assert after["tokenmill:prompt_tokens_total"] > before["tokenmill:prompt_tokens_total"]
    key = 'tokenmill:request_success_total{"finished_reason": "length"}'
    assert after[key] - before.get(key, 0) == 1
    assert after["tokenmill:time_to_first_token_seconds_count"] > before["tokenmill:time_to_first_token_seconds_count"]
    assert (
        after["tokenmill:inter_token_latency_seconds_count"] - before["tokenmill:inter_token_latency_seconds_count"]
        == 5
    )
    assert after["tokenmill:e2e_request_latency_seconds_count"] > before["tokenmill:e2e_request_latency_seconds_count"]
    assert after["tokenmill:request_queue_time_seconds_count"] > before["tokenmill:request_queue_time_seconds_count"]
    assert after["tokenmill:prefix_cache_queries_total"] > before["tokenmill:prefix_cache_queries_total"]
    for name in (
        "tokenmill:num_preemptions_total",
        "tokenmill:prefix_cache_hits_total",
        "tokenmill:num_requests_waiting",
        "tokenmill:kv_cache_usage_perc",
    ):
        assert name in after


def test_tokenizer_endpoints(server: ServerProcess, llm: LLM) -> None:
    tok = llm.get_tokenizer()
    r = httpx.post(f"{server.url}/tokenize", json={"prompt": "How do GPUs work?", "add_special_tokens": False}).json()
    assert r["tokens"] == tok.encode("How do GPUs work?") and r["count"] == 5 and r["max_model_len"] > 0
    r = httpx.post(f"{server.url}/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert r["tokens"] == llm.engine.encode_chat([{"role": "user", "content": "Hi"}])
    r = httpx.post(f"{server.url}/detokenize", json={"tokens": [19556, 905]}).json()
    assert r == {"prompt": "Hello world", "content": "Hello world"}  # vLLM's name and llama.cpp's
    info = httpx.get(f"{server.url}/tokenizer_info").json()
    assert info["eos_token"] == "<|im_end|>" and info["bos_token"] == "<|im_start|>"
    assert "<|im_start|>" in info["chat_template"] and info["tokenizer_class"]
    assert httpx.post(f"{server.url}/detokenize", json={"tokens": [-5]}).status_code == 400


def test_sigterm_drains_then_aborts_with_an_error_event() -> None:
    proc = start_server("--shutdown-grace", "3")
    url = proc.url
    results: dict[str, object] = {}

    def stream(name: str, max_tokens: int) -> None:
        body = {"prompt": f"{name}:", "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
        events = []
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
        results[name] = events

    short = threading.Thread(target=stream, args=("short", 20))
    long = threading.Thread(target=stream, args=("long", 5000))
    long.start()
    short.start()
    time.sleep(0.5)
    proc.process.send_signal(15)  # SIGTERM
    time.sleep(0.3)
    # still listening while it drains: what a load balancer asks gets an answer that says so
    refused = httpx.post(f"{url}/v1/completions", json={"prompt": "new", "max_tokens": 2}, timeout=5)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "server_shutdown"
    health = httpx.get(f"{url}/health", timeout=5)
    assert health.status_code == 503 and health.json() == {"status": "shutting down"}
    short.join(30)
    long.join(30)
    code = proc.process.wait(30)
    assert code == 0
    short_events, long_events = results["short"], results["long"]
    assert short_events[-1] == "[DONE]" and json.loads(short_events[-2])["choices"][0]["finish_reason"] == "length"
    assert long_events[-1] == "[DONE]"
    error = json.loads(long_events[-2])["error"]
    assert error["code"] == "server_shutdown"
    assert len(long_events) > 3  # it streamed until the grace period ran out
    log = proc.output()
    assert "shutting down" in log and "aborting 1" in log


def test_cached_tokens_and_token_ids(client: openai.OpenAI, model: str, llm: LLM) -> None:
    """usage.prompt_tokens_details.cached_tokens reports prefix-cache hits; return_token_ids (vLLM's extension)
    returns the prompt's and the choices' token ids."""
    messages = [{"role": "user", "content": "Tell me about caching in one sentence."}]
    client.chat.completions.create(model=model, messages=messages, max_tokens=2, temperature=0)
    again = client.chat.completions.create(
        model=model, messages=messages, max_tokens=4, temperature=0, extra_body={"return_token_ids": True}
    )
    assert again.usage.prompt_tokens_details.cached_tokens >= 16
    extra = again.model_extra
    assert extra["prompt_token_ids"] == llm.engine.encode_chat(messages)
    assert len(again.choices[0].model_extra["token_ids"]) == again.usage.completion_tokens == 4
    stream = client.completions.create(
        model=model,
        prompt="Once upon a time",
        max_tokens=5,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"return_token_ids": True},
    )
    chunks = list(stream)
    ids = [i for c in chunks if c.choices for i in c.choices[0].model_extra.get("token_ids", [])]
    assert len(ids) == 5 and chunks[-1].usage.prompt_tokens_details.cached_tokens == 0
    # a streamed chat: the prompt's ids at the top of the first chunk, and in no other (as vLLM streams them)
    chat = list(
        client.chat.completions.create(
            model=model, messages=messages, max_tokens=4, stream=True, extra_body={"return_token_ids": True}
        )
    )
    assert chat[0].model_extra["prompt_token_ids"] == llm.engine.encode_chat(messages)
    assert all("prompt_token_ids" not in c.model_extra for c in chat[1:])
    assert all("prompt_token_ids" not in (choice.model_extra or {}) for c in chat for choice in c.choices)
    assert sum(len(c.choices[0].model_extra.get("token_ids", [])) for c in chat if c.choices) == 4


def test_explorer_endpoints(server: ServerProcess) -> None:
    info = httpx.get(f"{server.url}/explorer/info").json()
    assert info["kv_bytes_per_block"] == 2 * info["num_layers"] * info["block_size"] * info["num_kv_heads"] * (
        info["head_dim"] * info["kv_element_bytes"] + info["kv_scale_bytes"]
    )
    page = httpx.get(f"{server.url}/")
    assert page.status_code == 200 and "request explorer" in page.text
    assert httpx.get(f"{server.url}/static/app.js").status_code == 200
    events = []
    with httpx.stream("GET", f"{server.url}/explorer/events", timeout=30) as r:
        threading.Thread(
            target=lambda: httpx.post(
                f"{server.url}/v1/completions", timeout=60, json={"prompt": "Hi", "max_tokens": 3}
            )
        ).start()
        for line in r.iter_lines():
            if line.startswith("data: "):
                event = json.loads(line[6:])
                events.append(event)
                if event["type"] == "step" and any(b["kind"] == "decode" for b in event["batch"]):
                    break
    step = next(e for e in events if e["type"] == "step")
    assert step["batch"][0]["request_id"].startswith("cmpl-") and step["batch"][0]["blocks"] >= 1
    assert {"num_running", "num_waiting", "kv_blocks_in_use", "duration_ms"} <= set(step)
    # the engine panel is filled at page load from the last step, and the page has an icon
    last = httpx.get(f"{server.url}/explorer/info").json()["engine"]["last_step"]
    assert last["batch_size"] >= 1 and last["duration_ms"] > 0 and last["step"] >= step["step"]
    icon = httpx.get(f"{server.url}/favicon.ico")
    assert icon.status_code == 200 and icon.headers["content-type"].startswith("image/svg+xml")


def test_x_request_id_names_the_call(server: ServerProcess) -> None:
    """A client's X-Request-Id (as vLLM honours it) names the call from the moment it is sent, in the response's id,
    its header and the engine's step events; an id that is not a short token, or is already in flight, is a 400."""
    url = server.url
    body = {"prompt": "Hi", "max_tokens": 2}
    r = httpx.post(f"{url}/v1/completions", json=body, headers={"X-Request-Id": "my-call.1"}, timeout=60)
    assert r.status_code == 200 and r.headers["x-request-id"] == "my-call.1" and r.json()["id"] == "cmpl-my-call.1"
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "stream": True}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=chat, headers={"X-Request-Id": "c_2"}) as r:
        assert r.headers["x-request-id"] == "c_2"
        assert all(json.loads(x[6:])["id"] == "chatcmpl-c_2" for x in r.iter_lines() if x.startswith("data: {"))
    unnamed = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert unnamed.json()["id"] == f"cmpl-{unnamed.headers['x-request-id']}"
    for bad in ("", "has space", "x" * 65, "semi;colon", "slash/"):
        for path, sent in (("/v1/completions", body), ("/v1/chat/completions", {**chat, "stream": False})):
            r = httpx.post(f"{url}{path}", json=sent, headers={"X-Request-Id": bad})
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request_id", (bad, r.text)

    # the same id while the first call runs: a 400, and the first call is untouched
    long = {"prompt": "Count:", "max_tokens": 24, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=long, headers={"X-Request-Id": "twice"}) as first:
        lines = first.iter_lines()
        assert next(x for x in lines if x.startswith("data: "))  # it runs
        again = httpx.post(f"{url}/v1/completions", json=body, headers={"X-Request-Id": "twice"}, timeout=60)
        assert again.status_code == 400 and again.json()["error"]["code"] == "duplicate_request_id"
        chunks = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
    assert all(c["id"] == "cmpl-twice" for c in chunks) and chunks[-1]["choices"][0]["finish_reason"] == "length"
    # once it ended, the id is free again
    r = httpx.post(f"{url}/v1/completions", json=body, headers={"X-Request-Id": "twice"}, timeout=60)
    assert r.status_code == 200 and r.json()["id"] == "cmpl-twice"


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 20}},
            "required": ["zone"],
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_required_tool_calls_are_valid_calls(client: openai.OpenAI, model: str) -> None:
    import jsonschema

    resp = client.chat.completions.create(
        model=model,
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice="required",
        max_tokens=60,
        n=3,
        temperature=1.0,
        seed=11,
    )
    for choice in resp.choices:
        # content "" with a call tool_choice required, as vLLM answers (its suite's named-tool test reads it)
        assert choice.finish_reason == "tool_calls" and choice.message.content == ""
        (call,) = choice.message.tool_calls
        assert call.id.startswith("call_") and call.type == "function"
        spec = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
        jsonschema.validate(json.loads(call.function.arguments), spec["function"]["parameters"])
    named = client.chat.completions.create(
        model=model,
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        max_tokens=40,
        temperature=0,
    )
    assert named.choices[0].message.tool_calls[0].function.name == "get_time"


def test_the_log_says_the_finish_the_api_reported(server: ServerProcess, client: openai.OpenAI, model: str) -> None:
    """A reply that is a call finishes "tool_calls" on the API, and so says its log line (it said "stop")."""
    for stream in (False, True):
        call_id = f"logged-call-{stream}"
        answer = client.chat.completions.create(
            model=model,
            messages=ASK,
            tools=[WEATHER],
            tool_choice="required",
            max_tokens=60,
            temperature=0,
            stream=stream,
            extra_headers={"X-Request-Id": call_id},
        )
        choices = [c for chunk in answer for c in chunk.choices] if stream else answer.choices
        assert "tool_calls" in [c.finish_reason for c in choices]
        (line,) = server.log_lines(f"chatcmpl-{call_id} ")
        assert "200: " in line and "finish tool_calls," in line


def test_a_streamed_tool_call_reassembles_to_the_same_call(client: openai.OpenAI, model: str) -> None:
    kwargs = dict(model=model, messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=60, temperature=0)
    whole = client.chat.completions.create(**kwargs).choices[0].message.tool_calls[0]
    names, arguments, finish = [], "", None
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                names += [delta.function.name] if delta.function.name else []
                arguments += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    assert names == [whole.function.name] and json.loads(arguments) == json.loads(whole.function.arguments)
    assert finish == "tool_calls"


def test_a_tool_result_turn_and_tool_choice_none(client: openai.OpenAI, model: str) -> None:
    call = (
        client.chat.completions.create(
            model=model, messages=ASK, tools=[WEATHER], tool_choice="required", max_tokens=60, temperature=0
        )
        .choices[0]
        .message
    )
    follow_up = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in call.tool_calls]},
        {"role": "tool", "tool_call_id": call.tool_calls[0].id, "content": '{"temperature": 21, "sky": "clear"}'},
    ]
    answer = client.chat.completions.create(
        model=model, messages=follow_up, tools=[WEATHER], tool_choice="none", max_tokens=30, temperature=0
    ).choices[0]
    assert answer.message.tool_calls is None and answer.message.content and answer.finish_reason in ("stop", "length")
    auto = client.chat.completions.create(model=model, messages=ASK, tools=[WEATHER], max_tokens=40, temperature=0)
    choice = auto.choices[0]  # the model decides; either way the answer is well formed
    assert (choice.finish_reason == "tool_calls") == (choice.message.tool_calls is not None)


@pytest.mark.parametrize(
    "tools, tool_choice, param, message",
    [
        ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice", "not in tools"),
        ([WEATHER], "required", "tool_choice", None),  # with response_format below
        (
            [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": 5}}}}],
            "auto",
            "tools",
            "cannot be compiled",
        ),
        ([{"type": "function", "function": {"name": "bad name!"}}], "auto", "tools", "letters, digits"),
        ([WEATHER, WEATHER], "auto", "tools", "a second function"),
        (None, "required", "tool_choice", "needs tools"),
    ],
)
def test_bad_tools_get_400(client: openai.OpenAI, model: str, tools, tool_choice, param, message) -> None:
    extra = {"response_format": {"type": "json_object"}} if message is None else {}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=model, messages=ASK, tools=tools, tool_choice=tool_choice, max_tokens=5, extra_body=extra
        )
    assert info.value.body["param"] == param and (message is None or message in info.value.message)


def test_the_log_has_a_line_per_request_and_throughput_lines(
    server: ServerProcess, client: openai.OpenAI, model: str
) -> None:
    chat = client.chat.completions.create(model=model, messages=ASK, max_tokens=4, temperature=0)
    completion = client.completions.create(model=model, prompt=["a", "b"], max_tokens=3, temperature=0)
    stream = list(client.completions.create(model=model, prompt="c", max_tokens=2, stream=True))
    ids = {chat.id: "/v1/chat/completions", completion.id: "/v1/completions", stream[0].id: "/v1/completions"}
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the throughput line comes when the engine goes idle after work
        log = server.output()
        if all(i in log for i in ids) and "engine: prompt" in log.split(chat.id)[-1]:
            break
        time.sleep(0.2)
    lines = server.output().splitlines()
    for request_id, endpoint in ids.items():
        (line,) = [x for x in lines if f"tokenmill.requests: {request_id} " in x]
        assert f"{request_id} {endpoint} 200: " in line and "finish length" in line and "TTFT" in line
    assert "2 prompt + 6 output tokens" in next(x for x in lines if completion.id in x)  # two prompts, n=1 each
    throughput = [x for x in lines if "engine: prompt" in x]
    shape = r"generation [\d.]+ tok/s, running \d+, waiting \d+, KV"
    assert throughput and all(re.search(shape, x) for x in throughput)


def test_streamed_completions_with_n_finish_each_choice_once(client: openai.OpenAI, model: str) -> None:
    """With n > 1 the samples stop at different steps; each choice's finish chunk comes once (a finished sample
    stays in its request's later outputs, as the others go on)."""
    stream = client.completions.create(
        model=model,
        prompt="My favourite animal is",
        max_tokens=24,
        n=4,
        temperature=1.0,
        seed=11,
        stop=["e"],
        stream=True,
    )
    finishes: dict[int, int] = {}
    for chunk in stream:
        for c in chunk.choices:
            if c.finish_reason is not None:
                finishes[c.index] = finishes.get(c.index, 0) + 1
    assert finishes == {0: 1, 1: 1, 2: 1, 3: 1}


def test_models_retrieve_and_an_unknown_model(client: openai.OpenAI, model: str) -> None:
    card = client.models.retrieve(model)
    assert card.id == model and card.object == "model"
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("no-such-model")
    assert missing.value.body["code"] == "model_not_found"  # type: ignore[index]


def test_a_browser_preflight_is_answered(server: ServerProcess) -> None:
    """CORS: a local web page (another port) may call the API (the preflight needs no key and no body); other
    sites' pages may not (tests/test_host_origin.py, tests/test_server_safety.py)."""
    r = httpx.options(
        f"{server.url}/v1/chat/completions",
        headers={
            "Origin": "http://localhost:3000",
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        },
    )
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == "http://localhost:3000"
    assert "POST" in r.headers["access-control-allow-methods"]
    answer = httpx.get(f"{server.url}/v1/models", headers={"Origin": "http://localhost:3000"})
    assert answer.headers["access-control-allow-origin"] == "http://localhost:3000"


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"stream_options": {"include_usage": True}}, "stream_options"),  # without stream
        ({"seed": 2**64}, "seed"),
        # fields the server knows nothing of: refused, never ignored
        ({"kv_transfer_params": {"do_remote_decode": True}}, "kv_transfer_params"),
        ({"cache_salt": "tenant-1"}, "cache_salt"),
        ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
        ({"store": True}, "store"),
        ({"service_tier": "flex"}, "service_tier"),
    ],
)
def test_fields_not_honoured_are_refused_by_name(client: openai.OpenAI, model: str, extra: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, extra_body=extra
        )
    assert refused.value.body["param"] == param  # type: ignore[index]
    assert param in refused.value.body["message"]  # type: ignore[index]
    # the values that ask for nothing pass, and so do the hints clients send for OpenAI's platform
    client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=2,
        user="someone",
        metadata={"team": "a"},
        store=False,
        service_tier="auto",
        extra_body={"use_beam_search": False, "continue_final_message": False, "prompt_logprobs": None, "x": None},
    )


def test_unknown_fields_are_refused_on_completions_and_embeddings(client: openai.OpenAI, model: str) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=model, prompt="Hi", max_tokens=2, extra_body={"kv_transfer_params": {}})
    assert refused.value.body["param"] == "kv_transfer_params"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as refused:
        client.embeddings.create(model=model, input="Hi", extra_body={"cache_salt": "tenant-1"})
    assert refused.value.body["param"] == "cache_salt"  # type: ignore[index]
    assert client.embeddings.create(model=model, input="Hi", user="someone").data


def test_llama_cpp_n_predict_is_max_tokens(client: openai.OpenAI, model: str) -> None:
    """llama.cpp's clients name the output's length n_predict on the OpenAI endpoints too; its slot and cache
    hints, and the defaults SGLang's gateway writes into every request, ask for nothing and pass."""
    ask = [{"role": "user", "content": "Tell me a story."}]
    hints = {"id_slot": 0, "cache_prompt": False, "no_stop_trim": False, "separate_reasoning": True}
    answer = client.completions.create(model=model, prompt="Once", extra_body={"n_predict": 3, "ignore_eos": True})
    assert answer.usage.completion_tokens == 3
    chat = client.chat.completions.create(model=model, messages=ask, extra_body={"n_predict": 5, **hints})
    assert chat.usage.completion_tokens <= 5 and chat.choices[0].finish_reason == "length"


def test_llama_cpp_constraint_forms(client: openai.OpenAI, model: str) -> None:
    """llama.cpp's top-level grammar and json_schema, its response_format json_object with a schema, and a
    json_schema format without a name all constrain the output; an invalid grammar is a 400."""
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}},
        "required": ["n"],
        "additionalProperties": False,
    }
    ask = [{"role": "user", "content": "Give me a number as JSON."}]
    for extra in (
        {"json_schema": schema},
        {"response_format": {"type": "json_object", "schema": schema}},
        {"response_format": {"type": "json_schema", "json_schema": {"schema": schema}}},
    ):
        reply = client.chat.completions.create(
            model=model, messages=ask, max_tokens=24, temperature=0, extra_body=extra
        )
        if reply.choices[0].finish_reason == "stop":
            assert set(json.loads(reply.choices[0].message.content)) == {"n"}
        else:  # cut by max_tokens: still the schema's start
            assert reply.choices[0].message.content.startswith('{"n"')
    done = client.completions.create(
        model=model, prompt="Answer:", max_tokens=8, temperature=0, extra_body={"grammar": 'root ::= "yes" | "no"'}
    )
    assert done.choices[0].text in ("yes", "no")
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model, prompt="Answer:", max_tokens=4, extra_body={"grammar": "root ::= ("})


def test_tool_parameters_with_defs_and_refs(client: openai.OpenAI, model: str) -> None:
    """Parameters as pydantic writes nested (and recursive) models, "$ref": "#/$defs/X", under tool_choice
    required and auto: the call's arguments match them."""
    import jsonschema
    from pydantic import BaseModel, Field

    class Address(BaseModel):
        city: str = Field(max_length=20)
        country: str = Field(max_length=20)

    class Person(BaseModel):
        name: str = Field(max_length=20)
        home: Address
        friends: list["Person"] = Field(default=[], max_length=1)

    parameters = Person.model_json_schema()
    assert "$defs" in parameters and "$ref" in json.dumps(parameters)
    tool = {"type": "function", "function": {"name": "add_person", "parameters": parameters}}
    ask = [{"role": "user", "content": "Add Ada, who lives in London, England."}]
    reply = client.chat.completions.create(
        model=model, messages=ask, tools=[tool, WEATHER], tool_choice="required", max_tokens=120, temperature=0
    ).choices[0]
    assert reply.finish_reason == "tool_calls", reply
    call = reply.message.tool_calls[0].function
    if call.name == "add_person":
        jsonschema.validate(json.loads(call.arguments), parameters)
    auto = client.chat.completions.create(model=model, messages=ask, tools=[tool], max_tokens=40, temperature=0)
    assert auto.choices[0].finish_reason in ("tool_calls", "stop", "length")
    # sampled freely under a named function: never a key the models do not declare (OpenAI's strict reading), and
    # a call cut off by max_tokens is an incomplete call, not text
    from tokenmill.structured.tools import closed_objects

    named = client.chat.completions.create(
        model=model,
        messages=ask,
        tools=[tool],
        tool_choice={"type": "function", "function": {"name": "add_person"}},
        max_tokens=160,
        n=3,
        temperature=1.0,
        seed=5,
    )
    for choice in named.choices:
        (call,) = choice.message.tool_calls
        assert choice.message.content == "" and call.function.name == "add_person"
        if choice.finish_reason == "tool_calls":
            jsonschema.validate(json.loads(call.function.arguments), closed_objects(parameters))
        else:
            assert choice.finish_reason == "length"


def test_answers_carry_a_system_fingerprint(client: openai.OpenAI, model: str) -> None:
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    text = client.completions.create(model=model, prompt="Hi", max_tokens=2)
    chunks = list(client.completions.create(model=model, prompt="Hi", max_tokens=2, stream=True))
    assert chat.system_fingerprint and chat.system_fingerprint.startswith("fp_")
    assert text.system_fingerprint == chat.system_fingerprint == chunks[0].system_fingerprint


def test_openai_paths_without_v1(server: ServerProcess, model: str) -> None:
    """A client given the server's address without /v1 is served, as llama.cpp's server serves it; /completions
    there is llama.cpp's own completion API, as in llama-server (test_server_apis has its shape)."""
    bare = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
    assert [m.id for m in bare.models.list().data] == [model]
    assert bare.models.retrieve(model).id == model
    ask = [{"role": "user", "content": "Hi"}]
    assert bare.chat.completions.create(model=model, messages=ask, max_tokens=2).usage.completion_tokens == 2
    llama = httpx.post(f"{server.url}/completions", json={"prompt": "Hi", "n_predict": 2}, timeout=120).json()
    assert llama["tokens_predicted"] == 2 and isinstance(llama["content"], str)
    assert len(bare.embeddings.create(model=model, input="Hi").data[0].embedding) == 576
    with pytest.raises(openai.NotFoundError):
        bare.models.retrieve("nope")
    # documented once, under /v1
    paths = httpx.get(f"{server.url}/openapi.json").json()["paths"]
    assert "/v1/chat/completions" in paths and "/chat/completions" not in paths


def test_a_regex_digit_is_an_ascii_digit(client: openai.OpenAI, model: str) -> None:
    """`\\d` is [0-9], as in a JSON schema's pattern: with the tokens of '🯸' (a Unicode digit) favoured, the
    output still holds only ASCII digits (Rust's Unicode \\d let the model write '🯸🯸🯸🯸-🯸🯸-🯸🯸')."""
    favoured = {str(t): 100 for t in (10813, 124, 133)}  # '🯸' in the bundled tokenizer
    answer = client.completions.create(
        model=model,
        prompt="Today's date:",
        max_tokens=20,
        temperature=0,
        logit_bias=favoured,
        extra_body={"structured_outputs": {"regex": r"\d{4}-\d{2}-\d{2}"}},
    )
    assert re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", answer.choices[0].text), answer.choices[0].text


def test_every_failed_call_leaves_one_log_line(server: ServerProcess, client: openai.OpenAI, model: str) -> None:
    """One line per API call, as the README promises: failed calls too (400, 404, 413, a client that left), each
    with its status and why; a successful call keeps its own single line."""
    url = f"{server.url}/v1/chat/completions"
    ask = [{"role": "user", "content": "Hi"}]
    calls = {
        "failed-400": ({"messages": ask, "temperature": -1}, 400),
        "failed-404": ({"messages": ask, "model": "nope"}, 404),
        "failed-n": ({"messages": ask, "n": 9999}, 400),  # refused by the engine's checks, not the schema
        "failed-413": ({"messages": [{"role": "user", "content": "a" * 5_000_000}]}, 413),
        "succeeded": ({"messages": ask, "max_tokens": 2}, 200),
    }
    for call_id, (body, status) in calls.items():
        try:
            answer = httpx.post(url, json=body, headers={"X-Request-Id": call_id}, timeout=60)
        except httpx.TransportError:  # the 413 may come before the client has sent it all, and close
            assert status == 413
            continue
        assert answer.status_code == status, answer.text
    for call_id, (_, status) in calls.items():
        (line,) = server.log_lines(f"{call_id} ")
        assert f" /v1/chat/completions {status}: " in line, line
    assert "model `nope` does not exist" in server.log_lines("failed-404 ")[0]
    assert "chatcmpl-succeeded /v1/chat/completions 200: " in server.log_lines("succeeded ")[0]
    # a route that does not exist, and a client that leaves before its answer
    assert httpx.get(f"{server.url}/v1/nothing", headers={"X-Request-Id": "failed-route"}).status_code == 404
    assert " /v1/nothing 404: " in server.log_lines("failed-route ")[0]
    with pytest.raises(httpx.TimeoutException):
        httpx.post(url, json={"messages": ask, "max_tokens": 4000, "ignore_eos": True}, timeout=1.0,
                   headers={"X-Request-Id": "failed-left"})  # fmt: skip
    (line,) = server.log_lines("failed-left ", timeout=30)
    assert " /v1/chat/completions aborted: " in line
