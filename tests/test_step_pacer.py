"""The step pacer: how many prompt tokens of other calls fit beside a call's decodes, learned from step times."""

import pytest

from tokenmill.config import EngineConfig
from tokenmill.engine.step_pacer import StepPacer
from tokenmill.errors import InvalidParameterError


def test_it_learns_the_cost_of_a_token_and_fits_the_target() -> None:
    pacer = StepPacer(250, min_tokens=16, max_tokens=512)
    assert pacer.prompt_tokens_when_shared() is None  # nothing measured yet: no limit
    pacer.observe(500, 1.0)  # 2 ms a token (no fixed part known yet)
    assert pacer.prompt_tokens_when_shared() == 125
    pacer.observe(4, 0.05)  # decodes alone: the fixed part of a step, which the prompt tokens fit beside
    assert pacer.prompt_tokens_when_shared() == 100  # (250 - 50) ms / 2 ms
    pacer.observe(500, 1.05)  # 50 ms + 500 x 2 ms
    assert pacer.prompt_tokens_when_shared() == 100
    for _ in range(30):  # the machine got 4x faster: the limit follows
        pacer.observe(500, 0.25)
    assert 480 <= pacer.prompt_tokens_when_shared() <= 512
    for _ in range(30):  # and far slower: never below a block
        pacer.observe(64, 60.0)
    assert pacer.prompt_tokens_when_shared() == 16


def test_no_target_means_no_limit() -> None:
    pacer = StepPacer(0, min_tokens=16, max_tokens=512)
    pacer.observe(500, 1.0)
    assert pacer.prompt_tokens_when_shared() is None
    assert EngineConfig(decode_step_ms=0).decode_step_ms == 0
    with pytest.raises(InvalidParameterError, match="decode_step_ms"):
        EngineConfig(decode_step_ms=-1)
