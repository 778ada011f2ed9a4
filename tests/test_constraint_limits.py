"""Constraints the matcher cannot follow (issue 24): refused when compiled with the limit named, never answered with
finish_reason "stop" and text that breaks them; a failure mid-way ends the sequence with an error; compiles are
bounded in size and time, run in the compiler's threads, and their outcomes, refusals included, are cached."""

import logging
import threading
import time

import pytest

from tokenmill import LLM, SamplingParams, StructuredOutputsParams
from tokenmill.errors import ConstraintError, InvalidParameterError
from tokenmill.structured.grammars import GrammarCompiler

# 20,000 rules in one alternative: a parser row of 20,001 items, where llguidance allows 2,000
LARK_20K_RULES = "start: " + " | ".join(f"r{i}" for i in range(20_000)) + "\n"
LARK_20K_RULES += "\n".join(f'r{i}: "t{i}"' for i in range(20_000))
# the first branch the compile-time dry run follows ("Sure", the allowed token of highest id); the other ("#", a
# low id) meets the same row limit three tokens in, where only a request that takes it finds it
TWO_BRANCHES = 'start: "Sure" | "#" w w w pick\nw: "#"\npick: ' + " | ".join(f'"v{i}"' for i in range(2_500))


def constrained(constraint: dict, **params: object) -> SamplingParams:
    return SamplingParams(
        temperature=0, max_tokens=params.pop("max_tokens", 12), structured_outputs=constraint, **params
    )


