"""Speculative decoding (n-gram prompt lookup and a draft model): proposals, their scheduling, and outputs exactly as
without it."""

import json
import math
from collections import Counter

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.errors import InvalidParameterError
from tokenmill.scheduler.block_manager import BlockManager
from tokenmill.scheduler.kv_cache_manager import KVCacheManager
from tokenmill.scheduler.scheduler import Scheduler, SchedulerConfig
from tokenmill.scheduler.sequence import Sequence
from tokenmill.spec_decode import SpeculativeConfig
from tokenmill.spec_decode.acceptance import AcceptanceTracker
from tokenmill.spec_decode.draft_model import DraftCacheLedger
from tokenmill.spec_decode.ngram import propose_ngram

# every proposal the method offers, in batches of any size: what is tested is that proposals never change outputs
ALWAYS = {"num_speculative_tokens": 4, "disable_by_batch_size": 64, "verify_row_cost": 0}
NGRAM = {"method": "ngram", **ALWAYS}
# the draft: the bundled model's 4-bit copy (`auto`) proposing for the float32 model
DRAFT = {"method": "draft_model", "model": "smollm2-135m", **ALWAYS}
PASSAGE = (
    "The river wound slowly through the valley, past old stone farmhouses and fields of barley. In the evening the "
    "light turned gold and the swallows flew low over the water. Children ran along the bank, calling to each "
    "other, while their parents talked quietly on the bridge. Far away a church bell rang seven times."
)
COPY = [{"role": "user", "content": "Repeat this passage word for word:\n\n" + PASSAGE}]


def test_ngram_proposals() -> None:
    # the most recent earlier occurrence of the longest suffix n-gram, and what followed it
    assert propose_ngram([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3], 3, 1, 2) == [7, 5]
    assert propose_ngram([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3], 3, 1, 5) == [7, 5, 1, 2, 3]
    assert propose_ngram([5, 6, 7, 8, 6], 3, 1, 3) == [7, 8, 6]  # only a 1-gram matches
    assert propose_ngram([5, 6, 7, 8, 6], 3, 2, 3) == []  # ... which is below prompt_lookup_min
    assert propose_ngram([1, 2, 3], 2, 1, 4) == [] and propose_ngram([4, 4], 2, 1, 0) == []


def test_speculative_config_is_checked() -> None:
    parsed = SpeculativeConfig.parse(json.dumps({"method": "ngram", "num_speculative_tokens": 3}))
    assert parsed == SpeculativeConfig("ngram", 3)
    for bad in (
        {"method": "eagle", "num_speculative_tokens": 3},
        {"method": "ngram"},
        {"method": "ngram", "num_speculative_tokens": 0},
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 5},
        {"method": "ngram", "num_speculative_tokens": 3, "lookahead": 1},
        {"method": "draft_model", "num_speculative_tokens": 3},  # which model?
        {"method": "ngram", "num_speculative_tokens": 3, "model": "smollm2-135m"},
        {**DRAFT, "quantization": "fp4"},
        {**NGRAM, "verify_row_cost": -1},
        "{not json",
        [1],
    ):
        with pytest.raises(InvalidParameterError, match="speculative_config"):
            SpeculativeConfig.parse(bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidParameterError, match="speculative_config"):
        LLM(speculative_config={"method": "ngram", "num_speculative_tokens": 99})


def test_a_draft_model_must_share_the_tokenizer() -> None:
    """Checked before either model's weights are read."""
    with pytest.raises(InvalidParameterError, match="another tokenizer"):
        LLM(quantization="auto", speculative_config={**DRAFT, "model": "gemma3-270m"})


