"""Block manager and prefix cache, without torch."""

import pytest

from tokenmill.sampling_params import SamplingParams
from tokenmill.scheduler.block_manager import BlockManager
from tokenmill.scheduler.sequence import Sequence

_ids = iter(range(10**6))


def seq(tokens: list[int]) -> Sequence:
    return Sequence(next(_ids), "r", tokens, SamplingParams())


def run_prefill(bm: BlockManager, s: Sequence) -> int:
    """Admit s the way the scheduler does: prefix hit, then slots for the rest; returns the hit tokens."""
    hit = bm.allocate_prefix(s, bm.lookup_prefix(s))
    s.num_computed_tokens = hit
    assert bm.allocate_slots(s, s.num_tokens - hit) == []
    s.num_computed_tokens = s.num_tokens
    bm.commit_computed(s)
    return hit


def accounting_holds(bm: BlockManager) -> None:
    bm.check_integrity()
    u = bm.usage()
    assert u.free + u.cached + u.in_use == u.total


def test_allocate_and_free() -> None:
    bm = BlockManager(8, 4)
    s = seq(list(range(10)))
    assert bm.allocate_slots(s, 10) == []
    assert len(s.block_table) == 3 and bm.num_free_blocks == 5
    s.num_computed_tokens = 10
    assert bm.allocate_slots(s, 2) == []  # 12 tokens still fit in 3 blocks
    assert len(s.block_table) == 3
    s.num_computed_tokens = 12
    bm.allocate_slots(s, 1)
    assert len(s.block_table) == 4
    bm.free(s)
    assert s.block_table == [] and bm.num_free_blocks == 8
    accounting_holds(bm)


def test_not_enough_blocks_changes_nothing() -> None:
    bm = BlockManager(2, 4)
    s = seq(list(range(12)))
    assert bm.allocate_slots(s, 12) is None
    assert s.block_table == [] and bm.num_free_blocks == 2


def test_prefix_hit_reuses_blocks_and_never_covers_the_last_token() -> None:
    bm = BlockManager(16, 4)
    a = seq(list(range(12)))  # exactly 3 full blocks
    run_prefill(bm, a)
    b = seq(list(range(12)))  # the same prompt: only 2 blocks may hit, the last token must be computed
    assert run_prefill(bm, b) == 8
    assert b.block_table[:2] == a.block_table[:2]
    c = seq(list(range(13)) + [99])  # longer: all 3 of a's blocks hit
    assert run_prefill(bm, c) == 12
    assert bm.prefix_hit_tokens == 20 and bm.prefix_query_tokens == 12 + 12 + 14
    for s in (a, b, c):
        bm.free(s)
    accounting_holds(bm)


def test_different_prefix_does_not_hit() -> None:
    bm = BlockManager(16, 4)
    run_prefill(bm, seq([1, 2, 3, 4, 5, 6, 7, 8, 9]))
    assert run_prefill(bm, seq([1, 2, 3, 4, 0, 6, 7, 8, 9])) == 4  # first block only
    assert run_prefill(bm, seq([0, 2, 3, 4, 5, 6, 7, 8, 9])) == 0


def test_freed_blocks_stay_cached_and_are_evicted_lru() -> None:
    bm = BlockManager(4, 4)
    a = seq([1, 2, 3, 4, 5])
    run_prefill(bm, a)
    bm.free(a)
    assert bm.usage().cached == 1  # the full block stays cached, the partial one is free
    b = seq([1, 2, 3, 4, 6])
    assert run_prefill(bm, b) == 4  # hit after the owner left
    bm.free(b)
    # fill the cache with other prompts: the oldest cached block goes first
    for first in (10, 20, 30):
        s = seq([first, 1, 1, 1, 0])
        run_prefill(bm, s)
        bm.free(s)
    assert run_prefill(bm, seq([1, 2, 3, 4, 7])) == 0
    accounting_holds(bm)


def test_hash_collision_never_serves_wrong_kv(monkeypatch: pytest.MonkeyPatch) -> None:
    """With every hash equal, a lookup must still verify token ids and parents."""
    bm = BlockManager(16, 4)
    monkeypatch.setattr(bm, "_chain_hash", lambda parent, tokens: 42)
    a = seq([1, 2, 3, 4, 5, 6, 7, 8, 0])
    run_prefill(bm, a)
    assert run_prefill(bm, seq([9, 9, 9, 9, 5, 6, 7, 8, 0])) == 0
    assert run_prefill(bm, seq([1, 2, 3, 4, 9, 9, 9, 9, 0])) == 4  # the real first block; the colliding second not
    accounting_holds(bm)


def test_reused_parent_block_invalidates_children(monkeypatch: pytest.MonkeyPatch) -> None:
    """A cached block whose parent block was evicted and refilled (here under another prefix, with a hash
    that ignores the parent, i.e. a collision) must not be served: its K/V were computed after the old prefix."""
    bm = BlockManager(4, 2)
    monkeypatch.setattr(bm, "_chain_hash", lambda parent, tokens: hash(tokens))
    s1 = seq([1, 2, 3, 4, 5, 6, 0])
    run_prefill(bm, s1)
    _, middle, last, _ = s1.block_table
    bm.free(s1)
    bm._evictable.move_to_end(last)  # evict the middle block ([3, 4]) before its child ([5, 6])
    s2 = seq([7, 8, 3, 4, 9])
    run_prefill(bm, s2)
    assert s2.block_table[1] == middle  # [3, 4] recomputed in the same block, now after [7, 8]
    bm.free(s2)
    s3 = seq([7, 8, 3, 4, 5, 6, 0])
    assert run_prefill(bm, s3) == 4  # [5, 6] is cached, but after the old [1, 2]: recomputed
    accounting_holds(bm)


