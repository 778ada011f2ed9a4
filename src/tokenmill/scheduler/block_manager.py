"""Paged KV cache bookkeeping: fixed-size blocks, per-sequence block tables, reference counts, prefix caching.

Prefix caching: when a block fills up, it gets a hash chained from its parent block's hash and its own token
ids, and goes into `cached`. A later sequence whose prompt starts with the same tokens walks its own full
blocks through `cached` and reuses the longest chain it finds. A hit is verified, not trusted: the cached
block's token ids must equal the sequence's and its parent must be the block matched just before (at the
same generation), so neither a hash collision nor a reused parent block can serve wrong K/V.

    seq tokens:  [t0 .. t15][t16 .. t31][t32 t33 t34]
    blocks:      [  b7 (h1) ][  b2 (h2) ][  b9 (partial, not hashed)]
                 h1 = hash((None, t0..t15)), h2 = hash((h1, t16..t31))

Blocks whose reference count drops to zero stay in the cache (LRU order) until a new allocation needs them;
never-hashed free blocks are used first. A hit never covers a sequence's last token: its logits are needed.

A sequence with a LoRA adapter (`Sequence.lora_id`) starts its chain from a root of that adapter instead of None,
and its blocks record the adapter, checked on a hit as the tokens are: the same prompt under two adapters (or one
and none) never shares K/V. Ids are never reused, so an adapter loaded again under the same name starts afresh.

A model with sliding-window layers (Gemma 3's local layers) keeps their K/V in a second pool, managed by a
WindowBlockManager (window_block_manager.py) with its own block table per sequence (`Sequence.local_block_table`):
a block whose positions have all left the window is released from the sequence (its entry becomes NULL_BLOCK), so a long
sequence holds about window / block_size blocks of that pool, not one per block_size tokens (vLLM's hybrid KV
cache manager, for two groups of layers).
"""

from collections import OrderedDict, deque
from dataclasses import dataclass, field

from tokenmill.scheduler.sequence import Sequence


@dataclass(eq=False)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None  # set once the block is full and registered in the prefix cache
    token_ids: tuple[int, ...] = ()
    parent: "Block | None" = None
    parent_generation: int = 0
    generation: int = 0  # bumped every time the block is reset for new contents
    salt: int = 0  # the LoRA adapter of the sequence that computed it (0: none)


@dataclass
class BlockUsage:
    total: int
    free: int  # never hashed (or reset) and unused
    cached: int  # unused, but holding a reusable prefix-cache entry
    in_use: int  # referenced by at least one sequence


@dataclass
class _SeqBlockState:
    hashes: list[int] = field(default_factory=list)  # hash of each registered full block of the sequence


class NoFreeBlocksError(RuntimeError):
    pass


