"""One front for the KV cache's pools, after vLLM v1's KVCacheManager: what the scheduler asks of the cache.

A model's layers keep their K/V in one pool of blocks (BlockManager), or, with sliding-window layers (Gemma 3's
local ones), in two: the full-attention layers' and the window layers' (WindowBlockManager). Every question the
scheduler has goes through here, for both pools at once:

- `find_prefix` -> a PrefixHit: the cached blocks a waiting sequence can start from (in both pools: the window
  pool's hit may be shorter, and then the hit is);
- `can_admit` / `take_prefix`: whether its blocks fit, and taking the hit;
- `allocate_slots(seq, num_new_tokens, num_lookahead_tokens)` -> the block copies of both pools to make before
  the forward (copy-on-write), or None with nothing changed when either pool is short;
- `commit` (the step wrote the K/V: register full blocks in the prefix cache, release blocks out of the window),
  `free`, `fork`.

Pure Python, no torch: the scheduler's tests run it in milliseconds.
"""

from dataclasses import dataclass, field

from tokenmill.scheduler.block_manager import BlockManager, BlockUsage
from tokenmill.scheduler.sequence import Sequence
from tokenmill.scheduler.window_block_manager import WindowBlockManager


@dataclass
class PrefixHit:
    """Cached blocks a sequence's prompt starts with, in each pool (not taken yet)."""

    blocks: list[int] = field(default_factory=list)  # the full-attention pool's, in order
    # the window pool's (WindowBlockManager.lookup_window_prefix): (hit blocks, the cached blocks its window
    # still reads, the chain hashes of all hit blocks)
    window: tuple[int, list[int], list[int]] = (0, [], [])
    num_found: int = 0  # the full-attention pool's own hit, before the window pool's shortened it

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)


@dataclass
class SavedBlocks:
    """A prefix's cached blocks: the full-attention pool's, and the window pool's blocks from window_first on
    (those its window reads)."""

    blocks: list[int]
    window_first: int = 0
    window: list[int] = field(default_factory=list)


@dataclass
class RestoredBlocks:
    """A prefix entered in the prefix cache: (block id, fresh) in each pool, fresh blocks needing their K/V."""

    chain: list[tuple[int, bool]]
    window_first: int = 0
    window: list[tuple[int, bool]] = field(default_factory=list)


@dataclass
class KVAllocation:
    """Block copies (src, dst) to make before the forward: the full-attention pool's and the window pool's."""

    copies: list[tuple[int, int]] = field(default_factory=list)
    local_copies: list[tuple[int, int]] = field(default_factory=list)


