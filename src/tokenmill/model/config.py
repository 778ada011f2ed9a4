"""The shape of a model, read from GGUF metadata (`{arch}.*` keys)."""

import math
from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType

from tokenmill.errors import ModelFileError, UnsupportedModelError
from tokenmill.loader.gguf_file import GGUFFile
from tokenmill.model.rope_scaling import yarn_attention_factor, yarn_frequency_factors


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position: int  # context length the model was trained for
    tie_word_embeddings: bool
    # what an architecture changes in the shared decoder (defaults: llama)
    activation: str = "silu"  # the MLP's gate: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    qk_norm: bool = False  # an RMSNorm over each query and key head before rope
    sandwich_norms: bool = False  # RMSNorms on the attention's and the MLP's outputs too (Gemma)
    embedding_scale: float | None = None  # embeddings multiplied by this (Gemma: sqrt(hidden_size))
    sliding_window: int | None = None  # local layers attend to at most this many latest positions
    local_layers: tuple[bool, ...] = ()  # per layer: attends to its sliding window only (the others: everything)
    local_rope_theta: float | None = None  # the local layers' rope base, when different
    # rope scaling, of the global layers only (Gemma 3's local layers keep their plain frequencies; llama has no
    # local layers): every frequency divided by rope_scale (linear: Gemma 3 4B's 8), and each by its own factor
    # (Llama 3's scaling: [rotary_dim / 2], GGUF's rope_freqs tensor; YaRN's ramp), and cos and sin multiplied by
    # rope_attention_factor (YaRN's)
    rope_scale: float = 1.0
    rope_freq_factors: tuple[float, ...] | None = None
    rope_attention_factor: float = 1.0
    rope_rows_permuted: bool = True  # Q/K rows stored permuted for ggml's interleaved rope (llama's GGUF files)
    attention_bias: bool = False  # Q, K and V projections have biases (Qwen2)
    attention_scale: float | None = None  # softmax scale of the attention scores (None: 1 / sqrt(head_dim))
    norm_scale_in_float32: bool = False  # RMSNorm weights multiply before rounding to a lower dtype (Gemma)
    qk_norm_whole: bool = False  # the QK-norm spans the whole Q and K projections, not each head (OLMoE)
    # mixture of experts (layers/moe.py): in the layers `moe_layers` marks, the MLP is `num_experts` experts of
    # width `expert_intermediate_size`, of which a router picks `experts_per_token` for each token (softmax over
    # all experts, the top k kept; their weights renormalized to sum 1 where `expert_weights_normalized`); with
    # `shared_expert_intermediate_size`, a dense expert every token takes, gated by a sigmoid (Qwen2-MoE). The
    # other layers keep the dense MLP of `intermediate_size`.
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    expert_weights_normalized: bool = False
    moe_layers: tuple[bool, ...] = ()
    shared_expert_intermediate_size: int = 0
    expert_weights_scale: float = 1.0  # the chosen experts' weights multiplied by this (after renormalizing)
    # gpt-oss: the router's top k logits first, then a softmax over them; biases on the router and every expert
    expert_softmax_after_topk: bool = False
    expert_biases: bool = False
    attention_output_bias: bool = False  # the output projection has a bias too (gpt-oss)
    attention_sinks: bool = False  # a learned logit per head in each query's softmax (gpt-oss: `attn_sinks`)
    ffn_norm_name: str = "ffn_norm"  # the GGUF name of the norm before the MLP (gpt-oss: post_attention_norm)

    def is_moe(self, layer: int) -> bool:
        """Whether a layer's MLP is a mixture of experts."""
        return self.num_experts > 0 and layer < len(self.moe_layers) and self.moe_layers[layer]

    def is_local(self, layer: int) -> bool:
        """Whether a layer attends only to its sliding window."""
        return self.sliding_window is not None and layer < len(self.local_layers) and self.local_layers[layer]

    @property
    def softmax_scale(self) -> float:
        return self.attention_scale if self.attention_scale is not None else 1.0 / math.sqrt(self.head_dim)


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
