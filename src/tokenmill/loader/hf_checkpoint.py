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
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType

from tokenmill.errors import ModelFileError, UnsupportedModelError
from tokenmill.loader.experts import ExpertStack, ExpertViews, release_expert_pages
from tokenmill.loader.gguf_file import GGUFTensor
from tokenmill.loader.mxfp4 import gguf_mxfp4_rows

# config.json "architectures" -> tokenmill's architecture name (GGUF's general.architecture)
HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma3ForCausalLM": "gemma3",
    "MixtralForCausalLM": "llama",  # llama with a mixture of experts, as llama.cpp's converter writes it
    "Qwen2MoeForCausalLM": "qwen2moe",
    "Qwen3MoeForCausalLM": "qwen3moe",
    "OlmoeForCausalLM": "olmoe",
    "GptOssForCausalLM": "gpt-oss",
}
# safetensors dtype -> (GGUF tensor type, numpy dtype of its stored elements, bytes per value): bfloat16 is kept as
# raw bytes, as GGUF files keep it (numpy has no bfloat16)
_DTYPES = {
    "F32": (GGMLQuantizationType.F32, np.float32, 4),
    "F16": (GGMLQuantizationType.F16, np.float16, 2),
    "BF16": (GGMLQuantizationType.BF16, np.uint8, 2),
    # bytes: only gpt-oss's MXFP4 blocks and scales, which become GGUF MXFP4 tensors (_gpt_oss_experts)
    "U8": (GGMLQuantizationType.I8, np.uint8, 1),
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
    # mixtures of experts: the router, Qwen2-MoE's shared expert and its gate
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "block_sparse_moe.gate.weight": "ffn_gate_inp.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
}
# one expert's weights (Qwen's and OLMoE's names, Mixtral's w1/w3/w2) -> the GGUF 3-D tensor they are part of
_EXPERT = re.compile(r"(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight")
_EXPERT_NAMES = {
    "gate_proj": "ffn_gate_exps.weight",
    "up_proj": "ffn_up_exps.weight",
    "down_proj": "ffn_down_exps.weight",
    "w1": "ffn_gate_exps.weight",
    "w3": "ffn_up_exps.weight",
    "w2": "ffn_down_exps.weight",
}
# Gemma's four norms per layer: its post_attention_layernorm is the norm of the attention's output
_GEMMA_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}
# gpt-oss: its second norm is the MLP's, named as llama.cpp's converter names it; biases on the output projection
# and the router, a sink logit per head. Its experts are fused tensors of their own layout (_gpt_oss_experts).
_GPT_OSS_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "self_attn.o_proj.bias": "attn_output.bias",
    "self_attn.sinks": "attn_sinks.weight",
    "mlp.router.weight": "ffn_gate_inp.weight",
    "mlp.router.bias": "ffn_gate_inp.bias",
}
_GPT_OSS_EXPERTS = re.compile(r"mlp\.experts\.((?:gate_up|down)_proj(?:_bias|_blocks|_scales)?)")
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
        release_expert_pages(tensor.data)

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
        arch = self._architecture
        layer_names = {"gemma3": _GEMMA_LAYER_NAMES, "gpt-oss": _GPT_OSS_LAYER_NAMES}.get(arch, _LAYER_NAMES)
        tensors: dict[str, GGUFTensor] = {}
        experts: dict[str, dict[int, GGUFTensor]] = {}  # GGUF 3-D tensor name -> expert -> its 2-D tensor
        fused: dict[str, dict[str, GGUFTensor]] = {}  # gpt-oss: layer prefix -> its expert tensors by HF name
        for file in self._files():
            for hf_name, tensor in _read_safetensors(file).items():
                name = _GLOBAL_NAMES.get(hf_name)
                if name is None and (match := _LAYER.fullmatch(hf_name)):
                    layer, rest = match.groups()
                    if (expert := _EXPERT.fullmatch(rest)) and expert.group(2) in _EXPERT_NAMES:
                        stacked = f"blk.{layer}.{_EXPERT_NAMES[expert.group(2)]}"
                        experts.setdefault(stacked, {})[int(expert.group(1))] = tensor
                        continue
                    if arch == "gpt-oss" and (part := _GPT_OSS_EXPERTS.fullmatch(rest)):
                        fused.setdefault(f"blk.{layer}.", {})[part.group(1)] = tensor
                        continue
                    if rest in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"):  # transformers 5's fused form
                        tensors.update(_fused_experts(f"blk.{layer}.", rest, tensor))
                        continue
                    suffix = layer_names.get(rest)
                    name = f"blk.{layer}.{suffix}" if suffix else None
                if name is None:
                    continue  # not a weight of the decoder (e.g. rotary_emb.inv_freq): checked by its shapes instead
                tensors[name] = GGUFTensor(name, tensor.ggml_type, tensor.shape, tensor.data)
        for name, by_expert in experts.items():
            if sorted(by_expert) != list(range(len(by_expert))):
                missing = sorted(set(range(max(by_expert) + 1)) - by_expert.keys())
                raise ModelFileError(f"{self.path}: the experts of {name} (GGUF's name) lack expert(s) {missing}")
            parts = [by_expert[e] for e in range(len(by_expert))]
            if len({(p.shape, p.ggml_type) for p in parts}) != 1:
                raise ModelFileError(f"{self.path}: the experts of {name} (GGUF's name) differ in shape or dtype")
            stack = ExpertStack([p.data for p in parts])
            tensors[name] = GGUFTensor(name, parts[0].ggml_type, (len(parts), *parts[0].shape), stack)
        for prefix, layer_tensors in fused.items():
            tensors.update(_gpt_oss_experts(self.path, prefix, layer_tensors))
        bytes_left = [name for name, t in tensors.items() if t.ggml_type == GGMLQuantizationType.I8]
        if bytes_left:
            raise UnsupportedModelError(f"{self.path}: U8 tensors other than MXFP4 experts: {bytes_left[:4]}")
        return tensors


