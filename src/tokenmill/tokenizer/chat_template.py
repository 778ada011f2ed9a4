"""Chat templates (`tokenizer.chat_template`) rendered with jinja2 the way HF transformers renders them.

Same environment as HF: sandboxed, `trim_blocks` and `lstrip_blocks`, the `loopcontrols` extension, a `tojson`
filter that keeps non-ASCII text, and `raise_exception` / `strftime_now` globals. A model without a template
gets its architecture's (BUILTIN_TEMPLATES: Gemma's turns), else a plain "Role: text" layout.
"""

import json
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tokenmill.errors import InvalidParameterError

FALLBACK_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] | capitalize }}: {{ message['content'] }}\n\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)
# appended to the final message's content to find where it ends in the rendered text (continue_final_message), as
# transformers does
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
# FireFunction v2's template (which llama.cpp tells by this text) reads the tools as `functions`: their JSON, indented
# by 2 ("" without tools), as llama.cpp passes it
FIREFUNCTION_MARK = " functools["

# Gemma's turn format, for Gemma GGUF files that carry no template (as Google's template renders text: a system
# message goes before the first user turn, the assistant is "model", turns alternate)
GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'system' %}"
    "{% set prefix = messages[0]['content'] + '\n\n' %}{% set turns = messages[1:] %}"
    "{% else %}{% set prefix = '' %}{% set turns = messages %}{% endif %}"
    "{% for message in turns %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\n' }}"
    "{{ (prefix if loop.first else '') + message['content'] | trim }}{{ '<end_of_turn>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
# the template of an architecture whose GGUF files may have none
BUILTIN_TEMPLATES = {"gemma3": GEMMA_TEMPLATE}


def base_model_note(model_name: str, builtin: bool) -> str:
    """What to tell a user who chats with a model whose file has no chat template (a base model, as a rule: one
    trained to continue text, such as Gemma 3 270M; instruction-tuned files carry the template they were tuned
    with). `builtin`: its architecture's turn format is used instead of the plain "Role: text" layout."""
    layout = "its architecture's turn format" if builtin else 'a plain "Role: text" layout'
    return (
        f"{model_name} has no chat template in its file, so it is most likely a base model, trained to continue "
        f"text rather than to answer: chat replies (which use {layout}) may be nonsense. Give it text to continue "
        "instead: `tokenmill generate --raw`, or /v1/completions"
    )


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatTemplate:
    def __init__(self, source: str | None, bos_token: str = "", eos_token: str = ""):
        self.is_fallback = not source
        self.source = source or FALLBACK_TEMPLATE
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(self.source)
        except jinja2.TemplateSyntaxError as exc:
            raise InvalidParameterError(f"the chat template does not parse: {exc}", "chat_template") from exc
        self.bos_token = bos_token
        self.eos_token = eos_token
        # whether the template renders a `tools` list itself (else the server describes tools in a system message)
        self.takes_tools = "tools" in self.source

    def render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        **extra: Any,
    ) -> str:
        """Messages ({"role", "content"}) -> prompt text. Content may be a string or a list of text parts; a role is
        any string (the template decides what it takes: Llama 3.1's ipython, a tool's result, ...; one that raises
        for a message is a 400 with its reason). `continue_final_message`: the text ends where the final message's
        content ends (without what the template writes after it, such as the end of the turn), for the model to
        go on with it, as transformers' apply_chat_template(continue_final_message=True) renders it."""
        normalized = [_normalize_message(m, i) for i, m in enumerate(messages)]
        if not normalized:
            raise InvalidParameterError("messages must not be empty", "messages")
        if continue_final_message:
            if add_generation_prompt:
                raise InvalidParameterError(
                    "continue_final_message and add_generation_prompt cannot both be true: the final message is "
                    "continued, no new turn started (send add_generation_prompt: false)",
                    "continue_final_message",
                )
            final = normalized[-1]["content"]
            normalized[-1] = {**normalized[-1], "content": final + CONTINUE_TAG}
        text = self._render(normalized, add_generation_prompt, **extra)
        if not continue_final_message:
            return text
        at = text.rfind(CONTINUE_TAG.strip())
        if at < 0 or final.strip() not in text:
            raise InvalidParameterError(
                "continue_final_message: the chat template does not write the final message's content as sent, so "
                "it cannot be continued",
                "continue_final_message",
            )
        # where the template trimmed the content's end (and so the tag's trailing space), the end is trimmed too
        return text[:at] if text[at : at + len(CONTINUE_TAG)] == CONTINUE_TAG else text[:at].rstrip()

    def _render(self, messages: list[dict[str, Any]], add_generation_prompt: bool, **extra: Any) -> str:
        now = datetime.now()
        # today's date, under the names Llama 3's and FireFunction's templates read (as llama.cpp passes them; a
        # template that finds none writes the date it was trained with), unless the request names its own
        variables = {"date_string": now.strftime("%d %b %Y"), "datetime": now.strftime("%b %d %Y"), **extra}
        if FIREFUNCTION_MARK in self.source and "functions" not in variables:
            tools = variables.get("tools")
            variables["functions"] = json.dumps(tools, indent=2, ensure_ascii=False) if tools else ""
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                **variables,
            )
        except jinja2.TemplateError as exc:
            raise InvalidParameterError(f"the chat template rejected the messages: {exc}", "messages") from exc
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as exc:
            # a template that meets a message it was not written for (a role or field it reads otherwise)
            raise InvalidParameterError(
                f"the chat template failed on the messages: {type(exc).__name__}: {exc}", "messages"
            ) from exc


def _normalize_message(message: Any, index: int) -> dict[str, Any]:
    if not isinstance(message, dict):
        raise InvalidParameterError(f"messages[{index}] must be an object with 'role' and 'content'", "messages")
    role = message.get("role")
    if not isinstance(role, str):
        raise InvalidParameterError(f"messages[{index}].role must be a string, got {role!r}", "messages")
    content = message.get("content")
    if content is None:
        content = ""
    elif isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidParameterError(
                    f"messages[{index}].content parts must be {{'type': 'text', 'text': ...}}", "messages"
                )
            texts.append(part["text"])
        content = "\n".join(texts)
    elif not isinstance(content, str):
        raise InvalidParameterError(f"messages[{index}].content must be a string or a list of parts", "messages")
    return {**message, "content": content}