NULL_BLOCK = -1  # a local block table's entry for a block released after it left the window


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: deque[int] = deque(range(num_blocks))  # unused, no cache entry
        self._evictable: OrderedDict[int, None] = OrderedDict()  # unused, cached; least recently used first
        self._cached: dict[int, Block] = {}  # block hash -> block
        self._seq_state: dict[int, _SeqBlockState] = {}
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0

    # ---- the sequence's table in this pool (WindowBlockManager: its local one) ----------------------------------

    def table(self, seq: Sequence) -> list[int]:
        return seq.block_table

    def _set_table(self, seq: Sequence, table: list[int]) -> None:
        seq.block_table = table

    # ---- capacity -----------------------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now (free or evictable)."""
        return len(self._free) + len(self._evictable)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_unreferenced(self, blocks: list[int]) -> int:
        """How many of these (cached) blocks no sequence holds: taking them takes them from the free pool."""
        return sum(1 for b in blocks if self.blocks[b].ref_count == 0)

    def usage(self) -> BlockUsage:
        in_use = sum(1 for b in self.blocks if b.ref_count > 0)
        return BlockUsage(self.num_blocks, len(self._free), len(self._evictable), in_use)

    def check_integrity(self) -> None:
        """free + cached + in use == total, and every structure agrees with the reference counts."""
        usage = self.usage()
        if usage.free + usage.cached + usage.in_use != usage.total:
            raise AssertionError(f"block accounting broken: {usage}")
        for block_id in self._free:
            b = self.blocks[block_id]
            if b.ref_count or b.block_hash is not None:
                raise AssertionError(f"free block {block_id} is referenced or hashed: {b}")
        for block_id in self._evictable:
            b = self.blocks[block_id]
            if b.ref_count or b.block_hash is None or self._cached.get(b.block_hash) is not b:
                raise AssertionError(f"evictable block {block_id} is inconsistent: {b}")

    # ---- prefix cache -------------------------------------------------------------------------------------------

    def _chain_hash(self, parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
        return hash((parent_hash, token_ids))

    @staticmethod
    def _root(salt: int) -> int | None:
        """The parent hash of a chain's first block: None, or one of the sequence's LoRA adapter."""
        return hash(("lora", salt)) if salt else None

    def lookup_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks matching the start of `seq` (at most num_tokens - 1 tokens), without taking them."""
        if not self.enable_prefix_caching:
            return []
        return self._cached_chain(seq.token_ids, (seq.num_tokens - 1) // self.block_size, seq.lora_id)

    def _cached_chain(self, token_ids: list[int], max_blocks: int, salt: int = 0) -> list[int]:
        """The cached blocks holding the start of `token_ids`, verified block by block (at most max_blocks)."""
        bs = self.block_size
        matched: list[int] = []
        parent: Block | None = None
        parent_hash = self._root(salt)
        for i in range(max_blocks):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            h = self._chain_hash(parent_hash, tokens)
            block = self._cached.get(h)
            if (
                block is None
                or block.token_ids != tokens
                or block.salt != salt
                or block.parent is not parent
                or (parent is not None and block.parent_generation != parent.generation)
            ):
                break
            matched.append(block.block_id)
            parent, parent_hash = block, h
        return matched

    def block_hashes(self, seq: Sequence, num_tokens: int) -> list[int]:
        """Chain hashes of the full blocks within the first num_tokens tokens of seq (registered ones reused).

        Lets the scheduler see which blocks a step is about to fill, so that a waiting request with the same
        prefix can wait one step and hit them instead of computing them a second time.
        """
        bs = self.block_size
        state = self._seq_state.get(seq.seq_id)
        out = list(state.hashes[: num_tokens // bs]) if state else []
        parent_hash = out[-1] if out else self._root(seq.lora_id)
        for i in range(len(out), num_tokens // bs):
            parent_hash = self._chain_hash(parent_hash, tuple(seq.token_ids[i * bs : (i + 1) * bs]))
            out.append(parent_hash)
        return out

    def allocate_prefix(self, seq: Sequence, block_ids: list[int], count_query: bool = True) -> int:
        """Give `seq` the cached blocks found by lookup_prefix; returns the number of tokens they cover."""
        if count_query:
            self.prefix_query_tokens += seq.num_tokens
        state = self._seq_state.setdefault(seq.seq_id, _SeqBlockState())
        for block_id in block_ids:
            block = self.blocks[block_id]
            self._take(block)
            self.table(seq).append(block_id)
            state.hashes.append(block.block_hash)  # type: ignore[arg-type]
        hit = len(block_ids) * self.block_size
        self.prefix_hit_tokens += hit
        return hit

    def _take(self, block: Block) -> None:
        if block.ref_count == 0:
            self._evictable.pop(block.block_id, None)
        block.ref_count += 1

    # ---- allocation ---------------------------------------------------------------------------------------------

    def _new_block(self) -> Block:
        if self._free:
            block = self.blocks[self._free.popleft()]
        elif self._evictable:
            block_id, _ = self._evictable.popitem(last=False)
            block = self.blocks[block_id]
            del self._cached[block.block_hash]  # type: ignore[arg-type]
            self._reset(block)
        else:
            raise NoFreeBlocksError("no free KV blocks")
        block.ref_count = 1
        return block

    def _reset(self, block: Block) -> None:
        block.block_hash = None
        block.token_ids = ()
        block.parent = None
        block.salt = 0
        block.generation += 1

    def _needs(self, seq: Sequence, num_new_tokens: int) -> tuple[int, bool]:
        """(new blocks for num_new_tokens more tokens, whether the write block needs a private copy first: a
        shared, partly filled last block)."""
        table = self.table(seq)
        new_blocks = max(0, self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(table))
        write_block = seq.num_computed_tokens // self.block_size
        cow = (
            num_new_tokens > 0
            and seq.num_computed_tokens % self.block_size != 0
            and write_block < len(table)
            and self.blocks[table[write_block]].ref_count > 1
        )
        return new_blocks, cow

    def slots_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Free blocks that allocate_slots(seq, num_new_tokens) would take."""
        new_blocks, cow = self._needs(seq, num_new_tokens)
        return new_blocks + int(cow)

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> list[tuple[int, int]] | None:
        """Make the block table cover num_computed_tokens + num_new_tokens.

        Returns the block copies (src, dst) needed first (copy-on-write of a shared, partly filled last block),
        or None, with nothing changed, when there are not enough free blocks.
        """
        new_blocks, cow = self._needs(seq, num_new_tokens)
        if new_blocks + int(cow) > self.num_free_blocks:
            return None
        table = self.table(seq)
        copies = []
        if cow:
            write_block = seq.num_computed_tokens // self.block_size
            old = self.blocks[table[write_block]]
            new = self._new_block()
            old.ref_count -= 1
            table[write_block] = new.block_id
            copies.append((old.block_id, new.block_id))
        for _ in range(new_blocks):
            table.append(self._new_block().block_id)
        self._seq_state.setdefault(seq.seq_id, _SeqBlockState())
        return copies

    def commit_computed(self, seq: Sequence) -> None:
        """Register the sequence's newly filled blocks in the prefix cache (after their K/V were written)."""
        if not self.enable_prefix_caching:
            return
        state = self._seq_state.setdefault(seq.seq_id, _SeqBlockState())
        bs = self.block_size
        num_full = seq.num_computed_tokens // bs
        table = self.table(seq)
        for i in range(len(state.hashes), num_full):
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            parent_hash = state.hashes[i - 1] if i else self._root(seq.lora_id)
            h = self._chain_hash(parent_hash, tokens)
            state.hashes.append(h)
            if table[i] == NULL_BLOCK:
                continue  # released (out of its window) before it was registered
            block = self.blocks[table[i]]
            if block.block_hash is not None or h in self._cached:
                continue  # already registered (shared) or the same content is cached in another block
            parent = self.blocks[table[i - 1]] if i and table[i - 1] != NULL_BLOCK else None
            block.block_hash = h
            block.token_ids = tokens
            block.salt = seq.lora_id
            block.parent = parent
            block.parent_generation = parent.generation if parent is not None else 0
            self._cached[h] = block

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """`child` shares every block of `parent` (copy-on-write on the partly filled last one)."""
        self._set_table(child, list(self.table(parent)))
        child.num_computed_tokens = parent.num_computed_tokens
        for block_id in self.table(child):
            if block_id != NULL_BLOCK:
                self.blocks[block_id].ref_count += 1
        state = self._seq_state.get(parent.seq_id, _SeqBlockState())
        self._seq_state[child.seq_id] = _SeqBlockState(list(state.hashes))

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's references; its blocks become free or stay cached for reuse."""
        self._drop_references(self.table(seq), "freed")
        self._set_table(seq, [])
        seq.num_computed_tokens = 0
        self._seq_state.pop(seq.seq_id, None)

    def _unused(self, block: Block) -> None:
        """A block no sequence references any more: kept as a prefix-cache entry when it is one, else free."""
        if block.block_hash is not None and self._cached.get(block.block_hash) is block:
            self._evictable[block.block_id] = None
        else:
            self._reset(block)
            self._free.append(block.block_id)

    def forget_prefix(self, token_ids: list[int]) -> int:
        """Drop the prefix-cache entries of the full blocks `token_ids` starts with that no sequence uses (llama.cpp's
        slot erase); blocks a running sequence holds keep theirs. Returns the number of blocks forgotten."""
        forgotten = 0
        for block_id in reversed(self._cached_chain(token_ids, len(token_ids) // self.block_size)):
            if self.blocks[block_id].ref_count == 0:
                self._drop_cached(self.blocks[block_id])
                forgotten += 1
        return forgotten

    # ---- a prefix's blocks saved and restored (llama.cpp's slot save and restore) ------------------------------

    def cached_prefix(self, token_ids: list[int]) -> list[int]:
        """The cached blocks holding the full blocks `token_ids` starts with, as a prompt would find them."""
        if not self.enable_prefix_caching:
            return []
        return self._cached_chain(token_ids, len(token_ids) // self.block_size)

    def restore_chain(self, token_ids: list[int], num_blocks: int) -> list[tuple[int, bool]]:
        """Enter the first num_blocks full blocks of `token_ids` in the prefix cache as if computed: each is the
        cached block holding it, else a free one (evicting the least recently used). Returns [(block id, whether
        its K/V must be written)], shorter when the pool runs short or a hash is held by another block in use; the
        blocks stay held (never evicted) until `release_blocks`, while the caller writes the new ones' K/V."""
        bs = self.block_size
        chain: list[tuple[int, bool]] = []
        parent: Block | None = None
        parent_hash: int | None = None
        for i in range(num_blocks if self.enable_prefix_caching else 0):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            parent_hash = self._chain_hash(parent_hash, tokens)
            entered = self._enter(parent_hash, tokens, parent)
            if entered is None:
                break
            parent = entered[0]
            chain.append((parent.block_id, entered[1]))
        return chain

    def _enter(
        self, h: int, tokens: tuple[int, ...], parent: Block | None, chained: bool = True
    ) -> tuple[Block, bool] | None:
        """Hold the cached block holding `tokens` under hash h (verified: its tokens, and with `chained` its
        parent), or a new block entered under h (True: its K/V are to be written); None when neither can be had."""
        block = self._cached.get(h)
        verified = block is not None and block.token_ids == tokens and block.salt == 0  # saved prefixes: no adapter
        if verified and chained:
            verified = block.parent is parent and (parent is None or block.parent_generation == parent.generation)
        if block is not None and not verified:
            if block.ref_count:  # a stale or colliding entry some sequence uses: leave it
                return None
            self._drop_cached(block)  # a stale entry (its parent was evicted): its hash is ours now
            block = None
        if block is not None:
            self._take(block)
            return block, False
        if not self.num_free_blocks:
            return None
        block = self._new_block()  # held (ref_count 1)
        block.block_hash, block.token_ids, block.parent = h, tokens, parent
        block.parent_generation = parent.generation if parent is not None else 0
        self._cached[h] = block
        return block, True

    def release_blocks(self, block_ids: list[int]) -> None:
        """Drop the hold restore_chain took: the blocks stay in the prefix cache, unused (evictable; the last ones
        first, as `free` leaves a sequence's blocks)."""
        self._drop_references(block_ids, "released")

    def _drop_references(self, block_ids: list[int], verb: str) -> None:
        """One reference less on each block; a block no one holds becomes free, or stays cached for reuse. The tail
        first, so that a chain's last blocks are evicted before its first ones."""
        for block_id in reversed(block_ids):
            if block_id == NULL_BLOCK:
                continue
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count < 0:
                raise AssertionError(f"block {block_id} {verb} twice")
            if block.ref_count == 0:
                self._unused(block)

    def forget_blocks(self, block_ids: list[int]) -> None:
        """Undo restore_chain's new blocks (their K/V could not be written): out of the cache, free again."""
        for block_id in block_ids:
            self.blocks[block_id].ref_count = 0
            self._drop_cached(self.blocks[block_id])

    def _drop_cached(self, block: Block) -> None:
        """An unused cached block leaves the cache and becomes free."""
        self._evictable.pop(block.block_id, None)
        del self._cached[block.block_hash]  # type: ignore[arg-type]
        self._reset(block)
        self._free.append(block.block_id)

    def reset_prefix_cache(self) -> None:
        """Forget every cached block that no sequence uses."""
        while self._evictable:
            self._drop_cached(self.blocks[next(iter(self._evictable))])
