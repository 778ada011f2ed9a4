"""Constraints compiled by llguidance into matchers that give each step's allowed tokens.

llguidance rather than xgrammar (benchmarks/grammar_libraries.py, benchmarks/README.md "Structured output"): on the
bundled tokenizer it compiles a typical schema in about 1 ms against 5-7, computes a token's mask in 13 us
(median; xgrammar 2-3 us), both far under a decode step's 5 ms, covers the same JSON Schema features but
`uniqueItems` (which it refuses, where xgrammar accepts it without enforcing it), and installs as one 3 MB wheel
with no dependencies, where xgrammar brings transformers and triton into the serving install.

JSON is generated compact, with json.dumps's separators (", " and ": ") and no other whitespace: a small model
at temperature 1 left free whitespace can spend its whole budget on newlines.
"""

import json
import threading
from collections import OrderedDict

import llguidance
import numpy as np
import torch
from llguidance.gbnf_to_lark import any_to_lark

from tokenmill.errors import InvalidParameterError
from tokenmill.structured.params import StructuredOutputsParams
from tokenmill.tokenizer.gguf_tokenizer import Tokenizer

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CACHE_SIZE = 256  # compiled constraints kept (each a few KB to a few MB)


def grammar_source(params: StructuredOutputsParams) -> str:
    """The constraint as an llguidance grammar (not yet checked)."""
    kind = params.kind
    if kind == "json":
        return llguidance.LLMatcher.grammar_from_json_schema(params.json, overrides=JSON_OPTIONS)
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(params.regex)
    if kind == "choice":
        return _choice_grammar(params.choice)
    return llguidance.LLMatcher.grammar_from_lark(any_to_lark(params.grammar or ""))  # GBNF too, as llama.cpp's


def _choice_grammar(choices: list[str]) -> str:
    """One of the strings, exactly (Lark string literals are JSON's)."""
    return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))


class GrammarCompiler:
    """One per engine: the tokenizer as llguidance sees it, and the compiled constraints by their cache key."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int):
        # every token that ends generation may end a constrained output, where the grammar allows it to end
        stop = sorted(tokenizer.stop_token_ids)
        self.tokenizer = llguidance.LLTokenizer(
            tokenizer.backend.to_str(), n_vocab=vocab_size, eos_token=stop if stop else None
        )
        self.vocab_size = vocab_size
        self._cache: OrderedDict[tuple[str, str], str] = OrderedDict()
        self._lock = threading.Lock()  # the server validates requests from several threads
        self.executor = llguidance.LLExecutor()

    def compile(self, params: StructuredOutputsParams) -> str:
        """The checked grammar of a constraint, compiled once per distinct constraint; InvalidParameterError (400)
        when it cannot be compiled, with llguidance's reason."""
        key = params.cache_key()
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        try:
            grammar = grammar_source(params)
        except Exception as exc:  # noqa: BLE001 - the GBNF converter raises its own parse errors
            message = f"the {params.kind} constraint cannot be compiled: {exc}"
            raise InvalidParameterError(message, params.source) from exc
        error = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise InvalidParameterError(f"the {params.kind} constraint cannot be compiled: {error}", params.source)
        with self._lock:
            self._cache[key] = grammar
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return grammar

    def matcher(self, grammar: str) -> llguidance.LLMatcher:
        """A fresh matcher at the start of a compiled grammar (one per sequence)."""
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise InvalidParameterError(
                f"the constraint cannot be compiled: {matcher.get_error()}", "structured_outputs"
            )
        return matcher

    def allowed(self, matchers: list[llguidance.LLMatcher]) -> torch.Tensor:
        """bool [len(matchers), vocab_size]: the tokens each matcher allows next. numpy only: it runs in a thread
        beside the forward pass, where a torch operation would start a second OpenMP team of threads that
        spins against the forward's on a machine with few cores."""
        words = (self.vocab_size + 31) // 32
        bitmask = np.full((len(matchers), words), -1, dtype=np.int32)  # bit t of word w: token 32 w + t
        self.executor.unsafe_compute_mask_ptr(
            [(m, i) for i, m in enumerate(matchers)], bitmask.ctypes.data, words * 4, len(matchers)
        )
        bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, : self.vocab_size]  # [R, V]
        return torch.from_numpy(bits.view(np.bool_))
