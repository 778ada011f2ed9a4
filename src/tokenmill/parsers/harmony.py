"""OpenAI's harmony format (gpt-oss): the reply is a run of messages, each a header then a body,

    <|channel|>analysis<|message|>THINKING<|end|><|start|>assistant<|channel|>final<|message|>ANSWER

ending at <|return|> (or, for a tool call, `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>
{ARGUMENTS}` ending at <|call|>); the recipient may also stand in the header before the channel. The analysis
channel is the thinking, final the answer, commentary addressed to `functions.NAME` a call and commentary to no one
a preamble the user sees (as answer text). Headers are never shown; the markers are special tokens, so the reply's
text must keep them (the server decodes these replies with skip_special_tokens off). A reply that does not begin
with a header is plain answer text.
"""

import re

from tokenmill.parsers.streaming import find_first, held_suffix
from tokenmill.structured.tools import ToolCall, new_call

MESSAGE = "<|message|>"
BODY_ENDS = ("<|end|>", "<|call|>", "<|return|>", "<|start|>")
HEADER_STARTS = ("<|channel|>", "<|start|>")
_CHANNEL = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")
_RECIPIENT = re.compile(r"to=([^\s<]+)")

HEADER, BODY, PLAIN = "header", "body", "plain"


class HarmonySplitter:
    """One harmony reply -> (thinking, answer, calls) as its text streams."""

    def __init__(self) -> None:
        self.state = HEADER
        self.channel = ""
        self.recipient = ""
        self._buffer = ""
        self._arguments = ""  # the body of the call being written
        self._started = False  # whether any text came (the first decides between HEADER and PLAIN)

    @property
    def thinking(self) -> bool:
        return self.state == BODY and self.channel == "analysis"

    def feed(self, text: str, finished: bool = False, cut: bool = False) -> tuple[str, str, list[ToolCall]]:
        """`cut`: the reply was cut off (max_tokens), so a call being written ends incomplete."""
        buf, thinking, answer, calls = self._buffer + text, "", "", []
        while True:
            if self.state == HEADER:
                if not self._started and buf.strip():
                    start = buf.lstrip()
                    if not any(start.startswith(m) or m.startswith(start) for m in HEADER_STARTS):
                        self.state = PLAIN
                        continue
                    self._started = True
                at = buf.find(MESSAGE)
                if at == -1:
                    if finished:
                        buf = ""  # a header cut off: nothing to show
                    break
                header = buf[:at]
                channel, recipient = _CHANNEL.search(header), _RECIPIENT.search(header)
                self.channel = channel.group(1) if channel else "final"
                self.recipient = recipient.group(1) if recipient else ""
                self.state, buf, self._arguments = BODY, buf[at + len(MESSAGE) :], ""
                continue
            if self.state == PLAIN:
                answer, buf = answer + buf, ""
                break
            at, marker = find_first(buf, BODY_ENDS)
            body = buf if at == -1 else buf[:at]
            keep = 0 if (at != -1 or finished) else held_suffix(buf, BODY_ENDS)
            body = body[: len(body) - keep]
            if self.recipient.startswith("functions."):
                self._arguments += body
            elif self.channel == "analysis":
                thinking += body
            else:
                answer += body
            if at == -1 and not finished:
                buf = buf[len(buf) - keep :] if keep else ""
                break
            if self.recipient.startswith("functions."):
                name = self.recipient.removeprefix("functions.")
                calls.append(new_call(name, self._arguments.strip() if not cut or at != -1 else self._arguments))
            self.state, self.channel, self.recipient = HEADER, "", ""
            if at == -1:
                buf = ""
                break
            buf = buf[at + (len(marker) if marker != "<|start|>" else 0) :]
        self._buffer = buf
        return thinking, answer, calls
