"""A LoRA adapter's file read into one shape: per base weight (GGUF names, "blk.3.attn_q.weight") its low-rank pair
A [r, in] and B [out, r] in float32, and the scale the product B @ A is multiplied by.

Two formats:
- a PEFT directory (`adapter_config.json` + `adapter_model.safetensors`, as `save_pretrained` writes it): scale
  `lora_alpha / r`, or `lora_alpha / sqrt(r)` with `use_rslora`; tensors `base_model.model.model.layers.N.
  self_attn.q_proj.lora_A.weight` and so on;
- llama.cpp's GGUF LoRA (`convert_lora_to_gguf.py`: general.type "adapter", adapter.type "lora",
  adapter.lora.alpha; tensors `blk.N.attn_q.weight.lora_a` / `.lora_b`): scale alpha / r as llama.cpp computes it
  (0 or absent alpha: 1). A llama adapter's Q/K B rows are permuted for ggml's rope as the base file's Q/K rows
  are; the model undoes that with the same function (model/lora_weights.py).

Only the attention and dense MLP projections are taken (q/k/v/o, gate/up/down): an adapter that changes anything
else (embeddings, the LM head, DoRA magnitudes, biases, whole modules) is refused rather than half applied.
"""

import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from tokenmill.errors import ModelFileError, UnsupportedModelError
from tokenmill.loader.dequantize import dequantize
from tokenmill.loader.gguf_file import GGUFFile, GGUFTensor
from tokenmill.loader.hf_checkpoint import _LAYER_NAMES, _read_safetensors, read_json

# the GGUF kinds of the projections an adapter may change
LORA_TARGETS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
_PEFT_TENSOR = re.compile(
    r"base_model\.model\.model\.layers\.(\d+)\.((?:self_attn|mlp)\.\w+_proj)\.lora_([AB])\.weight"
)
_REFUSED = {"use_dora": "DoRA", "rank_pattern": "per-module ranks", "alpha_pattern": "per-module alphas"}
_GGUF_TENSOR = re.compile(r"(blk\.\d+\.(\w+)\.weight)\.lora_([ab])")
PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"


class LoRAError(ModelFileError):
    """An adapter path that is missing, unreadable, or not a LoRA adapter tokenmill can apply."""


@dataclass
class LoRAPair:
    a: torch.Tensor  # float32 [r, in]
    b: torch.Tensor  # float32 [out, r]


@dataclass
class LoRAFile:
    path: Path
    format: str  # "peft" or "gguf"
    scale: float  # multiplies B @ A
    pairs: dict[str, LoRAPair]  # GGUF base weight name -> its pair
    # GGUF adapters: Q/K B rows are stored permuted for ggml's rope, as the base GGUF's Q/K rows are
    rope_rows_permuted: bool = False

    @property
    def rank(self) -> int:
        return max(p.a.shape[0] for p in self.pairs.values())


def read_lora(path: str | Path) -> LoRAFile:
    """Read an adapter (a PEFT directory or a GGUF LoRA file). Raises LoRAError naming what is wrong."""
    path = Path(path).expanduser()
    if path.is_dir():
        return _read_peft(path)
    if path.is_file():
        return _read_gguf(path)
    raise LoRAError(f"{path}: no such LoRA adapter (a PEFT directory with {PEFT_CONFIG}, or a GGUF LoRA file)")


