"""Open a GGUF file with the `gguf` package, validate it, and expose its metadata and tensors.

A model split by llama.cpp's gguf-split (`name-00001-of-0000N.gguf`, ...: the first shard holds the metadata, each
shard some of the tensors) opens from any of its shards, all of which must lie in one directory.

`gguf.GGUFReader` parses every element of an array field with several numpy calls, which takes seconds for a
49k-token vocabulary; `_FastArrayReader` reads each array whole (numbers in one numpy call, strings decoded in
one loop) into a single part holding its values, so the bundled model's metadata parses in about 0.15 s.
"""

import re
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUF_MAGIC, GGMLQuantizationType, GGUFReader, GGUFValueType

from tokenmill.errors import ModelFileError, UnsupportedModelError
from tokenmill.loader.pages import release_pages

# Tensor types tokenmill can turn into weights (see dequantize.py).
SUPPORTED_TENSOR_TYPES = frozenset(
    GGMLQuantizationType[name]
    for name in ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "MXFP4")
)


class _FastArrayReader(GGUFReader):
    """GGUFReader with whole-array parsing of metadata arrays (same fields, parts and tensors)."""

    _plain: np.ndarray | None = None

    def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> np.ndarray:
        # Slicing a plain ndarray view of the memmap is many times cheaper than slicing the memmap itself.
        if self._plain is None:
            self._plain = self.data.view(np.ndarray)
        count = int(count)
        end = offset + np.dtype(dtype).itemsize * count
        arr = self._plain[offset:end].view(dtype=dtype)[:count]
        return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

    def _get_field_parts(self, orig_offs: int, raw_type: int) -> tuple[int, list[np.ndarray], list[int], list[Any]]:
        if GGUFValueType(raw_type) != GGUFValueType.ARRAY or self.byte_order != "I" or sys.byteorder != "little":
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        alen = self._get(orig_offs + 4, np.uint64)
        item_type = GGUFValueType(raw_itype[0])
        count = int(alen[0])
        offs = orig_offs + 12
        parts: list[np.ndarray] = [raw_itype, alen]
        scalar_type = self.gguf_scalar_to_np.get(item_type)
        if scalar_type is not None:
            values = self._get(offs, scalar_type, count)
            parts.append(_WholeArray(int(values.nbytes), values.tolist()))
            return 12 + int(values.nbytes), parts, [], [GGUFValueType.ARRAY, item_type]
        if item_type != GGUFValueType.STRING:
            return super()._get_field_parts(orig_offs, raw_type)
        buf = self._plain
        assert buf is not None
        view = memoryview(buf)
        strings: list[str] = []
        append = strings.append
        unpack = struct.Struct("<Q").unpack_from
        start = offs
        for _ in range(count):
            (length,) = unpack(view, offs)
            append(str(view[offs + 8 : offs + 8 + length], "utf-8"))
            offs += 8 + length
        if offs > len(buf):
            raise ValueError("string array runs past the end of the file")
        parts.append(_WholeArray(offs - start, strings))
        return offs - orig_offs, parts, [], [GGUFValueType.ARRAY, GGUFValueType.STRING]


