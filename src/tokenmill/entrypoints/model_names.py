"""What `--model` (and `LLM(model)`) names, settled before anything loads: a model's name, a path, or a Hugging Face
Hub repository (`ORG/NAME`, `ORG/NAME-GGUF:QUANT`, with `--revision` and `--hf-file`), which is downloaded into the
Hub's cache here (or found there) so that everything after it sees a local path. A name that is none of these gets
the names there are and where to look, not just "no such file"."""

from pathlib import Path

from tokenmill.errors import ModelFileError
from tokenmill.loader.hub_reference import parse_hub_reference
from tokenmill.loader.model_path import NAMED_MODELS


def find_model(model: str | None, revision: str | None = None, hf_file: str | None = None) -> str | None:
    """The model to load: `model` itself when it is None, a model's name or an existing path; a Hub repository's
    local path (downloaded with a progress bar where the cache lacks it); else a ModelFileError that says what
    tokenmill can load and how to list it."""
    if model is None or model.lower() in NAMED_MODELS or Path(model).expanduser().exists():
        if revision is not None or hf_file is not None:
            raise ModelFileError("--revision and --hf-file apply to a Hugging Face Hub model (--model ORG/NAME)")
        return model
    ref = parse_hub_reference(model, revision, hf_file)
    if ref is None:
        raise ModelFileError(
            f"model {model!r} is no model's name and no such file or directory. Named models: "
            f"{', '.join(NAMED_MODELS)} (`tokenmill models` lists them, whether their packages are installed, and the "
            "GGUF files and checkpoint directories in tokenmill's cache and the Hugging Face Hub's); or give a .gguf "
            "file, a Hugging Face checkpoint directory, or a Hub repository (ORG/NAME, ORG/NAME-GGUF:QUANT)"
        )
    from tokenmill.loader.hub_download import fetch_model

    return str(fetch_model(ref))
