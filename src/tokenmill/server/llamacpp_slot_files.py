"""llama-server's slot save and restore (POST /slots/{id}?action=save|restore, {"filename"}): a slot's tokens and
the K/V the prefix cache holds for them, written to a file in --slot-save-path and read back into the prefix
cache (engine/kv_snapshot.py), so that the next prompt that starts with those tokens reads them, in this server or
another one of the same model. The answers are llama-server's: id_slot, filename, n_saved / n_restored (the
slot's tokens), n_written / n_read (the file's bytes) and timings."""

import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any

from tokenmill.engine.kv_snapshot import NoRoomError, PrefixFile, SnapshotUnsupported, decode_file, encode_file
from tokenmill.errors import InvalidParameterError
from tokenmill.server.errors import APIError
from tokenmill.server.llamacpp_slots import Slot
from tokenmill.server.state import ServerState

NOT_SUPPORTED = 501
FORBIDDEN_CHARACTERS = set(':*?"<>|/\\')


def valid_filename(name: str) -> bool:
    """llama.cpp's fs_validate_filename (no subfolders): a plain file name, never a path. Refused: empty or over
    255 bytes, control characters, the characters Windows forbids and the Unicode look-alikes of / and \\ and .,
    surrogates, U+FFFD and the BOM, a leading or trailing space, a trailing dot, "." and any "..": a name that
    could leave the folder, or be read as another name, is no name."""
    if not name or len(name.encode("utf-8", "surrogatepass")) > 255:
        return False
    for ch in name:
        c = ord(ch)
        if (
            c <= 0x1F
            or c == 0x7F
            or 0x80 <= c <= 0x9F
            or c in (0xFF0E, 0x2215, 0x2216, 0xFFFD, 0xFEFF)
            or 0xD800 <= c <= 0xDFFF
            or ch in FORBIDDEN_CHARACTERS
        ):
            return False
    return not (name[0] == " " or name[-1] in " ." or ".." in name or name == ".")


def slot_file(state: ServerState, filename: str | None) -> tuple[str, Path]:
    """The request's {"filename"}, checked, and its path in --slot-save-path (501 without one, as llama-server)."""
    folder = state.settings.slot_save_path
    if folder is None:
        raise APIError(
            NOT_SUPPORTED,
            "This server does not support slots action. Start it with `--slot-save-path`",
            "not_supported_error",
        )
    if not filename:
        raise APIError(400, '"filename" is required: the file\'s name in --slot-save-path', param="filename")
    if not valid_filename(filename):
        raise APIError(400, "Invalid filename", param="filename")
    return filename, Path(folder) / filename


async def save_slot(state: ServerState, slot: Slot, filename: str, path: Path) -> dict[str, Any]:
    """The slot's tokens and their cached K/V, written to `path` (a file written whole, then renamed)."""
    start = time.perf_counter()
    engine = state.require_engine()
    try:
        snapshot = await engine.save_prefix(slot.tokens)
    except SnapshotUnsupported as exc:
        raise APIError(NOT_SUPPORTED, str(exc), "not_supported_error") from exc
    try:
        written = await asyncio.to_thread(_write, path, snapshot)
    except OSError as exc:
        raise APIError(500, f"Unable to save slot: {exc.strerror or exc}", "server_error") from exc
    return {
        "id_slot": slot.id,
        "filename": filename,
        "n_saved": len(slot.tokens),
        "n_written": written,
        "timings": {"save_ms": (time.perf_counter() - start) * 1e3},
    }


async def restore_slot(state: ServerState, slot: Slot, filename: str, path: Path) -> dict[str, Any]:
    """The file's K/V entered in the prefix cache and its tokens made the slot's; a failed restore leaves the slot
    empty (as llama-server's)."""
    start = time.perf_counter()
    engine = state.require_engine()
    try:
        data = await asyncio.to_thread(path.read_bytes)
        snapshot = await asyncio.to_thread(decode_file, data)
        if len(snapshot.tokens) > slot.n_ctx:
            raise InvalidParameterError("Restored prompt does not fit in the slot context", "filename")
        await engine.restore_prefix(snapshot)
    except SnapshotUnsupported as exc:
        raise APIError(NOT_SUPPORTED, str(exc), "not_supported_error") from exc
    except (OSError, InvalidParameterError, NoRoomError) as exc:
        slot.tokens = []
        reason = f"no file {filename!r} in --slot-save-path" if isinstance(exc, FileNotFoundError) else str(exc)
        if isinstance(exc, OSError) and not isinstance(exc, FileNotFoundError):
            reason = exc.strerror or str(exc)
        raise APIError(400, f"Unable to restore slot: {reason}", param="filename") from exc
    slot.tokens = snapshot.tokens
    return {
        "id_slot": slot.id,
        "filename": filename,
        "n_restored": len(snapshot.tokens),
        "n_read": len(data),
        "timings": {"restore_ms": (time.perf_counter() - start) * 1e3},
    }


def _write(path: Path, snapshot: PrefixFile) -> int:
    """The file written whole beside its place, then renamed there: a reader never sees half of it."""
    data = encode_file(snapshot)
    with tempfile.NamedTemporaryFile(dir=path.parent, prefix=".slot-", delete=False) as f:
        f.write(data)
    Path(f.name).replace(path)
    return len(data)
