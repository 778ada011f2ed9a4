"""The llama architecture (SmolLM2, Llama 2/3, Mistral-style dense models): RMSNorm, rope, GQA, SwiGLU.

The model takes the flattened new tokens of a whole step ([T] ids and positions) plus AttentionMetadata; it never
sees a padded batch. Q/K/V and gate/up projections are fused into one matmul each.
"""

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers.activation import silu_and_mul
from tokenmill.layers.attention import AttentionMetadata, paged_attention
from tokenmill.layers.linear import Linear
from tokenmill.layers.norm import RMSNorm
from tokenmill.layers.rotary import RotaryEmbedding
from tokenmill.loader.dequantize import dequantize
from tokenmill.loader.gguf_file import GGUFFile
from tokenmill.model.config import ModelConfig

KVCache = tuple[torch.Tensor, torch.Tensor]  # (k, v), each [num_slots, num_kv_heads, head_dim]


class RopeTables(NamedTuple):
    """The step's rotary tables, computed once in the model's forward and shared by every layer."""

    rotary: RotaryEmbedding
    cos_sin: tuple[torch.Tensor, torch.Tensor]


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.scale = 1.0 / math.sqrt(config.head_dim)
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, dtype)
        self.o_proj = Linear(self.q_size, config.hidden_size, dtype)

    def forward(self, rope: RopeTables, x: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        q, k = rope.rotary(rope.cos_sin, q, k)
        out = paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)  # [T, H, D]
        return self.o_proj(out.reshape(tokens, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, dtype)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config, dtype)

    def forward(
        self, rope: RopeTables, hidden: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        hidden = hidden + self.self_attn(rope, self.input_layernorm(hidden), kv_cache, meta)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.embed_tokens = nn.Parameter(torch.empty(config.vocab_size, config.hidden_size, dtype=dtype), False)
        self.rotary = RotaryEmbedding(config.head_dim, config.rotary_dim, config.max_position, config.rope_theta)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, dtype) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = None if config.tie_word_embeddings else Linear(config.hidden_size, config.vocab_size, dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[KVCache],
    ) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, hidden] (normed)."""
        hidden = F.embedding(input_ids, self.embed_tokens)
        rope = RopeTables(self.rotary, self.rotary.cos_sin(positions))
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden = layer(rope, hidden, kv_cache, meta)
        return self.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> float32 logits [N, vocab]."""
        weight = self.embed_tokens if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight).float()

    # ---- weights -------------------------------------------------------------------------------------------------

    def load_gguf(self, gguf: GGUFFile) -> None:
        """Dequantize the GGUF tensors into this model's (fused) parameters."""
        c = self.config

        def load(name: str) -> torch.Tensor:
            t = gguf.tensor(name)
            return dequantize(t.data, t.ggml_type, t.shape).to(self.dtype)

        def copy(param: torch.Tensor, value: torch.Tensor, name: str) -> None:
            if param.shape != value.shape:
                raise ValueError(f"{gguf.path}: {name} has shape {tuple(value.shape)}, expected {tuple(param.shape)}")
            param.data = value.contiguous()  # adopt the loaded tensor: no second copy of the weights

        copy(self.embed_tokens, load("token_embd.weight"), "token_embd.weight")
        copy(self.norm.weight, load("output_norm.weight").float(), "output_norm.weight")
        if self.lm_head is not None:
            copy(self.lm_head.weight, load("output.weight"), "output.weight")
        for i, layer in enumerate(self.layers):
            p = f"blk.{i}."
            q = unpermute_rope_rows(load(p + "attn_q.weight"), c.num_heads)
            k = unpermute_rope_rows(load(p + "attn_k.weight"), c.num_kv_heads)
            qkv = torch.cat([q, k, load(p + "attn_v.weight")])
            copy(layer.self_attn.qkv_proj.weight, qkv, p + "attn_q/k/v.weight")
            copy(layer.self_attn.o_proj.weight, load(p + "attn_output.weight"), p + "attn_output.weight")
            gate_up = torch.cat([load(p + "ffn_gate.weight"), load(p + "ffn_up.weight")])
            copy(layer.mlp.gate_up_proj.weight, gate_up, p + "ffn_gate/up.weight")
            copy(layer.mlp.down_proj.weight, load(p + "ffn_down.weight"), p + "ffn_down.weight")
            copy(layer.input_layernorm.weight, load(p + "attn_norm.weight").float(), p + "attn_norm.weight")
            copy(layer.post_attention_layernorm.weight, load(p + "ffn_norm.weight").float(), p + "ffn_norm.weight")


def unpermute_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's conversion permutation of Q/K projection rows.

    llama.cpp reorders each head's rows from [first half | second half] (HF, "neox" rope) to interleaved pairs
    (ggml's rope): GGUF row h*D + 2j + s holds HF row h*D + s*D/2 + j. Works on any [rows, ...] tensor, including
    raw quantized rows, since it only moves whole rows.
    """
    rows = weight.shape[0]
    head_dim = rows // num_heads
    return weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)
