"""Log-probabilities in OpenAI's Responses API (`include: ["message.output_text.logprobs"]`, `top_logprobs`): each
output_text delta carries the entries of the tokens that made its text, and the message's output_text all of them,
each as chat's `logprobs.content` entries are ({token, logprob, bytes, top_logprobs}).

A reply's tokens are not all text: its thinking and its calls are parsed out of the same tokens, and text may be held
back a while (it could be a tag or the start of a call). So tokens read while the reply thinks (the tag that closes
the thinking included) are not the text's, unless the same output shows text (a token that ends the tag and starts
the answer); the entries of the others wait until a delta shows what they made: a text delta takes them, a thinking
or call delta drops them. A final end token makes no text and has none.
"""

from tokenmill.outputs import CompletionOutput
from tokenmill.parsers.reply import ReplyDelta
from tokenmill.server.logprobs_format import LogprobsShape, chat_logprobs
from tokenmill.tokenizer import Tokenizer


class TextLogprobs:
    """The log-probability entries of one reply's text, fed each output and the reply delta it made."""

    def __init__(self, tokenizer: Tokenizer, top: int):
        self.tokenizer = tokenizer
        self.shape = LogprobsShape(top)
        self.content: list[dict] = []  # every entry a text delta took: the message's output_text.logprobs
        self._waiting: list[dict] = []  # entries of tokens whose text has not come out yet

    def feed(self, output: CompletionOutput, delta: ReplyDelta, read_thinking: bool) -> list[dict]:
        """The entries the text delta of this output carries ([] when it has none); `read_thinking`: the reply was
        inside its thinking when this output's tokens came."""
        if not read_thinking or delta.text:
            first = len(output.token_ids) - len(output.delta_token_ids)
            positions = (output.logprobs or [])[first : first + len(output.delta_token_ids)]
            self._waiting += chat_logprobs(self.tokenizer, list(output.delta_token_ids), positions, self.shape)
        if delta.text:
            taken, self._waiting = self._waiting, []
            self.content += taken
            return taken
        if delta.thinking or delta.calls:
            self._waiting = []
        return []
