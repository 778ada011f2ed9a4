"""Speculation as a stage of the engine's step: before scheduling, how many tokens each decoding sequence proposes
(plan); once scheduled, the proposals in their slots (fill); after the forward pass, each proposing sequence's
rows sampled in order, its proposals kept while they are what the target samples (verify)."""

import time
from collections.abc import Callable

import torch

from tokenmill.config import SpeculativeConfig
from tokenmill.runner.sampler import SampledToken, Sampler, SamplingRow, is_plain_greedy
from tokenmill.scheduler.scheduler import SchedulerOutput
from tokenmill.scheduler.sequence import Sequence
from tokenmill.spec_decode.acceptance import AcceptanceTracker
from tokenmill.spec_decode.draft_model import DraftModelProposer
from tokenmill.spec_decode.ngram import propose_ngram
from tokenmill.spec_decode.stats import SpecDecodeStats

# the engine's sampling row of a sequence at a row of some logits; its emission of a sampled token; a constrained
# sequence's mask where its grammar is now (bool [vocab]; the sequence is finished instead when nothing is allowed)
RowFn = Callable[[Sequence, int], SamplingRow]
EmitFn = Callable[[Sequence, SampledToken, float], None]
MaskFn = Callable[[Sequence], torch.Tensor | None]


class Speculator:
    def __init__(self, spec: SpeculativeConfig | None, drafter: DraftModelProposer | None, max_model_len: int):
        self.spec = spec
        self.drafter = drafter
        self.max_model_len = max_model_len
        self.stats = SpecDecodeStats()  # proposals made and accepted
        # how many proposals pay, per sequence and step
        self.acceptance = AcceptanceTracker(spec.verify_row_cost if spec is not None else 0.0)
        self._ngram_proposals: dict[int, list[int]] = {}  # this step's, by seq_id (n-gram speculation)

    def plan(self, running: list[Sequence]) -> None:
        """How many tokens each decoding sequence proposes this step: as many as pay for their rows (by its recent
        acceptance rate and the batch's size: spec_decode/acceptance.py), none while more than
        spec.disable_by_batch_size sequences run, none past max_tokens and max_model_len. Constrained sequences
        propose as others do: their rows are sampled under their grammar's mask at each position (verify), so a
        proposal the grammar forbids is never accepted. n-gram proposals are looked up now (their number is what
        matched); a draft model's are made once the scheduler has given them slots (fill)."""
        spec = self.spec
        assert spec is not None
        speculate = self.stats.active = len(running) <= spec.disable_by_batch_size
        self._ngram_proposals.clear()
        for seq in running:
            seq.num_lookahead_tokens = 0
            if not speculate or seq.num_computed_tokens != seq.num_tokens - 1 or seq.num_output_tokens == 0:
                continue  # not decoding (prefill left, or the prompt's last token)
            room = min(
                spec.num_speculative_tokens,
                seq.max_tokens - seq.num_output_tokens - 1,  # the step emits one token more than it accepts
                self.max_model_len - seq.num_tokens,
            )
            # as many as pay for their rows, by the sequence's recent acceptance rate and the batch's size
            room = self.acceptance.proposal_length(seq.seq_id, room, len(running)) if room > 0 else 0
            if room > 0 and self.drafter is None:
                proposals = propose_ngram(seq.token_ids, spec.prompt_lookup_max, spec.prompt_lookup_min, room)
                self._ngram_proposals[seq.seq_id] = proposals
                room = len(proposals)
            if room == 0:
                self.acceptance.idle(seq.seq_id)
            seq.num_lookahead_tokens = room

    def fill(self, sched: SchedulerOutput) -> None:
        """The proposals of the sequences the scheduler gave proposal slots (as many as it gave)."""
        wanted = [s for s in sched.scheduled if s.num_draft_tokens]
        if self.drafter is None:
            for s in wanted:
                s.draft_token_ids = self._ngram_proposals[s.seq.seq_id][: s.num_draft_tokens]
            return
        self.drafter.copy_blocks(sched.block_copies)  # the target's copy-on-write, in the draft's cache too
        if wanted:
            proposals = self.drafter.propose([(s.seq, s.num_draft_tokens) for s in wanted])
            for s, tokens in zip(wanted, proposals, strict=True):
                s.draft_token_ids = tokens

    def verify(
        self,
        sched: SchedulerOutput,
        all_logits: list,
        sampler: Sampler,
        row_of: RowFn,
        emit: EmitFn,
        mask_of: MaskFn,
    ) -> tuple[dict[int, int], int]:
        """Sample each proposing sequence's rows in order, as plain decoding would sample its next tokens, and
        keep going while the sampled token is the proposed one. A proposal is a single token, so accepting it
        exactly when the target's own sample equals it is exact rejection sampling: the output has the target's
        distribution, and with the same seed the same tokens (one draw per emitted token, as without proposals).
        Rows of all proposing sequences are sampled together, one position at a time; plain greedy rows, whose
        token does not depend on the tokens before it, all at once. A constrained sequence's row at each position is
        masked where its grammar is then: after the tokens emitted before it, which are the proposals accepted so
        far, so its masks cover the proposed tokens. Each sampled token goes to `emit`; the scheduler settles the
        accepted proposals (Scheduler.update_from_output). Returns (seq_id -> proposals accepted, tokens emitted)."""
        verifying = [(s, logits) for s, logits in zip(sched.scheduled, all_logits, strict=True) if s.draft_token_ids]
        if not verifying:
            return {}, 0
        upfront = self._sample_independent_rows(verifying, sampler, row_of)
        accepted = [0] * len(verifying)
        active = list(range(len(verifying)))
        position = emitted = 0
        while active:
            drawn: dict[int, SampledToken] = {k: upfront[k][position] for k in active if k in upfront}
            needed, rows = [], []
            for k in active:
                if k in upfront:
                    continue
                seq = verifying[k][0].seq
                row = row_of(seq, len(rows))
                if seq.params.structured_outputs is not None:
                    row.allowed = mask_of(seq)
                    if seq.is_finished:  # its grammar allows nothing more: ended with an error
                        continue
                needed.append(k)
                rows.append(row)
            taken = set(needed)
            active = [k for k in active if k in upfront or k in taken]
            if needed:
                logits = torch.stack([verifying[k][1][position] for k in needed])  # [needed, vocab]
                drawn.update(zip(needed, sampler.sample(logits, rows), strict=True))
            emitted += len(active)
            now = time.monotonic()
            still = []
            for k in active:
                s, token = verifying[k][0], drawn[k]
                emit(s.seq, token, now)
                drafts = s.draft_token_ids
                if not s.seq.is_finished and position < len(drafts) and token.token_id == drafts[position]:
                    accepted[k] += 1
                    still.append(k)
            active = still
            position += 1
        for (s, _), num_accepted in zip(verifying, accepted, strict=True):
            self.stats.record(len(s.draft_token_ids), num_accepted)
            self.acceptance.observe(s.seq.seq_id, len(s.draft_token_ids), num_accepted)
        return {s.seq.seq_id: n for (s, _), n in zip(verifying, accepted, strict=True)}, emitted

    def _sample_independent_rows(
        self, verifying: list, sampler: Sampler, row_of: RowFn
    ) -> dict[int, list[SampledToken]]:
        """The tokens of every row of the verifying sequences (index into `verifying` -> one per row) whose rows are
        plain greedy (no penalty, bias, ban or constraint; min_tokens reached), in one sampler call: such a row's
        token is its argmax whatever came before it, so the verification needs no round per position."""
        independent = [
            k
            for k, (s, _) in enumerate(verifying)
            if s.seq.params.structured_outputs is None and is_plain_greedy(row_of(s.seq, 0))
        ]
        if not independent:
            return {}
        rows: list[SamplingRow] = []
        for k in independent:
            seq, first = verifying[k][0].seq, len(rows)
            rows += [row_of(seq, first + j) for j in range(verifying[k][1].shape[0])]
        sampled = sampler.sample(torch.cat([verifying[k][1] for k in independent]), rows)  # [sum(K + 1), vocab]
        upfront, first = {}, 0
        for k in independent:
            count = verifying[k][1].shape[0]
            upfront[k], first = sampled[first : first + count], first + count
        return upfront

    def release(self, seq_id: int) -> None:
        """A sequence left: its acceptance history and its draft cache's ledger go."""
        self.acceptance.release(seq_id)
        if self.drafter is not None:
            self.drafter.release(seq_id)
