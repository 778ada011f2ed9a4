"""A Hugging Face checkpoint directory seen as a model source: `config.json`, `*.safetensors` (one file, or shards
listed by `model.safetensors.index.json`) and the tokenizer's files, with the interface of GGUFFile (`path`,
`architecture`, `get`, `tensors`, `tensor`), so the model, its loader and tensor parallelism read either format.

Tensors are memory-mapped: nothing is read until a weight is loaded, one tensor at a time. They are renamed to
GGUF's names and conventions (Gemma's norm weights get the 1 that GGUF files store added), so the model code knows
one naming. The safetensors header (an 8-byte length, then JSON: dtype, shape and byte range of every tensor) is
read here rather than through the `safetensors` package, whose loaders copy each tensor out of the file: a numpy
view of the mapped file costs nothing until it is read.
"""

import json
import re
import struct
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType

from tokenmill.errors import ModelFileError, UnsupportedModelError
from tokenmill.loader.gguf_file import GGUFTensor
from tokenmill.loader.pages import release_pages

# config.json "architectures" -> tokenmill's architecture name (GGUF's general.architecture)
HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma3ForCausalLM": "gemma3",
}
# safetensors dtype -> (GGUF tensor type, numpy dtype of its stored elements, bytes per value): bfloat16 is kept as
# raw bytes, as GGUF files keep it (numpy has no bfloat16)
_DTYPES = {
    "F32": (GGMLQuantizationType.F32, np.float32, 4),
    "F16": (GGMLQuantizationType.F16, np.float16, 2),
    "BF16": (GGMLQuantizationType.BF16, np.uint8, 2),
}
_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
# Gemma's four norms per layer: its post_attention_layernorm is the norm of the attention's output
_GEMMA_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
TOKENIZER_FILE = "tokenizer.json"


