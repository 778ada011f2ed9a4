"""Constraints compiled by llguidance into matchers that give each step's allowed tokens.

llguidance rather than xgrammar (benchmarks/grammar_libraries.py, benchmarks/README.md "Structured output"): on the
bundled tokenizer it compiles a typical schema in about 1 ms against 5-7, computes a token's mask in 13 us
(median; xgrammar 2-3 us), both far under a decode step's 5 ms, covers the same JSON Schema features but
`uniqueItems` (which it refuses, where xgrammar accepts it without enforcing it), and installs as one 3 MB wheel
with no dependencies, where xgrammar brings transformers and triton into the serving install.

JSON is generated compact, with json.dumps's separators (", " and ": ") and no other whitespace: a small model
at temperature 1 left free whitespace can spend its whole budget on newlines.
"""

import copy
import json
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

import llguidance
import numpy as np
import torch
from llguidance.gbnf_to_lark import any_to_lark

from tokenmill.errors import ConstraintError
from tokenmill.structured.ecma_regex import ecma_schema, ecma_to_rust
from tokenmill.structured.params import StructuredOutputsParams
from tokenmill.tokenizer.gguf_tokenizer import Tokenizer

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CACHE_SIZE = 256  # compiled constraints kept, failures included (a 30,000-option choice's matcher: about 11 MB)
DEFAULT_MAX_CONSTRAINT_BYTES = 1024 * 1024  # a constraint's text (schema, regex, grammar, choices) above this: 400
DEFAULT_MAX_COMPILE_SECONDS = 10.0  # a compile that takes longer is refused (and the refusal cached)
COMPILE_THREADS = 2  # compiles in flight at once; more wait (their wait counts against the time bound)
PROBE_TOKENS = 8  # tokens of a dry run at compile time: limits the matcher hits on its first steps show there
# llguidance's own limits (its defaults), without the parser state in error messages (they reach clients)
PARSER_LIMITS = llguidance.LLParserLimits(verbose_errors=False)


def grammar_source(params: StructuredOutputsParams) -> str:
    """The constraint as an llguidance grammar (not yet checked). With `thinking` or `wrap`, the constraint is the
    second of two grammars, referred to (@answer) by a first that lets the thinking come before it (its text free
    until the tag that ends it: a lexeme with a stop string) and writes the wrapping text around it. Harmony's
    markers (<|channel|>, ...) are written as special tokens where the tokenizer has them so (`special_markers`),
    else as text."""
    answer = _answer_source(params)
    if params.thinking is None and params.wrap is None:
        return answer
    entry = json.loads(answer)["grammars"][0] if answer.lstrip().startswith("{") else {"lark_grammar": answer}
    entry["name"] = "answer"
    before, after = (_lark_text(w, params.special_markers) for w in params.wrap or ("", ""))
    opening = _lark_text("<|channel|>analysis<|message|>", params.special_markers)
    closing = _lark_text("<|start|>assistant", params.special_markers)
    end = _lark_text("<|end|>", params.special_markers)
    think = {
        "before": '("<think>" think WS)?',
        "thinking": "think WS",
        "harmony": f"({opening} analysis {closing})?",
    }.get(params.thinking or "", "")
    lark = f"start: {think} {before} @answer {after}\n"
    if params.thinking in ("before", "thinking"):
        # a blank line or two between the thinking and the answer, not more: left free, a weak model at
        # temperature 0 spends its whole budget on whitespace there (seen: 1,000 tokens of it before a call)
        lark += 'think[stop="</think>"]: /(.|\\n)*/\nWS: /[ \\t\\r\\n]{0,4}/\n'
    elif params.thinking == "harmony":  # the analysis message's text, free until <|end|> (which it consumes)
        lark += f"analysis[stop={end}]: /(.|\\n)*/\n"
    return json.dumps({"grammars": [{"name": "main", "lark_grammar": lark}, entry]})


_MARKER = re.compile(r"(<\|[a-z_]+\|>)")


def _lark_text(text: str, special_markers: bool) -> str:
    """`text` as Lark items: string literals, and harmony's markers bare (special tokens) when `special_markers`."""
    items = []
    for piece in _MARKER.split(text):
        if piece:
            items.append(piece if special_markers and _MARKER.fullmatch(piece) else json.dumps(piece))
    return " ".join(items)


