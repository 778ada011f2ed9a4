"""Structured outputs with the bundled model: sampled outputs (temperature 1, many seeds) under JSON schemas, a
regex, a choice and a grammar always parse and validate when they end by stopping; constrained and free
requests share batches without changing the free ones' tokens; what cannot compile is refused."""

import json
import re

import jsonschema
import pytest

from tests.test_engine import token_lists
from tokenmill import LLM, SamplingParams, StructuredOutputsParams
from tokenmill.errors import InvalidParameterError

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 30},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}
SCORES = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {"team": {"enum": ["red", "blue"]}, "points": {"type": "integer", "minimum": 0, "maximum": 10}},
        "required": ["team", "points"],
        "additionalProperties": False,
    },
    "minItems": 2,
    "maxItems": 4,
}
SEEDS = range(8)


def chat_batch(llm: LLM, content: str, constraint: StructuredOutputsParams, max_tokens: int = 120) -> list:
    messages = [{"role": "user", "content": content}]
    params = [
        SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens, structured_outputs=constraint)
        for seed in SEEDS
    ]
    return [o.outputs[0] for o in llm.chat([messages] * len(params), params, use_tqdm=False)]


@pytest.mark.slow
@pytest.mark.parametrize("schema", [PERSON, SCORES], ids=["nested-object", "array-of-objects"])
def test_sampled_json_always_validates(llm: LLM, schema: dict) -> None:
    prompt = "Reply with JSON describing a person or some scores."
    outputs = chat_batch(llm, prompt, StructuredOutputsParams(json=schema))
    stopped = [o for o in outputs if o.finish_reason == "stop"]
    assert len(stopped) >= len(outputs) // 2  # most end within the budget (measured: all 16 of 16 seeds)
    for o in stopped:
        jsonschema.validate(json.loads(o.text), schema)


@pytest.mark.slow
def test_json_object_regex_choice_and_grammar(llm: LLM) -> None:
    for o in chat_batch(llm, "Give me a JSON object.", StructuredOutputsParams(json_object=True), 40):
        if o.finish_reason == "stop":
            assert isinstance(json.loads(o.text), dict)
    phone = r"\(\d{3}\) \d{3}-\d{4}"
    for o in chat_batch(llm, "A phone number?", StructuredOutputsParams(regex=phone), 30):
        assert o.finish_reason == "stop" and re.fullmatch(phone, o.text)
    choices = ["positive", "negative", "neutral"]
    for o in chat_batch(llm, "Sentiment of 'great movie'?", StructuredOutputsParams(choice=choices), 10):
        assert o.finish_reason == "stop" and o.text in choices
    gbnf = 'root ::= "The answer is " [0-9]+ "."'  # llama.cpp's GBNF; Lark grammars are taken as they are
    for o in chat_batch(llm, "2+2?", StructuredOutputsParams(grammar=gbnf), 20):
        if o.finish_reason == "stop":
            assert re.fullmatch(r"The answer is [0-9]+\.", o.text)


def test_free_requests_keep_their_tokens_beside_constrained_ones(llm: LLM) -> None:
    free = [{"prompt_token_ids": list(range(1000 + 40 * i, 1030 + 40 * i))} for i in range(3)]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = token_lists(llm.generate(free, greedy, use_tqdm=False))
    constrained = SamplingParams(temperature=1.0, seed=3, max_tokens=12, structured_outputs={"json": SCORES})
    mixed = llm.generate(free + ["Scores:"] * 3, [greedy] * 3 + [constrained] * 3, use_tqdm=False)
    assert token_lists(mixed[:3]) == alone


def test_n_samples_each_follow_the_constraint(llm: LLM) -> None:
    params = SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=10, structured_outputs={"choice": ["A", "BB"]})
    out = llm.generate("Pick:", params, use_tqdm=False)[0]
    assert len(out.outputs) == 4 and all(o.text in ("A", "BB") and o.finish_reason == "stop" for o in out.outputs)


@pytest.mark.parametrize(
    "constraint, message",
    [
        ({"json": {"type": "integer", "minimum": 5, "maximum": 2}}, "minimum .5. is greater than maximum .2."),
        ({"json": {"type": "array", "uniqueItems": True}}, "uniqueItems"),
        ({"json": "{not json"}, "not valid JSON"),
        ({"regex": "[0-9"}, "unclosed character class"),
        ({"grammar": "start: undefined_rule"}, "unknown name"),
        ({"choice": []}, "non-empty list"),
        ({"json": {"type": "object"}, "regex": "a"}, "exactly one of"),
    ],
)
def test_what_cannot_compile_is_refused_and_nothing_else_is_disturbed(llm: LLM, constraint, message) -> None:
    with pytest.raises(InvalidParameterError, match=message):
        llm.engine.add_request(None, "Hi", SamplingParams(max_tokens=4, structured_outputs=constraint))
    assert not llm.engine.has_unfinished_requests()
    assert llm.generate("Hi", SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0].outputs[0].token_ids


def test_each_distinct_constraint_compiles_once(llm: LLM) -> None:
    grammars = llm.engine.grammars
    first = grammars.compile(StructuredOutputsParams(json=SCORES))
    reordered = json.loads(json.dumps(SCORES), object_pairs_hook=lambda pairs: dict(reversed(pairs)))
    assert grammars.compile(StructuredOutputsParams(json=json.dumps(reordered))) is first
