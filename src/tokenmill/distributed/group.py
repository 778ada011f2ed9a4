"""The ranks of one tensor-parallel model on torch.distributed: meeting through a store, and the collectives a
step uses.

Two process groups over the same ranks, made as objects on the store (no process-wide default group, so one
process can hold one tensor-parallel engine after another, or beside single-process ones):
- `control` (gloo, CPU tensors): rank 0's step descriptions. A worker waits here between steps for as long as
  the engine is idle; rank 0 waits at most `collective_timeout_s` for every rank to take one (a gloo broadcast's
  root waits until each receiver has posted its receive, so a rank stopped between two steps would hang it).
- `compute` (gloo on the CPU, NCCL on CUDA, `collective_timeout_s`): the all-reduces and the logits' gather
  inside a step. A rank that dies breaks it at once (its sockets close); one that stops answering fails it after
  the timeout. Either way rank 0's step raises, and the engine fails its requests instead of hanging.
When every rank is on one machine, the step's sums and the logits' gather go through shared memory instead of
`compute` (shm.py): microseconds instead of milliseconds. Every collective's wall time on rank 0 is added up
(`collective_seconds`): the cost of coordination.
"""

import datetime
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tokenmill.distributed.shm import SharedMemoryGroup, open_shared_memory
from tokenmill.errors import CollectiveError

STARTUP_TIMEOUT = datetime.timedelta(minutes=30)  # meeting and loading: a big model loads slowly
IDLE_TIMEOUT = datetime.timedelta(days=365)  # a worker waits for the next step as long as the engine is idle


def torchrun_rank() -> int | None:
    """This process's rank when torchrun (or another env:// launcher) started it, else None."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
        return int(os.environ["RANK"])
    return None


def torchrun_store(client: bool = False) -> dist.Store:
    """The rendezvous store torchrun's environment names (its agent's own store when it has one, as env:// does).
    `client`: another connection to it, never the one that serves it (a thread's own, heartbeat.py)."""
    rank = int(os.environ["RANK"])
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        int(os.environ["WORLD_SIZE"]),
        rank == 0 and not agent_store and not client,
        STARTUP_TIMEOUT,
        wait_for_workers=False,
    )
    return dist.PrefixStore(f"tokenmill/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/", store)


def local_store_client(port: int, world_size: int) -> dist.Store:
    """Another connection to the TCPStore that a self-launching rank 0 serves on 127.0.0.1:`port`."""
    return dist.TCPStore("127.0.0.1", port, world_size, False, STARTUP_TIMEOUT, wait_for_workers=False)


@dataclass
class ParallelGroup:
    rank: int
    world_size: int
    device: torch.device  # this rank's, chosen once when it joined
    store: dist.Store
    control: dist.ProcessGroup
    compute: dist.ProcessGroup
    collective_timeout_s: float  # rank 0's longest wait for a rank to take a step or answer a collective
    shm: SharedMemoryGroup | None = None  # the step's sums and gathers when every rank is on this machine
    collective_seconds: float = 0.0  # rank 0's wall time in compute collectives and step broadcasts, summed

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place; every rank gets the same bits."""
        start = time.perf_counter()
        if self.shm is not None:
            self.shm.all_reduce(x)
        else:
            self.compute.allreduce([x]).wait()
        self._count(start)
        return x

    def gather_columns(self, x: torch.Tensor) -> torch.Tensor | None:
        """[N, V / world] on every rank -> [N, V] on rank 0 (ranks' parts side by side), None elsewhere."""
        x = x.contiguous()
        start = time.perf_counter()
        if self.shm is not None:
            out = self.shm.gather_columns(x)
            self._count(start)
            return out
        options = dist.GatherOptions()
        options.rootRank = 0
        parts = [torch.empty_like(x) for _ in range(self.world_size)] if self.rank == 0 else []
        self.compute.gather([parts] if self.rank == 0 else [], [x], options).wait()
        self._count(start)
        return torch.cat(parts, dim=1) if self.rank == 0 else None

    def broadcast_control(self, buffer: torch.Tensor) -> None:
        """Rank 0's buffer (CPU) to every rank."""
        start = time.perf_counter()
        options = dist.BroadcastOptions()
        options.rootRank, options.rootTensor = 0, 0
        work = self.control.broadcast([buffer], options)
        if self.rank != 0:
            work.wait()  # a worker's wait for the next step is idle time, not coordination
            return
        try:
            work.wait(datetime.timedelta(seconds=self.collective_timeout_s))
        except RuntimeError as exc:  # gloo's "Operation timed out!", or a peer that closed
            if "timed out" not in str(exc):
                raise
            raise CollectiveError(
                f"a tensor-parallel rank did not take the step within the collective timeout "
                f"({self.collective_timeout_s:g} s)"
            ) from exc
        self._count(start)

    def _count(self, start: float) -> None:
        self.collective_seconds += time.perf_counter() - start

    def destroy(self) -> None:
        if self.shm is not None:
            self.shm.close()
            self.shm = None
        for group in (self.compute, self.control):
            try:
                group.shutdown()
            except (RuntimeError, AttributeError):  # a broken group has nothing left to shut down
                pass


def join_group(
    rank: int, world_size: int, device: torch.device, collective_timeout_s: float, store: dist.Store
) -> ParallelGroup:
    """Meet the other ranks through `store` (every rank makes the same groups in the same order)."""
    control = dist.ProcessGroupGloo(dist.PrefixStore("control/", store), rank, world_size, IDLE_TIMEOUT)
    timeout = datetime.timedelta(seconds=collective_timeout_s)
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        compute = dist.ProcessGroupNCCL(dist.PrefixStore("compute/", store), rank, world_size, options)
    else:
        compute = dist.ProcessGroupGloo(dist.PrefixStore("compute/", store), rank, world_size, timeout)
    shm = open_shared_memory(store, rank, world_size, collective_timeout_s) if device.type == "cpu" else None
    return ParallelGroup(rank, world_size, device, store, control, compute, collective_timeout_s, shm)
