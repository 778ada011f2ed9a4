"""Continuous batching with chunked prefill, after vLLM v1's scheduler.

There are no prefill and decode phases: every sequence has `num_computed_tokens` catching up with its tokens.
Each step has a token budget (max_num_batched_tokens) and a sequence cap (max_num_seqs):

1. running sequences first, oldest first: a decode takes 1 token of the budget, an unfinished prompt takes
   the rest of its prompt or what is left of the budget (a chunk). When the KV cache is out of blocks, the
   newest running sequence is preempted: its blocks are freed and it goes back to the head of the queue, to be
   recomputed later (its generated tokens are kept, so nothing is lost).
2. then waiting sequences, while budget, sequence slots and blocks last, taking turns between API calls
   (waiting_queue.py: round robin over groups, first come first served within one, so a call of 2,048 prompts
   cannot hold back a request that arrives after it); a waiting sequence first takes whatever prefix of it the
   prefix cache holds.
3. while more than one call has work (running or waiting), a step's prompt tokens are limited to
   `prompt_tokens_when_shared` (the engine sets it from the step time it aims at: stall-free batching, after
   Sarathi-Serve), shared equally between the calls that have prompt tokens to compute (at least a block each),
   so one call's prompts, however many, neither stretch the steps that stream another call's tokens nor hold back
   its first one. Decodes are never limited; a call alone (an offline batch) is not either.

The KV cache is asked only through its manager (kv_cache_manager.py), over one pool or, with sliding-window
layers, two. After the step's tokens are sampled, `update_from_output` settles it: every scheduled sequence's
computed tokens (with the proposals that were accepted) enter the cache, and the sequences that stopped leave the
batch and free their blocks.
"""

from collections.abc import Mapping
from dataclasses import dataclass, field

