"""Beam search as vLLM runs it: a stage around the engine's step, never inside the scheduler (the engine core only
steps). No torch here.

Each round, every live beam of every prompt is one request for one token (greedy, with the log-probabilities of
its 2 * beam_width most likely tokens), all of a round submitted together so that they share its steps; the prefix
cache holds what the beams have in common, so a round computes each beam's last partial block and its new token,
not its whole context. A beam's candidates are its 2 * beam_width tokens: one that ends the sequence (an EOS
token, unless ignore_eos) is put aside as finished; of the others, the best beam_width by cumulative
log-probability go on. After max_tokens rounds, or once no beam goes on, the finished and the live beams together
are ranked by cumulative log-probability / generated tokens ** length_penalty (a final EOS counted; vLLM's
get_beam_search_score) and the best beam_width are the answer. There is no early stopping: every round runs, as
vLLM's (Hugging Face's `early_stopping` heuristics end sooner, and admit an EOS only from the top beam_width
candidates of a step).

One driver for both fronts: `BeamSearch` holds the beams of one call's prompts; `LLM.beam_search` runs its rounds
on the synchronous engine (`run`), the server on the asyncio front (`run_async` with AsyncEngine.run_requests).
"""

import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from tokenmill.engine.input_processor import fit_output
from tokenmill.errors import InvalidParameterError
from tokenmill.outputs import CompletionOutput, PositionLogprobs, RequestMetrics, RequestOutput
from tokenmill.sampling_params import BeamSearchParams, SamplingParams
from tokenmill.tokenizer import Tokenizer


@dataclass
class BeamSearchSequence:
    """A beam (vLLM's shape). `tokens`: the prompt's and the beam's, a final EOS included; `logprobs`: one position
    per generated token (the EOS's included), the 2 * beam_width candidates the beam was chosen among;
    `text`: its tokens decoded, the prompt's included (vLLM's offline answer); `finish_reason`: "stop" (an EOS),
    "length" (max_tokens) or "abort"."""

    tokens: list[int]
    logprobs: list[PositionLogprobs]
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """One prompt's answer: its best beams, best first (at most beam_width)."""

    sequences: list[BeamSearchSequence]


def get_beam_search_score(num_generated_tokens: int, cumulative_logprob: float, length_penalty: float = 1.0) -> float:
    """A beam's rank: its cumulative log-probability over its length ** length_penalty, the length counting its
    generated tokens and a final EOS (vLLM's and Hugging Face's)."""
    return cumulative_logprob / (max(num_generated_tokens, 1) ** length_penalty)


def beam_score(beam: BeamSearchSequence, length_penalty: float) -> float:
    return get_beam_search_score(len(beam.logprobs), beam.cum_logprob, length_penalty)


def round_params(params: BeamSearchParams) -> SamplingParams:
    """The request a live beam makes each round: one greedy token, and the log-probabilities of its candidates
    (more when the answer shows more per token)."""
    return SamplingParams(
        temperature=0.0,
        max_tokens=1,
        logprobs=max(2 * params.beam_width, params.logprobs or 0),
        skip_special_tokens=params.skip_special_tokens,
    )


@dataclass
class _PromptSearch:
    """One prompt's beams."""

    prompt: str | None
    prompt_ids: list[int]
    max_tokens: int
    beams: list[BeamSearchSequence]
    completed: list[BeamSearchSequence] = field(default_factory=list)
    rounds: int = 0
    num_cached_tokens: int = 0  # prompt tokens the first round read from the prefix cache
    first_scheduled_time: float | None = None

    @property
    def live(self) -> bool:
        return bool(self.beams) and self.rounds < self.max_tokens


RoundRunner = Callable[[list[list[int]], SamplingParams], Sequence[RequestOutput]]
AsyncRoundRunner = Callable[[list[list[int]], SamplingParams], Awaitable[Sequence[RequestOutput]]]


