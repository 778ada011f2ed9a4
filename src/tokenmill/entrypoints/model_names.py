"""What `--model` (and `LLM(model)`) may name, said before anything loads when it names nothing tokenmill can find:
a name the user guessed (`llama3`) or a Hugging Face Hub id (`Org/Name`) gets the names there are and where to
look, not just "no such file"."""

import re
from pathlib import Path

from tokenmill.errors import ModelFileError
from tokenmill.loader.model_path import NAMED_MODELS

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # Org/Name, as the Hub spells its repositories


def check_model_name(model: str | None) -> None:
    """Nothing when `model` is None, a model's name or an existing path; else a ModelFileError that says what
    tokenmill can load and how to list it."""
    if model is None or model.lower() in NAMED_MODELS or Path(model).expanduser().exists():
        return
    message = (
        f"model {model!r} is no model's name and no such file or directory. Named models: "
        f"{', '.join(NAMED_MODELS)} (`tokenmill models` lists them, whether their packages are installed, and the "
        "GGUF files and checkpoint directories in tokenmill's cache); or give a .gguf file or a Hugging Face "
        "checkpoint directory"
    )
    if HUB_ID.fullmatch(model) and not model.endswith(".gguf"):
        message += (
            f". {model!r} looks like a Hugging Face Hub id: tokenmill does not download models; download it first "
            f"(e.g. `hf download {model} --local-dir DIR`, or one of its .gguf files) and give that path"
        )
    raise ModelFileError(message)
