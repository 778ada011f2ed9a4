"""The sampler on synthetic logits: every parameter changes the outcome the way it should."""

import math
from collections import Counter

import torch

from tokenmill.runner.sampler import Sampler, SamplingRow
from tokenmill.sampling_params import SamplingParams

V = 8


def row(i: int = 0, logits_row: int = 0, prompt=(), output=(), banned=(), seed=None, **params) -> SamplingRow:
    return SamplingRow(i, logits_row, SamplingParams(**params), list(prompt), list(output), list(banned), seed)


def logits_from_probs(probs: list[float]) -> torch.Tensor:
    return torch.tensor([[math.log(p) if p > 0 else -1e9 for p in probs]])


def draw(sampler: Sampler, logits: torch.Tensor, n: int, **params) -> Counter:
    """n independent draws from one logits row (n rows with distinct seeds)."""
    rows = [row(i, seed=i, **params) for i in range(n)]
    return Counter(t.token_id for t in sampler.sample(logits, rows))


def test_greedy_is_argmax() -> None:
    logits = torch.tensor([[0.1, 3.0, 2.0, -1.0], [5.0, 0.0, 0.0, 0.0]])
    out = Sampler(torch.device("cpu")).sample(logits, [row(0, 0, temperature=0), row(1, 1, temperature=0)])
    assert [t.token_id for t in out] == [1, 0]


def test_temperature_sampling_follows_the_distribution() -> None:
    probs = [0.5, 0.3, 0.15, 0.05, 0, 0, 0, 0]
    counts = draw(Sampler(torch.device("cpu")), logits_from_probs(probs), 4000, temperature=1.0)
    for token, p in enumerate(probs[:4]):
        assert abs(counts[token] / 4000 - p) < 4 * math.sqrt(p * (1 - p) / 4000) + 1e-3


def test_low_temperature_sharpens() -> None:
    counts = draw(Sampler(torch.device("cpu")), logits_from_probs([0.4, 0.35, 0.25] + [0] * 5), 500, temperature=0.01)
    assert counts[0] > 490


def test_top_k_top_p_min_p_cut_the_tail() -> None:
    sampler = Sampler(torch.device("cpu"))
    logits = logits_from_probs([0.4, 0.3, 0.2, 0.1, 0, 0, 0, 0])
    assert set(draw(sampler, logits, 400, top_k=2)) == {0, 1}
    assert set(draw(sampler, logits, 400, top_p=0.65)) == {0, 1}  # 0.4 + 0.3 reaches 0.65
    assert set(draw(sampler, logits, 400, top_p=0.7)) == {0, 1}  # exactly reached: the third is not needed
    assert set(draw(sampler, logits, 400, top_p=0.71)) == {0, 1, 2}
    assert set(draw(sampler, logits, 400, min_p=0.6)) == {0, 1}  # keeps p >= 0.6 * 0.4
    assert set(draw(sampler, logits, 400, top_k=1)) == {0}


def test_logit_bias_and_bans() -> None:
    sampler = Sampler(torch.device("cpu"))
    logits = torch.tensor([[5.0, 4.0, 3.0, 0, 0, 0, 0, 0]])
    assert sampler.sample(logits, [row(temperature=0, logit_bias={0: -100})])[0].token_id == 1
    assert sampler.sample(logits, [row(temperature=0, logit_bias={7: 100})])[0].token_id == 7
    assert sampler.sample(logits, [row(temperature=0, banned=[0, 1])])[0].token_id == 2
    assert set(draw(sampler, logits, 200, logit_bias={0: -100, 1: -100, 2: -100})) <= {3, 4, 5, 6, 7}


def test_penalties() -> None:
    sampler = Sampler(torch.device("cpu"))
    logits = torch.tensor([[2.0, 1.5, 1.0, -1.0, 0, 0, 0, 0]])
    # repetition: 2.0 / 2 = 1.0 < 1.5
    assert sampler.sample(logits, [row(temperature=0, prompt=[0], repetition_penalty=2.0)])[0].token_id == 1
    # frequency counts occurrences in the output: 2.0 - 3 * 0.3 = 1.1 < 1.5
    out = sampler.sample(logits, [row(temperature=0, output=[0, 0, 0], frequency_penalty=0.3)])
    assert out[0].token_id == 1
    assert sampler.sample(logits, [row(temperature=0, output=[0], frequency_penalty=0.3)])[0].token_id == 0
    # presence counts once: 2.0 - 0.6 = 1.4 < 1.5, however often it appeared
    assert sampler.sample(logits, [row(temperature=0, output=[0], presence_penalty=0.6)])[0].token_id == 1
    # the prompt does not count for presence/frequency
    assert sampler.sample(logits, [row(temperature=0, prompt=[0], presence_penalty=2.0)])[0].token_id == 0
    # a negative logit is multiplied by the repetition penalty
    logits2 = torch.tensor([[-1.0, -1.5, -9.0, -9, -9, -9, -9, -9]])
    assert sampler.sample(logits2, [row(temperature=0, output=[0], repetition_penalty=2.0)])[0].token_id == 1


