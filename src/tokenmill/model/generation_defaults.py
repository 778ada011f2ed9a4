"""The sampling settings a model is meant to run with, used for every request field that is not given (as vLLM
does with a checkpoint's generation_config.json). Where they come from, first found wins:

1. the model's own: `generation_config.json` of a Hugging Face checkpoint; a GGUF file's `general.sampling.*`;
2. its family's published recommendation (the table below), found in the model's names: a GGUF file's
   `general.basename` and `general.name`; a checkpoint's `model_type`, `_name_or_path` and folder name (a Hugging
   Face download's repository name, e.g. models--HuggingFaceTB--SmolLM2-135M-Instruct);
3. for any other model: llama.cpp's defaults (what a GGUF file gets from llama.cpp's tools). Never plain
   temperature 1 with nothing to cut the tail: on a small model that reads as gibberish.

`generation_config="tokenmill"` skips all of this (SamplingParams' defaults apply); a path reads a
generation_config.json (or the directory holding one) instead of the model's. No torch here."""

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenmill.errors import InvalidParameterError, TokenmillError

logger = logging.getLogger(__name__)

# generation_config.json's field -> SamplingParams' (max_new_tokens becomes the default max_tokens)
HF_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
GGUF_FIELDS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_p": "top_p",
    "general.sampling.top_k": "top_k",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}

# google/gemma-3-*'s generation_config.json (do_sample, top_k 64, top_p 0.95 at temperature 1)
GEMMA3 = ({"temperature": 1.0, "top_k": 64, "top_p": 0.95}, "Gemma 3's generation_config.json")
# family -> (settings, where they are published); a family is found as a part of one of the model's names
FAMILY_DEFAULTS: dict[str, tuple[dict[str, Any], str]] = {
    # the model card's example (temperature 0.2, top_p 0.9); the repetition penalty is tokenmill's: the 135M model
    # repeats one sentence to the end of its budget without it, greedy or at 0.2 (benchmarks/repetition_guard.py)
    "smollm2": ({"temperature": 0.2, "top_p": 0.9, "repetition_penalty": 1.1}, "SmolLM2's model card"),
    "gemma-3": GEMMA3,  # GGUF files' basename
    "gemma3": GEMMA3,  # HF model_type gemma3 and gemma3_text
}
# llama.cpp's common_params_sampling defaults, for a model that names no settings and no known family
FALLBACK = ({"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}, "llama.cpp's defaults")
GENERATION_CONFIG_MODES = ("auto", "tokenmill")


@dataclass(frozen=True)
class GenerationDefaults:
    """SamplingParams field -> value, for fields a request leaves unset; `source` says where they came from."""

    values: dict[str, Any]
    source: str

    @property
    def max_tokens(self) -> int | None:
        return self.values.get("max_tokens")

    def sampling_values(self) -> dict[str, Any]:
        """Every default but max_tokens (which each entry point settles with its own rules)."""
        return {k: v for k, v in self.values.items() if k != "max_tokens"}

    def describe(self) -> str:
        settings = ", ".join(f"{k} {v}" for k, v in self.values.items()) or "none"
        return f"{settings} (from {self.source})"


NO_DEFAULTS = GenerationDefaults({}, "tokenmill's SamplingParams")


def read_generation_defaults(source: Any, mode: str = "auto") -> GenerationDefaults:
    """`source` is an opened model (GGUFFile or HFCheckpoint); `mode` is "auto", "tokenmill" or a path."""
    if mode == "tokenmill":
        return NO_DEFAULTS
    if mode != "auto":
        path = Path(mode).expanduser()
        file = path / "generation_config.json" if path.is_dir() else path
        try:
            config = json.loads(file.read_text())
        except (OSError, ValueError) as exc:
            raise InvalidParameterError(
                f"generation_config {mode!r}: cannot read {file} ({exc}); give 'auto', 'tokenmill' or a "
                "generation_config.json (or its directory)",
                "generation_config",
            ) from exc
        return _checked(_renamed(config, HF_FIELDS), str(file))
    if hasattr(source, "generation_config"):  # a Hugging Face checkpoint (its file may be missing: None)
        values = _renamed(source.generation_config or {}, HF_FIELDS)
        if values:
            return _checked(values, "the checkpoint's generation_config.json")
        names = [source.config.get("model_type"), source.config.get("_name_or_path"), *_folder_names(source)]
    else:
        values = _renamed(source.metadata, GGUF_FIELDS)
        if values:
            return _checked(values, "the GGUF file's general.sampling metadata")
        names = [source.get("general.basename"), source.get("general.name")]
    for name in names:  # in that order: a model_type or basename first
        for family, recommended in FAMILY_DEFAULTS.items():
            if isinstance(name, str) and family in name.lower():
                return _checked(*recommended)
    return _checked(*FALLBACK)


def _folder_names(checkpoint: Any) -> list[str]:
    """The checkpoint folder's name, and the repository's where it is a Hugging Face download
    (.../models--ORG--NAME/snapshots/REVISION)."""
    path = getattr(checkpoint, "path", None)
    if path is None:
        return []
    path = Path(path)
    names = [path.name]
    if path.parent.name == "snapshots":
        names.append(path.parent.parent.name)
    return names


def _renamed(config: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    return {ours: config[theirs] for theirs, ours in names.items() if config.get(theirs) is not None}


def _checked(values: dict[str, Any], source: str) -> GenerationDefaults:
    """Keep the values SamplingParams accepts; a model file's bad value is logged and left out, never fatal."""
    from tokenmill.sampling_params import SamplingParams

    kept: dict[str, Any] = {}
    for name, value in values.items():
        try:
            SamplingParams(**{name: value})
        except (TokenmillError, TypeError) as exc:
            logger.warning("ignoring %s's %s=%r: %s", source, name, value, exc)
            continue
        kept[name] = value
    return GenerationDefaults(kept, source)
