"""Where the native kernels' weight buffers come from: made in memory at every load (`InMemoryWeights`), or kept in
a file under tokenmill's cache directory (`--weight-cache`) so a later load maps them instead of reading and
repacking the model file.

Why a file: loading a 17 GB model reads the file (about 1 GB/s from this class of disk) and writes a repacked copy
into fresh anonymous memory (about 0.5 s a GB of page faults on a VM); the file's pages and that copy do not both
stay in a 24 GiB machine's memory, so every load pays both again. The cache file holds the repacked bytes
themselves: mapped shared and read-only, its pages are the page cache's, so a restart finds them resident (a
18.5 GB mapping populates in under a second) and, when memory is short, the kernel can drop and re-read them
instead of failing. It costs disk: about the model file's size, one cache per model file (a newer one replaces it).

A cache is keyed by the model's files (path, size, modification time), the options that shape the weights
(quantization, tensor-parallel rank) and the code that lays them out (the native kernels' sources, the model's
and the layers' Python files). Buffers are taken in the order the model builds them; each is checked against its
entry (type, rows, inputs, bytes), and any mismatch drops the cache for the rest of the load (built in memory, the
file deleted, written again next time)."""

import hashlib
import json
import logging
import mmap
import os
import queue
import shutil
import threading
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

from tokenmill.cache import cache_dir

logger = logging.getLogger(__name__)

FORMAT = 1
ALIGN = 4096  # each buffer starts on a page: the kernels' 64-byte loads stay aligned
Fill = Callable[[int], None]  # fill(address): writes a buffer's bytes at `address`


class InMemoryWeights:
    """Every buffer made at load, in anonymous memory (the default)."""

    state = "off"

    def buffer(self, ggml_type: int, rows: int, in_features: int, size: int, fill: Fill) -> torch.Tensor:
        """uint8 [size]: the repacked bytes of `rows` rows of `in_features` inputs of `ggml_type`."""
        buffer = torch.empty(size, dtype=torch.uint8)
        fill(buffer.data_ptr())
        return buffer

    def finish(self) -> None:
        """The model is built."""

    def abandon(self) -> None:
        """Loading failed."""

    def wait(self) -> None:
        """Until what the store still writes is written."""


IN_MEMORY = InMemoryWeights()


def _code_hash(native_library: str) -> str:
    """The native library's name (keyed by its sources, flags and CPU) and the Python that orders and shapes the
    buffers."""
    package = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256(native_library.encode())
    for folder in ("model", "layers", "loader", "distributed"):
        for path in sorted((package / folder).glob("*.py")):
            digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()


def _file_identity(path: Path) -> list:
    stat = path.stat()
    return [str(path.resolve()), stat.st_size, stat.st_mtime_ns]


def weight_cache_key(model_path: Path, options: dict, native_library: str, files: list[Path] | None = None) -> dict:
    """What a cache must match: the model's files (a directory's, or `files`: a split GGUF's shards), the options
    that shape its weights, the code laying them out."""
    if files is None:
        files = sorted(p for p in model_path.iterdir() if p.is_file()) if model_path.is_dir() else [model_path]
    return {
        "format": FORMAT,
        "model": str(model_path.resolve()),
        "files": [_file_identity(p) for p in files],
        "options": options,
        "code": _code_hash(native_library),
    }


