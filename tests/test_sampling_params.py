"""Invalid sampling parameters raise InvalidParameterError naming the parameter."""

import pytest

from tokenmill import SamplingParams
from tokenmill.errors import InvalidParameterError


@pytest.mark.parametrize(
    "kwargs,param",
    [
        ({"n": 0}, "n"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 2}, "min_p"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"logprobs": -2}, "logprobs"),  # -1: the whole vocabulary (the engine's max_logprobs bounds both)
        ({"prompt_logprobs": -2}, "prompt_logprobs"),
        ({"stop": 5}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": ["a"]}, "stop_token_ids"),
        ({"stop_token_ids": [2, -1]}, "stop_token_ids"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {5: 500}}, "logit_bias"),
        ({"seed": "abc"}, "seed"),
        ({"n": True}, "n"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [1, -2]}, "allowed_token_ids"),
        ({"logprob_token_ids": ["a"]}, "logprob_token_ids"),
        ({"logprob_token_ids": list(range(129))}, "logprob_token_ids"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
        ({"truncation_side": "middle"}, "truncation_side"),
    ],
)
def test_invalid_values(kwargs: dict, param: str) -> None:
    with pytest.raises(InvalidParameterError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param
    assert param in str(info.value)


def test_valid_values_are_normalised() -> None:
    p = SamplingParams(stop="###", logit_bias={"42": 5}, top_k=-1)
    assert p.stop_strings == ["###"]
    assert p.logit_bias == {42: 5.0}
    assert SamplingParams(temperature=0).greedy


def test_token_ids_must_be_in_the_vocabulary() -> None:
    with pytest.raises(InvalidParameterError, match="outside the vocabulary"):
        SamplingParams(stop_token_ids=[10**9]).validate_token_ids(49152)
    for name in ("allowed_token_ids", "logprob_token_ids"):
        with pytest.raises(InvalidParameterError, match="outside the vocabulary") as info:
            SamplingParams(**{name: [5, 49152]}).validate_token_ids(49152)
        assert info.value.param == name
