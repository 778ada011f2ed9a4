"""Write small GGUF files for tests: a tiny random llama model (with HF-layout weights kept for comparison)."""

from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np


@dataclass
class TinyLlama:
    vocab_size: int = 96
    hidden: int = 64
    intermediate: int = 128
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    rope_theta: float = 10000.0
    eps: float = 1e-5
    context: int = 256
    tie_embeddings: bool = False
    seed: int = 0
    weights: dict[str, np.ndarray] = field(default_factory=dict)  # HF names, float32

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def make_weights(self) -> None:
        rng = np.random.default_rng(self.seed)

        def w(*shape: int, scale: float = 0.08) -> np.ndarray:
            return (rng.standard_normal(shape) * scale).astype(np.float32)

        hd = self.head_dim
        self.weights["model.embed_tokens.weight"] = w(self.vocab_size, self.hidden, scale=0.5)
        self.weights["model.norm.weight"] = (1 + w(self.hidden)).astype(np.float32)
        if not self.tie_embeddings:
            self.weights["lm_head.weight"] = w(self.vocab_size, self.hidden)
        for i in range(self.layers):
            p = f"model.layers.{i}."
            self.weights[p + "self_attn.q_proj.weight"] = w(self.heads * hd, self.hidden)
            self.weights[p + "self_attn.k_proj.weight"] = w(self.kv_heads * hd, self.hidden)
            self.weights[p + "self_attn.v_proj.weight"] = w(self.kv_heads * hd, self.hidden)
            self.weights[p + "self_attn.o_proj.weight"] = w(self.hidden, self.heads * hd)
            self.weights[p + "mlp.gate_proj.weight"] = w(self.intermediate, self.hidden)
            self.weights[p + "mlp.up_proj.weight"] = w(self.intermediate, self.hidden)
            self.weights[p + "mlp.down_proj.weight"] = w(self.hidden, self.intermediate)
            self.weights[p + "input_layernorm.weight"] = (1 + w(self.hidden)).astype(np.float32)
            self.weights[p + "post_attention_layernorm.weight"] = (1 + w(self.hidden)).astype(np.float32)


def permute_for_ggml(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of Q/K rows (HF rope layout -> ggml rope layout)."""
    halves = weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
    return halves.swapaxes(1, 2).reshape(weight.shape)


def write_tiny_llama(path: Path, model: TinyLlama, matrix_type: str = "F32", arch: str = "llama") -> Path:
    """A llama GGUF with byte-level tokenizer metadata (one token per byte value, no merges)."""
    if not model.weights:
        model.make_weights()
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(model.layers)
    writer.add_context_length(model.context)
    writer.add_embedding_length(model.hidden)
    writer.add_feed_forward_length(model.intermediate)
    writer.add_head_count(model.heads)
    writer.add_head_count_kv(model.kv_heads)
    writer.add_rope_freq_base(model.rope_theta)
    writer.add_layer_norm_rms_eps(model.eps)
    writer.add_rope_dimension_count(model.head_dim)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    tokens = ["a", "b", "ab"] + [f"<t{i}>" for i in range(3, model.vocab_size)]
    writer.add_token_list(tokens)
    writer.add_token_types([1] * model.vocab_size)
    writer.add_token_merges(["a b"])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    qtype = gguf.GGMLQuantizationType[matrix_type]

    def add(name: str, value: np.ndarray, quantize: bool = True) -> None:
        if quantize and value.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            raw = gguf.quants.quantize(value, qtype)
            writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=qtype)
        else:
            writer.add_tensor(name, value)

    w = model.weights
    add("token_embd.weight", w["model.embed_tokens.weight"])
    add("output_norm.weight", w["model.norm.weight"], quantize=False)
    if not model.tie_embeddings:
        add("output.weight", w["lm_head.weight"])
    for i in range(model.layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        add(b + "attn_q.weight", permute_for_ggml(w[p + "self_attn.q_proj.weight"], model.heads))
        add(b + "attn_k.weight", permute_for_ggml(w[p + "self_attn.k_proj.weight"], model.kv_heads))
        add(b + "attn_v.weight", w[p + "self_attn.v_proj.weight"])
        add(b + "attn_output.weight", w[p + "self_attn.o_proj.weight"])
        add(b + "ffn_gate.weight", w[p + "mlp.gate_proj.weight"])
        add(b + "ffn_up.weight", w[p + "mlp.up_proj.weight"])
        add(b + "ffn_down.weight", w[p + "mlp.down_proj.weight"])
        add(b + "attn_norm.weight", w[p + "input_layernorm.weight"], quantize=False)
        add(b + "ffn_norm.weight", w[p + "post_attention_layernorm.weight"], quantize=False)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# byte offsets of the half floats in each block type (the rest of a block is codes, bits and integer scales, all
# of whose byte values are valid)
BLOCK_HALVES = {
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "Q8_0": (0,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
}


def random_blocks(type_name: str, rows: int, k: int, rng: np.random.Generator, scale: float = 1.0) -> np.ndarray:
    """Raw GGUF rows (uint8 [rows, bytes per row]) of random blocks of a type: random bytes, with every half float
    a random value of either sign between 0.002 and 0.05, times `scale`."""
    qtype = gguf.GGMLQuantizationType[type_name]
    values, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows, k // values, block_bytes), dtype=np.uint8)
    for offset in BLOCK_HALVES[type_name]:
        size = (rows, k // values)
        half = (rng.uniform(0.002, 0.05, size=size) * scale * rng.choice([-1.0, 1.0], size=size)).astype(np.float16)
        blocks[..., offset : offset + 2] = half.view(np.uint8).reshape(rows, k // values, 2)
    return blocks.reshape(rows, -1)
