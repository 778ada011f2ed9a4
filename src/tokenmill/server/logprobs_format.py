"""Log-probabilities in the two OpenAI shapes, legacy completions and chat, and vLLM's prompt_logprobs.

What each position shows (LogprobsShape): its top k tokens (OpenAI's), or with vLLM's logprob_token_ids every
token the engine scored there (the sampled one and those listed, in that order); tokens as their text, or with
vLLM's return_tokens_as_token_ids as "token_id:N". A log-probability of -inf (a token a mask ruled out) is
written -9999.0, as vLLM writes it: JSON has no infinity.
"""

from dataclasses import dataclass

from tokenmill.outputs import PositionLogprobs
from tokenmill.tokenizer import Tokenizer

LOWEST_LOGPROB = -9999.0  # what -inf is written as


@dataclass(frozen=True)
class LogprobsShape:
    k: int  # the top tokens shown at each position (-1: every one the position holds, the whole vocabulary)
    listed: bool = False  # every token the position holds (logprob_token_ids'), not the top k
    as_ids: bool = False  # tokens written "token_id:N" (return_tokens_as_token_ids)


def _finite(logprob: float) -> float:
    return max(logprob, LOWEST_LOGPROB)


def _shown(position: PositionLogprobs, shape: LogprobsShape) -> list[tuple[int, float]]:
    if shape.listed:
        return [(tid, _finite(lp.logprob)) for tid, lp in position.items()]
    ranked = sorted(position.items(), key=lambda item: item[1].rank)
    return [(tid, _finite(lp.logprob)) for tid, lp in ranked if shape.k < 0 or lp.rank <= shape.k]


def token_name(tokenizer: Tokenizer, token: int, as_ids: bool) -> str:
    """A token as a log-probability entry names it: its text, or "token_id:N"."""
    return f"token_id:{token}" if as_ids else tokenizer.decode([token])


class CompletionLogprobs:
    """Builds {"tokens", "token_logprobs", "top_logprobs", "text_offset"}, possibly over several stream chunks."""

    def __init__(self, tokenizer: Tokenizer, shape: LogprobsShape):
        self.tokenizer = tokenizer
        self.shape = shape
        self.offset = 0  # characters of text before the next token

    def build(self, token_ids: list[int], positions: list[PositionLogprobs | None]) -> dict:
        tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
        as_ids = self.shape.as_ids
        for token, position in zip(token_ids, positions, strict=True):
            text = self.tokenizer.decode([token])
            name = token_name(self.tokenizer, token, as_ids)
            tokens.append(name)
            text_offset.append(self.offset)  # where the token's text starts in the choice's text, either way
            self.offset += len(text)
            if position is None:  # the first prompt token has no log-probability
                token_logprobs.append(None)
                top_logprobs.append(None)
                continue
            token_logprobs.append(_finite(position[token].logprob))
            top = {token_name(self.tokenizer, tid, as_ids): lp for tid, lp in _shown(position, self.shape)}
            top.setdefault(name, _finite(position[token].logprob))  # the chosen token is always listed
            top_logprobs.append(top)
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top_logprobs,
            "text_offset": text_offset,
        }


def chat_logprobs(
    tokenizer: Tokenizer, token_ids: list[int], positions: list[PositionLogprobs], shape: LogprobsShape
) -> list:
    """The `logprobs.content` list of a chat choice."""

    def entry(tid: int, logprob: float) -> dict:
        name = token_name(tokenizer, tid, shape.as_ids)
        return {"token": name, "logprob": logprob, "bytes": list(tokenizer.token_bytes(tid))}

    content = []
    for token, position in zip(token_ids, positions, strict=True):
        item = entry(token, _finite(position[token].logprob))
        item["top_logprobs"] = [entry(tid, lp) for tid, lp in _shown(position, shape)]
        content.append(item)
    return content


def prompt_logprobs_json(positions: list[PositionLogprobs | None] | None) -> list | None:
    """vLLM's `prompt_logprobs`: per prompt token, null for the first, else {token id: {"logprob", "rank",
    "decoded_token"}} for the token there and the top ones."""
    if positions is None:
        return None
    return [
        None
        if position is None
        else {
            str(tid): {"logprob": _finite(lp.logprob), "rank": lp.rank, "decoded_token": lp.decoded_token}
            for tid, lp in position.items()
        }
        for position in positions
    ]