class KVCacheManager:
    def __init__(self, pool: BlockManager, window_pool: WindowBlockManager | None = None):
        if window_pool is not None and window_pool.block_size != pool.block_size:
            raise ValueError("both KV pools must have the same block size")
        self.pool = pool
        self.window_pool = window_pool
        self.pools: tuple[BlockManager, ...] = (pool,) if window_pool is None else (pool, window_pool)

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    @property
    def num_blocks(self) -> int:
        """The full-attention pool's blocks: what bounds one sequence's length."""
        return self.pool.num_blocks

    @property
    def enable_prefix_caching(self) -> bool:
        return self.pool.enable_prefix_caching

    def blocks_needed(self, num_tokens: int) -> int:
        return self.pool.blocks_needed(num_tokens)

    # ---- admission ----------------------------------------------------------------------------------------------

    def find_prefix(self, seq: Sequence) -> PrefixHit:
        """The longest cached prefix of `seq` that both pools hold (empty without prefix caching)."""
        blocks = self.pool.lookup_prefix(seq)
        if self.window_pool is None or not blocks:
            return PrefixHit(blocks, num_found=len(blocks))
        window = self.window_pool.lookup_window_prefix(seq, len(blocks))
        return PrefixHit(blocks[: window[0]], window, len(blocks))

    def can_admit(self, seq: Sequence, hit: PrefixHit, num_new_tokens: int) -> bool:
        """Whether both pools have the blocks for `seq` to start from `hit` and compute num_new_tokens more (the
        hit's blocks no sequence holds count: taking them takes them out of the free ones)."""
        start = seq.num_computed_tokens + hit.num_blocks * self.block_size
        end = start + num_new_tokens
        pool = self.pool
        if pool.blocks_needed(end) - hit.num_blocks + pool.num_unreferenced(hit.blocks) > pool.num_free_blocks:
            return False
        w = self.window_pool
        if w is None:
            return True
        taken = hit.window[1]
        return w.blocks_to_admit(start, end) - len(taken) + w.num_unreferenced(taken) <= w.num_free_blocks

    def take_prefix(self, seq: Sequence, hit: PrefixHit, count_query: bool = True) -> int:
        """Give a sequence with nothing computed its hit in both pools; returns the tokens it covers."""
        tokens = self.pool.allocate_prefix(seq, hit.blocks, count_query=count_query)
        if self.window_pool is not None and hit.blocks:
            self.window_pool.allocate_window_prefix(seq, *hit.window)
        return tokens

    # ---- slots --------------------------------------------------------------------------------------------------

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, num_lookahead_tokens: int = 0) -> KVAllocation | None:
        """Make both pools' tables cover num_computed_tokens + num_new_tokens + num_lookahead_tokens (the
        lookahead: slots for proposed tokens). Returns the copies to make first, or None, with nothing changed,
        when either pool is short."""
        num_tokens = num_new_tokens + num_lookahead_tokens
        if any(p.slots_needed(seq, num_tokens) > p.num_free_blocks for p in self.pools):
            return None
        copies = self.pool.allocate_slots(seq, num_tokens)
        local = self.window_pool.allocate_slots(seq, num_tokens) if self.window_pool is not None else []
        if copies is None or local is None:  # cannot happen after the check: never leave one pool half done
            raise AssertionError("a KV pool refused slots it had")
        return KVAllocation(copies, local)

    def commit(self, seq: Sequence) -> None:
        """After the step wrote the K/V of seq's computed tokens: its full blocks enter the prefix cache, and the
        window pool's blocks its next query no longer reads go back."""
        for p in self.pools:
            p.commit_computed(seq)
        if self.window_pool is not None:
            self.window_pool.release_outside_window(seq)

    def free(self, seq: Sequence) -> None:
        for p in self.pools:
            p.free(seq)

    def fork(self, parent: Sequence, child: Sequence, num_computed_tokens: int) -> None:
        """`child` shares parent's blocks in both pools; num_computed_tokens of them hold its computed K/V."""
        for p in self.pools:
            p.fork(parent, child)
        child.num_computed_tokens = num_computed_tokens

    # ---- prefix cache and introspection --------------------------------------------------------------------------

    def block_hashes(self, seq: Sequence, num_tokens: int) -> list[int]:
        return self.pool.block_hashes(seq, num_tokens)

    def forget_prefix(self, token_ids: list[int]) -> int:
        """The prefix cache forgets these tokens' unused full blocks (a later prompt computes them anew)."""
        return self.pool.forget_prefix(token_ids)

    def saved_prefix(self, token_ids: list[int]) -> SavedBlocks:
        """The cached blocks of the longest prefix of `token_ids` a prompt would find in both pools: what a saved
        slot keeps (llama.cpp's slot save)."""
        blocks = self.pool.cached_prefix(token_ids)
        if self.window_pool is None or not blocks:
            return SavedBlocks(blocks)
        hit, window, _ = self.window_pool.window_chain(token_ids, len(blocks))
        return SavedBlocks(blocks[:hit], self.window_pool.first_needed_block(hit * self.block_size), window)

    def restore_prefix(self, token_ids: list[int], num_blocks: int) -> RestoredBlocks | None:
        """Enter num_blocks full blocks of `token_ids` in the prefix cache of both pools, held until
        `end_restore`: the blocks already cached are reused, the others (`fresh`) are taken from the free ones and
        need their K/V written. None, with nothing changed, when the pools have no room for them all."""
        chain = self.pool.restore_chain(token_ids, num_blocks)
        restored = RestoredBlocks(chain)
        if len(chain) == num_blocks and self.window_pool is not None and num_blocks:
            restored.window_first, restored.window = self.window_pool.restore_window(token_ids, num_blocks)
            if not restored.window:
                self.end_restore(restored, written=False)
                return None
        if len(chain) < num_blocks:
            self.end_restore(restored, written=False)
            return None
        return restored

    def end_restore(self, restored: RestoredBlocks, written: bool) -> None:
        """Drop restore_prefix's hold; `written` False: its fresh blocks hold no K/V and leave the cache."""
        for pool, blocks in ((self.pool, restored.chain), (self.window_pool, restored.window)):
            if pool is None:
                continue
            if not written:
                pool.forget_blocks([b for b, fresh in blocks if fresh])
            pool.release_blocks([b for b, fresh in blocks if written or not fresh])

    @property
    def prefix_query_tokens(self) -> int:
        return self.pool.prefix_query_tokens

    @property
    def prefix_hit_tokens(self) -> int:
        return self.pool.prefix_hit_tokens

    def usage(self) -> tuple[BlockUsage, BlockUsage | None]:
        """(the full-attention pool's, the window pool's or None)."""
        return self.pool.usage(), self.window_pool.usage() if self.window_pool is not None else None

    def check_integrity(self, idle: bool) -> None:
        """Each pool's accounting holds; `idle` (no request in flight): no block is in use."""
        for p in self.pools:
            p.check_integrity()
            if idle and p.usage().in_use:
                raise AssertionError(f"idle engine still holds blocks: {p.usage()}")