def test_fork_shares_blocks_and_copies_the_partial_one_on_write() -> None:
    bm = BlockManager(8, 4)
    parent = seq([1, 2, 3, 4, 5, 6])
    run_prefill(bm, parent)
    child = seq([1, 2, 3, 4, 5, 6])
    bm.fork(parent, child)
    assert child.block_table == parent.block_table
    assert bm.usage().in_use == 2
    child.append_token(7)
    copies = bm.allocate_slots(child, 1)  # writes into the shared, partly filled second block
    assert copies == [(parent.block_table[1], child.block_table[1])]
    assert child.block_table[0] == parent.block_table[0]
    parent.append_token(8)
    assert bm.allocate_slots(parent, 1) == []  # the parent is now the only owner: no copy
    bm.free(parent)
    bm.free(child)
    accounting_holds(bm)
    assert bm.usage().in_use == 0


def test_disabled_prefix_caching() -> None:
    bm = BlockManager(8, 4, enable_prefix_caching=False)
    run_prefill(bm, seq(list(range(9))))
    assert run_prefill(bm, seq(list(range(9)))) == 0
    assert bm.usage().cached == 0


def test_forget_prefix_drops_unused_cached_blocks_only() -> None:
    """llama.cpp's slot erase: the prefix cache forgets a token list's unused full blocks (a later prompt computes
    them again), while a block a running sequence holds keeps its entry."""
    bm = BlockManager(8, 4)
    first = seq(list(range(10)))
    run_prefill(bm, first)
    bm.free(first)
    assert bm.usage().cached == 2
    assert bm.forget_prefix(list(range(10))) == 2
    accounting_holds(bm)
    assert bm.usage().cached == 0 and run_prefill(bm, seq(list(range(10)))) == 0
    holder = seq(list(range(10)))
    assert run_prefill(bm, holder) == 8  # hits the blocks the previous prompt cached
    assert bm.forget_prefix(list(range(10))) == 0  # in use: kept
    accounting_holds(bm)


def test_skip_reading_prefix_cache_computes_the_whole_prompt() -> None:
    """llama.cpp's cache_prompt false: the sequence asks to compute every prompt token."""
    s = Sequence(next(_ids), "r", list(range(10)), SamplingParams(skip_reading_prefix_cache=True))
    assert s.computes_whole_prompt and not seq(list(range(10))).computes_whole_prompt


def test_restore_chain_enters_a_prefix_a_later_prompt_hits() -> None:
    """llama.cpp's slot restore: a token list's full blocks enter the prefix cache as if computed (new blocks to
    write, held until released), reusing those already cached; a later prompt then hits them all."""
    bm = BlockManager(8, 4)
    tokens = list(range(13))
    chain = bm.restore_chain(tokens, 3)
    assert [fresh for _, fresh in chain] == [True, True, True]
    assert bm.usage().in_use == 3  # held while the caller writes their K/V
    bm.release_blocks([b for b, _ in chain])
    accounting_holds(bm)
    assert bm.usage().cached == 3 and bm.cached_prefix(tokens) == [b for b, _ in chain]
    assert run_prefill(bm, seq(tokens)) == 12
    again = bm.restore_chain(tokens, 3)  # already cached: nothing to write
    assert [fresh for _, fresh in again] == [False] * 3
    bm.release_blocks([b for b, _ in again])
    accounting_holds(bm)


def test_restore_chain_stops_when_the_pool_is_full_and_forget_blocks_undoes_it() -> None:
    bm = BlockManager(3, 4)
    holder = seq(list(range(100, 108)))
    bm.allocate_slots(holder, 8)  # 2 of the 3 blocks in use
    chain = bm.restore_chain(list(range(12)), 3)
    assert len(chain) == 1  # room for one
    bm.forget_blocks([b for b, fresh in chain if fresh])
    accounting_holds(bm)
    assert bm.usage().cached == 0 and bm.usage().free == 1


def test_restore_chain_replaces_a_stale_entry() -> None:
    """A cached block whose parent was evicted (its entry no longer verifies) gives its hash to the restored one."""
    bm = BlockManager(4, 2)
    s1 = seq([1, 2, 3, 4, 5, 6, 0])
    run_prefill(bm, s1)
    first, middle, last, _ = s1.block_table
    bm.free(s1)
    bm._evictable.move_to_end(middle)
    bm._evictable.move_to_end(last)  # evict the first block ([1, 2]) before its children
    holder = seq([7, 8, 9, 10])
    run_prefill(bm, holder)  # takes the free block, then evicts [1, 2]
    bm.free(holder)
    bm._evictable.move_to_end(middle)
    bm._evictable.move_to_end(last)  # the stale children are evicted last
    assert bm.cached_prefix([1, 2, 3, 4, 5, 6]) == []  # their parent is gone: they no longer verify
    chain = bm.restore_chain([1, 2, 3, 4, 5, 6], 3)
    assert len(chain) == 3 and all(fresh for _, fresh in chain)
    bm.release_blocks([b for b, _ in chain])
    accounting_holds(bm)
    assert bm.cached_prefix([1, 2, 3, 4, 5, 6]) == [b for b, _ in chain]
