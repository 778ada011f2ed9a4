"""The models a server of several serves, by name: those given with --model (`--model NAME=MODEL` chooses the
name), the files and checkpoint folders of --models-dir, and the Hugging Face Hub's cache (what /api/pull or
`tokenmill pull` fetched, by the name --model takes, as llama.cpp's router lists its cache). Loaded or not, each is
listed by /v1/models and /api/tags, and requests name it by its id or an alias (Ollama's ":latest" tag or not)."""

import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from tokenmill.loader.hf_checkpoint import is_hf_checkpoint
from tokenmill.loader.hub_cache import cached_hub_models, hub_repo_of
from tokenmill.loader.hub_download import HubSettings
from tokenmill.loader.hub_reference import is_hub_reference
from tokenmill.loader.model_path import BUNDLED_NAME, NAMED_MODELS, bundled_model_path

OLLAMA_TAG = ":latest"
HUB_CACHE_TTL_S = 5.0  # the Hub cache is read again after this long (a scan walks every cached file)
_LATER_SHARD = re.compile(r"-0000[2-9]-of-|-000[1-9][0-9]-of-")  # a split GGUF's other shards: not models


@dataclass(frozen=True)
class ServableModel:
    name: str  # its id: what /v1/models lists and responses say
    path: str  # where it is on this machine (a .gguf file or a checkpoint folder)
    aliases: tuple[str, ...] = ()  # other names requests may use (the name typed on the command line)
    source: str = "--model"  # where it comes from: --model, --models-dir, /api/pull

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.aliases)

    def disk_bytes(self) -> int:
        p = Path(self.path)
        if p.is_dir():
            return sum(f.stat().st_size for f in p.glob("*.safetensors"))
        shards = sorted(p.parent.glob(_shard_pattern(p.name))) if "-00001-of-" in p.name else [p]
        return sum(s.stat().st_size for s in shards if s.exists())


def _shard_pattern(first: str) -> str:
    return re.sub(r"-00001-of-", "-*-of-", first)


def split_named(spec: str) -> tuple[str | None, str]:
    """`NAME=MODEL` -> (NAME, MODEL); anything else (a path that holds "=" included) -> (None, spec)."""
    name, sep, model = spec.partition("=")
    if not sep or not name or "/" in name or not model or Path(spec).expanduser().exists():
        return None, spec
    return name, model


def served_model(spec: str, path: str, name: str | None = None, source: str = "--model") -> ServableModel:
    """The entry for a model given as `spec` (as typed) and found at `path`: named as the one-model server names
    it (server/state.py): `name` where given; a Hub repository by its Hub name, as vLLM serves it; else the file's
    own name, with a model's short name typed (gemma3-270m) as an alias."""
    if name is not None:
        return ServableModel(name, path, source=source)
    if is_hub_reference(spec):
        return ServableModel(spec, path, source=source)
    p = Path(path)
    try:
        bundled = p.resolve() == bundled_model_path().resolve()
    except Exception:  # noqa: BLE001 - the bundled package is not installed: this is no bundled model
        bundled = False
    own = BUNDLED_NAME if bundled else (hub_repo_of(p) or p.stem)
    aliases = (spec,) if spec.lower() in NAMED_MODELS and spec != own else ()
    return ServableModel(own, path, aliases, source)


def scan_models_dir(folder: Path) -> list[ServableModel]:
    """The models of a --models-dir: every .gguf file (a split one by its first shard) and checkpoint folder, by
    its file's stem or folder's name."""
    found = []
    for p in sorted(folder.iterdir()) if folder.is_dir() else []:
        if p.is_file() and p.suffix.lower() == ".gguf" and not _LATER_SHARD.search(p.name):
            found.append(ServableModel(p.stem, str(p), source="--models-dir"))
        elif p.is_dir() and is_hf_checkpoint(p):
            found.append(ServableModel(p.name, str(p), source="--models-dir"))
    return found


def hub_cache_models() -> list[ServableModel]:
    """The Hub cache's models that a name alone loads (not those that need --revision or --hf-file)."""
    return [
        ServableModel(m.name, str(m.path), source="Hub cache")
        for m in cached_hub_models(HubSettings.from_environment().cache_dir)
        if " " not in m.name
    ]


class Catalog:
    """Every servable model; the first given is the default (requests that name none go to it). Reads folders and
    the Hub cache: call from worker threads (it is thread-safe)."""

    def __init__(self, given: list[ServableModel], models_dir: str | None = None, hub_cache: bool = True):
        self._given = list(given)
        self._pulled: list[ServableModel] = []
        self._models_dir = Path(models_dir).expanduser() if models_dir else None
        self._hub_cache = hub_cache
        self._hub_read: tuple[float, list[ServableModel]] = (-HUB_CACHE_TTL_S, [])
        self._lock = threading.Lock()

    def _hub(self) -> list[ServableModel]:
        with self._lock:
            read_at, models = self._hub_read
        if not self._hub_cache or time.monotonic() - read_at < HUB_CACHE_TTL_S:
            return models
        models = hub_cache_models()
        with self._lock:
            self._hub_read = (time.monotonic(), models)
        return models

    def all(self, hub: bool = True) -> list[ServableModel]:
        """Every model, each once (by id: the first of a name wins), the folder read again (files come and go)."""
        scanned = scan_models_dir(self._models_dir) if self._models_dir is not None else []
        cached = self._hub() if hub else []
        with self._lock:
            models = [*self._given, *scanned, *self._pulled, *cached]
        seen: set[str] = set()
        unique = []
        for m in models:
            if m.name not in seen:
                seen.add(m.name)
                unique.append(m)
        return unique

    def find(self, name: str) -> ServableModel | None:
        """The model `name` names (its id or an alias; Ollama's ":latest" tag is optional), or None."""
        wanted = {name, name.removesuffix(OLLAMA_TAG)}
        found = next((m for m in self.all(hub=False) if wanted & set(m.names)), None)
        return found or next((m for m in self.all() if wanted & set(m.names)), None)

    @property
    def default(self) -> ServableModel | None:
        models = self.all(hub=False)
        return models[0] if models else None

    def forget_hub_cache(self) -> None:
        """The cache changed (a pull or a delete): read it again at the next listing."""
        with self._lock:
            self._hub_read = (-HUB_CACHE_TTL_S, self._hub_read[1])

    def add(self, model: ServableModel) -> None:
        with self._lock:
            if all(model.name not in m.names for m in (*self._given, *self._pulled)):
                self._pulled.append(model)

    def forget(self, name: str) -> None:
        """Drop a pulled model (deleted from the Hub cache)."""
        with self._lock:
            self._pulled = [m for m in self._pulled if name not in m.names]
