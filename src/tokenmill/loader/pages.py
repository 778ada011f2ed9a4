"""Handing back the pages of a memory-mapped model file once a weight has been built from them.

A weight read from the file's memory map leaves the pages it touched resident in the process (they count in its
RSS) although the built module holds its own copy, in the kernels' layout: the model would be held twice.
madvise(MADV_DONTNEED) drops them from the process (the kernel's page cache may keep them; touching them again
reads them again), so loading holds about one copy of the model at any time."""

import mmap

import numpy as np


def _mapping(view: np.ndarray) -> np.memmap | None:
    """The np.memmap a view's memory belongs to, following its bases (None: not a view of a mapped file)."""
    base = view
    while base is not None and not isinstance(base, np.memmap):
        base = base.base if isinstance(base, np.ndarray) else None
    return base


def release_pages(view: np.ndarray) -> None:
    """Drop the whole pages under `view` (a contiguous view of a memory-mapped file) from this process."""
    mapped = _mapping(view)
    if mapped is None or getattr(mapped, "_mmap", None) is None or not view.flags.c_contiguous:
        return
    # the mmap object starts at the memmap's offset rounded down to the allocation granularity
    begin = view.ctypes.data - mapped.ctypes.data + mapped.offset % mmap.ALLOCATIONGRANULARITY
    first = -(-begin // mmap.PAGESIZE) * mmap.PAGESIZE  # whole pages inside the view only
    end = (begin + view.nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
    if end > first:
        mapped._mmap.madvise(mmap.MADV_DONTNEED, first, end - first)
