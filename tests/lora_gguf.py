"""A PEFT adapter of a Llama checkpoint written as llama.cpp's GGUF LoRA, the way its `convert_lora_to_gguf.py
--outtype f32` writes one: general.type "adapter", adapter.type "lora", adapter.lora.alpha; per projection
`blk.N.KIND.weight.lora_a` (A [r, in]) and `.lora_b` (B [out, r]), float32, Q's and K's B rows permuted for ggml's
rope as the converter permutes the base file's Q/K rows. tests/data/lora_llamacpp.json holds the converter's own
tensors' digests (tests/data/make_lora_llamacpp.py): the test checks that this writes the same bytes."""

import hashlib
import json
import re
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import load_file

from tests.gguf_builder import finish, permute_for_ggml

KINDS = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output"}
KINDS |= {"gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}
PEFT_NAME = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+_proj)\.lora_([AB])\.weight")


def gguf_lora_tensors(adapter: Path, base: Path) -> dict[str, np.ndarray]:
    """GGUF name -> float32 array, in the converter's layout."""
    config = json.loads((base / "config.json").read_text())
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config.get("num_key_value_heads")}
    heads["attn_k"] = heads["attn_k"] or heads["attn_q"]
    tensors = {}
    for name, value in load_file(str(adapter / "adapter_model.safetensors")).items():
        layer, proj, half = PEFT_NAME.fullmatch(name).groups()
        kind = KINDS[proj]
        value = value.astype(np.float32)
        if half == "B" and kind in heads:
            value = permute_for_ggml(value, heads[kind])
        tensors[f"blk.{layer}.{kind}.weight.lora_{half.lower()}"] = np.ascontiguousarray(value)
    return tensors


def write_gguf_lora(adapter: Path, base: Path, out: Path) -> Path:
    alpha = float(json.loads((adapter / "adapter_config.json").read_text())["lora_alpha"])
    writer = gguf.GGUFWriter(out, "llama")
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
    for name, value in sorted(gguf_lora_tensors(adapter, base).items()):
        writer.add_tensor(name, value)
    finish(writer)
    return out


def gguf_digests(path: Path) -> dict[str, list]:
    """Tensor name -> [type, shape, SHA-256 of its bytes]: what tests/data/lora_llamacpp.json records."""
    return {
        t.name: [
            t.tensor_type.name,
            [int(d) for d in t.shape],
            hashlib.sha256(np.asarray(t.data).tobytes()).hexdigest(),
        ]
        for t in gguf.GGUFReader(path).tensors
    }
