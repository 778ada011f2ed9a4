"""The reply parsers (tokenmill/parsers): thinking, answer and tool calls split out of a reply's text, whole and
streamed in every split of its text (a tag may arrive in any pieces). No torch, milliseconds."""

import json

import pytest

from tokenmill.errors import InvalidParameterError
from tokenmill.parsers.reply import ReplyFormat, ReplyParser, reply_format
from tokenmill.parsers.think import ANSWER, BEFORE, THINKING, start_state

WEATHER = [{"name": "get_weather"}, {"name": "get_time"}]


def run(parser: ReplyParser, pieces: list[str], cut: bool = False) -> tuple[str, str, list]:
    """Feed `pieces` one by one; the deltas' thinking and text joined, and the calls."""
    thinking = text = ""
    calls = []
    for i, piece in enumerate(pieces):
        last = i == len(pieces) - 1
        delta = parser.feed(piece, finished=last, cut=cut and last)
        thinking += delta.thinking
        text += delta.text
        calls += delta.calls
    assert (thinking, text, calls) == (parser.thinking, parser.text, parser.calls)
    return thinking, text, calls


def splits(text: str) -> list[list[str]]:
    """The text whole, one character at a time, and cut at every place into two pieces."""
    return [[text], list(text), *[[text[:i], text[i:]] for i in range(1, len(text))]]


def calls_of(calls) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize(
    "tail, state",
    [
        ("<|im_start|>assistant\n", BEFORE),
        ("<｜Assistant｜><think>\n", THINKING),
        ("<|im_start|>assistant\n<think>\n\n</think>\n\n", ANSWER),
        (
            "<think>\nold\n</think>\n\nold answer<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
            BEFORE,
        ),
    ],
)
def test_where_a_reply_starts_is_read_from_the_prompt(tail, state):
    assert start_state(tail) == state


def test_formats_are_chosen_from_the_template():
    assert reply_format("{{ '<think>' }}<tool_call>") == ReplyFormat("think", "hermes")
    assert reply_format("<|start|>{{ x }}<|channel|>analysis<|message|>") == ReplyFormat("harmony", "harmony")
    assert reply_format("<|python_tag|>") == ReplyFormat("", "llama3_json")
    assert reply_format("[TOOL_CALLS]") == ReplyFormat("", "mistral")
    assert reply_format("plain") == ReplyFormat("", "constrained")
    assert reply_format("<think>", reasoning="none", tools="constrained") == ReplyFormat("", "constrained")
    assert reply_format("", reasoning="deepseek_r1", tools="qwen") == ReplyFormat("think", "hermes")
    with pytest.raises(InvalidParameterError, match="no reasoning parser 'magic'"):
        reply_format("", reasoning="magic")
    with pytest.raises(InvalidParameterError, match="no tool-call parser"):
        reply_format("", tools="magic")


QWEN3 = "<think>\nLet me see: 2 < 3.\n</think>\n\nIt is 3."


@pytest.mark.parametrize("pieces", splits(QWEN3))
def test_think_blocks_split_in_any_pieces(pieces):
    parser = ReplyParser(ReplyFormat("think", "hermes"), "<|im_start|>assistant\n")
    assert run(parser, pieces) == ("Let me see: 2 < 3.", "It is 3.", [])


@pytest.mark.parametrize("pieces", splits("Thinking about it.\n</think>\n\nThe answer."))
def test_a_reply_that_starts_inside_its_thinking(pieces):
    parser = ReplyParser(ReplyFormat("think", "hermes"), "<｜Assistant｜><think>\n")
    assert run(parser, pieces) == ("Thinking about it.", "The answer.", [])


def test_no_block_is_all_answer_and_a_closed_prompt_block_too():
    assert run(ReplyParser(ReplyFormat("think", "hermes"), "x"), ["<thought> no"]) == ("", "<thought> no", [])
    closed = ReplyParser(ReplyFormat("think", "hermes"), "<think>\n\n</think>\n\n")
    assert run(closed, ["<think>a</think>b"]) == ("", "<think>a</think>b", [])


def test_a_tag_is_never_shown_half():
    parser = ReplyParser(ReplyFormat("think", "hermes"), "")
    assert parser.feed("<thi").text == "" and parser.feed("nk>").thinking == ""
    delta = parser.feed("abc</th")
    assert (delta.thinking, delta.text) == ("abc", "")
    delta = parser.feed("ink>ok")
    assert (delta.thinking, delta.text) == ("", "ok")


QWEN3_CALL = (
    "<think>\nI should look.\n</think>\n\nChecking.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
    '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
)


