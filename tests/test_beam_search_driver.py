"""The beam search driver (engine/beam_search.py) against a scripted language model, no torch and no engine: its
rounds, its ranking (vLLM's: candidates by cumulative log-probability, the finished and live beams by cumulative
log-probability / generated tokens ** length_penalty), EOS, aborts, and the two answers' shapes."""

import math

import pytest

from tokenmill.engine.beam_search import BeamSearch, beam_score, get_beam_search_score, round_params
from tokenmill.errors import InvalidParameterError, PromptTooLongError
from tokenmill.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from tokenmill.sampling_params import MAX_BEAM_WIDTH, BeamSearchParams

EOS = 0


class Words:
    """A tokenizer of the scripted model: token t is the word "w<t>", EOS is special."""

    stop_token_ids = frozenset({EOS})

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return " ".join("</s>" if t == EOS else f"w{t}" for t in ids if not (skip_special_tokens and t == EOS))


# the next token's probabilities after the last token (after the prompt's last token, 9): greedy takes 1 (0.5),
# then can only go on badly (0.2 at best); 2 (0.4) leads to 5 (0.9), a likelier pair, then to EOS or on
NEXT = {
    9: {1: 0.5, 2: 0.4, 3: 0.1},
    1: {4: 0.2, 3: 0.2, 5: 0.2, 6: 0.2, 7: 0.2},
    2: {5: 0.9, 3: 0.1},
    3: {3: 0.6, 4: 0.4},
    4: {4: 0.6, 3: 0.4},
    5: {EOS: 0.6, 6: 0.4},
    6: {6: 0.7, 7: 0.3},
    7: {7: 0.7, 6: 0.3},
    EOS: {7: 1.0},  # (with ignore_eos)
}


def model_round(requests: list[list[int]], params) -> list[RequestOutput]:
    """What the engine answers a round: each request's greedy token with its top `params.logprobs` candidates."""
    outputs = []
    for i, ids in enumerate(requests):
        ranked = sorted(NEXT[ids[-1]].items(), key=lambda kv: -kv[1])[: params.logprobs]
        position = {t: Logprob(math.log(p), rank, f"w{t}") for rank, (t, p) in enumerate(ranked, start=1)}
        top, top_lp = ranked[0][0], math.log(ranked[0][1])
        completion = CompletionOutput(0, f"w{top}", [top], top_lp, [position], "length")
        metrics = RequestMetrics(arrival_time=0.0, first_scheduled_time=1.0)
        outputs.append(RequestOutput(f"r{i}", None, ids, [completion], True, metrics, num_cached_tokens=3))
    return outputs


def search(width: int, max_tokens: int, prompts: int = 1, **params) -> BeamSearch:
    beams = BeamSearch(
        [(None, [8, 9])] * prompts, BeamSearchParams(width, max_tokens, **params), Words(), max_model_len=64
    )
    beams.run(model_round)
    return beams


def generated(beams: BeamSearch, prompt: int = 0) -> list[list[int]]:
    return [b.tokens[2:] for b in beams.best(prompt)]


def test_width_one_is_greedy_and_two_beams_find_the_likelier_pair() -> None:
    assert generated(search(1, 2)) == [[1, 4]]  # greedy: 0.5 * 0.2
    best = search(2, 2).best(0)
    assert [b.tokens[2:] for b in best] == [[2, 5], [1, 4]]  # 0.4 * 0.9 beats it
    assert best[0].cum_logprob == pytest.approx(math.log(0.4 * 0.9))


def test_a_beam_that_reaches_eos_is_kept_aside_and_ranked_with_the_length_penalty() -> None:
    # after [2, 5]: EOS (0.6) finishes a beam of 3 tokens; the live beams go on for 6 tokens
    for penalty in (0.0, 1.0, 3.0):
        beams = search(2, 6, length_penalty=penalty)
        best = beams.best(0)
        scores = [beam_score(b, penalty) for b in best]
        assert scores == sorted(scores, reverse=True)
        finished = [b for b in beams.searches[0].completed if b.tokens[-1] == EOS]
        assert finished and all(b.finish_reason == "stop" and b.stop_reason == EOS for b in finished)
        assert len({tuple(b.tokens) for b in best}) == len(best) == 2
    # a high penalty favours the longer live beams over the short finished one; none, the likelier finished one
    assert search(2, 6, length_penalty=0.0).best(0)[0].tokens[2:] == [2, 5, EOS]
    assert all(b.finish_reason == "length" for b in search(2, 6, length_penalty=3.0).best(0))


def test_the_score_counts_the_generated_tokens_and_a_final_eos() -> None:
    assert get_beam_search_score(4, -2.0, 1.0) == -0.5
    assert get_beam_search_score(4, -2.0, 0.0) == -2.0
    assert get_beam_search_score(0, -1.0, 2.0) == -1.0  # an aborted beam that made no token
    beams = search(2, 6, length_penalty=1.0)
    eos_beam = next(b for b in beams.searches[0].completed if b.tokens[2:] == [2, 5, EOS])
    assert beam_score(eos_beam, 1.0) == pytest.approx(math.log(0.4 * 0.9 * 0.6) / 3)


