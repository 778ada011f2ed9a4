"""Download a model from the Hugging Face Hub into huggingface_hub's cache (or find it there) and give its local
path: a safetensors repo's snapshot directory, or a GGUF file (the first shard of a split one, all shards fetched).

huggingface_hub does the work: its cache (shared with transformers, vLLM and `hf download`), HF_TOKEN, resumable
downloads with a progress bar. Its settings (HF_ENDPOINT, HF_HUB_OFFLINE, HF_HUB_CACHE, HF_HOME) are read here each
time, not once at its import, so a program that changes them (a test, a notebook) is obeyed. huggingface_hub is
imported only when a Hub model is asked for: the command line starts without it."""

import os
from dataclasses import dataclass
from pathlib import Path

from tokenmill.errors import ModelFileError
from tokenmill.loader.hub_errors import explain_hub_error, is_unreachable
from tokenmill.loader.hub_files import SAFETENSORS_IGNORED, SAFETENSORS_PATTERNS, is_safetensors_repo, pick_gguf
from tokenmill.loader.hub_reference import HubReference

_TRUE = ("1", "on", "yes", "true")


@dataclass(frozen=True)
class HubSettings:
    endpoint: str  # HF_ENDPOINT, or huggingface.co
    cache_dir: Path  # HF_HUB_CACHE, or $HF_HOME/hub, or ~/.cache/huggingface/hub
    offline: bool  # HF_HUB_OFFLINE: the cache only

    @classmethod
    def from_environment(cls) -> "HubSettings":
        from huggingface_hub import constants

        endpoint = (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")
        cache = os.environ.get("HF_HUB_CACHE") or (
            os.path.join(os.environ["HF_HOME"], "hub") if os.environ.get("HF_HOME") else constants.HF_HUB_CACHE
        )
        offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUE or constants.HF_HUB_OFFLINE
        return cls(endpoint, Path(cache).expanduser(), offline)


def fetch_model(ref: HubReference, settings: HubSettings | None = None, tqdm_class: type | None = None) -> Path:
    """The local path of the model `ref` names, downloaded first where the cache lacks it (or has an older
    revision); `tqdm_class`: the progress bars' class (a server's /api/pull reports them as JSON lines). Raises
    ModelFileError with what to do: a name the Hub does not know, a gated or private repo without HF_TOKEN, a quant
    or file the repo lacks, offline with nothing cached."""
    settings = settings or HubSettings.from_environment()
    try:
        files, cached = _repo_files(ref, settings)
        if ref.hf_file is not None and not ref.hf_file.lower().endswith(".gguf"):
            raise ModelFileError(f"--hf-file names one .gguf file of a GGUF repo, not {ref.hf_file!r}")
        if not ref.wants_gguf and is_safetensors_repo(files):
            return _fetch_snapshot(ref, settings, tqdm_class)
        try:
            chosen = pick_gguf(ref, files)
        except ModelFileError as exc:
            if not cached:
                raise
            where = "HF_HUB_OFFLINE is set" if settings.offline else f"{settings.endpoint} cannot be reached"
            raise ModelFileError(f"{where}, and in the Hub cache ({settings.cache_dir}): {exc}") from None
        return _fetch_gguf(ref, chosen, settings, tqdm_class)
    except ModelFileError:
        raise
    except Exception as exc:  # noqa: BLE001 - huggingface_hub's and httpx's errors, said in the Hub's terms
        explained = explain_hub_error(exc, ref, settings.endpoint, settings.cache_dir, settings.offline)
        if explained is None:
            raise
        raise explained from exc


def _repo_files(ref: HubReference, settings: HubSettings) -> tuple[list[str], bool]:
    """The repo's files at the revision, and whether they are the cache's: from the Hub, or from the cache when
    offline or the Hub cannot be reached."""
    from huggingface_hub import HfApi

    if not settings.offline:
        try:
            info = HfApi(endpoint=settings.endpoint).model_info(ref.repo_id, revision=ref.revision)
            return [s.rfilename for s in info.siblings or []], False
        except Exception as exc:
            cached = cached_repo_files(ref, settings.cache_dir) if is_unreachable(exc) else None
            if cached is None:
                raise
            return cached, True  # huggingface_hub's downloads fall back to the cache the same way
    cached = cached_repo_files(ref, settings.cache_dir)
    if cached is None:
        from huggingface_hub.errors import OfflineModeIsEnabled

        raise OfflineModeIsEnabled(f"{ref.repo_id} is not in the cache")
    return cached, True


def cached_repo_files(ref: HubReference, cache_dir: Path) -> list[str] | None:
    """The files of the cached snapshot of `ref`'s revision, or None when the cache has none."""
    from huggingface_hub.file_download import repo_folder_name

    storage = cache_dir / repo_folder_name(repo_id=ref.repo_id, repo_type="model")
    revision = ref.revision or "main"
    ref_file = storage / "refs" / revision
    commit = ref_file.read_text().strip() if ref_file.is_file() else revision
    snapshot = storage / "snapshots" / commit
    if not snapshot.is_dir():
        return None
    return sorted(str(p.relative_to(snapshot)) for p in snapshot.rglob("*") if p.is_file())


def _fetch_snapshot(ref: HubReference, settings: HubSettings, tqdm_class: type | None = None) -> Path:
    from huggingface_hub import snapshot_download

    folder = snapshot_download(
        ref.repo_id,
        revision=ref.revision,
        endpoint=settings.endpoint,
        cache_dir=settings.cache_dir,
        local_files_only=settings.offline,
        allow_patterns=SAFETENSORS_PATTERNS,
        ignore_patterns=SAFETENSORS_IGNORED,
        tqdm_class=tqdm_class,
    )
    return Path(folder)


def _fetch_gguf(ref: HubReference, files: list[str], settings: HubSettings, tqdm_class: type | None = None) -> Path:
    """Every file of the chosen GGUF model (all shards of a split one); the first one's path."""
    from huggingface_hub import hf_hub_download

    paths = [
        hf_hub_download(
            ref.repo_id,
            name,
            revision=ref.revision,
            endpoint=settings.endpoint,
            cache_dir=settings.cache_dir,
            local_files_only=settings.offline,
            tqdm_class=tqdm_class,
        )
        for name in files
    ]
    return Path(paths[0])