def _answer_source(params: StructuredOutputsParams) -> str:
    kind = params.kind
    if kind == "json":  # its patterns in JSON Schema's regex dialect (ecma_regex.py)
        schema = json.loads(params.json) if isinstance(params.json, str) else params.json
        return llguidance.LLMatcher.grammar_from_json_schema(ecma_schema(schema), overrides=JSON_OPTIONS)
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)
    if kind == "regex":  # JSON Schema's dialect too: \d is [0-9], as users of a `pattern` expect
        return llguidance.LLMatcher.grammar_from_regex(ecma_to_rust(params.regex or ""))
    if kind == "choice":
        return _choice_grammar(params.choice)
    return llguidance.LLMatcher.grammar_from_lark(any_to_lark(params.grammar or ""))  # GBNF too, as llama.cpp's


def _choice_grammar(choices: list[str]) -> str:
    """One of the strings, exactly (Lark string literals are JSON's). One lexeme (an uppercase terminal) for all of
    them: the lexer follows the alternatives together, where one grammar rule per option puts them all in one
    parser row, which llguidance caps at 2,000 items (a 2,500-option choice failed after its first token)."""
    return llguidance.LLMatcher.grammar_from_lark(
        "start: CHOICE\nCHOICE: " + " | ".join(json.dumps(c) for c in choices)
    )


def clean_reason(text: str) -> str:
    """llguidance's reason without what only its developers read: a Rust panic's "panic:" and backtrace, the
    parser-state dump, the "<non-verbose/>" marker."""
    for marker in ("<backtrace>", "<state>", "<non-verbose/>"):
        text = text.split(marker, 1)[0]
    text = text.strip()
    if text.startswith("panic:"):
        text = text.removeprefix("panic:").strip()
        if "grammar.symbols.len()" in text:  # llguidance numbers a grammar's symbols with 16 bits
            return "it needs more grammar symbols than llguidance can number (about 65,000)"
        return f"llguidance failed an internal check ({text.splitlines()[0] if text else 'no reason given'})"
    if text == "NoExtensionBias":  # the parser cannot go on from where it is
        return "no output can satisfy it (nothing may come next; e.g. an empty character class or a $ref cycle)"
    text = " ".join(text.split())
    if "Current row has" in text:
        text += " (llguidance's limit of items in a parser row)"
    return text


@dataclass
class CompiledConstraint:
    """A constraint that compiled and was followed for a few tokens: its grammar, and a matcher at its start that
    each sequence's matcher is copied from (a copy costs microseconds; compiling again would cost the compile)."""

    grammar: str
    start: llguidance.LLMatcher


class _TokensAsText:
    """The tokenizer as llguidance's TokenizerWrapper reads it: each id's exact bytes, the control tokens as the
    special ones, and text -> ids with control tokens written in the text kept as text.

    Given the tokenizer's JSON instead, llguidance takes every added token that looks like <...> for a special
    one, whatever its `special` flag says; Qwen3's <think> and <tool_call> are added tokens that are text
    (user-defined in GGUF, special: false in HF), which the model writes in its reply and a grammar must be able
    to match as text: read as special, a tool call's grammar could not end (llguidance: "token [id] doesn't
    satisfy the grammar")."""

    def __init__(self, tokenizer: Tokenizer):
        added = tokenizer.backend.get_added_tokens_decoder()
        self.eos_token_id = tokenizer.eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        self.tokens = [tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
        self.special_token_ids = sorted(i for i, token in added.items() if token.special)
        self._text = copy.copy(tokenizer.backend)
        self._text.encode_special_tokens = True  # "<|im_end|>" in a grammar's text is text, as the model's bytes

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):  # llguidance probes with bytes: it then passes whole strings only
            raise TypeError("text only")
        return self._text.encode(text, add_special_tokens=False).ids


def llguidance_tokenizer(tokenizer: Tokenizer, vocab_size: int, stop: list[int]) -> llguidance.LLTokenizer:
    """The tokenizer as llguidance sees it (_TokensAsText), over the model's vocabulary (rows past the
    tokenizer's, if any, are tokens no grammar allows); `stop`: the tokens that may end a constrained output."""
    wrapper = llguidance.TokenizerWrapper(_TokensAsText(tokenizer))
    return llguidance.LLTokenizer(wrapper, n_vocab=vocab_size, eos_token=stop if stop else None)


@dataclass
class _Entry:
    future: "Future[CompiledConstraint]"
    deadline: float  # time.monotonic() by which the compile must be done


