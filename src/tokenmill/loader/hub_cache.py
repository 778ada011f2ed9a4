"""The Hugging Face Hub's cache seen as models (`tokenmill models`): each cached safetensors checkpoint and GGUF
model, by the name `--model` takes to load it again, and the repository a cached path belongs to."""

from dataclasses import dataclass
from pathlib import Path

from tokenmill.loader.hub_files import gguf_models, is_safetensors_repo, quant_of


@dataclass(frozen=True)
class CachedHubModel:
    name: str  # what --model takes: ORG/NAME or ORG/NAME:QUANT
    path: Path  # the snapshot directory, or the GGUF file (first shard)
    note: str


def hub_repo_of(path: Path) -> str | None:
    """ORG/NAME of a snapshot directory of the Hub's cache (.../models--ORG--NAME/snapshots/COMMIT), else None."""
    if path.parent.name == "snapshots" and path.parent.parent.name.startswith("models--"):
        return path.parent.parent.name.removeprefix("models--").replace("--", "/")
    return None


def cached_hub_models(cache_dir: Path) -> list[CachedHubModel]:
    """Every model in the Hub's cache at `cache_dir`, one per cached revision (`--revision` named where it is no
    branch's head)."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound, CorruptedCacheException

    try:
        info = scan_cache_dir(cache_dir)
    except (CacheNotFound, CorruptedCacheException, OSError):
        return []
    found = []
    for repo in sorted(info.repos, key=lambda r: r.repo_id):
        if repo.repo_type != "model":
            continue
        for revision in sorted(repo.revisions, key=lambda r: r.commit_hash):
            refs = sorted(revision.refs)
            at = "" if "main" in refs else f" --revision {refs[0] if refs else revision.commit_hash}"
            note = f"Hub cache{at.replace(' --revision ', ', revision ')}"
            snapshot = Path(revision.snapshot_path)
            files = [str(f.file_path.relative_to(snapshot)) for f in revision.files]
            if is_safetensors_repo(files):
                found.append(CachedHubModel(repo.repo_id + at, snapshot, note))
            for first in gguf_models(files):
                quant = quant_of(first)
                name = f"{repo.repo_id}:{quant}" if quant else f"{repo.repo_id} --hf-file {first}"
                found.append(CachedHubModel(name + at, snapshot / first, note))
    return found
