"""The engine's LoRA adapters: served name -> id, the runner holding their weights (vLLM's `--lora-modules` and
its /v1/load_lora_adapter, /v1/unload_lora_adapter).

Ids count up from 1 and are never reused: a sequence's id keys its prefix-cache blocks (scheduler/block_manager.py),
so an adapter unloaded and loaded again under its name (new weights, perhaps) shares no K/V with its old self. An
unloaded adapter's name goes at once (new requests naming it are refused); its weights stay until the last
sequence using them ends.
"""

import itertools
import logging
from dataclasses import dataclass
from typing import Protocol

from tokenmill.errors import InvalidParameterError
from tokenmill.layers.lora import AdapterWeights
from tokenmill.loader.lora_file import LoRAFile, describe

logger = logging.getLogger(__name__)


class LoRANotFoundError(InvalidParameterError):
    """A request or an unload names an adapter this engine does not hold."""


class LoRAExistsError(InvalidParameterError):
    """A load names an adapter already loaded (unload it first, as vLLM asks)."""


class AdapterHolder(Protocol):  # ModelRunner, TensorParallelRunner
    def add_lora(self, lora_id: int, lora: LoRAFile) -> AdapterWeights: ...

    def remove_lora(self, lora_id: int) -> None: ...


@dataclass(frozen=True)
class LoadedLoRA:
    name: str
    lora_id: int
    path: str
    format: str  # "peft" or "gguf"
    rank: int
    nbytes: int  # its weights as held here (this rank's part under tensor parallelism)


class LoRARegistry:
    def __init__(self, runner: AdapterHolder):
        self._runner = runner
        self._ids = itertools.count(1)
        self.loaded: dict[str, LoadedLoRA] = {}  # by served name
        self._retiring: set[int] = set()  # unloaded while sequences still used them

    def names(self) -> list[str]:
        return list(self.loaded)

    def load(self, name: str, lora: LoRAFile) -> LoadedLoRA:
        """Hold adapter `lora` under `name` (on the engine's thread: the runner's ranks are told in step order).
        Raises LoRAExistsError, or LoRAError when the adapter does not fit the model."""
        if not isinstance(name, str) or not name.strip():
            raise InvalidParameterError("a LoRA adapter needs a name", "lora_name")
        if name in self.loaded:
            raise LoRAExistsError(f"a LoRA adapter named {name!r} is already loaded; unload it first", "lora_name")
        lora_id = next(self._ids)
        adapter = self._runner.add_lora(lora_id, lora)
        loaded = LoadedLoRA(name, lora_id, str(lora.path), lora.format, adapter.rank, adapter.nbytes)
        self.loaded[name] = loaded
        mib = adapter.nbytes / 2**20
        logger.info("LoRA adapter %r loaded from %s: %s (%.1f MiB)", name, lora.path, describe(lora), mib)
        return loaded

    def id_of(self, name: str) -> int:
        loaded = self.loaded.get(name)
        if loaded is None:
            known = f" (loaded: {', '.join(self.loaded)})" if self.loaded else " (none is loaded)"
            raise LoRANotFoundError(f"no LoRA adapter named {name!r}{known}", "lora_name")
        return loaded.lora_id

    def unload(self, name: str, in_use: set[int]) -> LoadedLoRA:
        """Forget `name`; its weights go now, or once no sequence of `in_use` (the ids running) uses them."""
        lora_id = self.id_of(name)
        loaded = self.loaded.pop(name)
        if lora_id in in_use:
            self._retiring.add(lora_id)
        else:
            self._runner.remove_lora(lora_id)
        logger.info("LoRA adapter %r unloaded", name)
        return loaded

    @property
    def retiring(self) -> bool:
        return bool(self._retiring)

    def retire_unused(self, in_use: set[int]) -> None:
        """Drop the weights of unloaded adapters that no sequence of `in_use` uses any more."""
        for lora_id in self._retiring - in_use:
            self._runner.remove_lora(lora_id)
        self._retiring &= in_use
