"""Continuous batching, chunked prefill and preemption, driven by a fake runner (no torch)."""

from tokenmill.sampling_params import SamplingParams
from tokenmill.scheduler.block_manager import BlockManager
from tokenmill.scheduler.kv_cache_manager import KVCacheManager
from tokenmill.scheduler.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from tokenmill.scheduler.sequence import Sequence, SequenceStatus


class FakeEngine:
    """Steps the scheduler; each sequence that completes its tokens 'samples' token 1000 + its output length."""

    def __init__(self, num_blocks=64, block_size=4, max_num_seqs=8, budget=16, prefix_caching=True):
        self.bm = BlockManager(num_blocks, block_size, prefix_caching)
        self.sched = Scheduler(SchedulerConfig(max_num_seqs, budget, 4096), KVCacheManager(self.bm))
        self.next_id = 0
        self.finished: list[Sequence] = []

    def add(self, prompt_len: int, max_tokens: int, first_token: int = 0, group: str | None = None) -> Sequence:
        s = Sequence(
            self.next_id,
            f"r{self.next_id}",
            list(range(first_token, first_token + prompt_len)),
            SamplingParams(max_tokens=max_tokens),
            group=group,
        )
        self.next_id += 1
        self.sched.add(s)
        return s

    def step(self) -> SchedulerOutput:
        out = self.sched.schedule()
        self.sched.update_from_output(out)
        for s in out.scheduled:
            if s.completes_sequence:
                s.seq.append_token(1000 + s.seq.num_output_tokens)
                if s.seq.num_output_tokens >= s.seq.max_tokens:
                    self.sched.finish(s.seq)
                    self.finished.append(s.seq)
        self.bm.check_integrity()
        return out

    def run(self, max_steps: int = 1000) -> int:
        steps = 0
        while self.sched.has_unfinished():
            self.step()
            steps += 1
            assert steps < max_steps
        return steps


def test_decodes_first_then_prefill_fills_the_budget() -> None:
    e = FakeEngine(budget=16)
    a = e.add(10, 5)
    e.step()  # a's prompt in one go
    b = e.add(40, 5, first_token=500)
    out = e.step()
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(a, 1), (b, 15)]  # decode + a chunk of b
    out = e.step()
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(a, 1), (b, 15)]
    out = e.step()
    assert [(s.seq, s.num_new_tokens) for s in out.scheduled] == [(a, 1), (b, 10)]
    assert out.scheduled[1].completes_sequence  # b's last chunk samples its first token


def test_chunked_prefill_only_samples_at_the_end() -> None:
    e = FakeEngine(budget=8)
    a = e.add(20, 1)
    samples = []
    while e.sched.has_unfinished():
        out = e.step()
        samples.append([s.completes_sequence for s in out.scheduled])
    assert samples == [[False], [False], [True]]
    assert a.output_token_ids == [1000]


def test_first_come_first_served_and_seq_cap() -> None:
    e = FakeEngine(max_num_seqs=2, budget=100)
    a, b, c = e.add(5, 3), e.add(5, 3, first_token=100), e.add(5, 3, first_token=200)
    out = e.step()
    assert [s.seq for s in out.scheduled] == [a, b]
    assert c.status == SequenceStatus.WAITING
    e.run()
    assert [s.seq_id for s in e.finished[:2]] == [a.seq_id, b.seq_id]
    assert c.num_output_tokens == 3


def test_finished_sequences_free_blocks_and_waiting_ones_join() -> None:
    e = FakeEngine(num_blocks=6, block_size=4, budget=64)
    a = e.add(8, 2)
    b = e.add(12, 2)  # 2 + 3 blocks: both fit, the third does not
    c = e.add(12, 2)
    e.step()
    assert c.status == SequenceStatus.WAITING
    e.run()
    assert all(s.is_finished for s in (a, b, c))
    assert e.bm.usage().in_use == 0


def test_preemption_recomputes_and_loses_nothing() -> None:
    e = FakeEngine(num_blocks=6, block_size=4, budget=64, prefix_caching=False)
    a = e.add(8, 12)  # grows to 20 tokens: 5 blocks
    b = e.add(4, 12)  # grows to 16 tokens: 4 blocks -- both cannot finish together
    e.run()
    assert e.sched.num_preemptions > 0
    assert a.output_token_ids == [1000 + i for i in range(12)]
    assert b.output_token_ids == [1000 + i for i in range(12)]
    assert b.num_preemptions > 0 and a.num_preemptions == 0  # the newest is the victim
    assert e.bm.usage().in_use == 0


def test_preempted_sequence_goes_back_to_the_head_of_the_queue() -> None:
    e = FakeEngine(num_blocks=5, block_size=4, budget=64, prefix_caching=False)
    e.add(8, 10)
    b = e.add(4, 10)
    e.add(4, 1)
    for _ in range(20):
        e.step()
        if b.num_preemptions:
            break
    assert e.sched.waiting.peek() is b


