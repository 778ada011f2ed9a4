"""The sums and gathers of a step through shared memory, for ranks on one machine (native/shm_reduce.c).

A gloo all-reduce of a step's few KiB costs 1-2.5 ms on this project's VMs and a step needs two per layer; the
shared segment does one in microseconds. Rank 0 creates the segment in /dev/shm and names it in the store; a
rank that cannot open it (another machine) says so, and then every rank keeps gloo. Once every rank has mapped
it, the file is unlinked: the memory lives as long as the mappings, and nothing is left behind however the
ranks end. TOKENMILL_TP_SHM=0 keeps gloo everywhere.
"""

import ctypes
import logging
import mmap
import os
import uuid

import torch
import torch.distributed as dist

from tokenmill import native
from tokenmill.errors import CollectiveError

logger = logging.getLogger(__name__)

CAPACITY_FLOATS = 1 << 20  # per slot (4 MiB): a larger sum or gather goes in parts
SHM_DIR = "/dev/shm"
_ERRORS = {-4: "its process is gone", -5: "it did not answer within the collective timeout"}


class _Group(ctypes.Structure):
    _fields_ = [
        ("base", ctypes.c_void_p),
        ("rank", ctypes.c_int64),
        ("seq", ctypes.c_int64),
        ("timeout_s", ctypes.c_double),
        ("failed_rank", ctypes.c_int64),
        ("failed_code", ctypes.c_int64),
    ]


class SharedMemoryGroup:
    def __init__(self, lib: ctypes.CDLL, memory: mmap.mmap, rank: int, world_size: int, timeout_s: float):
        self.lib = lib
        self.memory = memory
        self.world_size = world_size
        self._base = ctypes.c_char.from_buffer(memory)  # keeps the mapping's address valid
        self.group = _Group(ctypes.addressof(self._base), rank, 0, timeout_s, -1, 0)
        self.rank = rank
        # for the native decoder: the C function and its state, called without Python in between
        self.reduce_fn = ctypes.cast(lib.tm_shm_allreduce, native.REDUCE_FN)
        self.reduce_ctx = ctypes.addressof(self.group)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x (contiguous, on the CPU) over the ranks in place; the same bits on every rank."""
        values = x if x.dtype == torch.float32 else x.float()
        self._check(self.lib.tm_shm_allreduce(self.reduce_ctx, values.data_ptr(), values.numel()))
        if values is not x:
            x.copy_(values)
        return x

    def gather_columns(self, x: torch.Tensor) -> torch.Tensor | None:
        """float32 [N, n] on every rank -> [N, world * n] on rank 0 (the ranks' parts side by side), else None."""
        x = x.contiguous()
        rows, n = x.shape
        out = torch.empty(rows, self.world_size * n) if self.rank == 0 else None
        step = max(1, CAPACITY_FLOATS // max(n, 1))
        for first in range(0, max(rows, 1), step):
            part = x[first : first + step]
            target = out[first : first + step].data_ptr() if out is not None else None
            self._check(self.lib.tm_shm_gather_columns(self.reduce_ctx, part.data_ptr(), part.shape[0], n, target))
        return out

    def _check(self, rc: int) -> None:
        if rc:
            raise self.error()

    def error(self) -> "CollectiveError":
        """The error of the operation that failed last, naming the rank."""
        why = _ERRORS.get(self.group.failed_code, f"code {self.group.failed_code}")
        return CollectiveError(f"tensor-parallel rank {self.group.failed_rank} failed during a step: {why}")

    def close(self) -> None:
        del self._base
        self.memory.close()


def open_shared_memory(store: dist.Store, rank: int, world_size: int, timeout_s: float) -> SharedMemoryGroup | None:
    """Every rank calls this together: the shared group when all ranks are on this machine, else None (gloo)."""
    lib = native.load()
    enabled = lib is not None and os.environ.get("TOKENMILL_TP_SHM", "1") != "0" and os.path.isdir(SHM_DIR)
    size = lib.tm_shm_bytes(world_size, CAPACITY_FLOATS) if lib is not None else 0
    memory = None
    if rank == 0:
        name = ""
        if enabled:
            name = os.path.join(SHM_DIR, f"tokenmill-tp-{uuid.uuid4().hex}")
            try:
                with open(name, "w+b") as f:
                    f.truncate(size)  # zeros: every flag at 0
                    memory = mmap.mmap(f.fileno(), size)
                lib.tm_shm_init(ctypes.addressof(ctypes.c_char.from_buffer(memory)), world_size, CAPACITY_FLOATS)
            except OSError as exc:  # /dev/shm full or read-only: gloo it is
                logger.warning("tensor parallel: no shared memory segment (%s)", exc)
                if os.path.exists(name):
                    os.unlink(name)
                name, memory = "", None
        store.set("shm/name", name)
    else:
        store.wait(["shm/name"])
        name = store.get("shm/name").decode()
        if enabled and name:
            try:
                with open(name, "r+b") as f:
                    memory = mmap.mmap(f.fileno(), size)
            except OSError:  # another machine
                memory = None
    store.set(f"shm/mapped/{rank}", "1" if memory is not None else "0")
    keys = [f"shm/mapped/{r}" for r in range(world_size)]
    store.wait(keys)
    everyone = all(store.get(key) == b"1" for key in keys)
    if rank == 0 and name:
        os.unlink(name)  # mapped wherever it will be: the memory lives on without the file
    if not everyone:
        if memory is not None:
            memory.close()
        if rank == 0:
            why = "the ranks are not all on this machine" if enabled else "shared memory is off or unavailable"
            logger.info("tensor parallel: the step's sums through gloo (%s)", why)
        return None
    group = SharedMemoryGroup(lib, memory, rank, world_size, timeout_s)
    lib.tm_shm_join(group.group.base, rank, os.getpid())
    store.set(f"shm/joined/{rank}", "1")
    store.wait([f"shm/joined/{r}" for r in range(world_size)])
    if rank == 0:
        logger.info("tensor parallel: the step's sums through shared memory (%d ranks on this machine)", world_size)
    return group