def test_penalties_match_their_dense_definition_row_by_row() -> None:
    """Several rows with different penalties at once: each row's logits are exactly vLLM's dense formula
    (seen tokens: positive / r, negative * r; then - frequency * count - presence * (count > 0))."""
    gen = torch.Generator().manual_seed(0)
    vocab = 300
    logits = torch.randn(4, vocab, generator=gen) * 3
    rows = [
        row(0, 0, prompt=[1, 2, 2, 5], output=[5, 7, 7, 7], repetition_penalty=1.3, frequency_penalty=0.4),
        row(1, 1, prompt=[9], output=[3, 3], presence_penalty=-0.5, temperature=0),
        row(2, 2, prompt=[4, 8], output=[], repetition_penalty=0.7, presence_penalty=1.0),
        row(3, 3, prompt=[0], output=[0, 1]),  # nothing to apply
    ]
    got = Sampler(torch.device("cpu"))._apply_biases_and_penalties(logits.clone(), rows)
    for i, r in enumerate(rows):
        expected = logits[i].clone()
        p = r.params
        seen = torch.zeros(vocab, dtype=torch.bool)
        seen[r.prompt_token_ids + r.output_token_ids] = True
        if p.repetition_penalty != 1.0:
            rep = p.repetition_penalty
            expected = torch.where(seen, torch.where(expected > 0, expected / rep, expected * rep), expected)
        counts = torch.bincount(torch.tensor(r.output_token_ids, dtype=torch.int64), minlength=vocab).float()
        expected = expected - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).float()
        torch.testing.assert_close(got[i], expected, rtol=0, atol=1e-6)


def test_seed_makes_a_row_independent_of_its_batch() -> None:
    logits = torch.randn(1, 1000)
    alone = Sampler(torch.device("cpu"))
    tokens_alone = [alone.sample(logits, [row(7, seed=1234)])[0].token_id for _ in range(10)]
    mixed = Sampler(torch.device("cpu"))
    tokens_mixed = []
    for step in range(10):
        others = [row(100 + j, seed=None) for j in range(step % 4)]
        rows = others + [row(7, seed=1234)] + [row(200 + j, seed=j) for j in range(3)]
        tokens_mixed.append(mixed.sample(logits, rows)[len(others)].token_id)
    assert tokens_alone == tokens_mixed
    assert len(set(tokens_alone)) > 1  # it is really sampling


def test_logprobs_are_the_raw_distribution() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.5, 0, 0, 0, 0]])
    out = Sampler(torch.device("cpu")).sample(
        logits, [row(temperature=0, logprobs=3, repetition_penalty=2.0, prompt=[1])]
    )[0]
    expected = torch.log_softmax(logits[0], -1)
    assert out.token_id == 2  # the penalty moved 3.0 to 1.5, below 2.0
    assert out.rank == 2 and abs(out.logprob - expected[2].item()) < 1e-6
    assert [t for t, _ in out.top_logprobs] == [1, 2, 0]
    assert all(abs(lp - expected[t].item()) < 1e-6 for t, lp in out.top_logprobs)


def test_rows_can_share_logits() -> None:
    """n samples of one prompt read the same logits row."""
    logits = torch.tensor([[0.0] * 8, [0.0, 0, 0, 0, 0, 0, 0, 10.0]])
    out = Sampler(torch.device("cpu")).sample(logits, [row(0, 1, temperature=0), row(1, 1, temperature=0)])
    assert [t.token_id for t in out] == [7, 7]


