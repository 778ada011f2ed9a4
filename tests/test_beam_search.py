"""Beam search on real models (LLM.beam_search, engine/beam_search.py): width 1 is greedy; wider beams find likelier
sequences, whose log-probabilities the model itself confirms; the answers are distinct beams ranked with the length
penalty; and on a tiny random-weight Llama, Hugging Face transformers' beam search gives the same beams."""

from pathlib import Path

import pytest
import torch
import transformers

from tests.test_hf_checkpoints import tokenizer_files, write_tiny  # noqa: F401 (tokenizer_files: a fixture)
from tokenmill import LLM, BeamSearchParams, SamplingParams
from tokenmill.engine.beam_search import beam_score, get_beam_search_score

PROMPTS = ["The capital of France is", "def fibonacci(n):"]


def model_logprobs(llm: LLM, tokens: list[int], start: int) -> list[float]:
    """The model's log-probability of each of tokens[start:] after the tokens before it (one prefill)."""
    out = llm.generate({"prompt_token_ids": tokens}, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    return [out[0].prompt_logprobs[i][t].logprob for i, t in enumerate(tokens) if i >= start]


def test_width_one_is_greedy(llm: LLM) -> None:
    greedy = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    beams = llm.beam_search(PROMPTS, BeamSearchParams(beam_width=1, max_tokens=8, ignore_eos=True))
    assert len(beams) == len(PROMPTS)
    for g, b in zip(greedy, beams, strict=True):
        (seq,) = b.sequences
        assert seq.tokens == g.prompt_token_ids + g.outputs[0].token_ids
        assert seq.cum_logprob == pytest.approx(g.outputs[0].cumulative_logprob, abs=1e-3)
        assert seq.finish_reason == "length" and len(seq.logprobs) == 8
        assert seq.text == llm.get_tokenizer().decode(seq.tokens, skip_special_tokens=True)  # the prompt's too


def test_wider_beams_find_a_likelier_sequence_as_the_model_scores_it(llm: LLM) -> None:
    """Not a theorem (a beam can prune the greedy path for prefixes that end worse), but what beam search is for:
    here 3 beams find a sequence the model finds likelier than greedy's."""
    prompt = PROMPTS[0]
    greedy = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)[0]
    (answer,) = llm.beam_search(prompt, BeamSearchParams(beam_width=3, max_tokens=8, ignore_eos=True))
    best = answer.sequences[0]
    n = len(greedy.prompt_token_ids)
    ours = model_logprobs(llm, best.tokens, n)
    assert sum(ours) == pytest.approx(best.cum_logprob, abs=1e-3)
    assert sum(model_logprobs(llm, greedy.prompt_token_ids + greedy.outputs[0].token_ids, n)) == pytest.approx(
        greedy.outputs[0].cumulative_logprob, abs=1e-3
    )
    assert best.cum_logprob > greedy.outputs[0].cumulative_logprob + 0.1
    assert best.tokens != greedy.prompt_token_ids + greedy.outputs[0].token_ids


@pytest.mark.slow
def test_beams_are_distinct_and_ranked_with_the_length_penalty(llm: LLM) -> None:
    """A chat answer that ends soon: beams that reach EOS are kept aside and compete with the longer live ones
    by cumulative log-probability / generated tokens ** length_penalty."""
    question = [{"role": "user", "content": "What is 2+2? Reply with the number only."}]
    prompt = {"prompt_token_ids": llm.engine.encode_chat(question)}
    n = len(prompt["prompt_token_ids"])
    stop_ids = llm.get_tokenizer().stop_token_ids
    answers = {}
    for penalty in (0.0, 2.0):
        (answer,) = llm.beam_search(prompt, BeamSearchParams(beam_width=3, max_tokens=8, length_penalty=penalty))
        beams = answer.sequences
        assert len(beams) == 3 and len({tuple(b.tokens) for b in beams}) == 3
        scores = [beam_score(b, penalty) for b in beams]
        assert scores == sorted(scores, reverse=True)
        for b in beams:
            assert b.tokens[:n] == prompt["prompt_token_ids"] and len(b.logprobs) == len(b.tokens) - n
            chosen = [position[t].logprob for position, t in zip(b.logprobs, b.tokens[n:], strict=True)]
            assert sum(chosen) == pytest.approx(b.cum_logprob, abs=1e-4)
            if b.finish_reason == "stop":
                assert b.tokens[-1] in stop_ids and b.stop_reason == b.tokens[-1]
            else:
                assert b.finish_reason == "length" and len(b.logprobs) == 8
        assert any(b.finish_reason == "stop" for b in beams)
        answers[penalty] = [b.tokens for b in beams]
    # a penalty of 2 favours the beams that went on: a short finished one ranked third without it is out
    assert answers[0.0] != answers[2.0]


@pytest.mark.slow
def test_a_tiny_llama_gives_hugging_faces_beams(tmp_path: Path, tokenizer_files: Path) -> None:  # noqa: F811
    """transformers' generate(num_beams=4, do_sample=False, length_penalty=2) and LLM.beam_search(beam_width=4) on
    a tiny random-weight Llama, no EOS on either side: the same 4 beams, in the same order, with the same scores.
    With EOS the two differ by design: transformers admits a finished beam only from a step's top num_beams
    candidates and stops early (early_stopping), vLLM (and tokenmill) from each beam's 2 * width candidates and
    runs every round."""
    folder = write_tiny("llama", tmp_path, tokenizer_files)
    prompt, width, steps, penalty = list(range(1000, 1012)), 4, 8, 2.0
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=steps,
            num_beams=width,
            num_return_sequences=width,
            do_sample=False,
            length_penalty=penalty,
            eos_token_id=None,
            pad_token_id=0,
            output_scores=True,
            return_dict_in_generate=True,
        )
    (ours,) = LLM(str(folder)).beam_search(
        {"prompt_token_ids": prompt},
        BeamSearchParams(beam_width=width, max_tokens=steps, ignore_eos=True, length_penalty=penalty),
    )
    assert [b.tokens for b in ours.sequences] == out.sequences.tolist()
    scores = [get_beam_search_score(steps, b.cum_logprob, penalty) for b in ours.sequences]
    assert scores == pytest.approx(out.sequences_scores.tolist(), abs=1e-5)
