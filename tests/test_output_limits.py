"""max_tokens is settled in one place for every API (server/output_limits.py, then the engine's fit_output against
the context): each API's request says what it asked in neutral terms (OutputLength), and no other module sets a
number. Model-free: milliseconds. tests/test_server_apis.py sends the same over-long request through every API of a
real server."""

import ast
from pathlib import Path

import pytest

from tokenmill.engine.input_processor import fit_output
from tokenmill.errors import PromptTooLongError
from tokenmill.server.anthropic_protocol import MessagesRequest
from tokenmill.server.errors import APIError
from tokenmill.server.infill import InfillRequest
from tokenmill.server.llamacpp_protocol import LlamaCompletionRequest
from tokenmill.server.neutral_request import OutputLength
from tokenmill.server.ollama_protocol import ChatRequest, GenerateRequest
from tokenmill.server.output_limits import OutputLimits
from tokenmill.server.protocol import ChatCompletionRequest, CompletionRequest
from tokenmill.server.responses_protocol import ResponsesRequest

SERVER = Path(__file__).resolve().parents[1] / "src" / "tokenmill" / "server"
HI = [{"role": "user", "content": "Hi"}]


def each_api(tokens: int | None) -> dict[str, OutputLength]:
    """The output length each API's request says when it asks for `tokens` (None: names none), in its own field."""
    ollama = {"options": {"num_predict": tokens}} if tokens is not None else {}
    asked = {
        "completions": CompletionRequest(prompt="Hi", **({"max_tokens": tokens} if tokens else {})),
        "chat max_tokens": ChatCompletionRequest(messages=HI, max_tokens=tokens),
        "chat max_completion_tokens": ChatCompletionRequest(messages=HI, max_completion_tokens=tokens),
        "responses": ResponsesRequest(input="Hi", max_output_tokens=tokens),
        "ollama chat": ChatRequest(model="m", messages=HI, **ollama),
        "ollama generate": GenerateRequest(model="m", prompt="Hi", **ollama),
        "llama.cpp n_predict": LlamaCompletionRequest(prompt="Hi", n_predict=tokens),
        "llama.cpp max_tokens": LlamaCompletionRequest(prompt="Hi", max_tokens=tokens),
        "infill": InfillRequest(**({"n_predict": tokens} if tokens else {})),
    }
    if tokens is not None:  # Anthropic's max_tokens is required
        asked["anthropic"] = MessagesRequest(model="m", messages=HI, max_tokens=tokens)
    return {api: req.output_length() for api, req in asked.items()}


def test_every_api_asks_in_the_same_terms() -> None:
    """The same number in each API's own field is the same neutral ask; so is naming none (but completions, whose
    default is OpenAI's 16, and the -1/-2 "no limit" values of llama.cpp and Ollama)."""
    assert set(each_api(300).values()) == {OutputLength(300)}
    unnamed = each_api(None)
    assert unnamed.pop("completions") == OutputLength(None, 16)
    assert set(unnamed.values()) == {OutputLength(None)}
    for no_limit in (
        LlamaCompletionRequest(n_predict=-1),
        GenerateRequest(model="m", prompt="Hi", options={"num_predict": -2}),
    ):
        assert no_limit.output_length() == OutputLength(None)
    assert CompletionRequest(prompt="Hi", max_tokens=None).output_length() == OutputLength(None)  # null: the context
    assert CompletionRequest(prompt="Hi", max_tokens=0, echo=True).output_length().prompt_only
    assert LlamaCompletionRequest(n_predict=0).output_length().prompt_only
    assert GenerateRequest(model="m", options={"num_ctx": 64}).output_length() == OutputLength(context_limit=64)


