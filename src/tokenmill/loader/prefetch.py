"""Read a model's GGUF metadata and build its tokenizer in a thread, while the rest of a program starts, and,
on request, build the whole engine in a second thread (`tokenmill serve`: the model loads while the web stack is
imported). Importing this module does not import torch; the engine thread does.
"""

import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenmill.loader.model_path import resolve_model_path
from tokenmill.loader.model_source import ModelSource, load_tokenizer, open_model_source
from tokenmill.tokenizer.gguf_tokenizer import Tokenizer

if TYPE_CHECKING:
    from tokenmill.engine.llm_engine import LLMEngine


class ModelPrefetch:
    def __init__(self, model: str | None):
        self.model = model
        self.path: Path = resolve_model_path(model)
        self._result: tuple[ModelSource, Tokenizer] | None = None
        self._error: BaseException | None = None
        self._engine: LLMEngine | None = None
        self._engine_error: BaseException | None = None
        self._engine_thread: threading.Thread | None = None  # set by start_engine
        self._thread = threading.Thread(target=self._run, name="tokenmill-prefetch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            source = open_model_source(self.path)
            self._result = (source, load_tokenizer(source))
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits for the result
            self._error = exc

    def take(self) -> tuple[ModelSource, Tokenizer]:
        """The parsed file and its tokenizer, handed over once: the prefetch keeps no reference, so the file's
        mapped pages (about 90 MiB of resident memory for the bundled model) go when the engine is built."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._result is not None, "the prefetched model was already taken"
        result, self._result = self._result, None
        return result

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
