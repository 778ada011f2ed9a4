"""The sliding-window layers' pool of KV blocks (Gemma 3's local layers): a BlockManager whose sequences release
the blocks that have left their window (scheduler/block_manager.py describes both pools)."""

from tokenmill.scheduler.block_manager import NULL_BLOCK, BlockManager, _SeqBlockState
from tokenmill.scheduler.sequence import Sequence


class WindowBlockManager(BlockManager):
    """The pool of the sliding-window layers' KV blocks. A query at position p reads the keys at positions
    p - window < k <= p, so once a sequence's next position is p, its blocks wholly before p - window + 1 are
    released: hashed ones stay in the prefix cache (evictable), the others are free at once.

    A prefix-cache hit here needs only the blocks that the window of the hit's end still reads: the hit is the
    longest prefix (at most what the full-attention pool found) whose window blocks are all cached, and the table
    gets NULL_BLOCK for the blocks before them."""

    def __init__(self, num_blocks: int, block_size: int, window: int, enable_prefix_caching: bool = True):
        super().__init__(num_blocks, block_size, enable_prefix_caching)
        if window < 1:
            raise ValueError("window must be positive")
        self.window = window

    def table(self, seq: Sequence) -> list[int]:
        return seq.local_block_table

    def _set_table(self, seq: Sequence, table: list[int]) -> None:
        seq.local_block_table = table

    def first_needed_block(self, next_position: int) -> int:
        """The first block a query at `next_position` (or later) still reads."""
        return max(0, next_position - self.window + 1) // self.block_size

    def blocks_to_admit(self, start: int, end: int) -> int:
        """Blocks a sequence whose next computed token is at `start` needs to compute up to `end` (the ones the
        window of `start` reads, and the new ones)."""
        return self.blocks_needed(end) - self.first_needed_block(start)

    def release_outside_window(self, seq: Sequence) -> int:
        """Release the sequence's blocks its next query no longer reads; returns how many were released."""
        table = self.table(seq)
        released = 0
        for i in range(self.first_needed_block(seq.num_computed_tokens)):
            block_id = table[i]
            if block_id == NULL_BLOCK:
                continue
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._unused(block)
            table[i] = NULL_BLOCK
            released += 1
        return released

    def held_blocks(self, seq: Sequence) -> int:
        return sum(1 for b in self.table(seq) if b != NULL_BLOCK)

    def lookup_window_prefix(self, seq: Sequence, max_blocks: int) -> tuple[int, list[int], list[int]]:
        """The longest hit of at most max_blocks blocks whose window blocks are cached: (hit blocks, the ids of
        the cached blocks from first_needed_block(hit) on, the chain hashes of all hit blocks)."""
        return self.window_chain(seq.token_ids, max_blocks, seq.lora_id)

    def window_chain(self, token_ids: list[int], max_blocks: int, salt: int = 0) -> tuple[int, list[int], list[int]]:
        """lookup_window_prefix for a list of tokens."""
        if not self.enable_prefix_caching or max_blocks == 0:
            return 0, [], []
        bs = self.block_size
        hashes: list[int] = []
        found: list[int | None] = []  # per block: the cached block holding it, or None
        parent_hash = self._root(salt)
        for i in range(max_blocks):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            parent_hash = self._chain_hash(parent_hash, tokens)
            hashes.append(parent_hash)
            block = self._cached.get(parent_hash)
            hit = block is not None and block.token_ids == tokens and block.salt == salt
            found.append(block.block_id if hit else None)
        for hit in range(max_blocks, 0, -1):
            needed = found[self.first_needed_block(hit * bs) : hit]
            if all(b is not None for b in needed):
                return hit, needed, hashes[:hit]  # type: ignore[return-value]
        return 0, [], []

    def allocate_window_prefix(self, seq: Sequence, hit_blocks: int, block_ids: list[int], hashes: list[int]) -> None:
        """Give `seq` a hit found by lookup_window_prefix (its tokens are counted by the full-attention pool)."""
        state = self._seq_state.setdefault(seq.seq_id, _SeqBlockState())
        table = self.table(seq)
        table.extend([NULL_BLOCK] * (hit_blocks - len(block_ids)))
        for block_id in block_ids:
            self._take(self.blocks[block_id])
            table.append(block_id)
        state.hashes.extend(hashes)

    def restore_window(self, token_ids: list[int], num_blocks: int) -> tuple[int, list[tuple[int, bool]]]:
        """restore_chain for this pool: only the blocks the window of a num_blocks-block hit reads (those a later
        prompt's lookup_window_prefix needs). Returns (their first block index, [(block id, whether its K/V must
        be written)]); the whole window or nothing ([] when blocks run short), held until release_blocks."""
        bs = self.block_size
        first = self.first_needed_block(num_blocks * bs)
        window: list[tuple[int, bool]] = []
        h: int | None = None
        for i in range(num_blocks if self.enable_prefix_caching else 0):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            h = self._chain_hash(h, tokens)
            if i < first:
                continue
            entered = self._enter(h, tokens, None, chained=False)
            if entered is None:
                break
            window.append((entered[0].block_id, entered[1]))
        if len(window) < num_blocks - first:  # a window with a hole serves no hit: give it all back
            self.forget_blocks([b for b, fresh in window if fresh])
            self.release_blocks([b for b, fresh in window if not fresh])
            return first, []
        return first, window