def test_the_scheduler_computes_proposals_and_counts_only_accepted_ones() -> None:
    """A decoding sequence with proposals computes 1 + K tokens in one step (blocks for all of them, within the
    token budget); only the accepted ones then count as computed (and reach the prefix cache)."""
    for accepted in (0, 2):
        bm = BlockManager(8, 4)
        sched = Scheduler(
            SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=6, max_model_len=32), KVCacheManager(bm)
        )
        seq = Sequence(0, "r", [1, 2, 3, 4, 5], SamplingParams(max_tokens=10))
        sched.add(seq)
        sched.update_from_output(sched.schedule())  # the prompt
        seq.append_token(6)
        seq.num_lookahead_tokens = 6  # more than the budget leaves room for
        out = sched.schedule()
        (s,) = out.scheduled
        assert (s.start, s.num_new_tokens, s.num_draft_tokens, s.completes_sequence) == (5, 6, 5, True)
        assert len(seq.block_table) == 3  # positions 0 .. 10
        if accepted == 0:
            sched.update_from_output(out)
            assert seq.num_computed_tokens == 6  # the real token only
        else:
            seq.token_ids += [7, 8, 5]  # two proposals accepted, then a token of the model's own
            sched.update_from_output(out, {seq.seq_id: 2})
            assert seq.num_computed_tokens == 8 and len(bm.block_hashes(seq, 8)) == 2
    # out of blocks for the proposals: the step computes the one real token and preempts nobody
    small = Scheduler(SchedulerConfig(4, 16, 32), KVCacheManager(BlockManager(3, 4)))
    first, second = Sequence(1, "a", list(range(7)), SamplingParams()), Sequence(2, "b", [1, 2, 3], SamplingParams())
    for s in (first, second):
        small.add(s)
    small.update_from_output(small.schedule())  # 2 + 1 blocks: all of them
    first.append_token(7)
    first.num_lookahead_tokens = 4  # positions 7 .. 11 would need a third block
    out = small.schedule()
    assert [(s.seq, s.num_new_tokens, s.num_draft_tokens) for s in out.scheduled][0] == (first, 1, 0)
    assert not out.preempted


def test_proposals_are_as_many_as_pay_for_their_rows() -> None:
    """A sequence whose proposals hold proposes all K while few run and fewer in a large batch; one whose
    proposals fail stops proposing, and tries again after some steps without."""
    tracker = AcceptanceTracker()
    assert 1 <= tracker.proposal_length(0, 4, 1) < 4  # a new sequence: a rate of one half
    assert tracker.proposal_length(0, 4, 64) == 1  # which alone would not pay in a large batch: it tries one
    for _ in range(10):
        tracker.observe(0, 4, 4)  # all accepted
        tracker.observe(1, 4, 0)  # none
    assert tracker.rate(0) > 0.9 and tracker.rate(1) < 0.15
    assert tracker.proposal_length(0, 4, 1) == 4
    assert 0 < tracker.proposal_length(0, 4, 64) < tracker.proposal_length(0, 4, 16)
    assert tracker.proposal_length(0, 2, 1) == 2  # never more than the room
    assert tracker.proposal_length(1, 4, 1) == 0
    steps = 0
    while tracker.proposal_length(1, 4, 1) == 0:
        tracker.idle(1)
        steps += 1
    assert 3 <= steps <= 20
    tracker.release(0)
    assert tracker.rate(0) == 0.5


def test_the_draft_model_knows_how_much_of_its_cache_holds() -> None:
    ledger = DraftCacheLedger()
    seq = Sequence(0, "r", [1, 2, 3, 4, 5], SamplingParams())
    seq.append_token(6)
    assert ledger.valid_prefix(seq) == 0  # never computed
    ledger.record(seq, [7, 8, 9])  # tokens 1 .. 6, then proposals 7, 8, 9 fed back (a 4th proposal was not)
    seq.token_ids += [7, 5, 9, 4]  # one accepted, the target's own 5, then two steps without speculation
    assert ledger.valid_prefix(seq) == 7  # through the accepted 7 (its 8 there is wrong, whatever follows)
    seq.token_ids[-4:] = [7, 8, 5]  # two accepted, then a token of the target's own
    assert ledger.valid_prefix(seq) == 8  # through the accepted 8
    seq.token_ids[-3:] = [7, 8, 9, 10, 11]  # all four accepted, and one more
    assert ledger.valid_prefix(seq) == 9  # the 4th proposal and the target's token are new to the draft
    seq.num_preemptions += 1  # its blocks were freed, the draft's K/V in them too
    assert ledger.valid_prefix(seq) == 0
    ledger.record(seq, [])
    ledger.release(seq.seq_id)
    assert ledger.valid_prefix(seq) == 0


