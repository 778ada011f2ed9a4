"""Log-probabilities in OpenAI's Responses API (`include: ["message.output_text.logprobs"]`, `top_logprobs`): each
output_text delta carries the entries of the tokens that made its text, and the message's output_text all of them,
each as chat's `logprobs.content` entries are ({token, logprob, bytes, top_logprobs}).

A reply's tokens are not all text: its thinking and its calls are parsed out of the same tokens, and text may be held
back a while (it could be a tag or the start of a call). So the entries of the tokens seen since the last delta wait;
a text delta takes them, a thinking or call delta drops them (they made that, not the text).
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

    def feed(self, output: CompletionOutput, delta: ReplyDelta) -> list[dict]:
        """The entries the text delta of this output carries ([] when it has none)."""
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
