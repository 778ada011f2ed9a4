"""Log-probabilities in OpenAI's Responses API (`include: ["message.output_text.logprobs"]`, `top_logprobs`): each
output_text delta carries the entries of the tokens that made its text, and the message's output_text all of them,
each as chat's `logprobs.content` entries are ({token, logprob, bytes, top_logprobs}).

A reply's tokens are not all text: its thinking and its calls are parsed out of the same tokens, and text may be held
back a while (it could be a tag or the start of a call). So tokens read while the reply thinks (the tag that closes
the thinking included) are not the text's, unless the same token shows text (one that ends the tag and starts the
answer); the entries of the others wait until a delta shows what they made: a text delta takes them, a thinking or
call delta drops them. A final end token makes no text and has none.

The reply is read one token at a time (parsers/per_token.py): which tokens are the text's must not depend on how
many tokens an output carried.
"""

from tokenmill.outputs import CompletionOutput
from tokenmill.parsers.per_token import one_token_at_a_time
from tokenmill.parsers.reply import ReplyDelta, ReplyParser
from tokenmill.server.logprobs_format import LogprobsShape, chat_logprobs
from tokenmill.tokenizer import Tokenizer


class TextLogprobs:
    """The log-probability entries of one reply's text, read with the reply's tokens."""

    def __init__(self, tokenizer: Tokenizer, top: int):
        self.tokenizer = tokenizer
        self.shape = LogprobsShape(top)
        self.content: list[dict] = []  # every entry a text delta took: the message's output_text.logprobs
        self._waiting: list[dict] = []  # entries of tokens whose text has not come out yet

    def read(self, reply: ReplyParser, output: CompletionOutput) -> ReplyDelta:
        """Feed `reply` one output of the engine, token by token -> the reply's delta (that of the whole output);
        the entries of the tokens that made its text are added to `content`."""
        delta = ReplyDelta()
        for one in one_token_at_a_time(self.tokenizer, output):
            read_thinking = reply.thinking_now
            part = reply.feed_output(one)
            self._feed(one, part, read_thinking)
            delta.extend(part)
        return delta

    def _feed(self, output: CompletionOutput, delta: ReplyDelta, read_thinking: bool) -> None:
        """Take the entries of one token's output and of those waiting when its delta shows text; `read_thinking`:
        the reply was inside its thinking when the token came."""
        if not read_thinking or delta.text:
            first = len(output.token_ids) - len(output.delta_token_ids)
            positions = (output.logprobs or [])[first : first + len(output.delta_token_ids)]
            self._waiting += chat_logprobs(self.tokenizer, list(output.delta_token_ids), positions, self.shape)
        if delta.text:
            self.content += self._waiting
            self._waiting = []
        elif delta.thinking or delta.calls:
            self._waiting = []
