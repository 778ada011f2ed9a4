"""Read a model's GGUF metadata and build its tokenizer in a thread, while the rest of a program starts (the
engine takes them with `take`; entrypoints/engine_prefetch.py also builds the engine itself in a thread). It joins
the loader and the tokenizer, so it sits above both. Importing this module does not import torch.
"""

import threading
from pathlib import Path

from tokenmill.loader.model_path import resolve_model_path
from tokenmill.loader.model_source import ModelSource, open_model_source
from tokenmill.tokenizer.from_source import load_tokenizer
from tokenmill.tokenizer.gguf_tokenizer import Tokenizer


class ModelPrefetch:
    builds_engine = False  # EnginePrefetch (entrypoints/engine_prefetch.py) builds one

    def __init__(self, model: str | None):
        self.model = model
        self.path: Path = resolve_model_path(model)
        self._result: tuple[ModelSource, Tokenizer] | None = None
        self._error: BaseException | None = None
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