class BeamSearch:
    """The beam search of one call's prompts (their rounds run together): `round()` gives the requests of the next
    round, `advance()` takes their outputs; `outputs()` / `request_outputs()` answer once no round is left."""

    def __init__(
        self,
        prompts: Sequence[tuple[str | None, list[int]]],
        params: BeamSearchParams,
        tokenizer: Tokenizer,
        max_model_len: int,
    ):
        """`prompts`: (text or None, token ids) each. Raises PromptTooLongError where a prompt and max_tokens do
        not fit max_model_len (no round would fail half-way)."""
        self.params = params
        self.tokenizer = tokenizer
        self.eos = frozenset() if params.ignore_eos else frozenset(tokenizer.stop_token_ids)
        self.round_params = round_params(params)
        self.searches: list[_PromptSearch] = []
        for text, ids in prompts:
            if not ids:
                raise InvalidParameterError("the prompt is empty", "prompt")
            max_tokens = fit_output(len(ids), params.max_tokens, max_model_len)
            self.searches.append(_PromptSearch(text, list(ids), max_tokens, [BeamSearchSequence(list(ids), [])]))
        self.arrival_time = time.monotonic()
        self.round_times: list[float] = []  # when each round ended
        self._round: list[tuple[_PromptSearch, BeamSearchSequence]] = []

    @property
    def max_rounds(self) -> int:
        """The rounds the search runs at most (its longest max_tokens)."""
        return max((s.max_tokens for s in self.searches), default=0)

    # ---- rounds -------------------------------------------------------------------------------------------------

    def round(self) -> list[list[int]]:
        """The token ids of every live beam's request this round, prompt after prompt (empty: the search is over).
        Each is run for one token with `round_params`."""
        self._round = [(s, beam) for s in self.searches if s.live for beam in s.beams]
        return [beam.tokens for _, beam in self._round]

    def advance(self, outputs: Sequence[RequestOutput]) -> None:
        """The round's final outputs, in round() order: each prompt keeps its best beams."""
        self.round_times.append(time.monotonic())
        results: dict[int, tuple[_PromptSearch, list[tuple[BeamSearchSequence, RequestOutput]]]] = {}
        for (search, beam), out in zip(self._round, outputs, strict=True):
            results.setdefault(id(search), (search, []))[1].append((beam, out))
        for search, beam_outputs in results.values():
            self._advance(search, beam_outputs)
        self._round = []

    def _advance(self, s: _PromptSearch, beam_outputs: list[tuple[BeamSearchSequence, RequestOutput]]) -> None:
        if s.rounds == 0:
            first = beam_outputs[0][1]
            s.num_cached_tokens = first.num_cached_tokens
            s.first_scheduled_time = first.metrics.first_scheduled_time
        if any(out.outputs[0].finish_reason == "abort" for _, out in beam_outputs):  # the engine stopped it
            for beam in s.beams:
                beam.finish_reason = "abort"
            s.completed.extend(s.beams)
            s.beams = []
            return
        width = self.params.beam_width
        candidates: list[tuple[float, int, BeamSearchSequence, PositionLogprobs]] = []
        for beam, out in beam_outputs:
            position = (out.outputs[0].logprobs or [{}])[0]
            for token, logprob in position.items():
                if logprob.rank > 2 * width:  # shown in the answer's top-k only
                    continue
                cumulative = beam.cum_logprob + logprob.logprob
                if token in self.eos:
                    tokens, positions = [*beam.tokens, token], [*beam.logprobs, position]
                    s.completed.append(BeamSearchSequence(tokens, positions, cumulative, None, "stop", token))
                else:
                    candidates.append((cumulative, token, beam, position))
        candidates.sort(key=lambda c: c[0], reverse=True)  # stable: ties keep beam, then rank, order
        s.beams = [
            BeamSearchSequence([*beam.tokens, token], [*beam.logprobs, position], cumulative)
            for cumulative, token, beam, position in candidates[:width]
        ]
        s.rounds += 1
        if s.rounds >= s.max_tokens:
            for beam in s.beams:
                beam.finish_reason = "length"

    def run(self, run_round: RoundRunner) -> None:
        """Run every round: `run_round(token id lists, params)` runs a round's requests to their end, together,
        and returns their final outputs in order."""
        while beams := self.round():
            self.advance(run_round(beams, self.round_params))

    async def run_async(self, run_round: AsyncRoundRunner) -> None:
        """`run` on an asyncio front."""
        while beams := self.round():
            self.advance(await run_round(beams, self.round_params))

    # ---- answers ------------------------------------------------------------------------------------------------

    def best(self, index: int) -> list[BeamSearchSequence]:
        """Prompt `index`'s best beams, finished or live, best first."""
        s, penalty = self.searches[index], self.params.length_penalty
        ranked = sorted([*s.completed, *s.beams], key=lambda b: beam_score(b, penalty), reverse=True)
        return ranked[: self.params.beam_width]

    def outputs(self) -> list[BeamSearchOutput]:
        """vLLM's offline answer (LLM.beam_search), one per prompt: a beam's tokens and text include the prompt's,
        and a final EOS (the text as skip_special_tokens decodes it)."""
        answers = []
        for i in range(len(self.searches)):
            best = self.best(i)
            for beam in best:
                beam.text = self.tokenizer.decode(beam.tokens, skip_special_tokens=self.params.skip_special_tokens)
            answers.append(BeamSearchOutput(best))
        return answers

    def request_outputs(self, request_ids: Sequence[str]) -> list[RequestOutput]:
        """vLLM's served answer, a finished RequestOutput per prompt: its best beams as its outputs (index: rank),
        each with its generated tokens (a final EOS only with include_stop_str_in_output) and their text (never the
        EOS's), whole in the deltas too (a stream's one output); log-probabilities with `params.logprobs`."""
        p = self.params
        finished_time = time.monotonic()
        answers = []
        for i, (request_id, s) in enumerate(zip(request_ids, self.searches, strict=True)):
            completions = []
            for rank, beam in enumerate(self.best(i)):
                generated = beam.tokens[len(s.prompt_ids) :]
                said = generated[:-1] if beam.finish_reason == "stop" else generated
                shown = generated if p.include_stop_str_in_output else said
                text = self.tokenizer.decode(said, skip_special_tokens=p.skip_special_tokens)
                logprobs = beam.logprobs[: len(shown)] if p.logprobs is not None else None
                reason = beam.finish_reason or "length"
                completions.append(
                    CompletionOutput(rank, text, list(shown), beam.cum_logprob, logprobs, reason, beam.stop_reason)
                )
                completions[-1].delta_text, completions[-1].delta_token_ids = text, list(shown)
            token_times = self.round_times[: s.rounds]
            metrics = RequestMetrics(
                arrival_time=self.arrival_time,
                first_scheduled_time=s.first_scheduled_time,
                first_token_time=token_times[0] if token_times else None,
                last_token_time=token_times[-1] if token_times else None,
                finished_time=finished_time,
                token_times=token_times,
            )
            answers.append(
                RequestOutput(
                    request_id,
                    s.prompt,
                    s.prompt_ids,
                    completions,
                    True,
                    metrics,
                    num_cached_tokens=s.num_cached_tokens,
                )
            )
        return answers
