"""Log-probabilities in the two OpenAI shapes: legacy completions and chat."""

from tokenmill.outputs import PositionLogprobs
from tokenmill.tokenizer import Tokenizer


def _top(position: PositionLogprobs, k: int) -> list[tuple[int, float]]:
    ranked = sorted(position.items(), key=lambda item: item[1].rank)
    return [(tid, lp.logprob) for tid, lp in ranked if lp.rank <= k]


class CompletionLogprobs:
    """Builds {"tokens", "token_logprobs", "top_logprobs", "text_offset"}, possibly over several stream chunks."""

    def __init__(self, tokenizer: Tokenizer, k: int):
        self.tokenizer = tokenizer
        self.k = k
        self.offset = 0  # characters of text before the next token

    def build(self, token_ids: list[int], positions: list[PositionLogprobs | None]) -> dict:
        tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
        for token, position in zip(token_ids, positions, strict=True):
            text = self.tokenizer.decode([token])
            tokens.append(text)
            text_offset.append(self.offset)
            self.offset += len(text)
            if position is None:  # the first prompt token has no log-probability
                token_logprobs.append(None)
                top_logprobs.append(None)
                continue
            token_logprobs.append(position[token].logprob)
            top = {self.tokenizer.decode([tid]): lp for tid, lp in _top(position, self.k)}
            top.setdefault(text, position[token].logprob)  # the chosen token is always listed
            top_logprobs.append(top)
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top_logprobs,
            "text_offset": text_offset,
        }


def chat_logprobs(tokenizer: Tokenizer, token_ids: list[int], positions: list[PositionLogprobs], k: int) -> list:
    """The `logprobs.content` list of a chat choice."""

    def entry(tid: int, logprob: float) -> dict:
        return {"token": tokenizer.decode([tid]), "logprob": logprob, "bytes": list(tokenizer.token_bytes(tid))}

    content = []
    for token, position in zip(token_ids, positions, strict=True):
        item = entry(token, position[token].logprob)
        item["top_logprobs"] = [entry(tid, lp) for tid, lp in _top(position, k)]
        content.append(item)
    return content
