"""tests/test_moe.py's tiny mixtures of experts, shared with tests/data/make_moe_llamacpp.py (which runs them through
llama.cpp's converter and llama.cpp in the peers' environment): the builder's models, the prompt, and each
model's transformers config."""

import hashlib
from pathlib import Path

import numpy as np
import transformers

from tests.gguf_builder import TinyModel
from tokenmill.loader.gguf_file import GGUFFile

CASES = {
    # Qwen3-30B-A3B-like: QK-norm per head, 8 experts of 32, 2 a token, renormalized
    "qwen3moe": TinyModel(
        arch="qwen3moe", head_size=32, layers=3, experts=8, experts_used=2, rope_theta=1e6, eps=1e-6, seed=11,
    ),
    # Qwen1.5-MoE-like: Q/K/V biases, 4 experts, 2 a token, not renormalized, a shared expert of 48 with its gate
    "qwen2moe": TinyModel(
        arch="qwen2moe", experts=4, experts_used=2, shared_intermediate=48, rope_theta=1e6, eps=1e-6, seed=12,
    ),
    # OLMoE-1B-7B-like: the QK-norm over whole projections, as many KV heads as heads (llama.cpp's olmoe assumes
    # it), 8 experts of 64 (its feed_forward_length), 2 a token
    "olmoe": TinyModel(
        arch="olmoe", kv_heads=4, intermediate=64, experts=8, experts_used=2, expert_intermediate=64, seed=13,
    ),
    # Mixtral-like: llama's permuted Q/K rows, 4 query heads per KV head, 4 experts of 64, 2 a token
    "mixtral": TinyModel(
        heads=8, kv_heads=2, head_size=16, intermediate=64, experts=4, experts_used=2, expert_intermediate=64,
        rope_theta=1e6, seed=14,
    ),
}  # fmt: skip
PROMPT = [int(t) for t in np.random.default_rng(21).integers(3, 96, size=40)]
GREEDY_TOKENS = 16
LLAMACPP_CASES = tuple(sorted(CASES))  # each checked against llama.cpp too (tests/data/moe_llamacpp.json)
LLAMACPP_VOCAB = 49152  # the bundled SmolLM2 tokenizer's, which llama.cpp's converter recognises


def hf_config(model: TinyModel) -> transformers.PretrainedConfig:
    common = dict(
        model.hf_shape(),
        rope_parameters={"rope_type": "default", "rope_theta": model.rope_theta},
        num_experts_per_tok=model.experts_used,
    )
    if model.arch == "qwen3moe":  # llama.cpp's qwen3moe always renormalizes, as the released models do
        return transformers.Qwen3MoeConfig(
            **common, num_experts=model.experts, moe_intermediate_size=model.expert_intermediate,
            norm_topk_prob=True, mlp_only_layers=list(model.dense_layers),
        )  # fmt: skip
    if model.arch == "qwen2moe":
        return transformers.Qwen2MoeConfig(
            **common, num_experts=model.experts, moe_intermediate_size=model.expert_intermediate,
            shared_expert_intermediate_size=model.shared_intermediate, norm_topk_prob=False,
        )  # fmt: skip
    if model.arch == "olmoe":
        return transformers.OlmoeConfig(**common, num_experts=model.experts, norm_topk_prob=False)
    return transformers.MixtralConfig(**common, num_local_experts=model.experts)


def tensor_digests(path: Path) -> dict[str, list]:
    """name -> [GGML type name, shape (rows first), SHA-256 of the stored bytes] of every tensor of a GGUF file."""
    return {
        name: [t.ggml_type.name, list(t.shape), hashlib.sha256(np.ascontiguousarray(t.data).tobytes()).hexdigest()]
        for name, t in GGUFFile(path).tensors.items()
    }
