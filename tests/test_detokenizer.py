"""Incremental detokenization: no split characters, correct spacing, stop strings across tokens."""

from pathlib import Path

import pytest

from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.loader.gguf_file import GGUFFile
from tokenmill.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer(bundled_path: Path) -> Tokenizer:
    return Tokenizer.from_gguf(GGUFFile(bundled_path))


def stream(tokenizer: Tokenizer, text: str, prompt: str = "Say:", **kwargs) -> tuple[list[str], IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode(prompt), **kwargs)
    deltas = []
    seen = ""
    for token in tokenizer.encode(text):
        stopped = detok.add_token(token)
        visible = detok.visible_text(finished=stopped is not None)
        deltas.append(visible[len(seen) :])
        assert visible.startswith(seen), "visible text never shrinks"
        seen = visible
        if stopped:
            break
    return deltas, detok


@pytest.mark.parametrize("text", ["emoji 🚀🔥👍🏽 done", "日本語のテキスト", "Ünïcödé ñ ß", "mixed 😀😃 and 中文"])
def test_multibyte_characters_never_split(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text)
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids), "the text should have characters split over tokens"
    deltas, detok = stream(tokenizer, text)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text == detok.text


def test_stop_string_spanning_tokens_is_cut(tokenizer: Tokenizer) -> None:
    deltas, detok = stream(tokenizer, "The answer is 42. END of story", stop_strings=["42. EN"])
    assert detok.stopped_by == "42. EN"
    assert detok.text == "The answer is "
    assert "".join(deltas) == "The answer is "
    assert not any("4" in d for d in deltas), "no part of the stop string was ever visible"


def test_stop_string_included_on_request(tokenizer: Tokenizer) -> None:
    _, detok = stream(tokenizer, "one two three four", stop_strings=["three"], include_stop_str_in_output=True)
    assert detok.text == "one two three"


def test_possible_stop_prefix_is_held_back_then_released(tokenizer: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tokenizer, [], stop_strings=["###"])
    for token in tokenizer.encode("a #"):
        detok.add_token(token)
    assert detok.text == "a #" and detok.visible_text(False) == "a "
    for token in tokenizer.encode("b"):
        detok.add_token(token)
    assert detok.visible_text(False) == "a #b"


def test_earliest_of_several_stop_strings_wins(tokenizer: Tokenizer) -> None:
    _, detok = stream(tokenizer, "alpha beta gamma delta", stop_strings=["delta", "beta"])
    assert detok.stopped_by == "beta" and detok.text == "alpha "


def test_first_token_keeps_its_space_with_sentencepiece(gemma3_path: Path) -> None:
    gemma = Tokenizer.from_gguf(GGUFFile(gemma3_path))
    deltas, detok = stream(gemma, " Hello world", prompt="Say")
    assert "".join(deltas) == " Hello world"


def test_flush_emits_an_unfinished_character(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("🚀")
    detok = IncrementalDetokenizer(tokenizer, [])
    for token in ids[:-1]:
        detok.add_token(token)
    assert detok.text == ""
    detok.flush()
    assert detok.text.endswith("\ufffd")
