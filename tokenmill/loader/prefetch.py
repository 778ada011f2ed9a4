"""Read a model's GGUF metadata and build its tokenizer in a thread, while the rest of a program starts
(`tokenmill serve` imports torch and its web stack meanwhile). Nothing here imports torch."""

import threading
from pathlib import Path

from tokenmill.loader.gguf_file import GGUFFile
from tokenmill.loader.model_path import resolve_model_path
from tokenmill.tokenizer.gguf_tokenizer import Tokenizer


class ModelPrefetch:
    def __init__(self, model: str | None):
        self.path: Path = resolve_model_path(model)
        self._result: tuple[GGUFFile, Tokenizer] | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="tokenmill-prefetch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            gguf = GGUFFile(self.path)
            self._result = (gguf, Tokenizer.from_gguf(gguf))
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits for the result
            self._error = exc

    def result(self) -> tuple[GGUFFile, Tokenizer]:
        self._thread.join()
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result