@pytest.fixture(scope="module")
def spec_llm() -> LLM:
    return LLM(speculative_config=NGRAM)  # float32, as the shared `llm`


@pytest.fixture(scope="module")
def draft_llm() -> LLM:
    return LLM(speculative_config=DRAFT)  # float32, its 4-bit copy drafting


def _outputs(outs) -> list[tuple]:
    return [(o.token_ids, o.text, o.finish_reason, o.stop_reason) for out in outs for o in out.outputs]


@pytest.mark.slow
def test_greedy_float32_reference_prompts_are_unchanged(llm: LLM, spec_llm: LLM, smollm2_reference: dict) -> None:
    prompts = [{"prompt_token_ids": g["prompt_ids"]} for g in smollm2_reference["generations"]]
    prompts.append({"prompt_token_ids": spec_llm.engine.encode_chat(COPY)})
    greedy = SamplingParams(temperature=0, max_tokens=40)
    before = spec_llm.stats()["spec_decode_num_accepted_tokens"]
    plain = llm.generate(prompts, greedy, use_tqdm=False)
    assert _outputs(spec_llm.generate(prompts, greedy, use_tqdm=False)) == _outputs(plain)
    assert spec_llm.stats()["spec_decode_num_accepted_tokens"] - before > 30  # the copy request copied


@pytest.fixture(scope="module")
def mixed_requests(llm: LLM, smollm2_reference: dict) -> tuple[list[dict], list[SamplingParams], list]:
    """32 requests of every kind, and what plain decoding (the shared `llm`) answers them."""
    from tests.test_engine import mixed_prompts

    prompts = [{"prompt_token_ids": p[:96]} for p in mixed_prompts(llm, smollm2_reference)]  # decode matters here
    copy = {"prompt_token_ids": llm.engine.encode_chat(COPY)}
    prompts[-4:] = [copy, copy, copy, copy]  # the same prompt four times: prefix-cache hits
    params = []
    for i in range(len(prompts)):
        kind = i % 4
        if kind == 0:
            params.append(SamplingParams(temperature=0, max_tokens=20, stop=["farmhouses", "\n\n", " the"]))
        elif kind == 1:
            params.append(SamplingParams(temperature=0, max_tokens=16, n=2, logprobs=2))
        elif kind == 2:
            params.append(SamplingParams(temperature=0.8, top_p=0.95, seed=i, max_tokens=16))
        else:
            params.append(SamplingParams(temperature=0, max_tokens=16, repetition_penalty=1.1, stop=["valley"]))
    return prompts, params, llm.generate(prompts, params, use_tqdm=False)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_a_mixed_batch_is_unchanged(mixed_requests: tuple, method: str, request) -> None:
    """32 requests at once: stop strings (inside accepted runs too), n > 1, seeds, logprobs, prefix-cache hits."""
    spec_llm = request.getfixturevalue("spec_llm" if method == "ngram" else "draft_llm")
    prompts, params, plain = mixed_requests
    before = spec_llm.stats()
    fast = spec_llm.generate(prompts, params, use_tqdm=False)
    assert _outputs(fast) == _outputs(plain)
    for a, b in zip(plain, fast, strict=True):
        for oa, ob in zip(a.outputs, b.outputs, strict=True):
            if oa.logprobs is not None:
                for pa, pb in zip(oa.logprobs, ob.logprobs, strict=True):
                    assert set(pa) == set(pb) and all(abs(pa[t].logprob - pb[t].logprob) < 1e-3 for t in pa)
    after = spec_llm.stats()
    accepted = after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
    proposed = after["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"]
    assert accepted > 0
    if method == "draft_model":  # the 4-bit copy mostly agrees with the float32 model (less on random tokens)
        assert proposed > 500 and accepted > 0.5 * proposed
    assert after["prefix_cache_hit_tokens"] > before["prefix_cache_hit_tokens"]
    spec_llm.engine.check_integrity()


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_constrained_requests_speculate_and_keep_their_tokens(llm: LLM, method: str, request) -> None:
    """A constrained request proposes as others do: each verified row is masked where its grammar is after the
    tokens before it, so the output is what the constrained request gives without proposals, and the copy the
    grammar allows is accepted in runs."""
    spec_llm = request.getfixturevalue("spec_llm" if method == "ngram" else "draft_llm")
    prompt = {"prompt_token_ids": llm.engine.encode_chat(COPY)}
    constraints = [{"regex": "The river [a-z ,.]{10,300}"}, {"choice": [PASSAGE[:60], PASSAGE[:90]]}]
    params = [SamplingParams(temperature=0, max_tokens=48, structured_outputs=c) for c in constraints]
    params.append(SamplingParams(temperature=0.7, seed=4, max_tokens=32, structured_outputs=constraints[0]))
    plain = llm.generate([prompt] * len(params), params, use_tqdm=False)
    before = spec_llm.stats()
    fast = spec_llm.generate([prompt] * len(params), params, use_tqdm=False)
    assert _outputs(fast) == _outputs(plain)
    assert fast[0].outputs[0].text.startswith("The river") and fast[1].outputs[0].text in (PASSAGE[:60], PASSAGE[:90])
    after = spec_llm.stats()
    assert after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"] > 10
    spec_llm.engine.check_integrity()


