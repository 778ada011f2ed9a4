"""Open a model wherever it comes from: a GGUF file or a Hugging Face checkpoint directory. Both give the same
interface (GGUFFile's: `path`, `architecture`, `get`, `tensors`, `tensor`), read by the model, the tokenizer
(tokenizer/from_source.py builds a source's) and tensor parallelism alike."""

from pathlib import Path

from tokenmill.loader.gguf_file import GGUFFile
from tokenmill.loader.hf_checkpoint import HFCheckpoint, is_hf_checkpoint

ModelSource = GGUFFile | HFCheckpoint


def open_model_source(path: Path) -> ModelSource:
    """A resolved model path (loader/model_path.py) -> its source; raises ModelFileError or UnsupportedModelError
    for what cannot be read, before any weight is."""
    return HFCheckpoint(path) if is_hf_checkpoint(path) else GGUFFile(path)