def test_prefix_hits_skip_computation() -> None:
    e = FakeEngine(num_blocks=64, block_size=4, budget=64)
    a = e.add(17, 1)
    e.run()
    b = e.add(17, 1)
    out = e.step()
    assert out.scheduled[0].start == 16 and out.scheduled[0].num_new_tokens == 1
    assert b.num_cached_tokens == 16 and a.num_cached_tokens == 0


def test_same_prefix_arriving_together_is_computed_once() -> None:
    """A request whose prefix another request is computing in this very step waits one step and hits it."""
    e = FakeEngine(num_blocks=64, block_size=4, budget=100)
    first = e.add(17, 1)
    others = [e.add(17, 1) for _ in range(3)]
    out = e.step()
    assert [s.seq for s in out.scheduled] == [first]
    out = e.step()
    assert [s.seq for s in out.scheduled] == others
    assert all(s.num_new_tokens == 1 for s in out.scheduled)
    assert e.bm.prefix_hit_tokens == 3 * 16


def test_a_call_of_many_prompts_cannot_hold_back_a_later_request() -> None:
    """Waiting calls take turns at admission: a request arriving behind a 200-prompt call runs in the next step,
    not after the whole call (first come first served would put it 200 prompts back)."""
    e = FakeEngine(num_blocks=512, block_size=4, max_num_seqs=8, budget=24)
    big = [e.add(8, 1, first_token=10 * i, group="embed") for i in range(200)]
    out = e.step()
    assert [s.seq for s in out.scheduled] == big[:3]  # 3 x 8 tokens fill the budget
    chat = e.add(4, 4, first_token=5000, group="chat")
    out = e.step()
    assert chat in [s.seq for s in out.scheduled]
    assert [s.seq for s in out.scheduled][:2] == [big[3], chat]  # the call's turn, then the new one's
    steps = 1
    while chat not in e.finished:
        e.step()
        steps += 1
    assert steps == 4  # its prompt and first token, then 3 decodes: as if it were alone
    e.run()
    assert len(e.finished) == 201


def test_sequences_without_a_group_are_first_come_first_served() -> None:
    e = FakeEngine(num_blocks=512, block_size=4, max_num_seqs=2, budget=64)
    seqs = [e.add(4, 2) for _ in range(6)]
    e.run()
    assert e.finished == seqs


def test_the_waiting_queue_takes_turns_and_puts_a_preempted_sequence_first() -> None:
    from tokenmill.scheduler.waiting_queue import WaitingQueue

    def seq(i: int, group: str) -> Sequence:
        return Sequence(i, f"r{i}", [1], SamplingParams(), group=group)

    q = WaitingQueue()
    a = [seq(i, "a") for i in range(3)]
    b = [seq(10 + i, "b") for i in range(2)]
    for s in [*a, *b]:
        q.append(s)
    assert len(q) == 5 and list(q) == [a[0], b[0], a[1], b[1], a[2]]
    assert q.pop_front() is a[0] and q.peek() is b[0]
    q.push_front(a[0])  # preempted: next again, its group in front
    assert q.peek() is a[0]
    assert q.remove(b[1]) and not q.remove(b[1])
    assert [q.pop_front() for _ in range(len(q))] == [a[0], b[0], a[1], a[2]]
    assert not q and len(q) == 0


def test_a_step_shared_by_calls_carries_a_limited_number_of_prompt_tokens() -> None:
    """Stall-free steps: while more than one call has work, a step's prompt tokens are limited and shared between
    the calls that have prompts to compute (decodes never limited); a call alone takes the whole budget."""
    e = FakeEngine(num_blocks=1024, block_size=4, max_num_seqs=16, budget=64)
    e.sched.prompt_tokens_when_shared = 12
    big = [e.add(20, 1, first_token=100 * i, group="embed") for i in range(20)]
    out = e.step()
    assert out.num_batched_tokens == 64  # one call: the whole budget
    chat = e.add(6, 5, first_token=9000, group="chat")
    out = e.step()
    assert chat.num_output_tokens == 1 and out.num_batched_tokens == 12  # 6 each: the chat's prompt in one step
    for _ in range(3):
        out = e.step()
        by_group = {g: sum(s.num_new_tokens for s in out.scheduled if s.seq.group == g) for g in ("chat", "embed")}
        assert by_group == {"chat": 1, "embed": 12}  # the chat only decodes: the prompt tokens are the call's
    e.step()  # the chat's last token
    assert chat in e.finished
    out = e.step()
    assert out.num_batched_tokens == 64  # alone again
    e.run()
    assert all(s in e.finished for s in big)
