"""The sliding-window layers' own KV pool (WindowBlockManager) under the scheduler, without torch: blocks that
left a sequence's window go back, prefix-cache hits find the window's blocks, preemption and forks keep both
pools consistent."""

from tokenmill.sampling_params import SamplingParams
from tokenmill.scheduler.block_manager import NULL_BLOCK, BlockManager
from tokenmill.scheduler.kv_cache_manager import KVCacheManager
from tokenmill.scheduler.scheduler import Scheduler, SchedulerConfig
from tokenmill.scheduler.sequence import Sequence
from tokenmill.scheduler.window_block_manager import WindowBlockManager

BS, WINDOW = 4, 10  # a query at position p reads p - 9 .. p: at most 4 blocks of 4


class WindowedEngine:
    def __init__(self, full_blocks=200, local_blocks=64, budget=16, max_num_seqs=8, prefix_caching=True):
        self.bm = BlockManager(full_blocks, BS, prefix_caching)
        self.wm = WindowBlockManager(local_blocks, BS, WINDOW, prefix_caching)
        self.sched = Scheduler(SchedulerConfig(max_num_seqs, budget, 4096), KVCacheManager(self.bm, self.wm))
        self.ids = iter(range(10**6))
        self.finished: list[Sequence] = []
        self.max_local_held: dict[int, int] = {}

    def add(self, tokens: list[int], max_tokens: int) -> Sequence:
        s = Sequence(next(self.ids), "r", tokens, SamplingParams(max_tokens=max_tokens))
        self.sched.add(s)
        return s

    def step(self):
        out = self.sched.schedule()
        for s in out.scheduled:  # what a step reads must still be held: the window of each new token
            first = self.wm.first_needed_block(s.start)
            table = s.seq.local_block_table
            assert all(b != NULL_BLOCK for b in table[first : self.wm.blocks_needed(s.start + s.num_new_tokens)])
        self.sched.update_from_output(out)
        for s in out.scheduled:
            seq = s.seq
            self.max_local_held[seq.seq_id] = max(self.max_local_held.get(seq.seq_id, 0), self.wm.held_blocks(seq))
            if s.completes_sequence:
                seq.append_token(5000 + seq.num_output_tokens)
                if seq.num_output_tokens >= seq.max_tokens:
                    self.sched.finish(seq)
                    self.finished.append(seq)
        self.bm.check_integrity()
        self.wm.check_integrity()
        return out

    def run(self) -> None:
        for _ in range(10_000):
            if not self.sched.has_unfinished():
                return
            self.step()
        raise AssertionError("did not finish")


