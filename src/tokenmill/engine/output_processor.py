"""Outputs out: each sampled token is appended to its sequence, detokenized and checked against the stop
conditions (stop tokens, stop strings, a finished constraint, max_tokens, max_model_len), with its log-probabilities
and the request's timings; a prompt's log-probabilities as its chunks are computed. A sequence that stops is handed
to `finish` (the engine core frees its blocks and sampler state at once)."""

import logging
from collections.abc import Callable

import torch

from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.engine.request import Request, SampleState
from tokenmill.outputs import Logprob, PositionLogprobs
from tokenmill.runner.sampler import SampledToken, prompt_logprobs
from tokenmill.scheduler.sequence import Sequence
from tokenmill.tokenizer.gguf_tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# finish(seq, finish_reason, stop_reason)
FinishFn = Callable[[Sequence, str, int | str | None], None]


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, max_model_len: int, finish: FinishFn):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.finish = finish

    def sample_state(self, seq: Sequence, request: Request) -> SampleState:
        """A new sequence's output state: its detokenizer (with the request's stop strings) and logprobs list."""
        p = request.params
        detok = IncrementalDetokenizer(
            self.tokenizer,
            request.prompt_token_ids,
            p.skip_special_tokens,
            p.stop_strings,
            p.include_stop_str_in_output,
        )
        wants_logprobs = p.logprobs is not None or bool(p.logprob_token_ids)
        return SampleState(seq, detok, [] if wants_logprobs else None)

    def collects_prompt_logprobs(self, request: Request, seq: Sequence, start: int) -> bool:
        if request.prompt_logprobs is None or seq.sample_index != 0:
            return False
        return start < seq.num_prompt_tokens - 1 and len(request.prompt_logprobs) < seq.num_prompt_tokens

    def add_prompt_logprobs(self, request: Request, start: int, logits: torch.Tensor) -> None:
        """logits [chunk_len, V]: row j follows prompt token start + j and scores prompt token start + j + 1."""
        assert request.prompt_logprobs is not None
        ids = request.prompt_token_ids
        first_target = len(request.prompt_logprobs)  # next prompt position still missing
        rows = [j for j in range(logits.shape[0]) if first_target <= start + j + 1 < len(ids)]
        if not rows:
            return
        targets = [ids[start + j + 1] for j in rows]
        k = request.params.prompt_logprobs or 0
        for target, (lp, rank, top) in zip(
            targets, prompt_logprobs(logits[rows[0] : rows[-1] + 1], targets, k), strict=True
        ):
            request.prompt_logprobs.append(self.position_logprobs(target, lp, rank, top))

    def add_hidden(self, request: Request, seq: Sequence, start: int, hidden: torch.Tensor, completes: bool) -> None:
        """An embedding request's chunk of prompt rows (hidden [chunk_len, H] float32, the final norm's output, from
        prompt position `start`) folded into its pooled vector; once the whole prompt is in, the vector is made and
        the sequence stops."""
        pooling = request.pooling
        assert pooling is not None
        if start == 0:  # the first chunk, or the prompt computed again after a preemption
            request.pooled = None
        if pooling.pooling == "mean":
            part = hidden.sum(0)
            request.pooled = part if request.pooled is None else request.pooled + part
        else:
            request.pooled = hidden[-1]
        if not completes:
            return
        vector = request.pooled / seq.num_prompt_tokens if pooling.pooling == "mean" else request.pooled
        if pooling.dimensions is not None:
            vector = vector[: pooling.dimensions]
        if pooling.normalize:
            vector = vector / vector.norm().clamp_min(1e-12)
        request.embedding = vector.tolist()
        request.pooled = None
        self.finish(seq, "stop", None)

    def position_logprobs(
        self, token: int, logprob: float, rank: int, top: list, listed: list | None = None
    ) -> PositionLogprobs:
        """One position's log-probabilities: the actual token's first, then the top ones, then `listed` ((id,
        logprob, rank): the request's logprob_token_ids), each token once."""
        entry = {token: Logprob(logprob, rank, self.tokenizer.decode([token]))}
        for r, (tid, lp) in enumerate(top, start=1):
            if tid not in entry:
                entry[tid] = Logprob(lp, r, self.tokenizer.decode([tid]))
        for tid, lp, r in listed or ():
            if tid not in entry:
                entry[tid] = Logprob(lp, r, self.tokenizer.decode([tid]))
        return entry

    def append_token(self, request: Request, sample: SampleState, token: SampledToken, now: float) -> None:
        seq = sample.seq
        p = seq.params
        seq.append_token(token.token_id)
        seq.cumulative_logprob += token.logprob
        if sample.logprobs is not None:
            sample.logprobs.append(
                self.position_logprobs(
                    token.token_id, token.logprob, token.rank, token.top_logprobs or [], token.listed_logprobs
                )
            )
        metrics = request.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = now
        if seq.sample_index == 0:
            metrics.token_times.append(now)
            metrics.last_token_time = now
        # stop conditions, in vLLM's order: stop tokens, stop strings, then length; a constraint that is complete
        # (nothing more may follow) ends the output too
        n_out = seq.num_output_tokens
        can_stop = n_out >= p.min_tokens
        grammar_done = False
        if sample.grammar is not None:
            accepted = sample.grammar.consume_token(token.token_id)
            if sample.grammar.is_error():  # a limit hit mid-way: the output cannot be finished as constrained
                sample.detokenizer.add_token(token.token_id, check_stop=False)  # the mask allowed it
                self.fail_constraint(request, sample)
                return
            grammar_done = not accepted or sample.grammar.is_stopped()
        if grammar_done and token.token_id in self.tokenizer.stop_token_ids:
            self.finish(seq, "stop", None)
        elif can_stop and not p.ignore_eos and token.token_id in self.tokenizer.stop_token_ids:
            self.finish(seq, "stop", None)
        elif can_stop and p.stop_token_ids and token.token_id in p.stop_token_ids:
            self.finish(seq, "stop", token.token_id)
        else:
            stop = sample.detokenizer.add_token(token.token_id, check_stop=can_stop)
            if stop is not None:
                self.finish(seq, "stop", stop)
            elif grammar_done:
                sample.detokenizer.flush()
                self.finish(seq, "stop", None)
            elif n_out >= seq.max_tokens or seq.num_tokens >= self.max_model_len:
                sample.detokenizer.flush()
                self.finish(seq, "length", None)

    def fail_constraint(self, request: Request, sample: SampleState) -> None:
        """End a constrained sequence whose matcher failed (llguidance's limits, met mid-way): finish_reason
        "error" with the matcher's reason, never "stop" (its text so far does not satisfy the constraint)."""
        from tokenmill.structured.grammars import clean_reason

        error = sample.grammar.get_error() if sample.grammar.is_error() else "it allows no token here"
        sample.error = f"the structured-output constraint cannot be followed further: {clean_reason(error)}"
        seq = sample.seq
        logger.error(
            "request %s (sample %d) ends with an error after %d tokens: %s",
            request.request_id,
            seq.sample_index,
            seq.num_output_tokens,
            sample.error,
        )
        sample.detokenizer.flush()
        self.finish(seq, "error", None)