class _WholeArray:
    """One part for a whole metadata array: its size in the file (`.nbytes`, which GGUFReader sums over parts) and
    its values as a Python list (GGUFReader keeps one part per element, ~3 us each to build and to read back)."""

    def __init__(self, nbytes: int, values: list):
        self.nbytes = nbytes
        self.values = values


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of the file: its raw bytes (memory-mapped) and logical shape (rows, cols), row-major."""

    name: str
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray  # F32/F16: typed array of `shape`; quantized: uint8 [rows, bytes_per_row]


class GGUFFile:
    """A validated GGUF model: `metadata` (key -> Python value), `tensors` (name -> GGUFTensor), `path` (the file, or
    a split model's first shard) and `files` (every file it reads: the shards in order)."""

    def __init__(self, path: str | Path):
        given = Path(path)
        metadata, reader = _read(given)
        count = int(metadata.get("split.count") or 1)
        self.files = shard_paths(given, count) if count > 1 else [given]
        self.path = self.files[0]
        readers = {given: reader}
        if self.path != given:  # opened from a later shard: the metadata is the first one's
            metadata, readers[self.path] = _read(self.path)
        self.metadata = metadata
        self.tensors: dict[str, GGUFTensor] = {}
        for shard in self.files:
            self._add_tensors(shard, readers[shard] if shard in readers else _read(shard)[1])
        expected = metadata.get("split.tensors.count")
        if count > 1 and expected is not None and int(expected) != len(self.tensors):
            raise ModelFileError(
                f"{self.path}: the {count} shards hold {len(self.tensors)} tensors, the first says {expected}"
            )

    def _add_tensors(self, path: Path, reader: GGUFReader) -> None:
        file_size = path.stat().st_size
        for t in reader.tensors:
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            if t.data_offset + t.n_bytes > file_size or t.data.nbytes != t.n_bytes:
                raise ModelFileError(
                    f"{path}: truncated: tensor {t.name!r} needs bytes up to {t.data_offset + t.n_bytes}, "
                    f"the file has {file_size}"
                )
            if t.name in self.tensors:
                raise ModelFileError(f"{path}: tensor {t.name!r} is in two shards of the split model")
            self.tensors[t.name] = GGUFTensor(t.name, t.tensor_type, shape, t.data)

    @property
    def architecture(self) -> str:
        return str(self.require("general.architecture"))

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def require(self, key: str) -> Any:
        if key not in self.metadata:
            raise ModelFileError(f"{self.path}: required metadata key {key!r} is missing")
        return self.metadata[key]

    def release(self, tensor: GGUFTensor) -> None:
        """A weight was built from `tensor`: its pages of the file's memory map are not needed any more."""
        release_pages(tensor.data)

    def tensor(self, name: str) -> GGUFTensor:
        if name not in self.tensors:
            raise ModelFileError(f"{self.path}: tensor {name!r} is missing")
        tensor = self.tensors[name]
        if tensor.ggml_type not in SUPPORTED_TENSOR_TYPES:
            supported = ", ".join(sorted(t.name for t in SUPPORTED_TENSOR_TYPES))
            raise UnsupportedModelError(
                f"{self.path}: tensor {name!r} has type {tensor.ggml_type.name}, which tokenmill cannot load "
                f"(supported: {supported})"
            )
        return tensor


def _read(path: Path) -> tuple[dict[str, Any], GGUFReader]:
    """One file's metadata (key -> Python value) and reader."""
    check_gguf_magic(path)
    try:
        reader = _FastArrayReader(path)
    except (ValueError, IndexError, KeyError, OverflowError, struct.error) as exc:
        raise ModelFileError(f"{path}: not a readable GGUF file (truncated or corrupt?): {exc}") from exc
    metadata: dict[str, Any] = {}
    for name, field in reader.fields.items():
        try:
            whole = field.parts[-1]
            metadata[name] = whole.values if isinstance(whole, _WholeArray) else field.contents()
        except (UnicodeDecodeError, ValueError) as exc:
            raise ModelFileError(f"{path}: metadata key {name!r} cannot be decoded: {exc}") from exc
    return metadata, reader


# llama.cpp's names for the shards of a split model (gguf-split, and the Hub's repos)
SHARD_NAME = re.compile(r"(?P<base>.+)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf", re.IGNORECASE)


def shard_paths(path: Path, count: int) -> list[Path]:
    """The shards of the split model that `path` (one of them, its metadata saying `count`) belongs to, in order."""
    named = SHARD_NAME.fullmatch(path.name)
    if named is None or int(named["count"]) != count:
        raise ModelFileError(
            f"{path}: a shard of a GGUF split into {count} files, but not named as llama.cpp names shards "
            f"(NAME-00001-of-{count:05d}.gguf, ...): rename the shards so that they can be found"
        )
    shards = [path.with_name(f"{named['base']}-{i:05d}-of-{named['count']}.gguf") for i in range(1, count + 1)]
    missing = [shard.name for shard in shards if not shard.is_file()]
    if missing:
        raise ModelFileError(
            f"{path}: shard(s) {', '.join(missing)} of this {count}-file split model are missing; "
            f"all shards must lie in {path.parent}"
        )
    return shards


def check_gguf_magic(path: Path) -> None:
    try:
        with path.open("rb") as f:
            head = f.read(8)
    except OSError as exc:
        raise ModelFileError(f"{path}: cannot be read: {exc.strerror}") from exc
    if len(head) < 8:
        raise ModelFileError(f"{path}: not a GGUF file (only {len(head)} bytes long)")
    if struct.unpack("<I", head[:4])[0] != GGUF_MAGIC:
        raise ModelFileError(f"{path}: not a GGUF file (starts with {head[:4]!r}, expected b'GGUF')")


def quant_block_shape(ggml_type: GGMLQuantizationType) -> tuple[int, int]:
    """(values per block, bytes per block) of a tensor type."""
    return GGML_QUANT_SIZES[ggml_type]
