"""`tokenmill serve`'s start-up: the engine is built in a thread while the web stack is imported, from the
model the prefetch (engine/model_prefetch.py) is already reading. Importing this module does not import torch; the
engine thread does.
"""

import threading
from typing import TYPE_CHECKING, Any

from tokenmill.engine.model_prefetch import ModelPrefetch

if TYPE_CHECKING:
    from tokenmill.engine.llm_engine import LLMEngine


class EnginePrefetch(ModelPrefetch):
    """A ModelPrefetch that also builds the LLMEngine for its model in a thread (start_engine; engine() hands
    it over)."""

    def __init__(self, model: str | None):
        super().__init__(model)
        self._engine: LLMEngine | None = None
        self._engine_error: BaseException | None = None
        self._engine_thread: threading.Thread | None = None  # set by start_engine

    def start_engine(self, dtype: str, quantization: str | None, options: dict[str, Any]) -> None:
        """Build the LLMEngine for this model in a thread from now on (engine() hands it over)."""
        self._engine_thread = threading.Thread(
            target=self._build_engine, args=(dtype, quantization, options), name="tokenmill-engine", daemon=True
        )
        self._engine_thread.start()

    @property
    def builds_engine(self) -> bool:
        return self._engine_thread is not None

    def _build_engine(self, dtype: str, quantization: str | None, options: dict[str, Any]) -> None:
        try:
            from tokenmill.config import EngineConfig
            from tokenmill.engine.llm_engine import LLMEngine

            self._engine = LLMEngine(self.model, dtype, quantization, EngineConfig.from_options(options), self)
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits for the engine
            self._engine_error = exc

    def engine(self) -> "LLMEngine":
        assert self._engine_thread is not None, "start_engine() was not called"
        self._engine_thread.join()
        if self._engine_error is not None:
            raise self._engine_error
        assert self._engine is not None
        return self._engine
