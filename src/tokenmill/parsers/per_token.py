"""An engine output of several new tokens as outputs of one token each.

The engine hands out a step's tokens together when the reader fell behind (as many as it happened to miss), so
whatever is counted or attributed per token (the thinking's tokens, the text's log-probabilities) reads an output
one token at a time: the result must not depend on how busy the server was.
"""

from collections.abc import Iterator
from dataclasses import replace

from tokenmill.outputs import CompletionOutput
from tokenmill.tokenizer import Tokenizer


def one_token_at_a_time(tokenizer: Tokenizer, output: CompletionOutput) -> Iterator[CompletionOutput]:
    """An output of several new tokens as outputs of one token each: its new text cut where each token's bytes end
    (text held back, e.g. a possible stop string, goes to the last; the finish too)."""
    tokens = output.delta_token_ids
    if len(tokens) <= 1:
        yield output
        return
    first, text = len(output.token_ids) - len(tokens), output.delta_text
    cut, written = 0, b""
    for i, token in enumerate(tokens):
        last = i == len(tokens) - 1
        written += tokenizer.token_bytes(token)
        end = len(text) if last else min(max(cut, len(written.decode("utf-8", errors="ignore"))), len(text))
        yield replace(
            output,
            text=output.text[: len(output.text) - len(text) + end],
            token_ids=output.token_ids[: first + i + 1],
            delta_text=text[cut:end],
            delta_token_ids=[token],
            finish_reason=output.finish_reason if last else None,
            stop_reason=output.stop_reason if last else None,
        )
        cut = end
