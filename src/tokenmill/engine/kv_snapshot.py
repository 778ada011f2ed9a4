"""A prefix's K/V saved to a file and read back into the prefix cache: llama.cpp's slot save and restore.

llama-server keeps each slot's K/V apart and writes a slot's cells to a file. tokenmill's K/V live in blocks shared
by every sequence through the prefix cache (scheduler/block_manager.py), so a slot's K/V are the cached blocks its
tokens find there: save writes the tokens and those full blocks' K and V of every layer; restore enters the blocks
into the prefix cache again (taking free ones, as a computed prompt would), so that the next prompt starting with
those tokens reads them instead of computing them, in this process or another with the same model.

The file begins as llama.cpp's sequence state files do (magic "ggsq", version 3, the token words: llama-server's
packed slot tokens, [-1, 1, n, tokens..., 0 media chunks]; a plain token list, as older servers wrote, is read
too), then tokenmill's section: b"TMKV", its version, and the K/V as safetensors, with the model and the cache
layout they were computed with in its metadata: a file of another model or layout is refused, not read as K/V.

Runs on the engine thread between steps (AsyncEngine.run_on_engine): no step reads or writes the blocks meanwhile.
"""

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.errors import InvalidParameterError, TokenmillError

STATE_MAGIC = 0x67677371  # "ggsq": llama.cpp's LLAMA_STATE_SEQ_MAGIC
STATE_VERSION = 3  # llama.cpp's LLAMA_STATE_SEQ_VERSION
TOKENS_MARK = -1  # LLAMA_TOKEN_NULL: the token words are llama-server's packed slot tokens
TOKENS_VERSION = 1  # llama-server's SERVER_TOKENS_STATE_VERSION
SECTION = b"TMKV"
SECTION_VERSION = 1


class SnapshotUnsupported(TokenmillError):
    """This engine cannot save or restore K/V (prefix caching off, tensor parallelism)."""


class NoRoomError(TokenmillError):
    """The KV cache has no room for the restored blocks now (they are held by running requests)."""


@dataclass
class PrefixFile:
    """A slot file's contents: its tokens, and (None in a file without tokenmill's section) the K/V of the first
    num_blocks full blocks of them, with the layout they were computed with."""

    tokens: list[int]
    layout: dict[str, Any] | None = None
    num_blocks: int = 0
    window_first: int = 0  # the window pool's tensors start at this block
    tensors: dict[str, torch.Tensor] | None = None


def kv_layout(engine: LLMEngine) -> dict[str, Any]:
    """What K/V depend on and how they are laid out: a file saved under another layout is refused."""
    runner = engine.runner
    c = engine.model_config
    path = Path(engine.model_path)
    size = path.stat().st_size if path.is_file() else sum(f.stat().st_size for f in path.glob("*") if f.is_file())
    return {
        "model": path.name,
        "model_bytes": size,
        "quantization": str(engine.quantization),
        "dtype": str(runner.dtype).removeprefix("torch."),
        "kv_dtype": str(runner.kv_dtype).removeprefix("torch."),
        "block_size": engine.config.block_size,
        "num_layers": c.num_layers,
        "num_kv_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "window_layers": engine.kv.window_pool is not None,
    }


def _check_supported(engine: LLMEngine) -> None:
    if not engine.config.enable_prefix_caching:
        raise SnapshotUnsupported("the prefix cache is off (--no-enable-prefix-caching): no K/V to save or restore")
    if engine.tensor_parallel is not None:
        raise SnapshotUnsupported("saving and restoring K/V is not implemented under tensor parallelism")


def save_prefix(engine: LLMEngine, tokens: list[int]) -> PrefixFile:
    """The K/V the prefix cache holds for `tokens` (its cached full blocks), copied to the CPU."""
    _check_supported(engine)
    saved = engine.kv.saved_prefix(tokens)
    tensors = engine.runner.read_kv_blocks(saved.blocks, saved.window)  # type: ignore[union-attr]
    return PrefixFile(list(tokens), kv_layout(engine), len(saved.blocks), saved.window_first, tensors)


def restore_prefix(engine: LLMEngine, snapshot: PrefixFile) -> int:
    """Enter the file's blocks into the prefix cache; returns the tokens they cover. Raises InvalidParameterError
    for a file this engine cannot take, NoRoomError when its blocks do not fit now."""
    _check_supported(engine)
    if snapshot.layout is None or snapshot.tensors is None:
        raise InvalidParameterError("the file holds no K/V written by tokenmill (a llama.cpp slot file?)", "filename")
    ours = kv_layout(engine)
    differ = [f"{k}: {snapshot.layout.get(k)!r}, here {v!r}" for k, v in ours.items() if snapshot.layout.get(k) != v]
    if differ:
        raise InvalidParameterError(
            "the file's K/V were computed by another model or cache layout (" + "; ".join(differ) + ")", "filename"
        )
    vocab = engine.model_config.vocab_size
    if any(not 0 <= t < vocab for t in snapshot.tokens):
        raise InvalidParameterError("Invalid tokens in slot save file", "filename")
    bs = engine.config.block_size
    if snapshot.num_blocks * bs > len(snapshot.tokens):
        raise InvalidParameterError("the file holds K/V of more tokens than it names", "filename")
    _check_tensors(engine, snapshot)
    if snapshot.num_blocks == 0:
        return 0
    kv = engine.kv
    restored = kv.restore_prefix(snapshot.tokens, snapshot.num_blocks)
    if restored is None:
        raise NoRoomError("No available space in KV cache: its blocks are held by the requests running now")
    if kv.window_pool is not None and restored.window_first != snapshot.window_first:
        kv.end_restore(restored, written=False)
        raise InvalidParameterError("the file's window blocks do not match this cache", "filename")
    try:
        fresh = [(b, j) for j, (b, new) in enumerate(restored.chain) if new]
        local = [(b, j) for j, (b, new) in enumerate(restored.window) if new]
        engine.runner.write_kv_blocks(snapshot.tensors, fresh, local)  # type: ignore[union-attr]
    except BaseException:
        kv.end_restore(restored, written=False)
        raise
    kv.end_restore(restored, written=True)
    return snapshot.num_blocks * bs