@pytest.fixture(scope="module")
def auto_pair(offline: LLM) -> tuple[LLM, LLM]:
    """`auto` engines without (conftest.py's shared one) and with proposals (verified by the native decoder, as
    generated tokens are)."""
    return offline, LLM(quantization="auto", speculative_config=NGRAM)


@pytest.mark.slow
def test_greedy_auto_reference_prompts_are_unchanged(auto_pair, smollm2_reference: dict) -> None:
    plain, fast = auto_pair
    prompts = [{"prompt_token_ids": g["prompt_ids"]} for g in smollm2_reference["generations"]]
    prompts.append({"prompt_token_ids": plain.engine.encode_chat(COPY)})
    greedy = SamplingParams(temperature=0, max_tokens=64)
    for prompt in prompts:
        assert _outputs(fast.generate(prompt, greedy, use_tqdm=False)) == _outputs(
            plain.generate(prompt, greedy, use_tqdm=False)
        )
    assert fast.stats()["spec_decode_num_accepted_tokens"] > 30


@pytest.mark.slow
def test_a_draft_model_keeps_its_cache_right_through_preemption() -> None:
    """The `auto` model drafting for itself proposes exactly what it then samples greedily, as long as its own
    K/V cache is right: all proposals are accepted, also for sequences preempted (their blocks freed and given out
    again) and recomputed, and for the n > 1 samples forked from a prompt. A draft that kept using K/V it lost
    would propose wrong tokens. The outputs are those of plain decoding with room for every sequence."""
    from tests.test_engine import offline_workload

    workload = offline_workload(6)  # prompts of 40 .. 300 tokens
    prompts = [{"prompt_token_ids": p} for p, _ in workload]
    params = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, n=1 + i % 2) for i in range(6)]
    roomy = LLM(quantization="auto", num_kv_blocks=1024)
    expected = _outputs(roomy.generate(prompts, params, use_tqdm=False))
    itself = {**DRAFT, "quantization": "auto"}
    # 9 sequences, 1,000-odd tokens with their outputs, 768 slots
    tight = LLM(quantization="auto", num_kv_blocks=48, max_num_batched_tokens=1024, speculative_config=itself)
    assert _outputs(tight.generate(prompts, params, use_tqdm=False)) == expected
    stats = tight.stats()
    assert stats["num_preemptions"] > 0
    assert stats["spec_decode_num_draft_tokens"] > 200
    assert stats["spec_decode_num_accepted_tokens"] >= 0.99 * stats["spec_decode_num_draft_tokens"]
    tight.engine.check_integrity()