def is_hf_checkpoint(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file()


def read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ModelFileError(f"{path}: cannot be read: {exc.strerror}") from exc
    except (ValueError, UnicodeDecodeError) as exc:
        raise ModelFileError(f"{path}: not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise ModelFileError(f"{path}: expected a JSON object")
    return value


class HFCheckpoint:
    """A checkpoint directory: `config` (config.json), `metadata` (what GGUF files say in their metadata: the chat
    template), `tensors` (GGUF name -> memory-mapped GGUFTensor). Raises ModelFileError for missing or
    inconsistent files and UnsupportedModelError for an architecture or dtype tokenmill does not run."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.config = read_json(self.path / "config.json")
        names = self.config.get("architectures") or []
        known = [HF_ARCHITECTURES[n] for n in names if n in HF_ARCHITECTURES]
        if not known:
            raise UnsupportedModelError(
                f"{self.path}: config.json names architecture {names or self.config.get('model_type')!r}, which "
                f"tokenmill does not run (supported: {', '.join(sorted(HF_ARCHITECTURES))})"
            )
        self._architecture = known[0]
        if not (self.path / TOKENIZER_FILE).is_file():
            raise ModelFileError(
                f"{self.path}: {TOKENIZER_FILE} is missing (tokenmill reads the fast tokenizer's file)"
            )
        self.tokenizer_config = _optional_json(self.path / "tokenizer_config.json")
        self.generation_config = _optional_json(self.path / "generation_config.json")
        self.metadata: dict[str, Any] = {}
        template = self._chat_template()
        if template:
            self.metadata["tokenizer.chat_template"] = template
        self._add_one = self._architecture == "gemma3"  # GGUF stores Gemma's norm weights as 1 + w; HF as w
        self.tensors = self._map_tensors()
        if self.config.get("tie_word_embeddings", self._architecture == "gemma3"):
            self.tensors.pop("output.weight", None)  # the head is the embedding table

    @property
    def architecture(self) -> str:
        return self._architecture

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def release(self, tensor: GGUFTensor) -> None:
        """A weight was built from `tensor`: its pages of the mapped safetensors file are not needed any more."""
        release_pages(tensor.data)

    def tensor(self, name: str) -> GGUFTensor:
        if name not in self.tensors:
            raise ModelFileError(f"{self.path}: tensor {name!r} (GGUF's name) is missing from the safetensors files")
        tensor = self.tensors[name]
        if self._add_one and name.endswith("norm.weight"):
            raw = np.ascontiguousarray(tensor.data).reshape(-1).view(np.uint8)
            return GGUFTensor(name, GGMLQuantizationType.F32, tensor.shape, _as_float32(raw, tensor) + 1.0)
        return tensor

    def _chat_template(self) -> str | None:
        jinja = self.path / "chat_template.jinja"
        if jinja.is_file():
            return jinja.read_text(encoding="utf-8")
        template = self.tokenizer_config.get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        return template if isinstance(template, str) else None

    def _files(self) -> list[Path]:
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            weight_map = read_json(index).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise ModelFileError(f"{index}: has no weight_map")
            files = [self.path / name for name in sorted(set(weight_map.values()))]
            missing = [f.name for f in files if not f.is_file()]
            if missing:
                raise ModelFileError(f"{index}: lists {', '.join(missing)}, which is not in the directory")
            return files
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            kinds = sorted({p.suffix for p in self.path.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".gguf")})
            hint = f" (it has {', '.join(kinds)} files: tokenmill reads safetensors)" if kinds else ""
            raise ModelFileError(f"{self.path}: no *.safetensors weights{hint}")
        return files

    def _map_tensors(self) -> dict[str, GGUFTensor]:
        layer_names = _GEMMA_LAYER_NAMES if self._architecture == "gemma3" else _LAYER_NAMES
        tensors: dict[str, GGUFTensor] = {}
        for file in self._files():
            for hf_name, tensor in _read_safetensors(file).items():
                name = _GLOBAL_NAMES.get(hf_name)
                if name is None and (match := _LAYER.fullmatch(hf_name)):
                    suffix = layer_names.get(match.group(2))
                    name = f"blk.{match.group(1)}.{suffix}" if suffix else None
                if name is None:
                    continue  # not a weight of the decoder (e.g. rotary_emb.inv_freq): checked by its shapes instead
                tensors[name] = GGUFTensor(name, tensor.ggml_type, tensor.shape, tensor.data)
        return tensors


def _optional_json(path: Path) -> dict[str, Any]:
    return read_json(path) if path.is_file() else {}


def _as_float32(raw: np.ndarray, tensor: GGUFTensor) -> np.ndarray:
    """A small tensor's stored bytes -> float32 values of its shape."""
    if tensor.ggml_type == GGMLQuantizationType.BF16:
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(tensor.shape)
    return raw.view(_DTYPES[tensor.ggml_type.name][1]).astype(np.float32).reshape(tensor.shape)


def _read_safetensors(path: Path) -> dict[str, GGUFTensor]:
    """Every tensor of a .safetensors file as a view of the memory-mapped file (named as in the file)."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ModelFileError(f"{path}: not a safetensors file (only {len(head)} bytes long)")
            (header_len,) = struct.unpack("<Q", head)
            if header_len > min(size - 8, 100 * 2**20):
                raise ModelFileError(f"{path}: not a safetensors file (header length {header_len})")
            header = json.loads(f.read(header_len))
    except OSError as exc:
        raise ModelFileError(f"{path}: cannot be read: {exc.strerror}") from exc
    except (ValueError, UnicodeDecodeError) as exc:
        raise ModelFileError(f"{path}: the safetensors header is not valid JSON: {exc}") from exc
    header.pop("__metadata__", None)
    data_start = 8 + header_len
    mapped = np.memmap(path, dtype=np.uint8, mode="r") if header else np.empty(0, np.uint8)
    tensors = {}
    for name, info in header.items():
        dtype, shape, (begin, end) = info["dtype"], tuple(int(d) for d in info["shape"]), info["data_offsets"]
        if dtype not in _DTYPES:
            raise UnsupportedModelError(
                f"{path}: tensor {name!r} is {dtype}; tokenmill loads {', '.join(_DTYPES)} safetensors"
            )
        ggml_type, element, width = _DTYPES[dtype]
        count = int(np.prod(shape, dtype=np.int64))
        if end - begin != count * width or data_start + end > size:
            raise ModelFileError(f"{path}: tensor {name!r} of shape {shape} does not fit its byte range")
        raw = mapped[data_start + begin : data_start + end]
        per_value = width // np.dtype(element).itemsize  # stored elements per value (bfloat16: 2 bytes)
        stored_shape = (*shape[:-1], shape[-1] * per_value) if shape else shape
        tensors[name] = GGUFTensor(name, ggml_type, shape, raw.view(element).reshape(stored_shape))
    return tensors
