"""Chat templates render as HF transformers renders them; models without one get the plain fallback."""

from pathlib import Path

import pytest

from tests.hf_loading import fast_gguf_reading
from tokenmill.errors import InvalidParameterError
from tokenmill.loader.gguf_file import GGUFFile
from tokenmill.tokenizer import ChatTemplate

CONVERSATIONS = [
    [{"role": "user", "content": "How do GPUs work?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}],
    [
        {"role": "user", "content": "Name a fruit."},
        {"role": "assistant", "content": "Apple."},
        {"role": "user", "content": "Another, in 日本語 please 🍎"},
    ],
]


@pytest.fixture(scope="module")
def smollm2_template(bundled_path: Path) -> ChatTemplate:
    f = GGUFFile(bundled_path)
    return ChatTemplate(f.get("tokenizer.chat_template"), "<|im_start|>", "<|im_end|>")


def test_reference_chat_prompts(smollm2_template: ChatTemplate, smollm2_reference: dict) -> None:
    for gen in smollm2_reference["generations"]:
        if gen["kind"] == "chat":
            text = smollm2_template.render([{"role": "user", "content": gen["prompt"]}], add_generation_prompt=True)
            assert text == gen["text"]


@pytest.mark.slow
def test_matches_hf_apply_chat_template(smollm2_template: ChatTemplate, bundled_path: Path) -> None:
    import transformers

    with fast_gguf_reading():
        hf = transformers.AutoTokenizer.from_pretrained(bundled_path.parent, gguf_file=bundled_path.name)
    for conversation in CONVERSATIONS:
        for add in (True, False):
            expected = hf.apply_chat_template(conversation, tokenize=False, add_generation_prompt=add)
            assert smollm2_template.render(conversation, add_generation_prompt=add) == expected


def test_content_parts_are_joined(smollm2_template: ChatTemplate) -> None:
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert "a\nb<|im_end|>" in smollm2_template.render(parts)


def test_fallback_when_the_model_has_none(gemma3_path: Path) -> None:
    template = ChatTemplate(GGUFFile(gemma3_path).get("tokenizer.chat_template"))
    assert template.is_fallback
    text = template.render(CONVERSATIONS[1], add_generation_prompt=True)
    assert text == "System: You are terse.\n\nUser: Hi\n\nAssistant:"


def test_hf_template_features() -> None:
    """bos_token, raise_exception, tojson and loop controls, as HF provides them."""
    source = (
        "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tools') }}"
        "{% endif %}{% if loop.index > 2 %}{% break %}{% endif %}{{ m['content'] | tojson }}\n{% endfor %}"
    )
    template = ChatTemplate(source, bos_token="<s>")
    msgs = [{"role": "user", "content": "é"}, {"role": "assistant", "content": "x"}, {"role": "user", "content": "z"}]
    assert template.render(msgs) == '<s>"é"\n"x"\n'
    with pytest.raises(InvalidParameterError, match="no tools"):
        template.render([{"role": "tool", "content": "r"}])


@pytest.mark.parametrize(
    "messages,match",
    [
        ([], "must not be empty"),
        (["hello"], "must be an object"),
        ([{"role": 5, "content": "x"}], "role must be a string"),
        ([{"role": "user", "content": 5}], "content must be a string"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], "content parts"),
    ],
)
def test_bad_messages(smollm2_template: ChatTemplate, messages: list, match: str) -> None:
    with pytest.raises(InvalidParameterError, match=match):
        smollm2_template.render(messages)


def test_template_syntax_error() -> None:
    with pytest.raises(InvalidParameterError, match="does not parse"):
        ChatTemplate("{% for m in messages %}")


# Llama 3.1's way with roles: ipython (a tool's output) is a role of its own; a role it does not know raises
LLAMA31_ROLES = (
    "{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant', 'ipython', 'tool'] %}"
    "{{ raise_exception('Unknown role: ' + m['role']) }}{% endif %}"
    "<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] | trim }}<|eot_id|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


def test_any_role_reaches_the_template(smollm2_template: ChatTemplate) -> None:
    """A role is any string: the template decides (SmolLM2's writes any role; Llama 3.1's takes ipython and raises
    for what it does not know, which is a 400 naming the template's reason)."""
    text = smollm2_template.render([{"role": "ipython", "content": "42"}], add_generation_prompt=False)
    assert text.endswith("<|im_start|>ipython\n42<|im_end|>\n")
    llama = ChatTemplate(LLAMA31_ROLES)
    text = llama.render([{"role": "user", "content": "6*7?"}, {"role": "ipython", "content": "42"}])
    assert "<|start_header_id|>ipython<|end_header_id|>\n\n42<|eot_id|>" in text
    with pytest.raises(InvalidParameterError, match="Unknown role: narrator") as refused:
        llama.render([{"role": "narrator", "content": "Once"}])
    assert refused.value.param == "messages"


def test_a_template_that_fails_on_a_message_is_a_parameter_error() -> None:
    """Not only raise_exception: a template that meets a message it was not written for (here, a field it adds to
    a string) is the request's problem, not the server's."""
    template = ChatTemplate("{% for m in messages %}{{ m['content'] + m['count'] }}{% endfor %}")
    with pytest.raises(InvalidParameterError, match="failed on the messages: TypeError"):
        template.render([{"role": "user", "content": "a", "count": 1}])


CONTINUED = [
    [{"role": "user", "content": "Tell me a saying."}, {"role": "assistant", "content": "An apple a day"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Sure, "}],  # its end trimmed or not
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": [{"type": "text", "text": "Well"}]}],
]


@pytest.mark.slow
def test_continue_final_message_matches_hf(smollm2_template: ChatTemplate, bundled_path: Path) -> None:
    """continue_final_message renders as transformers' apply_chat_template(continue_final_message=True): the text
    stops where the final message's content does, before the end of its turn; for a template that trims the
    content (Llama 3.1's `| trim`) it stops at the trimmed end."""
    import transformers

    with fast_gguf_reading():
        hf = transformers.AutoTokenizer.from_pretrained(bundled_path.parent, gguf_file=bundled_path.name)
    for conversation in CONTINUED:
        # content parts reach the template joined (as this template takes only strings)
        as_text = [{**m, "content": m["content"] if isinstance(m["content"], str) else "Well"} for m in conversation]
        expected = hf.apply_chat_template(
            as_text, tokenize=False, add_generation_prompt=False, continue_final_message=True
        )
        ours = smollm2_template.render(conversation, add_generation_prompt=False, continue_final_message=True)
        assert ours == expected
        assert not ours.endswith("<|im_end|>\n")
        llama = ChatTemplate(LLAMA31_ROLES)
        hf.chat_template = LLAMA31_ROLES
        expected = hf.apply_chat_template(
            as_text, tokenize=False, add_generation_prompt=False, continue_final_message=True
        )
        assert llama.render(conversation, add_generation_prompt=False, continue_final_message=True) == expected
        hf.chat_template = smollm2_template.source


def test_continue_final_message_refusals(smollm2_template: ChatTemplate) -> None:
    conversation = CONTINUED[0]
    with pytest.raises(InvalidParameterError, match="cannot both be true") as refused:
        smollm2_template.render(conversation, add_generation_prompt=True, continue_final_message=True)
    assert refused.value.param == "continue_final_message"
    hides = ChatTemplate("{% for m in messages %}{{ m['role'] }}{% endfor %}")  # writes no content at all
    with pytest.raises(InvalidParameterError, match="does not write the final message"):
        hides.render(conversation, add_generation_prompt=False, continue_final_message=True)


def test_firefunction_reads_the_tools_as_functions_and_the_date() -> None:
    """FireFunction v2's template (told by its " functools[" text, as llama.cpp tells it) reads the tools' JSON as
    `functions` and today's date as `datetime`; without tools `functions` is "" (it was undefined: a 400 for every
    request, llama.cpp's test_date_inside_prompt)."""
    import datetime
    import json

    template = ChatTemplate(
        "{{ 'prefix calls with functools[' }}{{ functions }}|Today is {{ datetime }}.|"
        "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    )
    today = datetime.date.today().strftime("%b %d %Y")
    ask = [{"role": "user", "content": "What is today?"}]
    assert template.render(ask) == f"prefix calls with functools[|Today is {today}.|What is today?"
    tools = [{"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}]
    assert json.dumps(tools, indent=2) in template.render(ask, tools=tools)
    # a template without the mark gets no `functions` of the server's
    plain = ChatTemplate("{{ functions is defined }}")
    assert plain.render(ask, tools=tools) == "False"
