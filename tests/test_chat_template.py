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
        ([{"role": "wizard", "content": "x"}], "role must be one of"),
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
