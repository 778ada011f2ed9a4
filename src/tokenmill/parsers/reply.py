"""One reply split as it streams into its thinking, its answer and its tool calls, in the model's own format.

The format comes from the chat template (reply_format): a template that writes harmony's channels is gpt-oss's
(harmony: thinking and calls both), one that writes `<think>` a thinking model's; the tool-call syntax is the
one the template teaches (`<tool_call>`: hermes, `<|python_tag|>` or Llama 3's "parameters": llama3_json,
`[TOOL_CALLS]`: mistral), else tokenmill's constrained JSON. --reasoning-parser and --tool-call-parser override
either, as vLLM's flags do (vLLM's names are accepted: deepseek_r1 and qwen3 are `think`, openai and gpt_oss are
`harmony`). Every API formats the same ReplyDelta stream, so each shows the thinking apart from the answer.
"""

from dataclasses import dataclass, field

from tokenmill.errors import InvalidParameterError
from tokenmill.outputs import CompletionOutput
from tokenmill.parsers.harmony import HarmonySplitter
from tokenmill.parsers.per_token import one_token_at_a_time
from tokenmill.parsers.streaming import find_first, held_suffix
from tokenmill.parsers.think import END, START, ThinkSplitter, start_state
from tokenmill.parsers.tool_formats import FORMATS, ToolFormat
from tokenmill.structured.tools import ToolCall
from tokenmill.tokenizer import Tokenizer

# how much of the rendered prompt's end a parser is given (where a thinking block may already be open)
PROMPT_TAIL_CHARS = 256
REASONING_PARSERS = {"think": "think", "deepseek_r1": "think", "qwen3": "think", "harmony": "harmony"}
REASONING_PARSERS |= {"openai": "harmony", "gpt_oss": "harmony", "none": ""}
TOOL_PARSERS = {"hermes": "hermes", "qwen": "hermes", "llama3_json": "llama3_json", "llama": "llama3_json"}
TOOL_PARSERS |= {"mistral": "mistral", "harmony": "harmony", "openai": "harmony", "constrained": "constrained"}


@dataclass(frozen=True)
class ReplyFormat:
    reasoning: str  # "think", "harmony" or "" (none)
    tools: str  # "hermes", "llama3_json", "mistral", "harmony" or "constrained"

    @property
    def keeps_special_tokens(self) -> bool:
        """Whether a reply's text must keep the special tokens its format is written in (harmony's markers)."""
        return self.reasoning == "harmony" or self.tools == "harmony"


def reply_format(template: str, reasoning: str | None = None, tools: str | None = None) -> ReplyFormat:
    """The format of a model whose chat template source is `template`; `reasoning` and `tools` (the server's
    flags, None or "auto": from the template) override it. InvalidParameterError names an unknown parser."""
    harmony = "<|channel|>" in template and "<|message|>" in template
    if reasoning in (None, "auto"):
        found = "harmony" if harmony else "think" if START in template or END in template else ""
    elif reasoning in REASONING_PARSERS:
        found = REASONING_PARSERS[reasoning]
    else:
        known = ", ".join(sorted(REASONING_PARSERS))
        raise InvalidParameterError(f"no reasoning parser {reasoning!r} (known: {known}, auto)", "reasoning_parser")
    if tools in (None, "auto"):
        if harmony:
            syntax = "harmony"
        elif "<tool_call>" in template:
            syntax = "hermes"
        elif "[TOOL_CALLS]" in template:
            syntax = "mistral"
        elif "<|python_tag|>" in template or '"parameters": ' in template:
            syntax = "llama3_json"
        else:
            syntax = "constrained"
    elif tools in TOOL_PARSERS:
        syntax = TOOL_PARSERS[tools]
    else:
        known = ", ".join(sorted(TOOL_PARSERS))
        raise InvalidParameterError(f"no tool-call parser {tools!r} (known: {known}, auto)", "tool_call_parser")
    return ReplyFormat(found, syntax)


@dataclass
class ReplyDelta:
    """What a reply's next text adds: thinking, answer text, and calls (complete, or cut off at the end)."""

    thinking: str = ""
    text: str = ""
    calls: list[ToolCall] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.thinking or self.text or self.calls)

    def extend(self, later: "ReplyDelta") -> None:
        """This delta followed by `later`, as one."""
        self.thinking += later.thinking
        self.text += later.text
        self.calls += later.calls


