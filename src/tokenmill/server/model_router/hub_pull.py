"""Ollama's /api/pull and /api/delete over the Hugging Face Hub's cache: a pull downloads through the same code as
`tokenmill pull` (loader/hub_download.py), its progress bars reported as Ollama's JSON lines ({"status": "pulling
FILE", "digest", "total", "completed"}, then {"status": "success"}); a delete removes the repository (or, for
ORG/NAME:QUANT, that quant's files) from the cache. Both run in worker threads."""

import asyncio
import io
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

from tqdm.std import tqdm

from tokenmill.errors import TokenmillError
from tokenmill.loader.hub_download import HubSettings, fetch_model
from tokenmill.loader.hub_files import gguf_models, is_safetensors_repo, quant_of
from tokenmill.loader.hub_reference import HubReference, parse_hub_reference
from tokenmill.server.model_router.catalog import OLLAMA_TAG

REPORT_EVERY_S = 0.2  # a bar's progress, at most this often (and when it closes)
Report = Callable[[dict[str, Any]], None]


def hub_reference(name: str) -> HubReference | None:
    return parse_hub_reference(name.removesuffix(OLLAMA_TAG))


def _bar_class(report: Report) -> type:
    """huggingface_hub's progress bars, drawn nowhere, their byte counts reported."""

    class ReportedBar(tqdm):
        def __init__(self, *args: Any, **kwargs: Any):
            kwargs.pop("name", None)
            kwargs["file"] = io.StringIO()
            kwargs["disable"] = False
            super().__init__(*args, **kwargs)
            self._reported = 0.0

        def update(self, n: float | None = 1) -> bool | None:
            shown = super().update(n)
            if time.monotonic() - self._reported >= REPORT_EVERY_S:
                self._send()
            return shown

        def close(self) -> None:
            if not self.disable and self.unit == "B":
                self._send()
            super().close()

        def _send(self) -> None:
            self._reported = time.monotonic()
            if self.unit != "B" or not self.total:  # the files' count, or a bar that knows no size yet
                return
            what = (self.desc or "model").strip().rstrip(":")
            report({"status": f"pulling {what}", "digest": what, "total": int(self.total), "completed": int(self.n)})

    return ReportedBar


async def pull_events(ref: HubReference) -> AsyncIterator[dict[str, Any]]:
    """Ollama's progress objects for the download of `ref`; the last is {"status": "success", "path": ...} or
    {"error": message}."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

    def report(event: dict[str, Any]) -> None:
        loop.call_soon_threadsafe(queue.put_nowait, event)

    def download() -> None:
        try:
            path = fetch_model(ref, HubSettings.from_environment(), _bar_class(report))
            report({"status": "success", "path": str(path)})
        except TokenmillError as exc:
            report({"error": str(exc)})
        except Exception as exc:  # noqa: BLE001 - a network error said in the stream, as Ollama's pull says it
            report({"error": f"pulling {ref}: {exc}"})

    yield {"status": "pulling manifest"}
    threading.Thread(target=download, name="tokenmill-pull", daemon=True).start()
    while True:
        event = await queue.get()
        yield event
        if "error" in event or event.get("status") == "success":
            return


def delete_cached(ref: HubReference) -> bool:
    """Remove the model from the Hub's cache; False when the cache does not have it."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound, CorruptedCacheException

    try:
        info = scan_cache_dir(HubSettings.from_environment().cache_dir)
    except (CacheNotFound, CorruptedCacheException, OSError):
        return False
    repo = next((r for r in info.repos if r.repo_type == "model" and r.repo_id == ref.repo_id), None)
    if repo is None:
        return False
    if ref.tag is None and ref.hf_file is None:
        info.delete_revisions(*(r.commit_hash for r in repo.revisions)).execute()
        return True
    removed = False
    for revision in repo.revisions:
        snapshot = Path(revision.snapshot_path)
        files = [str(f.file_path.relative_to(snapshot)) for f in revision.files]
        if ref.tag is None and is_safetensors_repo(files):
            continue
        for first, shards in gguf_models(files).items():
            if (quant_of(first) or "").lower() == (ref.tag or "").lower() or first == ref.hf_file:
                for name in shards:
                    removed |= _remove_cached_file(snapshot / name)
    return removed


def _remove_cached_file(link: Path) -> bool:
    """A snapshot's file: its link and the blob it points to."""
    if not link.exists() and not link.is_symlink():
        return False
    blob = link.resolve()
    link.unlink()
    if blob != link and blob.is_file():
        blob.unlink()
    return True
