"""llguidance against xgrammar, the two libraries issue 13 names, on the bundled model's tokenizer (49,152 tokens):
grammar compile time, the time to compute one token's mask while a valid output is fed token by token, and which
JSON Schema features each compiles. Runs in the peers' venv, which has both (xgrammar needs transformers and
triton, which tokenmill's own install does not):

    .venv/bin/python benchmarks/grammar_libraries.py --write-tokenizer /tmp/tok
    .venv-peers/bin/pip install xgrammar llguidance
    .venv-peers/bin/python benchmarks/grammar_libraries.py --tokenizer /tmp/tok

Prints one JSON line per library.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))  # plain data only, also in the peers' venv
from tokenmill.entrypoints.bench.schemas import TYPICAL_SCHEMA as SCHEMA  # noqa: E402

OUTPUT = json.dumps(
    {"name": "Ada", "age": 36, "role": "admin", "tags": ["math", "code"], "address": {"city": "London", "zip": "12345"}}
)
FEATURES = {  # JSON Schema features a response_format may use
    "anyOf": {"anyOf": [{"type": "string"}, {"type": "integer"}]},
    "oneOf": {"oneOf": [{"type": "string"}, {"type": "null"}]},
    "allOf": {"allOf": [{"type": "object", "properties": {"a": {"type": "string"}}}, {"required": ["a"]}]},
    "$ref/$defs": {"$defs": {"p": {"type": "string"}}, "type": "object", "properties": {"a": {"$ref": "#/$defs/p"}}},
    "recursive $ref": {
        "$defs": {"node": {"type": "object", "properties": {"next": {"$ref": "#/$defs/node"}}}},
        "$ref": "#/$defs/node",
    },
    "string pattern": {"type": "string", "pattern": "^[a-z]+-[0-9]{2}$"},
    "string format date-time": {"type": "string", "format": "date-time"},
    "minLength/maxLength": {"type": "string", "minLength": 2, "maxLength": 5},
    "number bounds": {"type": "number", "minimum": -1.5, "exclusiveMaximum": 10},
    "integer bounds": {"type": "integer", "minimum": 3, "maximum": 17},
    "const": {"const": "fixed"},
    "array prefixItems": {"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}]},
    "uniqueItems": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
    "patternProperties": {"type": "object", "patternProperties": {"^x-": {"type": "string"}}},
    "additionalProperties schema": {"type": "object", "additionalProperties": {"type": "integer"}},
    "multipleOf": {"type": "integer", "multipleOf": 5},
}


def write_tokenizer(folder: Path) -> None:
    from tokenmill.loader.gguf_file import GGUFFile
    from tokenmill.loader.model_path import bundled_model_path
    from tokenmill.tokenizer.gguf_tokenizer import Tokenizer

    folder.mkdir(parents=True, exist_ok=True)
    Tokenizer.from_gguf(GGUFFile(bundled_model_path())).backend.save(str(folder / "tokenizer.json"))


def summary(times_s: list[float]) -> dict:
    us = sorted(t * 1e6 for t in times_s)
    return {"median_us": round(statistics.median(us), 1), "p90_us": round(us[int(0.9 * (len(us) - 1))], 1)}


def bench_llguidance(tokenizer_json: str, output_ids: list[int], vocab: int) -> dict:
    import llguidance
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

    tok = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab, eos_token=2)
    start = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA)
    matcher = llguidance.LLMatcher(tok, grammar)
    compile_s = time.perf_counter() - start
    assert not matcher.is_error(), matcher.get_error()
    mask = allocate_token_bitmask(1, vocab)
    times = []
    for token in output_ids:
        t = time.perf_counter()
        fill_next_token_bitmask(matcher, mask)
        times.append(time.perf_counter() - t)
        assert (int(mask[0, token // 32]) >> (token % 32)) & 1, f"token {token} masked"
        assert matcher.consume_token(token), matcher.get_error()
    covered = []
    for name, schema in FEATURES.items():
        g = llguidance.LLMatcher.grammar_from_json_schema(schema)
        if not llguidance.LLMatcher.validate_grammar(g, tok):
            covered.append(name)
    return {"compile_ms": round(compile_s * 1e3, 2), "mask": summary(times), "features": covered}


def bench_xgrammar(folder: Path, output_ids: list[int], vocab: int) -> dict:
    import torch
    import transformers
    import xgrammar as xgr

    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), eos_token="<|im_end|>")
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab)
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    start = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    matcher = xgr.GrammarMatcher(compiled)
    compile_s = time.perf_counter() - start
    mask = xgr.allocate_token_bitmask(1, vocab)
    times = []
    for token in output_ids:
        t = time.perf_counter()
        matcher.fill_next_token_bitmask(mask)
        times.append(time.perf_counter() - t)
        assert (int(mask[0, token // 32]) >> (token % 32)) & 1, f"token {token} masked"
        assert matcher.accept_token(token)
    covered = []
    for name, schema in FEATURES.items():
        try:
            compiler.compile_json_schema(json.dumps(schema))
            covered.append(name)
        except Exception:  # noqa: BLE001 - xgrammar raises RuntimeError or its own errors
            pass
    del torch
    return {"compile_ms": round(compile_s * 1e3, 2), "mask": summary(times), "features": covered}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokenizer", type=Path, help="a folder with the bundled model's tokenizer.json")
    parser.add_argument("--write-tokenizer", type=Path, help="write that folder (tokenmill's venv) and exit")
    args = parser.parse_args()
    if args.write_tokenizer:
        write_tokenizer(args.write_tokenizer)
        return
    from tokenizers import Tokenizer

    text = (args.tokenizer / "tokenizer.json").read_text()
    backend = Tokenizer.from_str(text)
    vocab = backend.get_vocab_size(with_added_tokens=True)
    output_ids = backend.encode(OUTPUT, add_special_tokens=False).ids + [2]  # then EOS (<|im_end|>)
    llg = bench_llguidance(text, output_ids, vocab)
    print(json.dumps({"library": "llguidance", "tokens": len(output_ids), **llg}))
    xgr = bench_xgrammar(args.tokenizer, output_ids, vocab)
    print(json.dumps({"library": "xgrammar", "tokens": len(output_ids), **xgr}))
    print(json.dumps({"features_tested": list(FEATURES)}))


if __name__ == "__main__":
    main()
