"""Token ids -> text deltas while generating, and stop strings.

Decoding each new token alone is wrong twice over: a character spread over several byte tokens (an emoji, CJK)
decodes to "\ufffd" until its last byte arrives, and SentencePiece decoders strip a leading space. So, as vLLM
does, we decode a short window that starts a few tokens back (prefix_offset) and emit only what the window adds
beyond the text already read (read_offset), holding back while the text ends in an incomplete character.

Stop strings are searched in the text as it grows; a match ends the sequence and the text is cut before it
(or after it, with include_stop_str_in_output). Until a match is ruled out, the end of the text that could be
the start of a stop string is held back from the visible text, so a client never sees part of a stop string.
"""

from tokenmill.tokenizer.gguf_tokenizer import Tokenizer

CONTEXT_TOKENS = 5  # prompt tokens decoded with the output so that the first output token gets its spacing


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        stop_strings: list[str] | None = None,
        include_stop_str_in_output: bool = False,
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop_strings = stop_strings or []
        self.include_stop = include_stop_str_in_output
        self._ids: list[int] = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""  # all decoded output text (cut at a matched stop string)
        self.stopped_by: str | None = None

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add_token(self, token_id: int, check_stop: bool = True) -> str | None:
        """Append one generated token; returns the stop string it completed, if any."""
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return None  # nothing printable yet (an incomplete character or a skipped special token)
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return self._append(delta, check_stop)

    def flush(self) -> None:
        """At the end, emit whatever is still held back as incomplete (it will never complete)."""
        if self.stopped_by is not None or self._read_offset == len(self._ids):
            return
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        self.text += new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset = len(self._ids)

    def _append(self, delta: str, check_stop: bool) -> str | None:
        old_len = len(self.text)
        self.text += delta
        if not check_stop or not self.stop_strings:
            return None
        best: tuple[int, str] | None = None
        for stop in self.stop_strings:
            idx = self.text.find(stop, max(0, old_len - len(stop) + 1))
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, stop)
        if best is None:
            return None
        idx, stop = best
        self.text = self.text[: idx + len(stop)] if self.include_stop else self.text[:idx]
        self.stopped_by = stop
        return stop

    def visible_text(self, finished: bool) -> str:
        """The text a client may see now: while running, a tail that could begin a stop string is held back."""
        if finished or not self.stop_strings:
            return self.text
        hold = 0
        for stop in self.stop_strings:
            for n in range(min(len(stop) - 1, len(self.text)), hold, -1):
                if self.text.endswith(stop[:n]):
                    hold = n
                    break
        return self.text[: len(self.text) - hold] if hold else self.text
