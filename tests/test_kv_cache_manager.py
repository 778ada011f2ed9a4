"""The KV-cache manager over both pools and the scheduler's update_from_output, without torch: an allocation
takes both pools' blocks or none, stopped sequences leave the batch only after their blocks reached the prefix
cache, proposals count once accepted."""

from tokenmill.sampling_params import SamplingParams
from tokenmill.scheduler.block_manager import BlockManager
from tokenmill.scheduler.kv_cache_manager import KVCacheManager
from tokenmill.scheduler.scheduler import Scheduler, SchedulerConfig
from tokenmill.scheduler.sequence import Sequence, SequenceStatus
from tokenmill.scheduler.window_block_manager import WindowBlockManager

BS = 4


def seq(seq_id: int, tokens: list[int], max_tokens: int = 4) -> Sequence:
    return Sequence(seq_id, f"r{seq_id}", tokens, SamplingParams(max_tokens=max_tokens))


def test_an_allocation_takes_both_pools_or_neither() -> None:
    kv = KVCacheManager(BlockManager(10, BS), WindowBlockManager(2, BS, window=8))
    s = seq(0, list(range(12)))
    assert kv.allocate_slots(s, 12) is None  # the window pool has 2 blocks, 12 tokens need 3
    assert s.block_table == [] and s.local_block_table == []
    assert kv.pool.num_free_blocks == 10 and kv.window_pool.num_free_blocks == 2
    allocation = kv.allocate_slots(s, 8)
    assert allocation is not None and allocation.copies == [] and allocation.local_copies == []
    assert len(s.block_table) == 2 and len(s.local_block_table) == 2


def test_lookahead_slots_are_taken_with_the_new_tokens() -> None:
    kv = KVCacheManager(BlockManager(4, BS))
    s = seq(0, list(range(5)))
    assert kv.allocate_slots(s, 5, num_lookahead_tokens=3) is not None
    assert len(s.block_table) == 2  # positions 0 .. 7
    assert kv.allocate_slots(s, 5, num_lookahead_tokens=12) is None and len(s.block_table) == 2


def test_stopped_sequences_leave_after_their_blocks_are_cached() -> None:
    bm = BlockManager(16, BS)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64), KVCacheManager(bm))
    a = seq(0, list(range(9)))
    sched.add(a)
    out = sched.schedule()
    a.append_token(100)
    sched.stop(a)  # stopped by its first token, within the step
    assert a.is_finished and a in sched.running and len(a.block_table) == 3  # still holding its blocks
    sched.update_from_output(out)
    assert a not in sched.running and a.block_table == [] and bm.usage().in_use == 0
    b = seq(1, list(range(9)) + [7])
    sched.add(b)
    sched.schedule()
    assert b.num_cached_tokens == 8  # a's two full blocks reached the prefix cache before they were freed
    bm.check_integrity()


def test_a_sequence_aborted_after_it_stopped_is_freed_once() -> None:
    bm = BlockManager(8, BS)
    sched = Scheduler(SchedulerConfig(4, 64, 64), KVCacheManager(bm))
    a = seq(0, list(range(6)))
    sched.add(a)
    out = sched.schedule()
    sched.stop(a)
    sched.finish(a)  # an abort between the stop and the step's end
    sched.update_from_output(out)
    assert a.status == SequenceStatus.FINISHED and not sched.running and bm.usage().in_use == 0
    bm.check_integrity()


def test_a_fork_that_stops_before_it_was_ever_scheduled_is_freed() -> None:
    bm = BlockManager(8, BS)
    kv = KVCacheManager(bm)
    sched = Scheduler(SchedulerConfig(4, 64, 64), kv)
    parent = seq(0, list(range(6)))
    sched.add(parent)
    out = sched.schedule()
    child = seq(1, parent.token_ids)
    kv.fork(parent, child, parent.num_prompt_tokens)
    sched.add_running(child)
    assert child.num_computed_tokens == 6 and child.block_table == parent.block_table
    for s in (parent, child):
        s.append_token(100)
        sched.stop(s)
    sched.update_from_output(out)
    assert not sched.running and bm.usage().in_use == 0
    bm.check_integrity()