def test_the_same_request_gets_the_same_limit_and_error_through_every_api() -> None:
    """One OutputLimits settles every API's ask: the same number, the same default, the same 400 above
    --max-tokens-limit; then the engine's one rule fits it to the context, with the same error beyond it."""
    limits = OutputLimits(default=None, limit=1024, model_default=None, max_model_len=2048)
    for api, output in each_api(100_000).items():
        with pytest.raises(APIError, match="max_tokens 100000 is above this server's limit of 1024") as info:
            limits.settle(output)
        assert info.value.status == 400 and info.value.param == "max_tokens", api
    unlimited = OutputLimits(max_model_len=2048)
    errors = set()
    for output in each_api(100_000).values():
        with pytest.raises(PromptTooLongError) as too_long:
            fit_output(48, unlimited.settle(output, 48), unlimited.max_model_len or 0)
        errors.add((str(too_long.value), too_long.value.param))
    assert errors == {
        (
            "prompt (48 tokens) + max_tokens (100000) = 100048 is more than max_model_len 2048; lower max_tokens to "
            "at most 2000",
            "max_tokens",
        )
    }
    defaulted = OutputLimits(default=256, limit=1024, max_model_len=2048)
    assert {defaulted.settle(o) for o in each_api(None).values()} == {256}
    up_to_the_context = {
        fit_output(48, unlimited.settle(o), 2048) for a, o in each_api(None).items() if a != "completions"
    }
    assert up_to_the_context == {2000}


def test_num_ctx_cuts_the_output_to_fit() -> None:
    limits = OutputLimits(max_model_len=2048)
    assert limits.settle(OutputLength(None, context_limit=64), 60) == 4
    assert limits.settle(OutputLength(3, context_limit=64), 60) == 3
    assert limits.settle(OutputLength(30, context_limit=64), 60) == 4
    with pytest.raises(PromptTooLongError, match="num_ctx 64 leaves no room") as info:
        limits.settle(OutputLength(None, context_limit=64), 64)
    assert info.value.param == "num_ctx"
    with pytest.raises(APIError, match="num_ctx 4096 is more than this server's context"):
        limits.settle(OutputLength(None, context_limit=4096), 60)
    assert OutputLimits().settle(OutputLength(5, prompt_only=True)) == 1  # one token made, not shown


def max_tokens_settings(path: Path) -> list[str]:
    """Where a server module gives max_tokens a value other than None (`max_tokens=...` or `x["max_tokens"] = ...`):
    `file:line`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.keyword) and node.arg == "max_tokens":
            value = node.value
        elif isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Subscript) and isinstance(t.slice, ast.Constant) and t.slice.value == "max_tokens"
            for t in node.targets
        ):
            value = node.value
        else:
            continue
        if not (isinstance(value, ast.Constant) and value.value is None):
            found.append(f"{path.name}:{node.lineno}")
    return found


def test_no_server_module_but_generation_sets_max_tokens() -> None:
    """Every API builds its SamplingParams with max_tokens unset; Generation alone gives it the value OutputLimits
    settles. A module that sets its own would be a second place that can settle it differently."""
    found = [where for path in sorted(SERVER.glob("*.py")) for where in max_tokens_settings(path)]
    assert [where.split(":")[0] for where in found] == ["generation.py"], found


def test_the_context_rule_is_written_once() -> None:
    """The engine's fit_output is the only place that fits an output to max_model_len (its message, once)."""
    src = SERVER.parent
    holders = [p.relative_to(src).as_posix() for p in src.rglob("*.py") if "lower max_tokens to" in p.read_text()]
    assert holders == ["engine/input_processor.py"]


def test_an_engine_error_names_the_field_the_user_sent() -> None:
    """Chat sends the engine's logprobs as top_logprobs: a 400 about it says top_logprobs; others stay as they are."""
    from tokenmill.errors import InvalidParameterError
    from tokenmill.sampling_params import SamplingParams
    from tokenmill.server.neutral_request import NeutralRequest

    chat = NeutralRequest(SamplingParams(), field_names={"logprobs": "top_logprobs"})
    renamed = chat.in_api_terms(InvalidParameterError("logprobs 21 asks for 21 log-probabilities", "logprobs"))
    assert (str(renamed), renamed.param) == ("top_logprobs 21 asks for 21 log-probabilities", "top_logprobs")
    other = InvalidParameterError("n=9 samples run together", "n")
    assert chat.in_api_terms(other) is other
    too_long = PromptTooLongError("prompt (9 tokens) + ...", "max_tokens")
    assert NeutralRequest(SamplingParams()).in_api_terms(too_long) is too_long
