"""The tokenizer as the grammars see it: added tokens that are text (Qwen3's <think> and <tool_call>, user-defined
in GGUF, `special: false` in HF) match a grammar's text, as the model writes them; control tokens stay special."""

import pytest

from tests.gguf_builder import QWEN3_ADDED, TinyModel, write_tiny_gguf
from tokenmill.loader.gguf_file import GGUFFile
from tokenmill.loader.model_path import bundled_model_path
from tokenmill.structured.grammars import GrammarCompiler
from tokenmill.structured.params import StructuredOutputsParams
from tokenmill.tokenizer.gguf_tokenizer import Tokenizer

CALL = {"type": "object", "properties": {"name": {"const": "f"}}, "required": ["name"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    path = tmp_path_factory.mktemp("qwen3-tokens") / "tiny.gguf"
    model = TinyModel(vocab_size=49152 + len(QWEN3_ADDED), hidden=16, intermediate=32, layers=1, heads=2, kv_heads=1)
    write_tiny_gguf(path, model, tokenizer_from=bundled_model_path(), added_tokens=QWEN3_ADDED)
    return Tokenizer.from_gguf(GGUFFile(path))


@pytest.fixture(scope="module")
def compiler(tokenizer: Tokenizer):
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size)
    yield compiler
    compiler.close()


def follow(compiler: GrammarCompiler, params: StructuredOutputsParams, ids: list[int]) -> bool:
    """Whether the constraint takes `ids` one by one and may end after them."""
    matcher = compiler.matcher(compiler.compile(params))
    for token in ids:
        if not compiler.allowed([matcher])[0, token] or not matcher.consume_token(token):
            return False
    return matcher.is_accepting()


def test_a_call_in_the_tag_tokens_follows_its_grammar(compiler: GrammarCompiler, tokenizer: Tokenizer) -> None:
    text = '<tool_call>\n{"name": "f"}\n</tool_call>'
    ids = tokenizer.encode(text)
    assert ids[0] == tokenizer.token_to_id("<tool_call>") and ids[-1] == tokenizer.token_to_id("</tool_call>")
    call = StructuredOutputsParams(json=CALL, wrap=("<tool_call>\n", "\n</tool_call>"))
    assert follow(compiler, call, ids)
    # after thinking written with the <think> tokens, as Qwen3 writes it
    thought = tokenizer.encode("<think>\nA call.\n</think>\n\n")
    assert thought[0] == tokenizer.token_to_id("<think>")
    thinking_then_call = StructuredOutputsParams(json=CALL, wrap=("<tool_call>\n", "\n</tool_call>"), thinking="before")
    assert follow(compiler, thinking_then_call, thought + ids)


def test_control_tokens_stay_special(compiler: GrammarCompiler, tokenizer: Tokenizer) -> None:
    """A regex's text "<|im_end|>" is text: the control token is not that text."""
    end = tokenizer.token_to_id("<|im_end|>")
    as_text = StructuredOutputsParams(regex="<\\|im_end\\|>")
    assert not follow(compiler, as_text, [end])
    pieces = compiler.tokenizer.tokenize_str("<|im_end|>")
    assert len(pieces) > 1 and follow(compiler, as_text, pieces)


def test_the_answer_after_thinking_may_not_wait_in_whitespace(compiler: GrammarCompiler, tokenizer: Tokenizer) -> None:
    """A blank line or two between </think> and the call, not a budget's worth: a weak model at temperature 0
    wrote 1,000 tokens of whitespace there and never called (vLLM's named-tool test, over a random model)."""
    call = StructuredOutputsParams(json=CALL, wrap=("<tool_call>\n", "\n</tool_call>"), thinking="before")
    thought, body = (
        tokenizer.encode("<think>\nA call.\n</think>"),
        tokenizer.encode('<tool_call>\n{"name": "f"}\n</tool_call>'),
    )
    assert follow(compiler, call, thought + tokenizer.encode("\n\n") + body)
    assert not follow(compiler, call, thought + tokenizer.encode("\n" * 8) + body)