def _read_peft(folder: Path) -> LoRAFile:
    if not (folder / PEFT_CONFIG).is_file() or not (folder / PEFT_WEIGHTS).is_file():
        raise LoRAError(f"{folder}: not a PEFT adapter directory (expected {PEFT_CONFIG} and {PEFT_WEIGHTS})")
    try:
        config = read_json(folder / PEFT_CONFIG)
    except ModelFileError as exc:
        raise LoRAError(str(exc)) from exc
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise LoRAError(f"{folder}: a {config.get('peft_type')} adapter; tokenmill applies LoRA adapters only")
    for key, what in _REFUSED.items():
        if config.get(key):
            raise LoRAError(f"{folder}: uses {what} ({key}), which tokenmill does not apply")
    if config.get("modules_to_save") or config.get("bias", "none") != "none":
        raise LoRAError(f"{folder}: trains whole modules or biases (modules_to_save, bias): tokenmill applies neither")
    r, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(r, int) or r < 1 or not isinstance(alpha, int | float):
        raise LoRAError(f"{folder}: {PEFT_CONFIG} needs a positive integer r and a number lora_alpha")
    scale = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
    try:
        tensors = _read_safetensors(folder / PEFT_WEIGHTS)
    except (ModelFileError, UnsupportedModelError) as exc:
        raise LoRAError(str(exc)) from exc
    halves: dict[str, dict[str, GGUFTensor]] = {}
    for name, tensor in tensors.items():
        match = _PEFT_TENSOR.fullmatch(name)
        gguf_name = _LAYER_NAMES.get(f"{match.group(2)}.weight") if match else None
        if match is None or gguf_name is None or gguf_name.split(".")[0] not in LORA_TARGETS:
            raise LoRAError(f"{folder}: tensor {name!r} is not a LoRA pair on {', '.join(LORA_TARGETS)}")
        halves.setdefault(f"blk.{match.group(1)}.{gguf_name}", {})[match.group(3).lower()] = tensor
    return LoRAFile(folder, "peft", float(scale), _pairs(folder, halves))


def _read_gguf(path: Path) -> LoRAFile:
    try:
        gguf = GGUFFile(path)
    except ModelFileError as exc:
        raise LoRAError(f"{exc} (a LoRA adapter is a PEFT directory or a GGUF LoRA file)") from exc
    if gguf.get("general.type") != "adapter" or gguf.get("adapter.type") != "lora":
        raise LoRAError(f"{path}: not a LoRA adapter (a GGUF file with general.type 'adapter', adapter.type 'lora')")
    halves: dict[str, dict[str, GGUFTensor]] = {}
    for name, tensor in gguf.tensors.items():
        match = _GGUF_TENSOR.fullmatch(name)
        if match is None or match.group(2) not in LORA_TARGETS:
            raise LoRAError(f"{path}: tensor {name!r} is not a LoRA pair on {', '.join(LORA_TARGETS)}")
        halves.setdefault(match.group(1), {})[match.group(3)] = tensor
    pairs = _pairs(path, halves)
    alpha = float(gguf.get("adapter.lora.alpha", 0.0) or 0.0)
    rank = max(p.a.shape[0] for p in pairs.values())
    # llama.cpp's converter permutes Q/K rows for llama's graph only (its other architectures use neox rope)
    permuted = gguf.get("general.architecture") == "llama"
    return LoRAFile(path, "gguf", alpha / rank if alpha else 1.0, pairs, rope_rows_permuted=permuted)


def _pairs(path: Path, halves: dict[str, dict[str, GGUFTensor]]) -> dict[str, LoRAPair]:
    """{base name: {"a": tensor, "b": tensor}} -> checked float32 pairs (A [r, in], B [out, r])."""
    if not halves:
        raise LoRAError(f"{path}: holds no LoRA tensors")
    pairs = {}
    for name, half in halves.items():
        if set(half) != {"a", "b"}:
            raise LoRAError(f"{path}: {name} has lora_{'a' if 'a' in half else 'b'} but not its other half")
        try:
            a, b = (dequantize(half[k].data, half[k].ggml_type, half[k].shape).float() for k in ("a", "b"))
        except UnsupportedModelError as exc:
            raise LoRAError(f"{path}: {exc}") from exc
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise LoRAError(f"{path}: {name}'s A {tuple(a.shape)} and B {tuple(b.shape)} are not a low-rank pair")
        pairs[name] = LoRAPair(a.contiguous(), b.contiguous())
    return pairs


def describe(lora: LoRAFile) -> str:
    """One line for the log: format, rank, scale, projections."""
    kinds = sorted({name.split(".")[2] for name in lora.pairs})
    return f"{lora.format} LoRA, rank {lora.rank}, scale {lora.scale:g}, on {', '.join(kinds)}"
