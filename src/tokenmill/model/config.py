"""The shape of a model (config/model_shape.py's ModelConfig), read from GGUF metadata (`{arch}.*` keys)."""

import numpy as np
from gguf import GGMLQuantizationType

from tokenmill.config.model_shape import ModelConfig
from tokenmill.errors import ModelFileError, UnsupportedModelError
from tokenmill.loader.gguf_file import GGUFFile
from tokenmill.model.rope_scaling import yarn_attention_factor, yarn_frequency_factors


def _int(gguf: GGUFFile, key: str, default: int | None = None) -> int:
    value = gguf.get(key, default)
    if value is None:
        raise ModelFileError(f"{gguf.path}: required metadata key {key!r} is missing")
    if isinstance(value, list):
        raise UnsupportedModelError(f"{gguf.path}: {key} varies per layer ({value[:4]}...), which is not supported")
    return int(value)


def model_config_from_gguf(gguf: GGUFFile) -> ModelConfig:
    arch = gguf.architecture
    hidden = _int(gguf, f"{arch}.embedding_length")
    num_heads = _int(gguf, f"{arch}.attention.head_count")
    num_kv_heads = _int(gguf, f"{arch}.attention.head_count_kv", num_heads)
    head_dim = _int(gguf, f"{arch}.attention.key_length", hidden // num_heads)
    if _int(gguf, f"{arch}.attention.value_length", head_dim) != head_dim:
        raise UnsupportedModelError(f"{gguf.path}: different key and value head sizes are not supported")
    if num_heads % num_kv_heads:
        raise ModelFileError(f"{gguf.path}: {num_heads} attention heads is not a multiple of {num_kv_heads} KV heads")
    for key in (f"{arch}.attn_logit_softcapping", f"{arch}.final_logit_softcapping"):
        if gguf.get(key):
            raise UnsupportedModelError(f"{gguf.path}: {key} (logit soft-capping) is not supported")
    rotary_dim = _int(gguf, f"{arch}.rope.dimension_count", head_dim)
    rope_theta = float(gguf.get(f"{arch}.rope.freq_base", 10000.0))
    trained = _int(gguf, f"{arch}.context_length", 2048)
    freq_factors = _rope_freq_factors(gguf, rotary_dim)
    yarn = _rope_yarn(gguf, arch, rotary_dim, rope_theta, trained)
    if yarn is not None and freq_factors is not None:
        raise UnsupportedModelError(f"{gguf.path}: YaRN together with rope_freqs.weight is not supported")
    embed = gguf.tensor("token_embd.weight")
    return ModelConfig(
        architecture=arch,
        vocab_size=embed.shape[0],
        hidden_size=hidden,
        intermediate_size=_int(gguf, f"{arch}.feed_forward_length"),
        num_layers=_int(gguf, f"{arch}.block_count"),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rotary_dim=rotary_dim,
        rope_theta=rope_theta,
        rms_norm_eps=float(gguf.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        tie_word_embeddings="output.weight" not in gguf.tensors,
        rope_scale=_rope_linear_scale(gguf, arch),
        **(yarn or {"max_position": trained, "rope_freq_factors": freq_factors}),
        **ARCHITECTURE_TRAITS.get(arch, _llama)(gguf, arch, hidden),
    )


def _rope_linear_scale(gguf: GGUFFile, arch: str) -> float:
    """The linear rope scaling factor, read as llama.cpp reads it: `rope.scaling.factor` (or the older
    `rope.scale_linear`), of type "linear" unless `rope.scaling.type` says otherwise, and none when it says "none"
    (YaRN's factor: _rope_yarn). LongRoPE and other types are refused."""
    kind = gguf.get(f"{arch}.rope.scaling.type", "linear")
    if kind == "yarn":
        return 1.0
    if kind not in ("linear", "none"):
        raise UnsupportedModelError(
            f"{gguf.path}: rope scaling {kind!r} ({arch}.rope.scaling.type) is not supported "
            "(linear, YaRN and Llama 3's rope_freqs are)"
        )
    factor = gguf.get(f"{arch}.rope.scaling.factor", gguf.get(f"{arch}.rope.scale_linear", 0.0))
    if not isinstance(factor, int | float) or factor < 0:
        raise ModelFileError(f"{gguf.path}: {arch}.rope.scaling.factor must be a positive number, not {factor!r}")
    return float(factor) if kind == "linear" and factor > 0 else 1.0  # llama.cpp: 0 means no scaling


def _rope_yarn(gguf: GGUFFile, arch: str, rotary_dim: int, theta: float, trained: int) -> dict | None:
    """YaRN (`rope.scaling.type` "yarn") as llama.cpp reads it -> ModelConfig's rope_freq_factors,
    rope_attention_factor and max_position (the longer of context_length and factor x original_context_length),
    or None for another type. llama.cpp's keys: rope.scaling.factor, .original_context_length (default:
    context_length), .yarn_ext_factor (1), .yarn_beta_fast (32), .yarn_beta_slow (1) and .attn_factor or
    .yarn_attn_factor (1), which multiplies YaRN's 1 + 0.1 ln(factor)."""
    if gguf.get(f"{arch}.rope.scaling.type") != "yarn":
        return None
    key = f"{arch}.rope.scaling."

    def number(name: str, default: float | None) -> float:
        value = gguf.get(key + name, default)
        if value is None or isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise ModelFileError(f"{gguf.path}: YaRN rope scaling needs a positive {key + name}, not {value!r}")
        return float(value)

    if gguf.get(key + "yarn_log_multiplier"):  # DeepSeek's mscale_all_dim: not a llama-family model's
        raise UnsupportedModelError(f"{gguf.path}: {key}yarn_log_multiplier is not supported")
    factor = number("factor", None)
    original = int(number("original_context_length", trained))
    ext = gguf.get(key + "yarn_ext_factor", 1.0)
    ext = 1.0 if ext is None or ext < 0 else float(ext)  # llama.cpp: negative means YaRN's own, 1
    factors = yarn_frequency_factors(
        rotary_dim, theta, factor, original, number("yarn_beta_fast", 32.0), number("yarn_beta_slow", 1.0), ext
    )
    attn = number("attn_factor", gguf.get(key + "yarn_attn_factor", 1.0))
    return {
        "rope_freq_factors": factors,
        # ggml: mscale = attn_factor * (1 + 0.1 ln(1 / freq_scale)) where ext_factor is not 0
        "rope_attention_factor": attn * (yarn_attention_factor(factor) if ext else 1.0),
        "max_position": max(trained, round(factor * original)),
    }


def _rope_freq_factors(gguf: GGUFFile, rotary_dim: int) -> tuple[float, ...] | None:
    """Llama 3's rope scaling as llama.cpp's converter stores it: `rope_freqs.weight`, float32 [rotary_dim / 2],
    the divisor of each rope frequency (ggml's rope divides the frequencies by it, in every layer)."""
    t = gguf.tensors.get("rope_freqs.weight")
    if t is None:
        return None
    if t.ggml_type not in (GGMLQuantizationType.F32, GGMLQuantizationType.F16) or t.shape != (rotary_dim // 2,):
        raise ModelFileError(
            f"{gguf.path}: rope_freqs.weight is {t.ggml_type.name} {t.shape}, expected F32 ({rotary_dim // 2},)"
        )
    factors = np.asarray(t.data, dtype=np.float32)
    if not np.all(np.isfinite(factors) & (factors > 0)):
        raise ModelFileError(f"{gguf.path}: rope_freqs.weight holds factors that are not positive numbers")
    return tuple(float(f) for f in factors)


def _experts(gguf: GGUFFile, arch: str, normalized: bool) -> dict:
    """The mixture-of-experts fields, read as llama.cpp reads them (`expert_count`, `expert_used_count`,
    `expert_feed_forward_length`, else `feed_forward_length`; `expert_shared_feed_forward_length`, else
    `feed_forward_length`, where the layers have a shared expert), or none for a dense model. Whether the chosen
    experts' weights are renormalized is fixed per architecture in llama.cpp's graphs (`normalized`), unless the
    file says (`expert_weights_norm`). A layer is a mixture where its file has a router (`ffn_gate_inp`); the
    others are dense. Gating other than a softmax (DeepSeek's sigmoid) is refused."""
    count = _int(gguf, f"{arch}.expert_count", 0)
    if count == 0:
        return {}
    used = _int(gguf, f"{arch}.expert_used_count")
    if not 0 < used <= count:
        raise ModelFileError(f"{gguf.path}: {arch}.expert_used_count {used} is not between 1 and {count} experts")
    gating = gguf.get(f"{arch}.expert_gating_func")
    if gating not in (None, 1):  # llama.cpp: 1 softmax, 2 sigmoid
        raise UnsupportedModelError(f"{gguf.path}: {arch}.expert_gating_func {gating} (not softmax) is not supported")
    norm = gguf.get(f"{arch}.expert_weights_norm")
    scale = float(gguf.get(f"{arch}.expert_weights_scale", 0.0) or 0.0)
    layers = _int(gguf, f"{arch}.block_count")
    moe_layers = tuple(f"blk.{i}.ffn_gate_inp.weight" in gguf.tensors for i in range(layers))
    dense_width = _int(gguf, f"{arch}.feed_forward_length", 0)
    shared = any(f"blk.{i}.ffn_up_shexp.weight" in gguf.tensors for i in range(layers))
    return {
        "num_experts": count,
        "experts_per_token": used,
        "expert_intermediate_size": _int(gguf, f"{arch}.expert_feed_forward_length", dense_width),
        "expert_weights_normalized": bool(norm) if norm is not None else normalized,
        "expert_weights_scale": scale if scale not in (0.0, 1.0) else 1.0,  # llama.cpp: 0 means none
        "moe_layers": moe_layers,
        "shared_expert_intermediate_size": (
            _int(gguf, f"{arch}.expert_shared_feed_forward_length", dense_width) if shared else 0
        ),
    }


def _llama(gguf: GGUFFile, arch: str, hidden: int) -> dict:
    """Llama, and Mixtral: llama's layers with a mixture of experts for the MLP (`llama.expert_count`), the
    chosen experts' weights renormalized."""
    return _experts(gguf, arch, normalized=True)


def _qwen2(gguf: GGUFFile, arch: str, hidden: int) -> dict:
    """Qwen2 (and Qwen 2.5): llama with biases on the Q, K and V projections. llama.cpp's converter stores Q/K rows
    unpermuted (its qwen2 graph uses neox rope)."""
    return {"attention_bias": True, "rope_rows_permuted": False}


def _qwen3(gguf: GGUFFile, arch: str, hidden: int) -> dict:
    """Qwen3 (dense): llama with an RMSNorm over each query and key head, no biases; Q/K rows unpermuted (neox)."""
    return {"qk_norm": True, "rope_rows_permuted": False}


def _qwen2moe(gguf: GGUFFile, arch: str, hidden: int) -> dict:
    """Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention, a mixture of experts whose chosen weights are
    not renormalized, and a shared expert gated by a sigmoid of its own router row."""
    return {**_qwen2(gguf, arch, hidden), **_experts(gguf, arch, normalized=False)}


def _qwen3moe(gguf: GGUFFile, arch: str, hidden: int) -> dict:
    """Qwen3-MoE (Qwen3-30B-A3B, Qwen3-Coder-30B-A3B): Qwen3's attention and a mixture of experts whose chosen
    weights are renormalized (llama.cpp's graph always renormalizes: the released models' norm_topk_prob)."""
    return {**_qwen3(gguf, arch, hidden), **_experts(gguf, arch, normalized=True)}


def _olmoe(gguf: GGUFFile, arch: str, hidden: int) -> dict:
    """OLMoE: llama with an RMSNorm over the whole Q and the whole K projection (not per head), neox rope, and a
    mixture of experts whose chosen weights are not renormalized."""
    return {"qk_norm": True, "qk_norm_whole": True, "rope_rows_permuted": False, **_experts(gguf, arch, False)}


def _gpt_oss(gguf: GGUFFile, arch: str, hidden: int) -> dict:
    """gpt-oss: every layer a mixture of experts with biases, whose router takes the top k logits and a softmax
    over them, and whose experts' SwiGLU is clamped (activation swiglu_oai); biases on Q, K, V and the output; a
    sink logit per head; neox rope (Q/K rows unpermuted), YaRN in every layer. Sliding-window layers (128) alternate
    with full ones, the first sliding: llama.cpp's `attention.sliding_window_pattern` (per-layer flags, or every
    n-th layer full; 2 when absent)."""
    num_layers = _int(gguf, f"{arch}.block_count")
    pattern = gguf.get(f"{arch}.attention.sliding_window_pattern", 2)
    if isinstance(pattern, list):
        if len(pattern) != num_layers:
            raise ModelFileError(f"{gguf.path}: {arch}.attention.sliding_window_pattern has {len(pattern)} flags")
        local = tuple(bool(flag) for flag in pattern)
    else:
        n = int(pattern)
        local = tuple(n == 0 or i % n < n - 1 for i in range(num_layers))  # llama.cpp's set_swa_pattern
    return {
        "activation": "swiglu_oai",
        "attention_bias": True,
        "attention_output_bias": True,
        "attention_sinks": True,
        "rope_rows_permuted": False,
        "sliding_window": _int(gguf, f"{arch}.attention.sliding_window"),
        "local_layers": local,
        "ffn_norm_name": "post_attention_norm",
        **_experts(gguf, arch, normalized=False),
        "expert_biases": True,
        "expert_softmax_after_topk": True,
    }


def _gemma3(gguf: GGUFFile, arch: str, hidden: int) -> dict:
    """Gemma 3 (text): GeGLU, QK-norm, sandwich norms, scaled embeddings; five local layers (sliding window,
    rope base `rope.freq_base_swa`, 10,000 in every Gemma 3) to one global one, as llama.cpp and HF transformers
    define it. GGUF stores the norms' weights with Gemma's +1 already added, and Q/K rows unpermuted (neox rope).
    A linear rope scaling (the 4B and larger: factor 8) applies to the global layers only."""
    num_layers = _int(gguf, f"{arch}.block_count")
    return {
        "activation": "gelu_tanh",
        "qk_norm": True,
        "sandwich_norms": True,
        "embedding_scale": hidden**0.5,
        "sliding_window": _int(gguf, f"{arch}.attention.sliding_window"),
        "local_layers": tuple((i + 1) % 6 != 0 for i in range(num_layers)),
        "local_rope_theta": float(gguf.get(f"{arch}.rope.freq_base_swa", 10000.0)),
        "rope_rows_permuted": False,
        "attention_scale": _gemma3_attention_scale(gguf, arch, hidden, num_layers),
        "norm_scale_in_float32": True,
    }


def _gemma3_attention_scale(gguf: GGUFFile, arch: str, hidden: int, num_layers: int) -> float | None:
    """GGUF has no key for HF's query_pre_attn_scalar: llama.cpp takes it to be the head size (1/sqrt(head_dim),
    tokenmill's default: right for 270M to 12B), except for the 27B (62 layers), whose scalar is hidden / heads."""
    if num_layers != 62:
        return None
    return (hidden / _int(gguf, f"{arch}.attention.head_count")) ** -0.5


# the declarative differences of each architecture from llama, read from its GGUF metadata
ARCHITECTURE_TRAITS = {
    "llama": _llama,
    "qwen2": _qwen2,
    "qwen3": _qwen3,
    "gemma3": _gemma3,
    "qwen2moe": _qwen2moe,
    "qwen3moe": _qwen3moe,
    "olmoe": _olmoe,
    "gpt-oss": _gpt_oss,
}
