"""gpt-oss's chat template (tests/data/templates/gpt-oss.jinja) over OpenAI-style messages, as the server hands them
over (server/chat.py's template_message: a turn's thinking under `thinking`), against the renderings of OpenAI's
harmony library's own tests (tests/data/harmony): the system message with its reasoning effort, and the rule that an
earlier turn's analysis is dropped once a final answer follows it. No server, milliseconds."""

import re
from pathlib import Path

from tokenmill.server.chat import template_message
from tokenmill.tokenizer.chat_template import ChatTemplate

DATA = Path(__file__).parent / "data"
TEMPLATE = ChatTemplate((DATA / "templates" / "gpt-oss.jinja").read_text())


def render(messages: list[dict], **kwargs) -> str:
    """The prompt, without the date line the template writes from today's clock (harmony's examples have none
    unless they set one)."""
    text = TEMPLATE.render([template_message(m) for m in messages], True, **kwargs)
    return re.sub(r"Current date: \d{4}-\d{2}-\d{2}\n", "", text)


def reference(name: str) -> str:
    return (DATA / "harmony" / f"{name}.txt").read_text(encoding="utf-8").rstrip()


def test_the_system_message_carries_the_reasoning_effort() -> None:
    messages = [{"role": "user", "content": "What is the capital of the largest country in the world?"}]
    assert render(messages, reasoning_effort="high") == reference("test_simple_convo_high_effort_no_instruction")
    # a system message becomes harmony's developer instructions (the template ends them with a blank line, where
    # harmony's library writes none before <|end|>)
    instructed = render([{"role": "system", "content": "Be a robot."}, *messages], reasoning_effort="low")
    assert "Reasoning: low" in instructed and "<|start|>developer<|message|># Instructions\n\nBe a robot." in instructed


def test_an_earlier_turns_analysis_is_dropped_after_its_final_answer() -> None:
    messages = [
        {"role": "user", "content": "What is 2 + 2?"},
        {
            "role": "assistant",
            "content": "2 + 2 equals 4.",
            "reasoning_content": "User asks: “What is 2 + 2?” Simple arithmetic. Provide answer.",
        },
        {"role": "user", "content": "What about 9 / 2?"},
    ]
    text = render(messages)
    conversation = text[text.index("<|end|>") + len("<|end|>") :]  # harmony's example has no system message
    assert conversation == reference("test_dropping_cot_by_default")
    assert "Simple arithmetic" not in text