def _check_tensors(engine: LLMEngine, snapshot: PrefixFile) -> None:
    """Every layer's K and V, shaped as this cache's rows for the file's blocks."""
    runner = engine.runner
    bs = engine.config.block_size
    tensors = snapshot.tensors or {}
    window_blocks = snapshot.num_blocks - snapshot.window_first
    for i, (k, _) in enumerate(runner.kv_caches):  # type: ignore[union-attr]
        blocks = window_blocks if runner.is_local_layer(i) else snapshot.num_blocks  # type: ignore[union-attr]
        want = (blocks * bs, *k.shape[1:])
        for name in (f"k.{i}", f"v.{i}"):
            t = tensors.get(name)
            if t is None or tuple(t.shape) != want or t.dtype != k.dtype:
                got = None if t is None else (tuple(t.shape), str(t.dtype))
                raise InvalidParameterError(f"the file's {name} is {got}, not {want} of {k.dtype}", "filename")


def encode_file(snapshot: PrefixFile) -> bytes:
    """The file's bytes: llama.cpp's header and packed slot tokens, then tokenmill's K/V section."""
    words = [TOKENS_MARK, TOKENS_VERSION, len(snapshot.tokens), *snapshot.tokens, 0]  # no media chunks
    head = struct.pack(f"<III{len(words)}i", STATE_MAGIC, STATE_VERSION, len(words), *words)
    meta = {"layout": snapshot.layout, "num_blocks": snapshot.num_blocks, "window_first": snapshot.window_first}
    body = save_tensors(snapshot.tensors or {}, metadata={"tokenmill": json.dumps(meta)})
    return head + SECTION + struct.pack("<I", SECTION_VERSION) + body


def decode_file(data: bytes) -> PrefixFile:
    """A slot file's bytes -> its tokens and K/V; InvalidParameterError when it is none."""
    if len(data) < 12:
        raise InvalidParameterError("invalid slot save file: too short", "filename")
    magic, version, n_words = struct.unpack_from("<III", data, 0)
    if magic != STATE_MAGIC or version != STATE_VERSION:
        raise InvalidParameterError(f"invalid slot save file: magic {magic:08x}, version {version}", "filename")
    end = 12 + 4 * n_words
    if end > len(data):
        raise InvalidParameterError("invalid slot save file: token count exceeds the file size", "filename")
    words = list(struct.unpack_from(f"<{n_words}i", data, 12))
    tokens = _slot_tokens(words)
    rest = data[end:]
    if not rest:
        return PrefixFile(tokens)
    if rest[:4] != SECTION or len(rest) < 8:
        return PrefixFile(tokens)  # another server's K/V (llama.cpp's): the tokens only
    (section_version,) = struct.unpack_from("<I", rest, 4)
    if section_version != SECTION_VERSION:
        raise InvalidParameterError(f"unsupported tokenmill K/V section version {section_version}", "filename")
    try:
        tensors = load_tensors(bytes(rest[8:]))
        meta = json.loads(_metadata(bytes(rest[8:])).get("tokenmill", "{}"))
    except Exception as exc:  # noqa: BLE001 - whatever the bytes are, the answer is the same
        raise InvalidParameterError(f"invalid slot save file: its K/V do not read: {exc}", "filename") from exc
    if not isinstance(meta, dict) or not isinstance(meta.get("layout"), dict):
        raise InvalidParameterError("invalid slot save file: its K/V carry no layout", "filename")
    return PrefixFile(tokens, meta["layout"], int(meta.get("num_blocks", 0)), int(meta.get("window_first", 0)), tensors)


def _slot_tokens(words: list[int]) -> list[int]:
    """llama-server's slot tokens: packed ([-1, version, n, tokens..., media count, ...]) or a plain list."""
    if not words or words[0] != TOKENS_MARK:
        return words
    if len(words) < 3 or words[1] != TOKENS_VERSION:
        raise InvalidParameterError("Unsupported server tokens state version", "filename")
    n = words[2]
    if n < 0 or 3 + n + 1 > len(words):
        raise InvalidParameterError("invalid slot save file: its token list is cut short", "filename")
    if words[3 + n] != 0:
        raise InvalidParameterError("Cannot restore media tokens: this server reads text only", "filename")
    if len(words) > 3 + n + 1:
        raise InvalidParameterError("Trailing data in server tokens state", "filename")
    return words[3 : 3 + n]


def _metadata(body: bytes) -> dict[str, str]:
    """A safetensors buffer's __metadata__."""
    (length,) = struct.unpack_from("<Q", body, 0)
    return json.loads(body[8 : 8 + length]).get("__metadata__") or {}
