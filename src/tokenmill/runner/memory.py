"""Keeping a long-running process's memory flat: the allocator and oneDNN, not tokenmill's own objects.

A soak of `tokenmill serve` (benchmarks/README.md, "Reliability") grew by about 30 MiB a minute while Python's
own objects did not (tracemalloc). What grew, and what keeps it in bounds:
- glibc keeps memory that tensors and tokenizer threads freed in its arenas: `malloc_trim(0)` hands it back
  (about 230 MiB after loading the model, whose float32 copies are temporary, and tens of MiB a minute under
  load). It takes 2-15 ms here, so the engine calls it after loading and then at most every TRIM_INTERVAL_S;
- oneDNN compiles a bfloat16 GEMM for every shape it meets and keeps it: its primitive cache holds 1,024 of
  them by default, about 330 MiB at random row counts. 32 keep what repeats (no measurable cost on offline-32
  or a 512-token prefill); the row counts themselves are few (layers/linear.py, padded_rows);
- the KV cache's pages became resident one by one as prefix caching cycled through every block: it is written
  when allocated (runner/model_runner.py), so its memory is there from the start instead of growing.
"""

import ctypes
import ctypes.util
import os
import time

ONEDNN_CACHE_CAPACITY = 32  # compiled GEMMs oneDNN keeps (its own default: 1,024)
TRIM_INTERVAL_S = 10.0


def bound_onednn_cache() -> None:
    """Read by oneDNN when it creates its first primitive: call before the first matrix product (a value the
    user set wins)."""
    os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", str(ONEDNN_CACHE_CAPACITY))


def _load_libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "malloc_trim") else None  # glibc only


_LIBC = _load_libc()


def release_free_memory() -> None:
    """Give the memory the allocator holds but nobody uses back to the system (glibc; elsewhere a no-op)."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


class MemoryTrimmer:
    """Calls release_free_memory at most once every `interval_s` (from a loop that runs steps)."""

    def __init__(self, interval_s: float = TRIM_INTERVAL_S):
        self.interval_s = interval_s
        self._last = time.monotonic()

    def maybe_release(self) -> None:
        now = time.monotonic()
        if now - self._last >= self.interval_s:
            release_free_memory()
            self._last = time.monotonic()
