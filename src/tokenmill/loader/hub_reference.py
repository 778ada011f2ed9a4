"""What a `--model` that names a Hugging Face Hub repository asks for: `ORG/NAME` (a safetensors repo, or a GGUF repo's
default file), `ORG/NAME:QUANT` (llama.cpp's `-hf` convention: the GGUF file whose name holds QUANT), with
`--revision` and `--hf-file`; Ollama's `hf.co/ORG/NAME:QUANT` spelling is accepted too. Plain strings, no network."""

import re
from dataclasses import dataclass
from pathlib import Path

# a repo id as the Hub spells it: ORG/NAME, letters, digits, "-", "_", "."; an optional :TAG after it
_HUB_MODEL = re.compile(r"(?:(?:https?://)?(?:hf\.co|huggingface\.co)/)?([A-Za-z0-9][\w.-]*/[\w.-]+)(?::([\w.-]+))?")
# a name that ends like a model file is a path that does not exist, not a repository
_FILE_SUFFIXES = (".gguf", ".safetensors", ".bin", ".json")


@dataclass(frozen=True)
class HubReference:
    repo_id: str  # ORG/NAME
    tag: str | None = None  # the quant after ":" (GGUF repos)
    revision: str | None = None  # a branch, tag or commit; None: main
    hf_file: str | None = None  # one file of the repo, by its path there

    @property
    def wants_gguf(self) -> bool:
        return self.tag is not None or (self.hf_file is not None and self.hf_file.lower().endswith(".gguf"))

    def __str__(self) -> str:
        shown = self.repo_id + (f":{self.tag}" if self.tag else "")
        if self.hf_file:
            shown += f" (file {self.hf_file})"
        return shown + (f" at revision {self.revision}" if self.revision else "")


def parse_hub_reference(model: str, revision: str | None = None, hf_file: str | None = None) -> HubReference | None:
    """The repository `model` names, or None when it is no Hub id (a name, a path, a file name). An existing path
    always wins: the caller checks that first."""
    if model.startswith((".", "/", "~")) or model.lower().endswith(_FILE_SUFFIXES):
        return None
    match = _HUB_MODEL.fullmatch(model)
    if match is None:
        return None
    return HubReference(match.group(1), match.group(2), revision, hf_file)


def is_hub_reference(model: str | None) -> bool:
    return model is not None and not Path(model).expanduser().exists() and parse_hub_reference(model) is not None