def test_ignore_eos_makes_eos_a_token_like_any_other() -> None:
    beams = search(2, 4, ignore_eos=True)
    assert not beams.searches[0].completed
    assert all(len(b.tokens) == 6 and b.finish_reason == "length" for b in beams.best(0))


def test_a_round_holds_every_live_beam_of_every_prompt() -> None:
    beams = BeamSearch([(None, [8, 9]), (None, [7, 9])], BeamSearchParams(3, 4), Words(), max_model_len=64)
    assert beams.round() == [[8, 9], [7, 9]]  # each prompt starts as one beam
    beams.advance(model_round(beams.round(), beams.round_params))
    assert len(beams.round()) == 6 and beams.round()[:3] == [[8, 9, 1], [8, 9, 2], [8, 9, 3]]
    beams.run(model_round)
    assert beams.round() == [] and len(beams.round_times) == 4
    assert generated(beams, 0) == generated(beams, 1)


def test_the_round_request_is_one_greedy_token_with_two_candidates_per_beam() -> None:
    one = round_params(BeamSearchParams(4, 10))
    assert (one.temperature, one.max_tokens, one.logprobs) == (0.0, 1, 8)
    assert round_params(BeamSearchParams(2, 10, logprobs=7)).logprobs == 7  # the answer shows 7 per token
    # those beyond a beam's 2 * width candidates (only for the answer's top-k) are never candidates
    assert generated(search(1, 2, logprobs=5)) == generated(search(1, 2))


def test_an_aborted_round_ends_its_prompt_with_the_beams_it_had() -> None:
    beams = BeamSearch([(None, [8, 9]), (None, [7, 9])], BeamSearchParams(2, 4), Words(), max_model_len=64)
    beams.advance(model_round(beams.round(), beams.round_params))
    outputs = model_round(beams.round(), beams.round_params)
    outputs[0].outputs[0].finish_reason = "abort"  # a beam of the first prompt (the server stopping)
    beams.advance(outputs)
    beams.run(model_round)
    aborted, whole = beams.best(0), beams.best(1)
    assert [b.finish_reason for b in aborted] == ["abort", "abort"] and all(len(b.tokens) == 3 for b in aborted)
    assert [b.finish_reason for b in whole] == ["stop", "length"]  # the other prompt ran its 4 rounds
    assert whole[0].tokens == [7, 9, 2, 5, EOS] and len(whole[1].tokens) == 6


def test_offline_answers_are_vllms_shape() -> None:
    (answer,) = search(2, 6, length_penalty=0.0).outputs()
    best = answer.sequences[0]
    assert best.tokens == [8, 9, 2, 5, EOS] and best.text == "w8 w9 w2 w5"  # the prompt's too; EOS skipped
    assert len(best.logprobs) == 3 and best.logprobs[1][5].logprob == pytest.approx(math.log(0.9))


@pytest.mark.parametrize("include_eos", [False, True])
def test_served_answers_are_vllms_shape(include_eos: bool) -> None:
    beams = search(2, 6, length_penalty=0.0, include_stop_str_in_output=include_eos, logprobs=2)
    (out,) = beams.request_outputs(["cmpl-1-0"])
    assert out.request_id == "cmpl-1-0" and out.finished and out.prompt_token_ids == [8, 9]
    assert out.num_cached_tokens == 3 and len(out.metrics.token_times) == 6
    first = out.outputs[0]
    assert (first.index, first.finish_reason, first.stop_reason) == (0, "stop", EOS)
    assert first.text == first.delta_text == "w2 w5"  # never the EOS
    assert first.token_ids == first.delta_token_ids == ([2, 5, EOS] if include_eos else [2, 5])
    assert len(first.logprobs) == len(first.token_ids)  # one position per token shown
    assert first.cumulative_logprob == pytest.approx(math.log(0.4 * 0.9 * 0.6))
    assert [o.index for o in out.outputs] == [0, 1] and out.outputs[1].finish_reason == "length"
    no_logprobs = search(2, 6).request_outputs(["x"])[0]
    assert no_logprobs.outputs[0].logprobs is None


def test_limits() -> None:
    with pytest.raises(PromptTooLongError, match="max_model_len 10"):
        BeamSearch([(None, [1] * 8)], BeamSearchParams(2, 4), Words(), max_model_len=10)
    unbounded = BeamSearch([(None, [1] * 8)], BeamSearchParams(2, None), Words(), max_model_len=10)
    assert unbounded.max_rounds == 2  # up to the context
    with pytest.raises(InvalidParameterError, match="empty"):
        BeamSearch([(None, [])], BeamSearchParams(2, 4), Words(), max_model_len=10)
    for bad in (
        dict(beam_width=0),
        dict(beam_width=MAX_BEAM_WIDTH + 1),
        dict(max_tokens=0),
        dict(length_penalty=float("nan")),
        dict(length_penalty=11.0),
        dict(temperature=-1.0),
    ):
        with pytest.raises(InvalidParameterError):
            BeamSearchParams(**{"beam_width": 2, "max_tokens": 4, **bad})
    params = BeamSearchParams(3, 4)
    assert params.n == 3 and params.structured_outputs is None
