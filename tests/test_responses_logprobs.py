"""A reply read one token at a time (parsers/per_token.py): the Responses API's text log-probabilities (which tokens
are the text's) and every API's count of thinking tokens do not depend on how many tokens each output of the engine
carried (the reader falls behind when the server is busy)."""

from pathlib import Path

import pytest

from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.loader.gguf_file import GGUFFile
from tokenmill.outputs import CompletionOutput, Logprob
from tokenmill.parsers.per_token import one_token_at_a_time
from tokenmill.parsers.reply import ReplyFormat, ReplyParser
from tokenmill.server.responses_logprobs import TextLogprobs
from tokenmill.tokenizer import Tokenizer

THOUGHT = "<think>\nThe user greets me. I should answer <briefly>.\n</think>\n\nHello there."


@pytest.fixture(scope="module")
def tokenizer(bundled_path: Path) -> Tokenizer:
    return Tokenizer.from_gguf(GGUFFile(bundled_path))


def outputs(tokenizer: Tokenizer, text: str, ends: list[int], stop: list[str] | None = None) -> list[CompletionOutput]:
    """The engine's outputs of a reply that writes `text` then EOS, the k-th output ending after token ends[k]."""
    ids = tokenizer.encode(text) + [tokenizer.eos_token_id]
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Hi"), stop_strings=stop or [])
    made, sent_text, sent = [], "", 0
    for i, token in enumerate(ids):
        if i < len(ids) - 1:
            detok.add_token(token)
        if i + 1 not in ends:
            continue
        finished = i == len(ids) - 1
        shown = detok.visible_text(finished)
        made.append(
            CompletionOutput(
                index=0,
                text=shown,
                token_ids=ids[: i + 1],
                logprobs=[{t: Logprob(-0.5, 1)} for t in ids[: i + 1]],
                finish_reason="stop" if finished else None,
                delta_text=shown[len(sent_text) :],
                delta_token_ids=ids[sent : i + 1],
            )
        )
        sent_text, sent = shown, i + 1
    return made


def read(tokenizer: Tokenizer, made: list[CompletionOutput]) -> tuple[list[str], list[str], str]:
    """(the entries' tokens, those the text deltas carried in turn, the reply's text)."""
    reply, logprobs = ReplyParser(ReplyFormat("think", "none")), TextLogprobs(tokenizer, 0)
    streamed = []
    for output in made:
        taken = len(logprobs.content)
        if logprobs.read(reply, output).text:
            streamed += logprobs.content[taken:]
    return [e["token"] for e in logprobs.content], [e["token"] for e in streamed], reply.text


def closing_tag(tokenizer: Tokenizer) -> int:
    """Where THOUGHT's closing tag begins: '</', 'think', '>', '\n', '\n', 'Hello'."""
    return tokenizer.encode(THOUGHT).index(tokenizer.encode("</")[0])


def groupings(tokenizer: Tokenizer) -> list[list[int]]:
    """Ways the engine may hand out THOUGHT's tokens (and EOS): one each, all in one, three outputs, and the tokens
    one each up to the closing tag, the next ones (2 to 6 of them) in one output."""
    n, closing = len(tokenizer.encode(THOUGHT)) + 1, closing_tag(tokenizer)
    return [list(range(1, n + 1)), [n], [5, n - 3, n], *[[*range(1, closing), closing + k, n] for k in range(2, 7)]]


def test_the_texts_tokens_whatever_the_outputs_carry(tokenizer: Tokenizer) -> None:
    reads = [read(tokenizer, outputs(tokenizer, THOUGHT, ends)) for ends in groupings(tokenizer)]
    entries, streamed, text = reads[0]
    assert text == "Hello there."
    assert entries == ["\n", "\n", "Hello", " there", "."]  # the tokens after the closing tag's
    assert streamed == entries
    assert all(r == reads[0] for r in reads), [r[0] for r in reads]


def test_the_thinking_tokens_whatever_the_outputs_carry(tokenizer: Tokenizer) -> None:
    counts, replies = [], []
    for ends in groupings(tokenizer):
        reply = ReplyParser(ReplyFormat("think", "none"), tokenizer=tokenizer)
        for output in outputs(tokenizer, THOUGHT, ends):
            reply.feed_output(output)
        counts.append(reply.thinking_tokens)
        replies.append((reply.thinking, reply.text))
    # every token up to the closing tag's '>' wrote the thinking ('<think>' and '</think>' included)
    assert counts == [closing_tag(tokenizer) + 3] * len(counts)
    assert replies == [("The user greets me. I should answer <briefly>.", "Hello there.")] * len(counts)


@pytest.mark.parametrize("text", ["emoji 🚀🔥👍🏽 done", "日本語のテキスト"])
def test_an_output_cut_at_its_tokens_keeps_its_text(tokenizer: Tokenizer, text: str) -> None:
    """Characters split over tokens: the pieces still make the output's text, each whole where its bytes end."""
    (whole,) = outputs(tokenizer, text, [len(tokenizer.encode(text)) + 1])
    pieces = list(one_token_at_a_time(tokenizer, whole))
    assert [p.delta_token_ids for p in pieces] == [[t] for t in whole.delta_token_ids]
    assert "".join(p.delta_text for p in pieces) == whole.delta_text == text
    assert all("\ufffd" not in p.delta_text for p in pieces)
    assert [p.text for p in pieces][-1] == whole.text and all(whole.text.startswith(p.text) for p in pieces)
    assert [p.finish_reason for p in pieces] == [None] * (len(pieces) - 1) + ["stop"]


def test_text_held_back_goes_to_the_last_token(tokenizer: Tokenizer) -> None:
    """A possible stop string's start is not in the output's text yet: the pieces cut what is there."""
    text = "Hello there. The end"
    held = outputs(tokenizer, text, [len(tokenizer.encode(text))], stop=["The end."])
    (whole,) = held
    assert whole.delta_text == "Hello there. "
    pieces = list(one_token_at_a_time(tokenizer, whole))
    assert "".join(p.delta_text for p in pieces) == whole.delta_text
    assert [p.delta_text for p in pieces][:3] == ["Hello", " there", "."]
