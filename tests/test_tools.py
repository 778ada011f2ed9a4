"""Tool calls' plumbing without a model: checking tools and tool_choice, how tools reach a chat template that
takes them and one that does not, and reading calls back from a reply."""

import json

import pytest

from tokenmill.errors import InvalidParameterError
from tokenmill.structured import tools
from tokenmill.tokenizer.chat_template import ChatTemplate

ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two numbers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}},
    },
}
FUNCTIONS = tools.check_tools([ADD, {"type": "function", "function": {"name": "now"}}])
TOOL_TEMPLATE = (  # a template that renders tools itself (Hermes-style)
    "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>\n{% endif %}"
    "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
)


def test_tools_and_tool_choice_are_checked() -> None:
    assert [f["name"] for f in FUNCTIONS] == ["add", "now"]
    assert FUNCTIONS[1]["parameters"] == {"type": "object", "properties": {}}
    assert tools.chosen_functions(FUNCTIONS, None)[0] == "auto"
    assert tools.chosen_functions(FUNCTIONS, "none") == ("none", [])
    assert tools.chosen_functions(FUNCTIONS, {"type": "function", "function": {"name": "now"}}) == (
        "required",
        [FUNCTIONS[1]],
    )
    for bad, message in [
        ([{"type": "retrieval"}], "type"),
        ([{"type": "function", "function": {"name": "a b"}}], "letters"),
        ([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}], "object"),
        ([], "non-empty"),
    ]:
        with pytest.raises(InvalidParameterError, match=message):
            tools.check_tools(bad)
    with pytest.raises(InvalidParameterError, match="not in tools"):
        tools.chosen_functions(FUNCTIONS, {"type": "function", "function": {"name": "missing"}})


def test_a_template_that_takes_tools_renders_them_and_others_get_a_system_message() -> None:
    messages = [{"role": "user", "content": "1+2?"}]
    template = ChatTemplate(TOOL_TEMPLATE)
    assert template.takes_tools
    shown = tools.template_messages(messages, FUNCTIONS, template.takes_tools)
    assert template.render(shown, tools=[{"type": "function", "function": f} for f in FUNCTIONS]).startswith(
        "<tools>add;now;</tools>"
    )
    plain = ChatTemplate("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}")
    assert not plain.takes_tools
    shown = tools.template_messages([{"role": "system", "content": "Be brief."}, *messages], FUNCTIONS, False)
    assert (
        shown[0]["content"].startswith("Be brief.\n\nYou can call functions") and '"name": "add"' in shown[0]["content"]
    )
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
    history = [
        *messages,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "3"},
    ]
    text = plain.render(tools.template_messages(history, FUNCTIONS, False))
    assert '[assistant] {"name": "add", "arguments": {"a": 1, "b": 2}}' in text and "[tool] 3" in text


@pytest.mark.parametrize(
    "reply, expected",
    [
        ('{"name": "add", "arguments": {"a": 1, "b": 2}}', [("add", {"a": 1, "b": 2})]),
        ('<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>', [("now", {})]),
        (
            '[{"name": "now", "arguments": {}}, {"name": "add", "parameters": {"a": 1}}]',
            [("now", {}), ("add", {"a": 1})],
        ),
        ('{"name": "other", "arguments": {}}', None),
        ("The answer is 3.", None),
        ('{"name": "add", "arguments": "1, 2"}', None),
        ('Sure! {"name": "now", "arguments": {}}', None),
    ],
)
def test_calls_are_read_back_from_replies(reply: str, expected) -> None:
    calls = tools.parse_tool_calls(reply, FUNCTIONS)
    if expected is None:
        assert calls is None
    else:
        assert [(c.name, json.loads(c.arguments)) for c in calls] == expected
        assert len({c.id for c in calls}) == len(calls) and all(c.id.startswith("call_") for c in calls)


def test_streaming_holds_text_back_only_while_it_may_be_a_call() -> None:
    """The reply parser for tokenmill's constrained calls (tokenmill/parsers) as a reply starts to stream."""
    from tokenmill.parsers.reply import ReplyFormat, ReplyParser

    def shown(start: str) -> str:
        return ReplyParser(ReplyFormat("", "constrained"), "", FUNCTIONS).feed(start).text

    assert all(shown(t) == "" for t in ["", "  ", '{"na', "[", "<tool", "<tool_call>\n{"])
    assert all(shown(t) == t for t in ["The", " Sure", "<b>"])


def test_call_schema_hoists_each_functions_definitions() -> None:
    """Parameters with local references keep them resolvable inside the call schema (each function's under its
    own names); parameters without any stay inline, as they were."""
    import jsonschema

    node = {
        "$defs": {
            "Node": {"type": "object", "properties": {"v": {"type": "integer"}, "next": {"$ref": "#/$defs/Node"}}}
        },
        "type": "object",
        "properties": {"head": {"$ref": "#/$defs/Node"}, "copy": {"$ref": "#/properties/head"}},
        "required": ["head"],
    }
    other = {"$defs": {"Node": {"type": "string"}}, "type": "object", "properties": {"n": {"$ref": "#/$defs/Node"}}}
    functions = tools.check_tools(
        [
            {"type": "function", "function": {"name": "walk", "parameters": node}},
            {"type": "function", "function": {"name": "tag", "parameters": other}},
            ADD,
        ]
    )
    schema = tools.call_schema(functions)
    jsonschema.validate({"name": "walk", "arguments": {"head": {"v": 1, "next": {"v": 2}}, "copy": {"v": 3}}}, schema)
    jsonschema.validate({"name": "tag", "arguments": {"n": "x"}}, schema)
    for bad in (
        {"name": "walk", "arguments": {"head": {"v": 1, "next": {"v": "two"}}}},
        {"name": "tag", "arguments": {"n": 5}},  # its own Node, not walk's
    ):
        try:
            jsonschema.validate(bad, schema)
        except jsonschema.ValidationError:
            continue
        raise AssertionError(f"accepted {bad}")
    plain = tools.call_schema([functions[2]])
    closed = {**functions[2]["parameters"], "additionalProperties": False}  # closed_objects: declared keys only
    assert "$defs" not in plain and plain["properties"]["arguments"] == closed


def test_a_calls_objects_take_only_their_declared_properties() -> None:
    """As OpenAI's strict mode reads a tool's parameters: LangChain's nested pydantic models (an Address under
    book_hotel, through $defs) get no invented keys; an object that allows more keeps what it says."""
    import jsonschema

    book_hotel = {
        "$defs": {
            "Address": {
                "type": "object",
                "properties": {"street": {"type": "string"}, "city": {"type": "string"}},
                "required": ["street", "city"],
            }
        },
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "address": {"$ref": "#/$defs/Address"},
            "guests": {"type": "array", "items": {"type": "object", "properties": {"age": {"type": "integer"}}}},
            "notes": {"type": "object", "additionalProperties": {"type": "string"}},
        },
        "required": ["name", "address"],
    }
    (function,) = tools.check_tools(
        [{"type": "function", "function": {"name": "book_hotel", "parameters": book_hotel}}]
    )
    schema = tools.call_schema([function])
    good = {"name": "X", "address": {"street": "1 Rue", "city": "Paris"}, "guests": [{"age": 3}], "notes": {"a": "b"}}
    jsonschema.validate({"name": "book_hotel", "arguments": good}, schema)
    for extra in (
        {**good, "id": 7},
        {**good, "address": {**good["address"], "tags": []}},
        {**good, "guests": [{"age": 3, "date": "x"}]},
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate({"name": "book_hotel", "arguments": extra}, schema)
    assert function["parameters"] == book_hotel  # the request's own schema is left as it was