def test_a_long_sequence_holds_only_its_window() -> None:
    e = WindowedEngine()
    s = e.add(list(range(300)), max_tokens=50)
    e.step()  # the first 16-token chunk
    e.run()
    assert len(s.block_table) == 0 and e.bm.usage().in_use == 0 and e.wm.usage().in_use == 0
    # 350 tokens: 88 blocks of the full pool, but after each step at most the 4 blocks its window spans here
    assert 0 < e.max_local_held[s.seq_id] <= -(-WINDOW // BS) + 1


def test_held_blocks_after_each_step() -> None:
    e = WindowedEngine()
    s = e.add(list(range(40)), max_tokens=30)
    while not s.is_finished:
        e.step()
        if s.is_finished:
            break
        table = s.local_block_table
        first = e.wm.first_needed_block(s.num_computed_tokens)
        assert table[:first] == [NULL_BLOCK] * first and NULL_BLOCK not in table[first:]
        assert len(s.block_table) == len(table)  # one entry per block of positions in both pools


def test_prefix_hit_needs_the_window_blocks_of_its_end() -> None:
    e = WindowedEngine()
    shared = list(range(100, 164))  # 64 tokens: 16 blocks
    a = e.add(shared + [1, 2, 3], max_tokens=1)
    e.run()
    # a's early local blocks were released but stay cached (they were hashed): a second sequence finds all of
    # what the window of its hit reads, and takes only those blocks
    b = e.add(shared + [7, 8], max_tokens=2)
    e.step()
    assert b.num_cached_tokens == 64
    first = e.wm.first_needed_block(64)
    assert b.local_block_table[:first] == [NULL_BLOCK] * first
    e.run()
    assert e.wm.usage().in_use == 0 and a.is_finished


def test_a_hit_shrinks_to_where_the_window_blocks_survive() -> None:
    e = WindowedEngine(local_blocks=24)  # small: other sequences evict a's released local blocks
    shared = list(range(100, 164))
    e.add(shared + [1], max_tokens=1)
    e.run()
    for k in range(4):  # new contents fill the local pool, evicting what a left in it
        e.add(list(range(1000 * (k + 1), 1000 * (k + 1) + 60)), max_tokens=1)
    e.run()
    b = e.add(shared + [9, 9], max_tokens=1)
    assert len(e.bm.lookup_prefix(b)) == 16  # the full pool still has all 16 blocks
    e.step()
    assert b.num_cached_tokens < 64  # the local pool lost the window's blocks: the hit is shorter (or none)
    e.run()
    assert e.bm.usage().in_use == 0 and e.wm.usage().in_use == 0


def test_preemption_and_forks_keep_both_pools_consistent() -> None:
    e = WindowedEngine(full_blocks=40, local_blocks=20, budget=8, max_num_seqs=6)
    seqs = [e.add(list(range(k * 100, k * 100 + 30)), max_tokens=40) for k in range(5)]
    e.run()
    assert e.sched.num_preemptions > 0 and all(s.is_finished for s in seqs)
    assert e.bm.usage().in_use == 0 and e.wm.usage().in_use == 0
    parent = e.add(list(range(50)), max_tokens=3)
    while parent.num_computed_tokens < 50:
        e.step()
    child = Sequence(999_999, "r", parent.token_ids, SamplingParams(max_tokens=3))
    e.bm.fork(parent, child)
    e.wm.fork(parent, child)
    e.sched.add_running(child)
    assert child.local_block_table == parent.local_block_table
    e.run()
    assert e.bm.usage().in_use == 0 and e.wm.usage().in_use == 0


def test_without_prefix_caching_released_blocks_are_free_at_once() -> None:
    e = WindowedEngine(prefix_caching=False)
    e.add(list(range(80)), max_tokens=5)
    for _ in range(8):
        e.step()
    u = e.wm.usage()
    assert u.cached == 0 and u.in_use <= -(-WINDOW // BS) + 1 + 16 // BS


def test_a_saved_prefix_restored_into_both_pools_is_hit() -> None:
    """llama.cpp's slot save and restore, in both pools: a saved prefix is the full pool's chain and the window
    pool's blocks its window reads; after both pools forgot it, restoring those blocks (fresh ones to write)
    gives a later prompt the whole hit again."""
    e = WindowedEngine()
    shared = list(range(100, 164))  # 16 blocks
    e.add(shared + [1, 2, 3], max_tokens=1)
    e.run()
    kv = e.sched.kv
    saved = kv.saved_prefix(shared)
    first = e.wm.first_needed_block(64)
    assert len(saved.blocks) == 16 and saved.window_first == first and len(saved.window) == 16 - first
    e.bm.reset_prefix_cache()
    e.wm.reset_prefix_cache()
    restored = kv.restore_prefix(shared, 16)
    assert restored is not None and restored.window_first == first
    assert all(fresh for _, fresh in restored.chain + restored.window) and len(restored.window) == 16 - first
    kv.end_restore(restored, written=True)
    e.bm.check_integrity()
    e.wm.check_integrity()
    b = e.add(shared + [7, 8], max_tokens=1)
    e.step()
    assert b.num_cached_tokens == 64
    e.run()
    assert e.bm.usage().in_use == 0 and e.wm.usage().in_use == 0


def test_a_restore_without_room_changes_nothing() -> None:
    e = WindowedEngine(full_blocks=20, local_blocks=16, budget=64)
    kv = e.sched.kv
    e.add(list(range(500, 540)), max_tokens=2)
    e.step()  # its 40 prompt tokens hold 10 blocks of the full pool
    before = (e.bm.usage(), e.wm.usage())
    assert kv.restore_prefix(list(range(64)), 16) is None  # 16 blocks do not fit in the 10 left
    assert (e.bm.usage(), e.wm.usage()) == before
    e.bm.check_integrity()
    e.wm.check_integrity()
    e.run()
