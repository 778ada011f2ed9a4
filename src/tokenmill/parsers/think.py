"""`<think>...</think>` reasoning (Qwen3, QwQ, DeepSeek-R1 and its distills, SmolLM3): the thinking comes first, in
one block, then the answer.

Where the reply starts is read from the prompt (start_state): Qwen3's template leaves the block to the model (the
reply may open one), R1's opens it in the prompt (the reply starts inside it, with no opening tag), and a template
told not to think (Qwen3's `enable_thinking: false`) closes an empty one (the reply is all answer). The newlines
the templates put around the thinking and before the answer are not part of either, as the templates themselves
strip them when they show an earlier turn again.
"""

from tokenmill.parsers.streaming import held_suffix

START, END = "<think>", "</think>"
BEFORE, THINKING, ANSWER = "before", "thinking", "answer"


def start_state(prompt_tail: str, start: str = START, end: str = END) -> str:
    """Where a reply to a prompt that ends with `prompt_tail` starts: BEFORE (it may open a block), THINKING (the
    prompt opened one) or ANSWER (the prompt closed one after its last turn began: thinking is off)."""
    opened, closed = prompt_tail.rfind(start), prompt_tail.rfind(end)
    if opened > closed:
        return THINKING
    if closed != -1 and not prompt_tail[closed + len(end) :].strip():
        return ANSWER
    return BEFORE


class ThinkSplitter:
    """Splits one reply into (thinking, answer) as its text streams; text that may still be a tag is held back."""

    def __init__(self, state: str = BEFORE, start: str = START, end: str = END):
        self.state = state
        self.start, self.end = start, end
        self._buffer = ""
        self._thinking_began = False  # newlines at the start of the thinking are dropped
        self._newlines = ""  # newlines at the end of the thinking so far: dropped if the tag follows
        self._after_block = False  # whitespace right after the closing tag is dropped

    @property
    def thinking(self) -> bool:
        """Whether text fed now goes to the thinking (before a block opens it may still)."""
        return self.state == THINKING

    def feed(self, text: str, finished: bool = False) -> tuple[str, str]:
        """The next text of the reply -> (thinking, answer) that can be shown now; `finished`: nothing follows."""
        buf, thinking, answer = self._buffer + text, "", ""
        while True:
            if self.state == BEFORE:
                stripped = buf.lstrip()
                if stripped.startswith(self.start):
                    self.state, buf = THINKING, stripped[len(self.start) :]
                    continue
                if stripped and not self.start.startswith(stripped):
                    self.state = ANSWER
                    continue
                if finished:
                    answer, buf = answer + buf, ""
                break
            if self.state == THINKING:
                at = buf.find(self.end)
                if at != -1:
                    thinking += self._thinking_text(buf[:at], closing=True)
                    self.state, buf, self._after_block = ANSWER, buf[at + len(self.end) :], True
                    continue
                keep = 0 if finished else held_suffix(buf, (self.end,))
                thinking += self._thinking_text(buf[: len(buf) - keep], closing=finished)
                buf = buf[len(buf) - keep :]
                break
            if self._after_block:
                buf = buf.lstrip()
                if not buf:
                    break
                self._after_block = False
            answer, buf = answer + buf, ""
            break
        self._buffer = buf
        return thinking, answer

    def _thinking_text(self, text: str, closing: bool) -> str:
        if not self._thinking_began:
            text = text.lstrip("\n")
            self._thinking_began = bool(text)
        text = self._newlines + text
        if closing:
            self._newlines = ""
            return text.rstrip("\n")
        body = text.rstrip("\n")
        self._newlines = text[len(body) :]
        return body