def open_weight_cache(
    model_path: Path, options: dict, native_library: str, folder: Path | None = None, files: list[Path] | None = None
) -> "InMemoryWeights":
    """The cache for this model and these options: read when a complete one matches, else written during this load
    (in memory instead when the disk lacks room for it)."""
    folder = folder or cache_dir() / "weights"
    key = weight_cache_key(model_path, options, native_library, files)
    name = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    index, data = folder / f"{name}.json", folder / f"{name}.bin"
    if index.exists():
        try:
            return CachedWeights(index, data, key)
        except (OSError, ValueError, KeyError) as exc:
            logger.warning("weight cache %s unreadable (%s): writing it again", index, exc)
            _remove(index, data)
    folder.mkdir(parents=True, exist_ok=True)
    _remove_others(folder, key, keep=name)
    need = sum(size for _, size, _ in key["files"]) * 1.05 + (1 << 30)
    free = shutil.disk_usage(folder).free
    if free < need:
        logger.warning(
            "weight cache: %.1f GB free in %s, %.1f GB needed: loading without it", free / 1e9, folder, need / 1e9
        )
        return IN_MEMORY
    return WritingWeights(index, data, key)


def _remove(*paths: Path) -> None:
    for path in paths:
        path.unlink(missing_ok=True)


def _remove_others(folder: Path, key: dict, keep: str) -> None:
    """Caches of the same model and options under another key (the file changed, or tokenmill did): one is kept;
    and what writers that died left half-written."""
    for index in folder.glob("*.json"):
        if index.stem == keep:
            continue
        try:
            other = json.loads(index.read_text())["key"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if isinstance(other, dict) and (other.get("model"), other.get("options")) == (key["model"], key["options"]):
            _remove(index, index.with_suffix(".bin"))
            logger.info("weight cache: removed %s, an older cache of %s", index.with_suffix(".bin"), key["model"])
    for partial in folder.glob("*.*.tmp"):  # name.PID.tmp
        pid = partial.suffixes[-2].lstrip(".")
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            _remove(partial)


class CachedWeights(InMemoryWeights):
    """Buffers read from a complete cache file: views of its shared, read-only mapping, populated at once."""

    state = "read"

    def __init__(self, index: Path, data: Path, key: dict):
        meta = json.loads(index.read_text())
        if meta["key"] != key:
            raise ValueError("key differs")
        self.index, self.data = index, data
        self.entries: list[list[int]] = meta["entries"]  # [type, rows, in_features, offset, size] in build order
        with open(data, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size != meta["bytes"]:
                raise ValueError(f"{data} has {size} bytes, its index says {meta['bytes']}")
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
            self._map = mmap.mmap(f.fileno(), size, flags=flags, prot=mmap.PROT_READ) if size else None
        self._next = 0
        self._stale = False

    def buffer(self, ggml_type: int, rows: int, in_features: int, size: int, fill: Fill) -> torch.Tensor:
        if not self._stale:
            if self._next < len(self.entries) and self.entries[self._next][:3] == [ggml_type, rows, in_features]:
                *_, offset, stored = self.entries[self._next]
                if stored == size:
                    self._next += 1
                    with warnings.catch_warnings():  # read-only memory: the kernels never write weights
                        warnings.simplefilter("ignore", UserWarning)
                        return torch.frombuffer(self._map, dtype=torch.uint8, count=size, offset=offset)
            logger.warning("weight cache %s does not match this model's build: building in memory", self.data)
            self._stale = True
            _remove(self.index)  # written again by the next load; the mapped bytes stay valid for this one
        return super().buffer(ggml_type, rows, in_features, size, fill)

    def finish(self) -> None:
        if not self._stale and self._next != len(self.entries):
            logger.warning("weight cache %s has buffers this build did not take: it is written again", self.data)
            _remove(self.index)


class WritingWeights(InMemoryWeights):
    """Buffers made in memory, as without a cache, and written to the cache file by a thread, during the load and
    after it (the engine serves meanwhile; the process waits for it at exit: the thread is not a daemon). Written
    with O_DIRECT where the file system takes it: through the page cache, 18 GB of dirty pages beside the model's
    own 18 GB pushed out the pages the load was reading (a 20 s load took 56-126 s). The index is written last,
    after the data is on disk, so a cache either is complete or is not found."""

    state = "written"
    CHUNK = 8 << 20  # bytes a write; the bounce buffer's size

    def __init__(self, index: Path, data: Path, key: dict):
        self.index, self.data, self.key = index, data, key
        self._tmp = data.with_name(f"{data.name}.{os.getpid()}.tmp")
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        try:
            self._fd = os.open(self._tmp, flags | getattr(os, "O_DIRECT", 0), 0o644)
        except OSError:  # a file system without direct I/O (tmpfs)
            self._fd = os.open(self._tmp, flags, 0o644)
        self.entries: list[list[int]] = []
        self._end = 0  # bytes of the file
        # (buffer, offset); None ends the writing. Not bounded: the buffers are the model's (held anyway)
        self._queue: queue.Queue[tuple[torch.Tensor, int] | None] = queue.Queue()
        self._complete = False
        self._thread = threading.Thread(target=self._write, name="tokenmill-weight-cache")
        self._thread.start()

    def buffer(self, ggml_type: int, rows: int, in_features: int, size: int, fill: Fill) -> torch.Tensor:
        buffer = super().buffer(ggml_type, rows, in_features, size, fill)
        offset = -(-self._end // ALIGN) * ALIGN
        self.entries.append([ggml_type, rows, in_features, offset, size])
        self._end = offset + size
        self._queue.put((buffer, offset))
        return buffer

    def _next(self) -> tuple[torch.Tensor, int] | None:
        """The next buffer to write; None at the end, or once the program has ended without finishing the build
        (the thread is not a daemon, so without this a writer never finished would hold the process at exit)."""
        while True:
            try:
                return self._queue.get(timeout=0.5)
            except queue.Empty:
                if not self._complete and not threading.main_thread().is_alive():
                    return None

    def _write(self) -> None:
        bounce = mmap.mmap(-1, self.CHUNK)  # page-aligned, as direct I/O wants its memory
        error: OSError | None = None
        while (item := self._next()) is not None:
            if error is None:
                try:
                    self._write_one(bounce, *item)
                except OSError as exc:  # a full disk, say: the model itself is in memory and unaffected
                    error = exc
        if not self._complete:
            self._discard()
        elif error is not None:
            logger.warning("weight cache not written (%s): the next load reads the model file again", error)
            self._discard()
        else:
            self._keep()

    def _write_one(self, bounce: mmap.mmap, buffer: torch.Tensor, offset: int) -> None:
        """Chunks of whole pages (direct I/O's unit), the last padded with zeros (the gap to the next buffer)."""
        data = memoryview(buffer.numpy())
        for start in range(0, len(data), self.CHUNK):
            piece = data[start : start + self.CHUNK]
            padded = -(-len(piece) // ALIGN) * ALIGN
            bounce[: len(piece)] = piece
            bounce[len(piece) : padded] = bytes(padded - len(piece))
            view = memoryview(bounce)[:padded]
            at = offset + start
            while view:  # pwrite may write less than asked
                written = os.pwrite(self._fd, view, at)
                view, at = view[written:], at + written

    def _keep(self) -> None:
        try:
            os.ftruncate(self._fd, self._end)  # the last buffer's padding
            os.fsync(self._fd)
            os.close(self._fd)
            self._tmp.replace(self.data)
            meta = {"key": self.key, "entries": self.entries, "bytes": self._end}
            tmp_index = self.index.with_name(f"{self.index.name}.{os.getpid()}.tmp")
            tmp_index.write_text(json.dumps(meta))
            tmp_index.replace(self.index)
            logger.info("weight cache: wrote %.2f GB to %s", self._end / 1e9, self.data)
        except OSError as exc:
            logger.warning("weight cache not written (%s): the next load reads the model file again", exc)
            self._discard()

    def finish(self) -> None:
        """The model is built: the rest is written in the background."""
        self._complete = True
        self._queue.put(None)

    def abandon(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def wait(self) -> None:
        self._thread.join()

    def _discard(self) -> None:
        try:
            os.close(self._fd)
        except OSError:
            pass
        _remove(self._tmp)
