"""Regexes in constraints read as JSON Schema reads a `pattern` (ECMA-262's dialect), for a top-level regex and a
schema's patterns alike: `\\d` is [0-9] (not any Unicode digit), `\\w` [A-Za-z0-9_], `\\s` ECMA's white space,
`.` anything but a line terminator. The bundled model's tokenizer only: no model is loaded."""

import json

import pytest

from tokenmill.loader.gguf_file import GGUFFile
from tokenmill.loader.model_path import bundled_model_path
from tokenmill.structured.grammars import GrammarCompiler
from tokenmill.structured.params import StructuredOutputsParams
from tokenmill.tokenizer.gguf_tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_gguf(GGUFFile(bundled_model_path()))


@pytest.fixture(scope="module")
def compiler(tokenizer: Tokenizer):
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size)
    yield compiler
    compiler.close()


def takes(compiler: GrammarCompiler, tokenizer: Tokenizer, params: StructuredOutputsParams, text: str) -> bool:
    """Whether the constraint takes `text` (as the tokenizer writes it) and may end after it."""
    matcher = compiler.matcher(compiler.compile(params))
    return all(matcher.consume_token(t) for t in tokenizer.encode(text)) and matcher.is_accepting()


# (pattern, texts it takes, texts it refuses): the refused ones are taken by Rust's Unicode classes
CASES = [
    (r"\d{4}-\d{2}-\d{2}", ["2024-01-02"], ["🯸🯸🯸🯸-🯸🯸-🯸🯸", "২০২৪-০১-০২"]),
    (r"\w+", ["a_Z9"], ["Łódź", "日本"]),
    (r"\s", [" ", "\t", "\u00a0", "\u2000", "\ufeff", "\u2028"], ["\u0085"]),  # ECMA's set, not Unicode's
    (r"\D\W\S", ["১ৈx"], ["1ৈx"]),
    (r"[^\d]", ["১"], ["7"]),
    (r"a.b", ["a\u0085b", "a১b"], ["a\nb", "a\rb", "a\u2028b"]),  # '.' stops at every line terminator
    (r"[[]\]", ["[]"], []),  # '[' in a class is a literal, as in JavaScript
]


@pytest.mark.parametrize("pattern, taken, refused", CASES, ids=[c[0] for c in CASES])
def test_a_regex_is_read_as_json_schema_reads_it(
    compiler: GrammarCompiler, tokenizer: Tokenizer, pattern: str, taken: list[str], refused: list[str]
) -> None:
    regex = StructuredOutputsParams(regex=pattern)
    schema = StructuredOutputsParams(json={"type": "string", "pattern": f"^{pattern}$"})
    for text in taken:
        assert takes(compiler, tokenizer, regex, text), text
        assert takes(compiler, tokenizer, schema, json.dumps(text, ensure_ascii=False)), text
    for text in refused:
        assert not takes(compiler, tokenizer, regex, text), text
        assert not takes(compiler, tokenizer, schema, json.dumps(text, ensure_ascii=False)), text


def test_pattern_properties_and_nested_patterns_too(compiler: GrammarCompiler, tokenizer: Tokenizer) -> None:
    schema = {
        "type": "object",
        "patternProperties": {r"^\d+$": {"type": "array", "items": {"type": "string", "pattern": r"^\s$"}}},
        "additionalProperties": False,
    }
    params = StructuredOutputsParams(json=schema)
    assert takes(compiler, tokenizer, params, '{"12": ["\ufeff"]}')
    assert not takes(compiler, tokenizer, params, '{"১": [" "]}')
    assert not takes(compiler, tokenizer, params, '{"1": ["\u0085"]}')
    # a value the schema states is left as it is (a const's text is no pattern)
    const = StructuredOutputsParams(json={"const": {"pattern": r"\d"}})
    assert takes(compiler, tokenizer, const, '{"pattern": "\\\\d"}')
