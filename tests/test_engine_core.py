"""The engine core's step (engine/core.py) around a fake runner: no model, milliseconds. The runner's logits make
each sequence count up (the token after t is t + 1, and token 0 is the end of a text), so every output is known."""

from dataclasses import dataclass, field

import torch

from tokenmill.config import EngineConfig, SpeculativeConfig
from tokenmill.engine.core import EngineCore
from tokenmill.runner.model_runner import StepChunk, StepOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.scheduler.block_manager import BlockManager
from tokenmill.scheduler.kv_cache_manager import KVCacheManager
from tokenmill.spec_decode.speculator import Speculator

VOCAB = 50
EOS = 0


@dataclass
class FakeModelConfig:
    vocab_size: int = VOCAB


@dataclass
class FakeRunner:
    """What the core asks of a runner: execute a step's chunks and copy blocks; the logits favour t + 1."""

    device: torch.device = torch.device("cpu")
    model_config: FakeModelConfig = field(default_factory=FakeModelConfig)
    steps: list[list[StepChunk]] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)

    @staticmethod
    def logits_after(tokens: list[int]) -> torch.Tensor:
        rows = torch.zeros(len(tokens), VOCAB)
        rows[torch.arange(len(tokens)), (torch.tensor(tokens) + 1) % VOCAB] = 10.0
        return rows

    def copy_blocks(self, copies: list[tuple[int, int]], local_copies: list[tuple[int, int]] = ()) -> None:
        self.copies += copies

    def execute(self, chunks: list[StepChunk]) -> StepOutput:
        self.steps.append(chunks)
        last = [self.logits_after(c.token_ids)[-1] for c in chunks if c.want_last_logits]
        all_logits = [self.logits_after(c.token_ids) if c.want_all_logits else None for c in chunks]
        return StepOutput(torch.stack(last) if last else torch.zeros(0, VOCAB), all_logits)


class FakeTokenizer:
    stop_token_ids = frozenset({EOS})

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(f"<{i}>" for i in ids if not (skip_special_tokens and i == EOS))


def make_core(speculative: SpeculativeConfig | None = None) -> tuple[EngineCore, FakeRunner]:
    config = EngineConfig(block_size=4, max_num_seqs=4, max_num_batched_tokens=16, speculative_config=speculative)
    runner = FakeRunner()
    max_model_len = 64
    core = EngineCore(
        runner,  # type: ignore[arg-type]
        config,
        KVCacheManager(BlockManager(64, config.block_size, config.enable_prefix_caching)),
        max_model_len,
        FakeTokenizer(),  # type: ignore[arg-type]
        Speculator(config.speculative_config, None, max_model_len),
    )
    return core, runner


def run(core: EngineCore) -> dict[str, list[int]]:
    """Steps until every request is done: request id -> its first sample's tokens."""
    done = {}
    for _ in range(200):
        for out in core.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        if not core.requests:
            return done
    raise AssertionError("the requests did not finish")


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kw)


def test_requests_join_and_leave_the_batch_and_count_up() -> None:
    core, runner = make_core()
    core.queue("a", None, [3, 4, 5], greedy(4), 4)
    core.queue("b", None, [40, 41], greedy(6, ignore_eos=True), 6)
    core.step()  # both prompts in one step
    core.queue("c", None, [10] * 20, greedy(2), 2)  # joins while the others decode; its prompt takes two steps
    outputs = run(core)
    assert outputs == {"a": [6, 7, 8, 9], "b": [42, 43, 44, 45, 46, 47], "c": [11, 12]}
    assert [len(c.token_ids) for c in runner.steps[0]] == [3, 2]
    # c's prompt was cut to the step's budget of 16 tokens beside the two decodes
    assert sum(len(c.token_ids) for c in runner.steps[1]) == 16
    core.check_integrity()  # every block back


def test_the_stop_token_ends_a_sequence_and_its_blocks_go_back() -> None:
    core, _ = make_core()
    core.queue("a", None, [47, 48], greedy(10), 10)  # 49, then 0: the end of the text
    outputs = run(core)
    assert outputs == {"a": [49, EOS]}
    assert core.block_manager.usage().in_use == 0


def test_an_aborted_request_leaves_at_once() -> None:
    core, _ = make_core()
    core.queue("a", None, [1, 2, 3], greedy(20), 20)
    core.step()
    output = core.abort("a")
    assert output is not None and output.finished and output.outputs[0].finish_reason == "abort"
    assert core.step() == [] and not core.requests
    core.check_integrity()


def test_n_samples_share_the_prompt_and_each_count_up() -> None:
    core, runner = make_core()
    core.queue("a", None, [5, 6, 7, 8, 9], greedy(3, n=2), 3)
    outputs = []
    while core.requests:
        outputs += [o for o in core.step() if o.finished]
    assert [o.token_ids for o in outputs[0].outputs] == [[10, 11, 12], [10, 11, 12]]
    assert len(runner.steps[0]) == 1  # one prefill for both samples
    core.check_integrity()


def test_ngram_proposals_are_verified_and_keep_the_same_tokens() -> None:
    """Counting up repeats the prompt, so n-gram lookup proposes the next tokens: they are accepted, fewer steps
    run, and the tokens are those without speculation."""
    prompt = list(range(1, 30)) + list(range(1, 5))  # after 1..4 again comes 5, 6, ...: proposals match
    plain, plain_runner = make_core()
    plain.queue("a", None, prompt, greedy(12), 12)
    spec = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 4, "verify_row_cost": 0.0})
    core, runner = make_core(spec)
    core.queue("a", None, prompt, greedy(12), 12)
    assert run(core) == run(plain) == {"a": list(range(5, 17))}
    assert core.speculator.stats.as_stats()["spec_decode_num_accepted_tokens"] > 0
    assert len(runner.steps) < len(plain_runner.steps)
    assert any(len(c.token_ids) > 1 and c.want_all_logits for step in runner.steps[1:] for c in step)
    core.check_integrity()