class ReplyParser:
    """One reply (one choice) as it streams. `prompt_tail`: the end of the rendered prompt (where a thinking block
    may already be open); `functions`: the functions it may call (none: calls are not looked for); `forced_name`:
    the one function tool_choice names (a cut-off call keeps that name); `tokenizer`: the model's, to read an
    output of several tokens one token at a time (feed_output), so that the count of thinking tokens does not
    depend on how the engine grouped them."""

    def __init__(
        self,
        fmt: ReplyFormat,
        prompt_tail: str = "",
        functions: list[dict] | None = None,
        forced_name: str | None = None,
        tokenizer: Tokenizer | None = None,
    ):
        self.format = fmt
        self.names = {f["name"] for f in functions or []}
        self.forced_name = forced_name
        self.tokenizer = tokenizer
        self._think = ThinkSplitter(start_state(prompt_tail)) if fmt.reasoning == "think" else None
        self._harmony = HarmonySplitter() if fmt.keeps_special_tokens else None
        self._tools: ToolFormat | None = FORMATS.get(fmt.tools) if self.names and fmt.tools != "harmony" else None
        self._answer_began = False  # whether answer text came (leading-only markers apply before it)
        self._answer_held = ""  # answer text that may still open a call
        self._region: str | None = None  # the call region's text once it opened
        self.thinking = ""  # all of the reply's thinking so far
        self.text = ""  # all of its answer text so far
        self.calls: list[ToolCall] = []  # all of its calls so far
        self._thinking_tokens = 0.0
        self._unplaced = 0  # tokens that showed nothing, outside the thinking: placed with the next token placed

    @property
    def thinking_tokens(self) -> int:
        """How many of the reply's tokens wrote its thinking (its tags and headers included)."""
        return round(self._thinking_tokens)

    @property
    def thinking_now(self) -> bool:
        """Whether the reply is inside its thinking."""
        if self._harmony is not None:
            return self._harmony.thinking
        return self._think is not None and self._think.thinking

    def feed(self, text: str, finished: bool = False, cut: bool = False, tokens: int = 0) -> ReplyDelta:
        """The reply's next text (of `tokens` tokens) -> what it adds; `finished`: the reply ended, `cut`: by its
        length limit (a call being written ends incomplete)."""
        delta, was_thinking = ReplyDelta(), self.thinking_now
        if self._harmony is not None:
            delta.thinking, answer, calls = self._harmony.feed(text, finished, cut)
            if self.format.reasoning != "harmony":  # --reasoning-parser none: the analysis is answer text
                delta.thinking, answer = "", delta.thinking + answer
            delta.calls += calls if self.names or not calls else []
            if calls and not self.names:  # a call to a function the request did not offer: shown as text
                answer += "".join(c.arguments for c in calls)
        elif self._think is not None:
            delta.thinking, answer = self._think.feed(text, finished)
        else:
            answer = text
        out, calls = self._answer(answer, finished, cut)
        delta.text, delta.calls = out, delta.calls + calls
        self._count(tokens, delta, was_thinking)
        self.thinking += delta.thinking
        self.text += delta.text
        self.calls += delta.calls
        return delta

    def _count(self, tokens: int, delta: ReplyDelta, was_thinking: bool) -> None:
        """Add the tokens that wrote the thinking: a delta's tokens by the share of its shown text that is thinking.
        One token that shows nothing is thinking where the reply thinks before or after it (a tag's end, a held
        piece); else (an opening tag's start, whitespace after a closing one) it goes with the next token that is
        placed. Several tokens that show nothing (fed without the tokenizer) go by where the reply is now."""
        shown = len(delta.thinking) + len(delta.text)
        if shown:
            share = len(delta.thinking) / shown
        elif tokens == 1 and not (was_thinking or self.thinking_now):
            self._unplaced += 1
            return
        else:
            share = float(self.thinking_now or (tokens == 1 and was_thinking))
        self._thinking_tokens += (tokens + self._unplaced) * share
        self._unplaced = 0

    def feed_output(self, o: CompletionOutput) -> ReplyDelta:
        """feed() with one choice's output as the engine gives it: its new text and tokens, and its finish (token
        by token where the parser has the tokenizer)."""
        if self.tokenizer is None or len(o.delta_token_ids) <= 1:
            finished, cut = o.finish_reason is not None, o.finish_reason == "length"
            return self.feed(o.delta_text, finished, cut, len(o.delta_token_ids))
        delta = ReplyDelta()
        for one in one_token_at_a_time(self.tokenizer, o):
            delta.extend(self.feed_output(one))
        return delta

    def _answer(self, text: str, finished: bool, cut: bool) -> tuple[str, list[ToolCall]]:
        """Answer text -> (what is shown as text now, the calls it completes)."""
        tools = self._tools
        if tools is None:
            return text, []
        if self._region is None:
            held = self._answer_held + text
            start = held.lstrip()
            if not self._answer_began and start:
                if any(start.startswith(m) for m in tools.leading):
                    self._region, self._answer_held = start, ""
                    return self._calls(finished, cut)
                if any(m.startswith(start) for m in tools.leading) and not finished:
                    self._answer_held = held
                    return "", []
                self._answer_began = True
            at, _ = find_first(held, tools.openers)
            if at != -1:
                self._region, self._answer_held = held[at:], ""
                out, calls = self._calls(finished, cut)
                return held[:at].rstrip() + out, calls
            keep = 0
            if not finished:  # a marker's start, and the whitespace before it (dropped if a call follows)
                keep = held_suffix(held, tools.openers)
                keep = len(held) - len(held[: len(held) - keep].rstrip())
            self._answer_held = held[len(held) - keep :]
            return held[: len(held) - keep], []
        self._region += text
        return self._calls(finished, cut)

    def _calls(self, finished: bool, cut: bool) -> tuple[str, list[ToolCall]]:
        tools, region = self._tools, self._region or ""
        assert tools is not None
        if not finished:
            calls, used = tools.closed_calls(region, self.names)
            self._region = region[used:]
            return "", calls
        self._region = ""
        if cut:
            return "", tools.cut_call(region, self.names, self.forced_name)
        calls = tools.final_calls(region, self.names)
        if calls is None:  # not calls after all: the model wrote text that looked like one
            return region, []
        return "", calls
