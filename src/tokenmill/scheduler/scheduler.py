"""Continuous batching with chunked prefill, after vLLM v1's scheduler.

There are no prefill and decode phases: every sequence has `num_computed_tokens` catching up with its tokens.
Each step has a token budget (max_num_batched_tokens) and a sequence cap (max_num_seqs):

1. running sequences first, oldest first: a decode takes 1 token of the budget, an unfinished prompt takes
   the rest of its prompt or what is left of the budget (a chunk). When the KV cache is out of blocks, the
   newest running sequence is preempted: its blocks are freed and it goes back to the head of the queue, to be
   recomputed later (its generated tokens are kept, so nothing is lost).
2. then waiting sequences, first come first served, while budget, sequence slots and blocks last; a waiting
   sequence first takes whatever prefix of it the prefix cache holds.

With sliding-window layers, a second pool (WindowBlockManager) holds their K/V: every allocation takes blocks of
both pools, and after each step the blocks that left a sequence's window go back to that pool.
"""

from collections import deque
from dataclasses import dataclass, field

from tokenmill.scheduler.block_manager import BlockManager, WindowBlockManager
from tokenmill.scheduler.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int = 8192


@dataclass
class ScheduledSequence:
    seq: Sequence
    start: int  # num_computed_tokens when scheduled
    num_new_tokens: int  # tokens computed this step, the proposed ones included
    # speculative decoding: slots for proposed tokens after the sequence's last one (the step's last ones), and
    # the proposals themselves, which the engine fills in after scheduling (num_draft_tokens of them)
    num_draft_tokens: int = 0
    draft_token_ids: list[int] = field(default_factory=list)
    # after this chunk every token of the sequence is computed, so it samples a new token
    completes_sequence: bool = field(init=False)

    def __post_init__(self) -> None:
        num_real = self.num_new_tokens - self.num_draft_tokens
        self.completes_sequence = self.start + num_real == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) before the forward
    local_block_copies: list[tuple[int, int]] = field(default_factory=list)  # the same in the window pool
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, block_manager: BlockManager, window_manager: WindowBlockManager | None = None
    ):
        self.config = config
        self.block_manager = block_manager
        self.window_manager = window_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """A sequence forked from a running one (n > 1) joins the running set directly."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        bm, wm = self.block_manager, self.window_manager
        in_flight: set[int] = set()  # hashes of prompt blocks this step fills (prefix caching only)

        # 1. running sequences, oldest first
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if num_new <= 0:
                i += 1
                continue
            local_copies: list[tuple[int, int]] = []  # kept across attempts: a copy-on-write happens once
            lookahead = min(seq.num_lookahead_tokens, budget - 1) if num_new == 1 else 0
            copies = self._allocate(seq, 1 + lookahead, local_copies) if lookahead else None
            if copies is not None:  # room for the proposals too (never preempt anyone for them)
                out.block_copies.extend(copies)
                out.local_block_copies.extend(local_copies)
                out.scheduled.append(ScheduledSequence(seq, seq.num_computed_tokens, 1 + lookahead, lookahead))
                budget -= 1 + lookahead
                i += 1
                continue
            while True:
                copies = self._allocate(seq, num_new, local_copies)
                if copies is not None:
                    break
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status != SequenceStatus.RUNNING:  # preempted itself: nothing more fits
                break
            out.block_copies.extend(copies)
            out.local_block_copies.extend(local_copies)
            out.scheduled.append(ScheduledSequence(seq, seq.num_computed_tokens, num_new))
            self._note_in_flight(seq, num_new, in_flight)
            budget -= num_new
            i += 1

        # 2. waiting sequences, first come first served (none while we had to preempt)
        while self.waiting and budget > 0 and not out.preempted:
            seq = self.waiting[0]
            slots_needed = seq.params.n if not seq.ever_scheduled else 1
            if len(self.running) + slots_needed > self.config.max_num_seqs:
                break
            prefix_blocks: list[int] = []
            if seq.num_computed_tokens == 0 and not seq.wants_prompt_logprobs:
                prefix_blocks = bm.lookup_prefix(seq)
                if in_flight and self._next_block_in_flight(seq, len(prefix_blocks), in_flight):
                    break  # another sequence is computing this prefix right now: hit it next step
            window_hit: tuple[int, list[int], list[int]] = (0, [], [])
            if wm is not None and prefix_blocks:  # the hit must also find the window's blocks
                window_hit = wm.lookup_window_prefix(seq, len(prefix_blocks))
                prefix_blocks = prefix_blocks[: window_hit[0]]
            hit_tokens = len(prefix_blocks) * bm.block_size
            num_new = min(seq.num_tokens - seq.num_computed_tokens - hit_tokens, budget)
            start, end = seq.num_computed_tokens + hit_tokens, seq.num_computed_tokens + hit_tokens + num_new
            needed = bm.blocks_needed(end)
            newly_taken = bm.num_unreferenced(prefix_blocks)
            if needed - len(prefix_blocks) + newly_taken > bm.num_free_blocks:
                break
            if wm is not None:
                local_taken = window_hit[1]
                newly_taken = wm.num_unreferenced(local_taken)
                if wm.blocks_to_admit(start, end) - len(local_taken) + newly_taken > wm.num_free_blocks:
                    break
            if seq.num_computed_tokens == 0:
                hit = bm.allocate_prefix(seq, prefix_blocks, count_query=not seq.wants_prompt_logprobs)
                if wm is not None:
                    wm.allocate_window_prefix(seq, *window_hit)
                seq.num_computed_tokens = hit
                if not seq.ever_scheduled:
                    seq.num_cached_tokens = hit
            local_copies = []
            copies = self._allocate(seq, num_new, local_copies)
            if copies is None:  # cannot happen after the checks above, but never lose a sequence
                self._free(seq)
                break
            out.block_copies.extend(copies)
            out.local_block_copies.extend(local_copies)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            seq.ever_scheduled = True
            self.running.append(seq)
            out.scheduled.append(ScheduledSequence(seq, seq.num_computed_tokens, num_new))
            self._note_in_flight(seq, num_new, in_flight)
            budget -= num_new
        return out

    def _note_in_flight(self, seq: Sequence, num_new: int, in_flight: set[int]) -> None:
        bm = self.block_manager
        if bm.enable_prefix_caching and num_new > 1:
            first_new_block = seq.num_computed_tokens // bm.block_size
            in_flight.update(bm.block_hashes(seq, seq.num_computed_tokens + num_new)[first_new_block:])

    def _next_block_in_flight(self, seq: Sequence, num_hit_blocks: int, in_flight: set[int]) -> bool:
        bs = self.block_manager.block_size
        if (num_hit_blocks + 1) * bs > seq.num_tokens - 1:
            return False  # no further full block could be a hit anyway
        return self.block_manager.block_hashes(seq, (num_hit_blocks + 1) * bs)[-1] in in_flight

    def _allocate(
        self, seq: Sequence, num_new: int, local_copies: list[tuple[int, int]]
    ) -> list[tuple[int, int]] | None:
        """Blocks of both pools for num_new more tokens: the full pool's copies, with the window pool's added to
        local_copies; None when either pool is short (what one pool took stays in the sequence's table)."""
        if self.window_manager is not None:
            local = self.window_manager.allocate_slots(seq, num_new)
            if local is None:
                return None
            local_copies.extend(local)
        return self.block_manager.allocate_slots(seq, num_new)

    def _free(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        if self.window_manager is not None:
            self.window_manager.free(seq)

    def commit_accepted(self, seq: Sequence, num_accepted: int) -> None:
        """num_accepted proposed tokens were right: their K/V, written by the step, now count as computed."""
        seq.num_computed_tokens += num_accepted
        self.block_manager.commit_computed(seq)
        if self.window_manager is not None:
            self.window_manager.commit_computed(seq)
            self.window_manager.release_outside_window(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def update_after_step(self, out: SchedulerOutput) -> None:
        """The forward pass wrote the K/V of every scheduled token."""
        for s in out.scheduled:
            # proposed tokens count once accepted (the engine advances num_computed_tokens over them then)
            s.seq.num_computed_tokens = s.start + s.num_new_tokens - s.num_draft_tokens
            self.block_manager.commit_computed(s.seq)
            if self.window_manager is not None:
                self.window_manager.commit_computed(s.seq)
                self.window_manager.release_outside_window(s.seq)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence wherever it is and free its blocks at once."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        self._free(seq)
        seq.status = SequenceStatus.FINISHED