from tokenmill.scheduler.kv_cache_manager import KVAllocation, KVCacheManager, PrefixHit
from tokenmill.scheduler.sequence import Sequence, SequenceStatus
from tokenmill.scheduler.waiting_queue import WaitingQueue


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
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager):
        self.config = config
        self.kv = kv
        self.waiting = WaitingQueue()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._stopped: list[Sequence] = []  # stopped during the step: freed by update_from_output
        # a step's prompt tokens while more than one call has work (None: no limit); set by the engine
        self.prompt_tokens_when_shared: int | None = None

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
        kv = self.kv
        in_flight: set[int] = set()  # hashes of prompt blocks this step fills (prefix caching only)
        share = _PromptShare(self.prompt_tokens_when_shared, self.running, self.waiting, kv.block_size)

        # 1. running sequences, oldest first
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = share.cap(seq, min(seq.num_tokens - seq.num_computed_tokens, budget))
            if num_new <= 0:
                i += 1
                continue
            lookahead = min(seq.num_lookahead_tokens, budget - 1) if num_new == 1 else 0
            allocation = kv.allocate_slots(seq, 1, lookahead) if lookahead else None
            if allocation is not None:  # room for the proposals too (never preempt anyone for them)
                self._add_copies(out, allocation)
                out.scheduled.append(ScheduledSequence(seq, seq.num_computed_tokens, 1 + lookahead, lookahead))
                budget -= 1 + lookahead
                i += 1
                continue
            while True:
                allocation = kv.allocate_slots(seq, num_new)
                if allocation is not None:
                    break
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            if allocation is None:  # preempted itself: nothing more fits
                break
            self._add_copies(out, allocation)
            out.scheduled.append(ScheduledSequence(seq, seq.num_computed_tokens, num_new))
            self._note_in_flight(seq, num_new, in_flight)
            share.spend(seq, num_new)
            budget -= num_new
            i += 1

        # 2. waiting sequences, the calls taking turns (none while we had to preempt)
        spent_calls: set[str] = set()  # calls whose share of this step is used up (rule 3)
        while self.waiting and budget > 0 and not out.preempted:
            seq = self.waiting.peek()
            if seq.group in spent_calls:
                break  # every waiting call has had its turn
            slots_needed = seq.params.n if not seq.ever_scheduled else 1
            if len(self.running) + slots_needed > self.config.max_num_seqs:
                break
            hit = PrefixHit()
            if seq.num_computed_tokens == 0 and not seq.computes_whole_prompt:
                hit = kv.find_prefix(seq)
                if in_flight and self._next_block_in_flight(seq, hit.num_found, in_flight):
                    break  # another sequence is computing this prefix right now: hit it next step
            hit_tokens = hit.num_blocks * kv.block_size
            num_new = share.cap(seq, min(seq.num_tokens - seq.num_computed_tokens - hit_tokens, budget))
            if num_new <= 0:  # its call's share is spent: the next call's turn
                spent_calls.add(seq.group)
                self.waiting.pass_turn()
                continue
            if not kv.can_admit(seq, hit, num_new):
                break
            if seq.num_computed_tokens == 0:
                tokens = kv.take_prefix(seq, hit, count_query=not seq.computes_whole_prompt)
                seq.num_computed_tokens = tokens
                if not seq.ever_scheduled:
                    seq.num_cached_tokens = tokens
            allocation = kv.allocate_slots(seq, num_new)
            if allocation is None:  # cannot happen after can_admit, but never lose a sequence
                kv.free(seq)
                break
            self._add_copies(out, allocation)
            self.waiting.pop_front()
            seq.status = SequenceStatus.RUNNING
            seq.ever_scheduled = True
            self.running.append(seq)
            out.scheduled.append(ScheduledSequence(seq, seq.num_computed_tokens, num_new))
            self._note_in_flight(seq, num_new, in_flight)
            share.spend(seq, num_new)
            budget -= num_new
        return out

    @staticmethod
    def _add_copies(out: SchedulerOutput, allocation: KVAllocation) -> None:
        out.block_copies.extend(allocation.copies)
        out.local_block_copies.extend(allocation.local_copies)

    def _note_in_flight(self, seq: Sequence, num_new: int, in_flight: set[int]) -> None:
        if self.kv.enable_prefix_caching and num_new > 1:
            first_new_block = seq.num_computed_tokens // self.kv.block_size
            in_flight.update(self.kv.block_hashes(seq, seq.num_computed_tokens + num_new)[first_new_block:])

    def _next_block_in_flight(self, seq: Sequence, num_hit_blocks: int, in_flight: set[int]) -> bool:
        bs = self.kv.block_size
        if (num_hit_blocks + 1) * bs > seq.num_tokens - 1:
            return False  # no further full block could be a hit anyway
        return self.kv.block_hashes(seq, (num_hit_blocks + 1) * bs)[-1] in in_flight

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push_front(seq)

    def stop(self, seq: Sequence) -> None:
        """A sequence's last token was sampled in this step: it is finished now, and leaves the batch (its blocks
        freed) in update_from_output, once its computed K/V reached the prefix cache. Not running: at once."""
        if seq.status != SequenceStatus.RUNNING:
            self.finish(seq)
            return
        seq.status = SequenceStatus.FINISHED
        self._stopped.append(seq)

    def update_from_output(self, out: SchedulerOutput, num_accepted: Mapping[int, int] | None = None) -> None:
        """After the step: the forward pass wrote the K/V of every scheduled token, and of its proposals the first
        num_accepted[seq_id] were right (the others' K/V get overwritten); those count as computed. Then the
        sequences that stopped in the step leave the batch and free their blocks."""
        accepted = num_accepted or {}
        stopped = {seq.seq_id for seq in self._stopped}
        for s in out.scheduled:
            seq = s.seq
            if seq.is_finished and seq.seq_id not in stopped:
                continue  # aborted, its blocks freed already
            seq.num_computed_tokens = s.start + s.num_new_tokens - s.num_draft_tokens + accepted.get(seq.seq_id, 0)
            self.kv.commit(seq)
        for seq in self._stopped:
            self.running.remove(seq)
            self.kv.free(seq)
        self._stopped.clear()

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence wherever it is and free its blocks at once."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        elif seq in self._stopped:  # stopped in this step, then aborted before update_from_output
            self._stopped.remove(seq)
            self.running.remove(seq)
        self.kv.free(seq)
        seq.status = SequenceStatus.FINISHED


class _PromptShare:
    """What prompt tokens each call may still add to a step that more than one call shares (rule 3 above)."""

    def __init__(self, limit: int | None, running: list[Sequence], waiting: WaitingQueue, block_size: int):
        waiting_calls = waiting.groups()
        self.limited = limit is not None and len({s.group for s in running} | waiting_calls) > 1
        # shared between the calls that have prompt tokens to compute; one that only decodes needs none
        with_prompts = {s.group for s in running if s.num_tokens - s.num_computed_tokens > 1} | waiting_calls
        self.per_call = max(block_size, (limit or 0) // max(len(with_prompts), 1))
        self.spent: dict[str, int] = {}

    def cap(self, seq: Sequence, num_new: int) -> int:
        """`num_new` tokens of `seq` (a chunk of its prompt, or a decode), as many as its call's share allows."""
        if not self.limited or num_new <= 1:
            return num_new
        return min(num_new, self.per_call - self.spent.get(seq.group, 0))

    def spend(self, seq: Sequence, num_new: int) -> None:
        if self.limited and num_new > 1:
            self.spent[seq.group] = self.spent.get(seq.group, 0) + num_new
