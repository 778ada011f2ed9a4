"""How many tokens a sequence should propose this step: as many as pay for the rows that verify them.

The k-th proposal of a sequence is emitted only if it and every proposal before it are accepted: with a per-token
acceptance rate a, that is a^k. Verifying it costs one more row in the step. While few sequences run, a row
costs little against the step (the weights are read once for all rows); in a large batch, whose step is already
bound by compute, a row costs what a sequence's token costs. So a proposal pays while a^k exceeds the tokens the
batch would have made in the row's time: B c / (1 + B c) for B running sequences, c a row's cost as a share of a
one-row step. Each sequence's rate is estimated from its own recent verifications (a copying answer accepts
nearly all, free text a third, random text none) and drifts back toward a prior while it does not propose, so a
sequence that starts copying is tried again; a sequence proposes at least one token until its first verification.
No torch here.
"""

from dataclasses import dataclass

from tokenmill.config.speculative import ROW_COST

DECAY = 0.8  # weight of the older verifications at each new one
IDLE_DECAY = 0.95  # ... at each step the sequence does not propose: its rate drifts back to the prior
PRIOR_ACCEPTED, PRIOR_REJECTED = 0.5, 0.5  # a new sequence starts at a rate of one half


@dataclass
class _Counts:
    accepted: float = 0.0  # proposals accepted, recent ones weighing most
    rejected: float = 0.0  # verifications that rejected a proposal


class AcceptanceTracker:
    def __init__(self, row_cost: float = ROW_COST) -> None:
        self.row_cost = row_cost
        self._counts: dict[int, _Counts] = {}

    def rate(self, seq_id: int) -> float:
        """The estimated chance that the sequence's next proposed token is accepted."""
        c = self._counts.get(seq_id) or _Counts()
        return (c.accepted + PRIOR_ACCEPTED) / (c.accepted + c.rejected + PRIOR_ACCEPTED + PRIOR_REJECTED)

    def threshold(self, num_running: int) -> float:
        """The chance of being emitted a proposal needs to pay for its row, with num_running sequences."""
        cost = num_running * self.row_cost
        return cost / (1 + cost)

    def proposal_length(self, seq_id: int, room: int, num_running: int) -> int:
        """How many tokens (at most room) the sequence should propose this step; at least one until its proposals
        were first verified (in a large batch the prior alone would never let it try, and never learn)."""
        rate, threshold = self.rate(seq_id), self.threshold(num_running)
        k, emitted = 0, rate  # emitted: the chance that proposal k + 1 is emitted
        while k < room and emitted >= threshold:
            k += 1
            emitted *= rate
        if seq_id not in self._counts:
            k = max(k, min(room, 1))
        return k

    def observe(self, seq_id: int, proposed: int, accepted: int) -> None:
        """A verification: `accepted` of `proposed` tokens held (the first rejected one, if any, counts once)."""
        c = self._counts.setdefault(seq_id, _Counts())
        c.accepted = c.accepted * DECAY + accepted
        c.rejected = c.rejected * DECAY + (accepted < proposed)

    def idle(self, seq_id: int) -> None:
        """A step in which the sequence decoded without proposing."""
        c = self._counts.get(seq_id)
        if c is not None:
            c.accepted *= IDLE_DECAY
            c.rejected *= IDLE_DECAY

    def release(self, seq_id: int) -> None:
        self._counts.pop(seq_id, None)
