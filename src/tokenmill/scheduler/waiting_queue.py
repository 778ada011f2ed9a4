"""The scheduler's waiting sequences, admitted fairly between groups (one group per API call).

A call with many prompts (a 2,048-input embedding call, a batch of completions) queues all its sequences at once;
first come first served would make a request that arrives after it wait for every one of them. Here the groups
take turns: each admission takes the first sequence of the group at the front, and that group, if it still has
sequences waiting, goes to the back. Within a group sequences keep their order, so a group of one request each is
plain first come first served (the offline API's case). A preempted sequence goes back to the head of its group,
and its group to the front: it runs again first, as before.

    groups (front to back):  [call A: a3 a4 a5]  [call B: b0]  [call C: c0 c1]
    pop_front() -> a3;       [call B: b0]  [call C: c0 c1]  [call A: a4 a5]
"""

from collections import OrderedDict, deque
from collections.abc import Iterator

from tokenmill.scheduler.sequence import Sequence


class WaitingQueue:
    def __init__(self) -> None:
        self._groups: OrderedDict[str, deque[Sequence]] = OrderedDict()  # front group first
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def __bool__(self) -> bool:
        return self._size > 0

    def __iter__(self) -> Iterator[Sequence]:
        """The sequences in the order they would be admitted if nothing else arrived."""
        queues = [list(q) for q in self._groups.values()]
        depth = max((len(q) for q in queues), default=0)
        for i in range(depth):
            for q in queues:
                if i < len(q):
                    yield q[i]

    def groups(self) -> set[str]:
        """The groups with a sequence waiting."""
        return set(self._groups)

    def append(self, seq: Sequence) -> None:
        """A new sequence: at the back of its group (a new group goes to the back of the turns)."""
        queue = self._groups.get(seq.group)
        if queue is None:
            queue = self._groups[seq.group] = deque()
        queue.append(seq)
        self._size += 1

    def push_front(self, seq: Sequence) -> None:
        """A preempted sequence: the next one admitted."""
        queue = self._groups.get(seq.group)
        if queue is None:
            queue = self._groups[seq.group] = deque()
        queue.appendleft(seq)
        self._groups.move_to_end(seq.group, last=False)
        self._size += 1

    def peek(self) -> Sequence:
        """The sequence admitted next (IndexError when none waits)."""
        if not self._groups:
            raise IndexError("no sequence is waiting")
        return next(iter(self._groups.values()))[0]

    def pop_front(self) -> Sequence:
        """Take the next sequence; its group's turn passes to the next group."""
        group, queue = next(iter(self._groups.items()))
        seq = queue.popleft()
        self._size -= 1
        if queue:
            self._groups.move_to_end(group)
        else:
            del self._groups[group]
        return seq

    def pass_turn(self) -> None:
        """The front group lets the next one go first (it may take nothing more this step)."""
        if self._groups:
            self._groups.move_to_end(next(iter(self._groups)))

    def remove(self, seq: Sequence) -> bool:
        """Take `seq` out wherever it waits (aborted); False when it does not wait here."""
        queue = self._groups.get(seq.group)
        if queue is None:
            return False
        try:
            queue.remove(seq)
        except ValueError:
            return False
        self._size -= 1
        if not queue:
            del self._groups[seq.group]
        return True