@pytest.mark.slow
def test_an_int8_kv_cache_speculates_with_the_same_tokens() -> None:
    """K/V in int8 for the target and its draft alike (the draft's cache takes the engine's kv_cache_dtype): the
    `auto` model drafting for itself proposes what it then samples, so every proposal is accepted and the tokens
    are plain int8 decoding's (measured: 186 of 186 accepted)."""
    from tests.test_engine import offline_workload

    prompts = [{"prompt_token_ids": p} for p, _ in offline_workload(6)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = LLM(quantization="auto", kv_cache_dtype="int8", num_kv_blocks=256)
    expected = _outputs(plain.generate(prompts, params, use_tqdm=False))
    itself = {**DRAFT, "quantization": "auto"}
    spec = LLM(quantization="auto", kv_cache_dtype="int8", num_kv_blocks=256, speculative_config=itself)
    assert spec.engine.drafter is not None and spec.engine.drafter.runner.kv_dtype == torch.int8
    assert _outputs(spec.generate(prompts, params, use_tqdm=False)) == expected
    stats = spec.stats()
    assert stats["spec_decode_num_draft_tokens"] > 100
    assert stats["spec_decode_num_accepted_tokens"] >= 0.95 * stats["spec_decode_num_draft_tokens"]


def _chi_square(a: Counter, b: Counter) -> tuple[float, int]:
    """Two-sample chi-square statistic over the categories (rare ones pooled) and its degrees of freedom."""
    na, nb = sum(a.values()), sum(b.values())
    common = [t for t in set(a) | set(b) if a[t] + b[t] >= 10]
    cells = [(a[t], b[t]) for t in common]
    cells.append((na - sum(a[t] for t in common), nb - sum(b[t] for t in common)))
    stat = 0.0
    for x, y in cells:
        total = x + y
        if total == 0:
            continue
        ex, ey = total * na / (na + nb), total * nb / (na + nb)
        stat += (x - ex) ** 2 / ex + (y - ey) ** 2 / ey
    return stat, len(cells) - 1


@pytest.mark.slow
def test_sampling_keeps_the_models_distribution(auto_pair) -> None:
    """Temperature 1, 300 samples each way (`auto`, for speed; seeded, with other seeds each way, so the test
    is the same on every run): the first positions where proposals are verified (the output's 2nd to 4th tokens)
    come from the same distribution. Threshold: the chi-square statistic below about its 0.999 quantile
    (df + 3.1 sqrt(2 df) + 1). Accepting every proposal moves mass onto the proposed tokens and fails it."""
    plain_llm = auto_pair[0]
    # 1-gram lookups propose at almost every position, and mostly tokens the model would not sample: a wrong
    # acceptance rule cannot hide behind proposals that were likely anyway
    one_gram = {**NGRAM, "num_speculative_tokens": 2, "prompt_lookup_max": 1, "prompt_lookup_min": 1}
    spec_llm = LLM(quantization="auto", speculative_config=one_gram)
    prompt = {"prompt_token_ids": plain_llm.engine.encode_chat(COPY)}
    draws = 300

    def params(first_seed: int) -> list[SamplingParams]:  # independent samples, the same on every run
        return [SamplingParams(temperature=1.0, max_tokens=4, seed=first_seed + i) for i in range(draws)]

    plain = plain_llm.generate([prompt] * draws, params(10**6), use_tqdm=False)  # other seeds than below
    before = spec_llm.stats()["spec_decode_num_drafts"]
    fast = spec_llm.generate([prompt] * draws, params(0), use_tqdm=False)
    assert spec_llm.stats()["spec_decode_num_drafts"] - before > draws / 2  # proposals were verified
    for position in (1, 2, 3):  # the token there (equal joint distributions have equal marginals)
        a = Counter(o.outputs[0].token_ids[position] for o in plain if len(o.outputs[0].token_ids) > position)
        b = Counter(o.outputs[0].token_ids[position] for o in fast if len(o.outputs[0].token_ids) > position)
        stat, df = _chi_square(a, b)
        assert stat < df + 3.1 * math.sqrt(2 * df) + 1, (position, stat, df, a.most_common(5), b.most_common(5))


@pytest.mark.slow
def test_seeded_sampling_gives_the_same_tokens(auto_pair) -> None:
    """One draw per emitted token, as without proposals: a seed gives the same output."""
    llm, spec_llm = auto_pair
    prompt = {"prompt_token_ids": llm.engine.encode_chat(COPY)}
    for seed in range(6):
        params = SamplingParams(temperature=0.7, top_k=40, seed=seed, max_tokens=60)
        assert _outputs(spec_llm.generate(prompt, params, use_tqdm=False)) == _outputs(
            llm.generate(prompt, params, use_tqdm=False)
        )


@pytest.mark.slow
@pytest.mark.server
def test_the_server_speculates_and_counts_it(auto_pair) -> None:
    """`tokenmill serve --speculative-config JSON`: the same answer as without it, and the counters on /metrics."""
    import httpx
    from openai import OpenAI

    from tests.server_utils import start_server

    server = start_server("--speculative-config", json.dumps({"method": "ngram", "num_speculative_tokens": 4}))
    try:
        client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        reply = client.chat.completions.create(model=client.models.list().data[0].id, messages=COPY, max_tokens=60,
                                               temperature=0)  # fmt: skip
        plain = auto_pair[0]
        expected = plain.chat(COPY, plain.get_default_sampling_params(temperature=0, max_tokens=60))[0].outputs[0]
        assert reply.choices[0].message.content == expected.text
        metrics = {
            line.split()[0].removeprefix("tokenmill:spec_decode_"): float(line.split()[1])
            for line in httpx.get(f"{server.url}/metrics").text.splitlines()
            if line.startswith("tokenmill:spec_decode")
        }
        assert metrics["num_accepted_tokens_total"] > 10  # measured 16 of the 60 tokens (one activation pass)
        assert metrics["num_emitted_tokens_total"] == metrics["num_accepted_tokens_total"] + metrics["num_drafts_total"]
        assert "enabled" in metrics
    finally:
        server.stop()


def test_step_descriptions_tell_proposed_and_accepted_tokens(auto_pair) -> None:
    """What the request explorer marks on its chips: per sequence and step, tokens proposed and accepted."""
    engine = auto_pair[1].engine
    engine.record_steps = True
    try:
        request_id = engine.add_request(None, {"prompt_token_ids": engine.encode_chat(COPY)}, SamplingParams(
            temperature=0, max_tokens=40))  # fmt: skip
        entries = []
        while request_id in engine.requests:
            engine.step()
            entries += [e for e in engine.last_step["batch"] if e["request_id"].startswith(request_id)]
    finally:
        engine.record_steps = False
    verified = [e for e in entries if e["proposed"]]
    assert verified and all(0 <= e["accepted"] <= e["proposed"] for e in verified)
    assert sum(e["accepted"] for e in verified) > 10
    assert all(e["accepted"] is None for e in entries if not e["proposed"])


@pytest.mark.slow
def test_sliding_window_models_draft_and_are_drafted_for(gemma3_path) -> None:
    """Gemma 3 (five layers with a window of 512 to one global) drafting, in its 4-bit file form, for itself in
    float32, past its window: the target's window layers keep their own pool, the draft (whose window layers read
    the full pool's block tables) proposes, and the tokens are plain greedy decoding's. (How the memory splits
    with a draft: tests/test_kv_cache_sizing.py.)"""
    from tests.test_gemma3 import long_prompt_text

    plain = LLM(str(gemma3_path), max_num_batched_tokens=256, num_kv_blocks=160)
    prompt = plain.get_tokenizer().encode(long_prompt_text())
    assert len(prompt) > 2 * plain.engine.model_config.sliding_window
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    expected = plain.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    config = {"method": "draft_model", "model": str(gemma3_path), "quantization": "auto", **ALWAYS}
    spec = LLM(str(gemma3_path), max_num_batched_tokens=256, num_kv_blocks=160, speculative_config=config)
    assert spec.engine.kv.window_pool is not None  # the target's window layers have their own pool
    got = spec.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    assert got[0].outputs[0].token_ids == expected[0].outputs[0].token_ids
    stats = spec.stats()
    assert stats["spec_decode_num_accepted_tokens"] > 0.5 * stats["spec_decode_num_draft_tokens"] > 0
    spec.engine.check_integrity()
