"""tests/test_moe.py's and tests/test_gpt_oss.py's tiny mixtures of experts, shared with
tests/data/make_moe_llamacpp.py (which runs them through llama.cpp's converter and llama.cpp in the peers'
environment): the builder's models, the prompt, each model's transformers config, and gpt-oss's MXFP4 checkpoint
as the Hub ships it."""

import hashlib
import json
from pathlib import Path

import gguf
import numpy as np
import transformers
from safetensors.numpy import save_file

from tests.gguf_builder import TinyModel, hf_mxfp4
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
# 4 layers (sliding, full, sliding, full) with a window of 8 positions under a 40-token prompt; 4 query heads on 2
# KV heads; 4 experts of 32, 2 a token; YaRN over an original context of 64
GPT_OSS = TinyModel(
    arch="gpt-oss", layers=4, head_size=16, intermediate=32, experts=4, experts_used=2, expert_intermediate=32,
    sliding_window=8, rope_theta=150000.0, eps=1e-5, seed=15,
    rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
)  # fmt: skip


def gpt_oss_hf_config(model: TinyModel, truncate: bool = True) -> transformers.GptOssConfig:
    """transformers' config of the model; `truncate`: YaRN's correction range floored and ceiled (llama.cpp always
    does; the released gpt-oss's config says false, which only a checkpoint can tell)."""
    shape = dict(model.hf_shape(), intermediate_size=model.expert_intermediate)
    rope = {"rope_theta": model.rope_theta, "truncate": truncate, "beta_fast": 32.0, "beta_slow": 1.0}
    return transformers.GptOssConfig(
        **shape, num_local_experts=model.experts, num_experts_per_tok=model.experts_used,
        sliding_window=model.sliding_window, rope_parameters={**model.rope_scaling, **rope},
        architectures=["GptOssForCausalLM"],
    )  # fmt: skip


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


def write_mxfp4_checkpoint(model: TinyModel, float_dir: Path, out: Path) -> None:
    """The checkpoint as openai/gpt-oss-20b ships it: the experts' weights as MXFP4 `*_blocks` [E, outputs,
    inputs / 32, 16] and `*_scales` [E, outputs, inputs / 32] (gate and up outputs interleaved, as transformers
    holds them), everything else as saved, and config.json's quantization_config."""
    out.mkdir()
    tensors = {}
    for name, value in model.weights.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            outputs = np.ascontiguousarray(value.transpose(0, 2, 1))  # [E, outputs, inputs]
            raw = gguf.quants.quantize(outputs, gguf.GGMLQuantizationType.MXFP4)
            tensors[name + "_blocks"], tensors[name + "_scales"] = hf_mxfp4(raw)
        else:
            tensors[name] = np.ascontiguousarray(value)
    save_file(tensors, str(out / "model.safetensors"))
    config = json.loads((float_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (out / "config.json").write_text(json.dumps(config))
    (out / "tokenizer.json").write_bytes((float_dir / "tokenizer.json").read_bytes())