def test_a_choice_of_2500_options_ends_in_one_of_them(llm: LLM) -> None:
    """Was "option" with finish_reason "stop": one rule per option put 2,501 items in a parser row."""
    choices = [f"option{i}" for i in range(2_500)]
    out = llm.generate("Pick one:", constrained({"choice": choices}), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.text in choices


@pytest.mark.parametrize(
    "constraint, reason",
    [
        ({"regex": "a{1000000}"}, "too many expressions constructed"),  # was "aaaa", "stop"
        ({"regex": "[^\\x00-\\U0010FFFF]"}, "no output can satisfy it"),  # was "", "stop"
        ({"json": {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}}, "no output can satisfy it"),
        ({"grammar": LARK_20K_RULES}, "Current row has 20001 items; max is 2000"),  # was "t", "stop"
    ],
    ids=["huge-repeat", "empty-class", "ref-cycle", "20k-rules"],
)
def test_what_the_matcher_cannot_follow_is_refused_when_compiled(llm: LLM, constraint: dict, reason: str) -> None:
    with pytest.raises(ConstraintError, match="cannot be followed") as info:
        llm.engine.add_request(None, "Hi", constrained(constraint))
    assert reason in str(info.value) and info.value.param == "structured_outputs"
    assert isinstance(info.value, InvalidParameterError)  # the server's 400
    assert "<state>" not in str(info.value) and "non-verbose" not in str(info.value)
    assert not llm.engine.has_unfinished_requests()


def test_a_matcher_that_fails_mid_way_ends_with_an_error_and_a_log_line(
    llm: LLM, caplog: pytest.LogCaptureFixture
) -> None:
    """The dry run at compile time covers the first tokens of one path; a limit met later ends that sequence with
    finish_reason "error" and the matcher's reason, never "stop"."""
    hash_token = llm.get_tokenizer().encode("#", add_special_tokens=False)[0]
    fine = llm.generate("Go:", constrained({"grammar": TWO_BRANCHES}), use_tqdm=False)[0].outputs[0]
    assert fine.finish_reason == "stop" and fine.text == "Sure"
    toward_failure = constrained({"grammar": TWO_BRANCHES}, logit_bias={hash_token: 100}, n=2, seed=1)
    with caplog.at_level(logging.ERROR, logger="tokenmill.engine.output_processor"):
        out = llm.generate("Go:", toward_failure, use_tqdm=False)[0]
    for o in out.outputs:
        assert o.finish_reason == "error" and "max is 2000" in o.error and o.text.startswith("#")
    assert sum(f"request {out.request_id} " in r.getMessage() for r in caplog.records) == 2
    llm.engine.check_integrity()  # the failed sequences gave their blocks back
    assert llm.generate("Hi", SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids


def test_a_constraint_over_the_size_bound_is_refused_before_compiling(llm: LLM) -> None:
    grammars = llm.engine.grammars
    compiles = grammars.num_compiles
    start = time.monotonic()
    with pytest.raises(ConstraintError, match=r"at most 1,048,576 bytes \(max_constraint_bytes\)"):
        grammars.compile(StructuredOutputsParams(choice=[f"option{i}" for i in range(100_000)]))  # 1.5 MB
    assert time.monotonic() - start < 1 and grammars.num_compiles == compiles


def test_a_panic_in_llguidance_reaches_no_message(llm: LLM) -> None:
    """Was "panic: assertion failed: grammar.symbols.len() < u16::MAX ..." and a backtrace, in a 400's message."""
    too_many_symbols = "start: " + " ".join('"t"' for _ in range(66_000))  # each literal a symbol: over 2**16
    with pytest.raises(ConstraintError) as info:
        llm.engine.add_request(None, "Hi", constrained({"grammar": too_many_symbols}))
    message = str(info.value)
    assert "more grammar symbols than llguidance can number" in message
    assert not any(part in message for part in ("panic", "backtrace", "<unknown>", "assertion failed"))


def test_compiles_are_bounded_in_time_cached_with_their_failures_and_off_the_caller(llm: LLM) -> None:
    compiler = GrammarCompiler(llm.engine.tokenizer, llm.engine.model_config.vocab_size, max_compile_seconds=0.01)
    slow = StructuredOutputsParams(choice=[f"option number {i}" for i in range(30_000)])  # about 0.15 s
    with pytest.raises(ConstraintError, match=r"more than 0.01 s to compile \(max_constraint_compile_seconds\)"):
        compiler.compile(slow)
    start = time.monotonic()
    with pytest.raises(ConstraintError, match="max_constraint_compile_seconds"):  # the refusal, from the cache
        compiler.compile(StructuredOutputsParams(choice=list(slow.choice)))
    assert time.monotonic() - start < 0.1 and compiler.num_compiles == 1
    for _ in range(2):  # a constraint that cannot be followed is compiled once too
        with pytest.raises(ConstraintError, match="no output can satisfy it"):
            compiler.compile(StructuredOutputsParams(regex="[^\\x00-\\U0010FFFF]"))
    assert compiler.num_compiles == 2
    # the compile runs in the compiler's own threads, never the caller's
    threads: list[str] = []
    original = compiler._compile

    def recording(params: StructuredOutputsParams):
        threads.append(threading.current_thread().name)
        return original(params)

    compiler._compile = recording  # type: ignore[method-assign]
    compiler.max_compile_seconds = 30
    compiler.compile(StructuredOutputsParams(regex="[0-9]{3}"))
    assert threads and threads[0].startswith("tokenmill-constraint")
    compiler.close()


def test_the_bounds_are_engine_options() -> None:
    from tokenmill.config import EngineConfig

    config = EngineConfig.from_options({"max_constraint_bytes": 2048, "max_constraint_compile_seconds": 2.5})
    assert (config.max_constraint_bytes, config.max_constraint_compile_seconds) == (2048, 2.5)
    for bad in ({"max_constraint_bytes": 0}, {"max_constraint_compile_seconds": -1}):
        with pytest.raises(InvalidParameterError, match=next(iter(bad))):
            EngineConfig.from_options(bad)


def test_a_penalty_that_rounds_to_zero_keeps_the_constraint(llm: LLM) -> None:
    """repetition_penalty 5e-324 is 0 in float32: the disallowed tokens' -inf times it was NaN, which argmax then
    picked, and a seen token's logit / 0 was inf, which made sampling's softmax NaN; the constraint failed after
    one token (schemathesis found it). Greedy and sampled, the constraint holds."""
    for extra in ({"temperature": 0}, {"temperature": 0.2, "seed": 3, "min_tokens": 2}):
        params = SamplingParams(
            max_tokens=12, structured_outputs={"choice": ["yes", "no", ""]}, repetition_penalty=5e-324, **extra
        )
        out = llm.generate("Answer yes or no: is the sky blue?", params, use_tqdm=False)[0].outputs[0]
        assert out.text in ("yes", "no", "") and out.finish_reason == "stop", (extra, out.text, out.error)