class GrammarCompiler:
    """One per engine: the tokenizer as llguidance sees it, and the compiled constraints by their cache key.

    A constraint is compiled in a thread of this compiler's own (llguidance drops the GIL while it builds a
    grammar), at most `max_compile_seconds` waited for, and its outcome, a refusal included, kept by constraint, so
    a constraint that fails or times out costs its compile once, not once per request."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        max_constraint_bytes: int = DEFAULT_MAX_CONSTRAINT_BYTES,
        max_compile_seconds: float = DEFAULT_MAX_COMPILE_SECONDS,
    ):
        # every token that ends generation may end a constrained output, where the grammar allows it to end
        stop = sorted(tokenizer.stop_token_ids)
        self.tokenizer = llguidance_tokenizer(tokenizer, vocab_size, stop)
        self.stop_token_ids = frozenset(stop)
        self.vocab_size = vocab_size
        self.max_constraint_bytes = max_constraint_bytes
        self.max_compile_seconds = max_compile_seconds
        self._cache: OrderedDict[tuple[str, str], _Entry] = OrderedDict()
        self._lock = threading.Lock()  # the server validates requests from several threads
        self._pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="tokenmill-constraint")
        self.executor = llguidance.LLExecutor()
        self.num_compiles = 0  # compiles started (cache misses), for tests and stats

    def compile(self, params: StructuredOutputsParams) -> CompiledConstraint:
        """The constraint compiled and checked to be followable, once per distinct constraint; ConstraintError
        (a 400) when it cannot be, with llguidance's reason or the limit it is over. Waits at most
        max_compile_seconds (a compile that takes longer goes on in its thread and is refused from then on)."""
        key = params.cache_key()
        size = len(key[1].encode("utf-8", "surrogatepass"))
        if size > self.max_constraint_bytes:  # before compiling: llguidance's work grows with the grammar
            raise ConstraintError(
                f"the {params.kind} constraint is {size:,} bytes; this engine compiles constraints of at most "
                f"{self.max_constraint_bytes:,} bytes (max_constraint_bytes)",
                params.source,
            )
        with self._lock:
            entry = self._cache.get(key)
            if entry is not None:
                self._cache.move_to_end(key)
            else:
                entry = _Entry(self._pool.submit(self._compile, params), time.monotonic() + self.max_compile_seconds)
                self.num_compiles += 1
                self._cache[key] = entry
                while len(self._cache) > CACHE_SIZE:
                    self._cache.popitem(last=False)
        try:
            return entry.future.result(timeout=max(0.0, entry.deadline - time.monotonic()))
        except FutureTimeout:
            error = ConstraintError(
                f"the {params.kind} constraint took more than {self.max_compile_seconds:g} s to compile "
                "(max_constraint_compile_seconds)",
                params.source,
            )
            failed: Future[CompiledConstraint] = Future()
            failed.set_exception(error)
            with self._lock:  # later requests with this constraint are refused at once
                if self._cache.get(key) is entry:
                    self._cache[key] = _Entry(failed, entry.deadline)
            raise error from None
        except ConstraintError as exc:
            # the cached exception keeps its traceback; each request gets a fresh error with the same message
            raise ConstraintError(str(exc), params.source) from None

    def _compile(self, params: StructuredOutputsParams) -> CompiledConstraint:
        """Runs in the compiler's thread: the grammar, its matcher, and a dry run of its first tokens."""
        try:
            grammar = grammar_source(params)
        except BaseException as exc:  # noqa: BLE001 - the converters' own errors, a Rust panic (a BaseException)
            raise ConstraintError(
                f"the {params.kind} constraint cannot be compiled: {clean_reason(str(exc))}", params.source
            ) from None
        start = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=PARSER_LIMITS)
        if start.is_error():
            raise ConstraintError(
                f"the {params.kind} constraint cannot be compiled: {clean_reason(start.get_error())}", params.source
            )
        self._probe(start.deep_copy(), params)
        return CompiledConstraint(grammar, start)

    def _probe(self, matcher: llguidance.LLMatcher, params: StructuredOutputsParams) -> None:
        """Follow the constraint for up to PROBE_TOKENS tokens (each time the allowed token of the highest id that
        does not end the output): llguidance reports most limits (a parser row of too many items, a lexer of too
        many states, nothing allowed) only once it computes masks and consumes tokens, and would then fail in the
        middle of a request."""
        for _ in range(PROBE_TOKENS):
            bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
            allowed = np.flatnonzero(bits[: self.vocab_size])
            if matcher.is_error():
                break
            if allowed.size == 0:
                raise ConstraintError(
                    f"the {params.kind} constraint cannot be followed: it allows no token", params.source
                )
            words = [int(t) for t in allowed[::-1] if int(t) not in self.stop_token_ids]
            if not words:
                return  # only the end may come: the constraint is complete
            matcher.consume_token(words[0])
            if matcher.is_error() or matcher.is_stopped():
                break
        if matcher.is_error():
            raise ConstraintError(
                f"the {params.kind} constraint cannot be followed: {clean_reason(matcher.get_error())}", params.source
            )

    def matcher(self, compiled: CompiledConstraint) -> llguidance.LLMatcher:
        """A fresh matcher at the start of a compiled constraint (one per sequence)."""
        return compiled.start.deep_copy()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

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