@pytest.mark.parametrize("pieces", splits(QWEN3_CALL)[:40])
def test_hermes_calls_after_thinking_and_text(pieces):
    parser = ReplyParser(ReplyFormat("think", "hermes"), "", WEATHER)
    thinking, text, calls = run(parser, pieces)
    assert (thinking, text) == ("I should look.", "Checking.")
    assert calls_of(calls) == [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})]


def test_a_hermes_call_is_taken_as_soon_as_it_closes():
    parser = ReplyParser(ReplyFormat("", "hermes"), "", WEATHER)
    first = parser.feed('<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n<tool_')
    assert calls_of(first.calls) == [("get_time", {})] and first.text == ""


def test_a_call_cut_off_by_max_tokens_is_an_incomplete_call_not_text():
    parser = ReplyParser(ReplyFormat("think", "hermes"), "", WEATHER)
    _, text, calls = run(
        parser, ['<think>x</think>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'], cut=True
    )
    assert text == "" and [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Pa')]
    named = ReplyParser(ReplyFormat("", "constrained"), "", WEATHER[:1], forced_name="get_weather")
    _, text, calls = run(named, ['{"na'], cut=True)
    assert text == "" and [(c.name, c.arguments) for c in calls] == [("get_weather", "")]


def test_text_that_only_looked_like_a_call_is_text():
    parser = ReplyParser(ReplyFormat("", "constrained"), "", WEATHER)
    assert run(parser, ["{not json"]) == ("", "{not json", [])
    hermes = ReplyParser(ReplyFormat("", "hermes"), "", WEATHER)
    assert run(hermes, ['<tool_call>{"name": "nope"}</tool_call>'])[1] == '<tool_call>{"name": "nope"}</tool_call>'


@pytest.mark.parametrize(
    "tools, reply, expected",
    [
        ("llama3_json", '{"name": "get_time", "parameters": {"zone": "UTC"}}', [("get_time", {"zone": "UTC"})]),
        (
            "llama3_json",
            '<|python_tag|>{"name": "get_time", "parameters": {}}; {"name": "get_weather", "parameters": {}}',
            [("get_time", {}), ("get_weather", {})],
        ),
        (
            "mistral",
            '[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "UTC"}}]',
            [("get_time", {"zone": "UTC"})],
        ),
        ("mistral", '[TOOL_CALLS]get_time[ARGS]{"zone": "UTC"}', [("get_time", {"zone": "UTC"})]),
        ("constrained", '[{"name": "get_time", "arguments": {}}]', [("get_time", {})]),
    ],
)
def test_each_tool_syntax(tools, reply, expected):
    for pieces in splits(reply)[:20]:
        parser = ReplyParser(ReplyFormat("", tools), "", WEATHER)
        _, text, calls = run(parser, pieces)
        assert text == "" and calls_of(calls) == expected


def test_without_functions_calls_are_not_looked_for():
    reply = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    assert run(ReplyParser(ReplyFormat("", "hermes"), ""), [reply]) == ("", reply, [])


HARMONY = (
    "<|channel|>analysis<|message|>User asks the time. Call get_time.<|end|>"
    '<|start|>assistant<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{"zone": "UTC"}'
)


@pytest.mark.parametrize("pieces", splits(HARMONY)[:60])
def test_harmony_thinking_and_a_call(pieces):
    parser = ReplyParser(ReplyFormat("harmony", "harmony"), "<|start|>assistant", WEATHER)
    thinking, text, calls = run(parser, pieces)
    assert (thinking, text) == ("User asks the time. Call get_time.", "")
    assert calls_of(calls) == [("get_time", {"zone": "UTC"})]


@pytest.mark.parametrize(
    "pieces",
    splits("<|channel|>analysis<|message|>Think.<|end|><|start|>assistant<|channel|>final<|message|>Answer <|x|>.")[
        :50
    ],
)
def test_harmony_thinking_and_answer(pieces):
    parser = ReplyParser(ReplyFormat("harmony", "harmony"), "")
    assert run(parser, pieces) == ("Think.", "Answer <|x|>.", [])


def test_harmony_counts_thinking_tokens_and_plain_text_passes():
    parser = ReplyParser(ReplyFormat("harmony", "harmony"), "")
    parser.feed("<|channel|>analysis<|message|>", tokens=3)
    parser.feed("a b c", tokens=3)
    parser.feed("<|end|><|start|>assistant<|channel|>final<|message|>", tokens=5)
    parser.feed("ok", finished=True, tokens=1)
    assert parser.thinking_tokens == 3 + 3 and (parser.thinking, parser.text) == ("a b c", "ok")
    plain = ReplyParser(ReplyFormat("harmony", "harmony"), "")
    assert run(plain, ["Just text."]) == ("", "Just text.", [])
