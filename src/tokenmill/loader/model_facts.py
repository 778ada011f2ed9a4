"""What a model is, in the words model lists use (Ollama's /api/tags and /api/show): its format, architecture,
parameter count, quantization and size on disk, read from the source's metadata and tensor shapes (no weight
is read)."""

import hashlib
import math
from dataclasses import dataclass
from pathlib import Path

from gguf import LlamaFileType

from tokenmill.loader.model_source import ModelSource


@dataclass(frozen=True)
class ModelFacts:
    format: str  # "gguf" or "safetensors"
    architecture: str  # GGUF's general.architecture ("llama", "gemma3", ...)
    parameter_count: int
    quantization: str  # the file's type: "Q4_K_M", "Q8_0", "F16", ... ("unknown" when it says none)
    size_bytes: int  # the model's files on disk
    modified_time: float  # their newest mtime (seconds since the epoch)
    digest: str  # sha256 of the path, size and mtime: changes when the file does (hashing gigabytes would not pay)

    @property
    def parameter_size(self) -> str:
        """ "135M", "1.7B", "8.0B": as Ollama writes it."""
        n = self.parameter_count
        if n >= 1e9:
            return f"{n / 1e9:.1f}B"
        return f"{n / 1e6:.0f}M" if n >= 1e6 else str(n)


def describe_model(source: ModelSource) -> ModelFacts:
    path = Path(source.path)
    files = [p for p in path.iterdir() if p.is_file()] if path.is_dir() else [path]
    stats = [p.stat() for p in files]
    size, modified = sum(s.st_size for s in stats), max(s.st_mtime for s in stats)
    file_type = source.get("general.file_type")
    try:
        quantization = LlamaFileType(int(file_type)).name.removeprefix("MOSTLY_").removeprefix("ALL_")
    except (TypeError, ValueError):
        quantization = "unknown"
    parameters = sum(math.prod(t.shape) for t in source.tensors.values())
    digest = hashlib.sha256(f"{path.resolve()}:{size}:{modified}".encode()).hexdigest()
    return ModelFacts(
        "safetensors" if path.is_dir() else "gguf",
        source.architecture,
        parameters,
        quantization,
        size,
        modified,
        digest,
    )