def test_argmax_rows_is_torch_argmax_with_first_ties_and_nan() -> None:
    from tokenmill.runner.sampler import argmax_rows

    x = torch.randn(6, 500)
    x[1, 7] = float("nan")
    x[2] = 1.0  # all tied: the first index
    x[3, 10] = x[3, 20] = x[3].max() + 1
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
    assert torch.equal(argmax_rows(x[:, ::3]), x[:, ::3].argmax(dim=-1))  # strided rows
    assert argmax_rows(x).tolist()[1:4] == [7, 0, 10]


def test_a_spent_thinking_budget_writes_the_closing_tag() -> None:
    from tokenmill.runner.sampler import budget_token
    from tokenmill.sampling_params import ThinkingBudget

    inside = ThinkingBudget(3, end_ids=[7, 8])  # the prompt opened the block
    assert budget_token(inside, [1, 2]) is None
    assert budget_token(inside, [1, 2, 3]) == 7 and budget_token(inside, [1, 2, 3, 7]) == 8
    assert budget_token(inside, [1, 2, 3, 7, 8]) is None and budget_token(inside, [1, 7, 8, 4, 5]) is None
    opens = ThinkingBudget(2, end_ids=[7, 8], start_ids=[5])  # the reply opens its own
    assert budget_token(opens, [1, 2, 3, 4]) is None  # not thinking
    assert budget_token(opens, [5, 1]) is None and budget_token(opens, [5, 1, 2]) == 7


def test_allowed_token_ids_mask_everything_else() -> None:
    """vLLM's allowed_token_ids: only these can be sampled, greedy or not, and with min_tokens banning every one of
    them the mask still holds (as a constraint's does); log-probabilities stay the raw distribution's."""
    sampler = Sampler(torch.device("cpu"))
    logits = logits_from_probs([0.5, 0.3, 0.1, 0.05, 0.05, 0, 0, 0])
    greedy = sampler.sample(logits, [row(temperature=0, allowed_token_ids=[2, 4], logprobs=0)])[0]
    assert greedy.token_id == 2 and abs(greedy.logprob - math.log(0.1)) < 1e-5 and greedy.rank == 3
    assert set(draw(sampler, logits, 300, temperature=1.0, allowed_token_ids=[3, 4])) == {3, 4}
    only = sampler.sample(logits, [row(temperature=0, banned=[3], allowed_token_ids=[3])])[0]
    assert only.token_id == 3
    both = torch.cat([logits, logits])  # a row without the mask beside one with it
    out = sampler.sample(both, [row(0, 0, temperature=0), row(1, 1, temperature=0, allowed_token_ids=[1])])
    assert [t.token_id for t in out] == [0, 1]


def test_logprob_token_ids_are_scored_whatever_their_rank() -> None:
    """vLLM's logprob_token_ids: each listed token's raw log-probability and true rank, in the order listed, beside
    the top ones when those are asked too."""
    sampler = Sampler(torch.device("cpu"))
    probs = [0.5, 0.3, 0.1, 0.05, 0.05, 0, 0, 0]
    (token,) = sampler.sample(logits_from_probs(probs), [row(temperature=0, logprob_token_ids=[3, 1])])
    assert token.token_id == 0 and token.top_logprobs is None
    assert [(t, r) for t, _, r in token.listed_logprobs] == [(3, 4), (1, 2)]
    assert [round(math.exp(lp), 5) for _, lp, _ in token.listed_logprobs] == [0.05, 0.3]
    (token,) = sampler.sample(logits_from_probs(probs), [row(temperature=0, logprobs=1, logprob_token_ids=[2])])
    assert [t for t, _ in token.top_logprobs] == [0] and [t for t, _, _ in token.listed_logprobs] == [2]


def test_a_rows_logprob_is_the_same_bits_alone_and_in_a_batch() -> None:
    """The chosen token's log-probability (every request's cumulative_logprob) and the listed ones do not depend on
    the other rows: 40 rows of a 49,152-token vocabulary, where logsumexp's reduction gave a row another last bit
    in the batch than alone."""
    logits = torch.randn(40, 49152, generator=torch.Generator().manual_seed(0)) * 4
    sampler = Sampler(torch.device("cpu"))
    for params in ({}, {"logprobs": 2}):
        batch = sampler.sample(logits, [row(i, i, temperature=0, **params) for i in range(40)])
        for i in range(40):
            alone = sampler.sample(logits[i : i + 1], [row(i, 0, temperature=0, **params)])[0]
            assert (alone.token_id, alone.logprob, alone.top_logprobs) == (
                batch[i].token_id,
                batch[i].logprob,
                batch[i].top_logprobs,
            )
