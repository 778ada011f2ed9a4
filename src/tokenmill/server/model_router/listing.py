"""The model lists of a server of several models: OpenAI's /v1/models (every servable model, with llama.cpp's
router `status`), Ollama's /api/tags (every servable model) and /api/ps (the loaded ones: when each unloads, its
resident memory as `size`, `size_vram` 0 on the CPU). Facts come from the files' headers (no weight is read),
remembered per file version."""

import functools
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tokenmill.loader.model_facts import ModelFacts, describe_model
from tokenmill.loader.model_source import open_model_source
from tokenmill.server.model_router.catalog import OLLAMA_TAG, ServableModel
from tokenmill.server.model_router.registry import Slot
from tokenmill.server.ollama import model_details

FOREVER = "2318-01-01T00:00:00Z"  # Ollama's expires_at for a model kept loaded (keep_alive negative)


def facts_of(model: ServableModel) -> ModelFacts | None:
    """The model's facts (None when its file cannot be read: it is listed all the same). Reads headers: call in a
    worker thread."""
    p = Path(model.path)
    try:
        return _facts(str(p), p.stat().st_mtime)
    except Exception:  # noqa: BLE001 - a file gone or unreadable is still listed, without details
        return None


@functools.lru_cache(maxsize=256)
def _facts(path: str, _mtime: float) -> ModelFacts:
    return describe_model(open_model_source(Path(path)))


def status_of(slot: Slot | None) -> str:
    if slot is None:
        return "unloaded"
    if slot.loaded:
        return "loaded"
    return "loading" if slot.loading is not None and not slot.loading.done() else "unloaded"


def openai_card(model: ServableModel, slot: Slot | None, created: int, shown_path: str) -> dict[str, Any]:
    return {
        "id": model.name,
        "object": "model",
        "created": created,
        "owned_by": "tokenmill",
        "root": shown_path,
        "aliases": list(model.names),
        "status": {"value": status_of(slot)},  # llama.cpp's router: loaded, loading or unloaded
    }


def ollama_name(name: str) -> str:
    return name if ":" in name.rsplit("/", 1)[-1] else name + OLLAMA_TAG


def ollama_entry(model: ServableModel, facts: ModelFacts | None) -> dict[str, Any]:
    """/api/tags' entry for a model."""
    name = ollama_name(model.name)
    entry: dict[str, Any] = {"name": name, "model": name}
    if facts is None:
        return {**entry, "modified_at": _iso(time.time()), "size": 0, "digest": "", "details": {}}
    return {
        **entry,
        "modified_at": _iso(facts.modified_time),
        "size": facts.size_bytes,
        "digest": facts.digest,
        "details": model_details(facts),
    }


def ps_entry(slot: Slot, facts: ModelFacts | None, context_length: int | None) -> dict[str, Any]:
    """/api/ps' entry for a loaded model: `size` is what its processes hold now (resident memory)."""
    assert slot.process is not None
    size = slot.process.rss_bytes()
    expires = FOREVER
    if slot.active > 0 and slot.keep_alive_s is not None:  # busy: its keep_alive starts once it is idle
        expires = _iso(time.time() + slot.keep_alive_s)
    elif slot.expires_at is not None:
        expires = _iso(slot.expires_at)
    entry = {**ollama_entry(slot.model, facts), "size": size, "expires_at": expires, "size_vram": 0}
    if context_length is not None:
        entry["context_length"] = context_length
    return entry


def show_unloaded(model: ServableModel) -> dict[str, Any]:
    """Ollama's /api/show for a model not loaded, from its file's header (a client that shows every model's details
    loads none): its template, details and shape; the loaded model's own answer says more (its sampling defaults
    as parameters). Reads headers: call in a worker thread."""
    source = open_model_source(Path(model.path))
    facts = describe_model(source)
    arch = facts.architecture
    shape = ("context_length", "embedding_length", "block_count", "attention.head_count", "attention.head_count_kv")
    info: dict[str, Any] = {"general.architecture": arch, "general.parameter_count": facts.parameter_count}
    info |= {f"{arch}.{key}": source.get(f"{arch}.{key}") for key in shape if source.get(f"{arch}.{key}") is not None}
    return {
        "modelfile": f"# served by tokenmill (not loaded)\nFROM {Path(model.path).name}\n",
        "parameters": "",
        "template": source.get("tokenizer.chat_template") or "",
        "details": ollama_entry(model, facts)["details"],
        "model_info": info,
        "capabilities": ["completion", "tools", "embedding"],
        "modified_at": _iso(facts.modified_time),
    }


def _iso(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).isoformat().replace("+00:00", "Z")
