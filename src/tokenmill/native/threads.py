"""How many threads the kernels and torch use: the CPUs this process may run on (its affinity and its cgroup's CPU
quota, as a container with `--cpus` sets), and one for torch while the kernels' pool finds its helpers off the CPU
(pool.c: another process is taking their cores; a second thread would only wait for them)."""

import math
import os
from pathlib import Path

import torch

_chosen: int | None = None  # the count set last (set_threads); torch's drops to 1 while the pool runs solo


def usable_cpus() -> int:
    """CPUs this process may use: its affinity mask, capped by a cgroup v2 CPU quota (cpu.max), at least 1."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            cpus = min(cpus, math.ceil(int(quota) / int(period)))
    except (OSError, ValueError):
        pass
    return max(1, cpus)


def set_threads(n: int, lib=None) -> None:
    """torch's and the kernels' thread counts (lib: the loaded kernels, or None without them)."""
    global _chosen
    _chosen = max(1, n)
    torch.set_num_threads(_chosen)
    if lib is not None:
        lib.tm_set_threads(_chosen)


def follow_contention(lib) -> None:
    """Before a step: torch's operations on one thread while the pool runs its jobs on the caller alone (its
    helpers were found descheduled: their barriers would stall torch's parallel operations the same way), and on
    the chosen count again once the pool tries its team again."""
    if lib is None or _chosen is None or _chosen == 1:
        return
    want = 1 if lib.tm_pool_solo() else _chosen
    if torch.get_num_threads() != want:
        torch.set_num_threads(want)