def _fused_experts(prefix: str, name: str, tensor: GGUFTensor) -> dict[str, GGUFTensor]:
    """transformers 5's fused expert tensors as GGUF's: `gate_up_proj` [experts, 2 x width, hidden] -> the gate and
    up halves (views), `down_proj` [experts, hidden, width]."""
    if len(tensor.shape) != 3:
        raise ModelFileError(f"{name} of layer {prefix} is {tensor.shape}, expected [experts, rows, columns]")
    if name.endswith("down_proj"):
        down = prefix + "ffn_down_exps.weight"
        return {down: GGUFTensor(down, tensor.ggml_type, tensor.shape, tensor.data)}
    experts, rows, cols = tensor.shape
    half = rows // 2
    gate, up = prefix + "ffn_gate_exps.weight", prefix + "ffn_up_exps.weight"
    return {
        gate: GGUFTensor(gate, tensor.ggml_type, (experts, half, cols), tensor.data[:, :half]),
        up: GGUFTensor(up, tensor.ggml_type, (experts, half, cols), tensor.data[:, half:]),
    }


def _elements(tensor: GGUFTensor) -> np.ndarray:
    """A float tensor's values as stored, one array element per value (bfloat16 as uint16), of its shape."""
    if tensor.ggml_type == GGMLQuantizationType.BF16:
        return tensor.data.view(np.uint16).reshape(tensor.shape)
    return tensor.data.reshape(tensor.shape)


def _stored(values: np.ndarray, ggml_type: GGMLQuantizationType) -> np.ndarray:
    """The inverse of _elements for a contiguous copy: bfloat16 back to its raw bytes."""
    values = np.ascontiguousarray(values)
    return values.view(np.uint8) if ggml_type == GGMLQuantizationType.BF16 else values


def _mxfp4_expert(blocks: np.ndarray, scales: np.ndarray, rows: slice, expert: int) -> np.ndarray:
    return gguf_mxfp4_rows(blocks[expert, rows], scales[expert, rows])


def _float_expert(values: np.ndarray, ggml_type: GGMLQuantizationType, rows: slice, expert: int) -> np.ndarray:
    """Expert `expert`'s rows (outputs) of a tensor stored inputs by outputs: a transposed copy."""
    return _stored(values[expert].T[rows], ggml_type)


def _gpt_oss_experts(path: Path, prefix: str, parts: dict[str, GGUFTensor]) -> dict[str, GGUFTensor]:
    """gpt-oss's expert tensors of one layer as GGUF's (llama.cpp's converter's split): `gate_up_proj`
    [E, hidden, 2 x width] (inputs by outputs, gate and up columns interleaved) -> ffn_gate_exps and ffn_up_exps
    [E, width, hidden]; `down_proj` [E, width, hidden] -> ffn_down_exps [E, hidden, width]; or the same as MXFP4
    `*_blocks` [E, rows, columns / 32, 16] and `*_scales` [E, rows, columns / 32] (rows: outputs, gate and up
    interleaved) -> GGUF MXFP4 tensors; the biases likewise split (`gate_up_proj_bias` [E, 2 x width]). Each expert
    is made when it is loaded (ExpertViews)."""
    out: dict[str, GGUFTensor] = {}

    def add(name: str, ggml_type: GGMLQuantizationType, shape: tuple[int, ...], data) -> None:
        out[prefix + name] = GGUFTensor(prefix + name, ggml_type, shape, data)

    splits = {"gate_up_proj": [("ffn_gate_exps", 0, 2), ("ffn_up_exps", 1, 2)], "down_proj": [("ffn_down_exps", 0, 1)]}
    for kind, split in splits.items():
        if (blocks := parts.get(kind + "_blocks")) is not None:
            scales = parts.get(kind + "_scales")
            if scales is None or len(blocks.shape) != 4 or tuple(scales.shape) != tuple(blocks.shape[:3]):
                raise ModelFileError(f"{path}: {prefix}{kind}'s MXFP4 blocks {blocks.shape} lack matching scales")
            experts, rows, groups, _ = blocks.shape
            for name, first, step in split:
                make = partial(_mxfp4_expert, blocks.data, scales.data, slice(first, None, step))
                shape = (experts, rows // step, groups * 32)
                add(name + ".weight", GGMLQuantizationType.MXFP4, shape, ExpertViews(shape, make, [blocks.data]))
        elif (weight := parts.get(kind)) is not None:
            if len(weight.shape) != 3:
                raise ModelFileError(f"{path}: {prefix}{kind} is {weight.shape}, expected [experts, inputs, outputs]")
            values, (experts, columns, rows) = _elements(weight), weight.shape
            for name, first, step in split:
                make = partial(_float_expert, values, weight.ggml_type, slice(first, None, step))
                shape = (experts, rows // step, columns)
                add(name + ".weight", weight.ggml_type, shape, ExpertViews(shape, make, [weight.data]))
        if (bias := parts.get(kind + "_bias")) is not None:
            for name, first, step in split:
                columns = _elements(bias)[:, first::step]
                add(name + ".bias", bias.ggml_type, tuple(columns.shape), _stored(columns, bias.ggml_type))
    return out


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
