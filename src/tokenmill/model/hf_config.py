"""The shape of a model, read from a Hugging Face `config.json` (what model/config.py reads from GGUF metadata).

Reads both the key names of transformers 5 (`rope_parameters`, `layer_types`) and of older checkpoints
(`rope_theta`, `rope_scaling`, `rope_local_base_freq`, `sliding_window_pattern`). Rope scaling of the types
"linear", "llama3" and "yarn" becomes ModelConfig's rope_scale, rope_freq_factors and rope_attention_factor
(model/config.py). Whatever the shared decoder does not implement (other rope scaling such as dynamic NTK or
LongRoPE, logit soft-capping, biases other than Qwen2's Q/K/V ones, Qwen's sliding windows) is refused here, by
name, before any weight is read.
"""

from typing import Any

from tokenmill.config.model_shape import ModelConfig
from tokenmill.errors import ModelFileError, UnsupportedModelError
from tokenmill.layers.activation import SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT
from tokenmill.layers.rotary import llama3_frequency_factors
from tokenmill.loader.hf_checkpoint import HFCheckpoint
from tokenmill.model.rope_scaling import yarn_attention_factor, yarn_frequency_factors

_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
# tie_word_embeddings when config.json does not say (the defaults of transformers' config classes)
_TIED_BY_DEFAULT = {"llama": False, "qwen2": False, "qwen3": False, "gemma3": True}
# whether an architecture's router renormalizes the chosen experts' weights when config.json does not say (the
# defaults of transformers' config classes; Mixtral always does)
_NORM_TOPK_BY_DEFAULT = {"qwen2moe": False, "qwen3moe": False, "olmoe": False, "gpt-oss": False}


def model_config_from_hf(checkpoint: HFCheckpoint) -> ModelConfig:
    cfg, arch, where = checkpoint.config, checkpoint.architecture, checkpoint.path / "config.json"

    def number(key: str, default: Any = None) -> Any:
        value = cfg.get(key, default)
        if value is None or isinstance(value, bool) or not isinstance(value, int | float):
            raise ModelFileError(f"{where}: {key!r} is missing or not a number")
        return value

    def refuse(what: str) -> UnsupportedModelError:
        return UnsupportedModelError(f"{where}: {what} is not supported by tokenmill")

    hidden, num_heads = int(number("hidden_size")), int(number("num_attention_heads"))
    num_kv_heads = int(number("num_key_value_heads", num_heads))
    num_layers = int(number("num_hidden_layers"))
    head_dim = int(cfg.get("head_dim") or hidden // num_heads)
    if num_heads % num_kv_heads:
        raise ModelFileError(f"{where}: {num_heads} attention heads is not a multiple of {num_kv_heads} KV heads")
    if cfg.get("partial_rotary_factor", 1.0) != 1.0:
        raise refuse("a partial rotary factor")
    activation = _ACTIVATIONS.get(cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu")
    if activation is None:
        raise refuse(f"activation {cfg.get('hidden_activation') or cfg.get('hidden_act')!r}")
    if cfg.get("mlp_bias"):
        raise refuse("mlp_bias")
    if cfg.get("attention_bias") and arch not in ("qwen2", "qwen2moe", "gpt-oss"):
        raise refuse("attention_bias (biases on every attention projection)")
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if cfg.get(key) is not None:
            raise refuse(key)
    rope = _rope_traits(cfg, arch, head_dim, where, refuse)
    extended_context = rope.pop("extended_context", 0)  # YaRN's factor x original context: not a ModelConfig field
    traits: dict[str, Any] = {}
    if arch in ("qwen2", "qwen3", "qwen2moe", "qwen3moe") and cfg.get("use_sliding_window"):
        raise refuse("use_sliding_window")
    if arch == "llama" and cfg.get("sliding_window") is not None:  # Mixtral's (null in the released models)
        raise refuse("sliding_window")
    if arch == "qwen2" or (arch == "qwen2moe" and cfg.get("qkv_bias", True)):
        traits["attention_bias"] = True
    if arch in ("qwen3", "gemma3", "qwen3moe", "olmoe"):
        traits["qk_norm"] = True
    if arch == "olmoe":
        if cfg.get("clip_qkv") is not None:
            raise refuse("clip_qkv")
        traits["qk_norm_whole"] = True
    if cfg.get("num_experts") or cfg.get("num_local_experts"):
        traits.update(_expert_traits(cfg, arch, num_layers, checkpoint, number))
    if arch == "gpt-oss":
        traits.update(_gpt_oss_traits(cfg, num_layers, where, refuse, number))
    if arch == "gemma3":
        traits.update(
            sandwich_norms=True,
            embedding_scale=hidden**0.5,
            sliding_window=int(number("sliding_window")),
            local_layers=_local_layers(cfg, num_layers, where),
            attention_scale=float(number("query_pre_attn_scalar", head_dim)) ** -0.5,
            norm_scale_in_float32=True,
        )
    return ModelConfig(
        architecture=arch,
        vocab_size=int(number("vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(number("intermediate_size")),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rotary_dim=head_dim,
        rms_norm_eps=float(number("rms_norm_eps", 1e-6)),
        max_position=max(int(number("max_position_embeddings", 2048)), extended_context),
        tie_word_embeddings="output.weight" not in checkpoint.tensors,
        activation=traits.pop("activation", activation),
        rope_rows_permuted=False,  # HF stores Q/K rows as its own (neox-style) rope reads them
        **rope,
        **traits,
    )


def _gpt_oss_traits(cfg: dict[str, Any], num_layers: int, where, refuse, number) -> dict[str, Any]:
    """gpt-oss (model/config.py's _gpt_oss): its clamped SwiGLU with transformers' constants (others refused),
    biases on every attention projection when `attention_bias` (the released models'), sinks, sliding-window layers
    from `layer_types` (else every other one, the first sliding, as transformers' default)."""
    if (cfg.get("swiglu_alpha", SWIGLU_OAI_ALPHA), cfg.get("swiglu_limit", SWIGLU_OAI_LIMIT)) != (
        SWIGLU_OAI_ALPHA,
        SWIGLU_OAI_LIMIT,
    ):
        raise refuse(f"swiglu_alpha / swiglu_limit other than {SWIGLU_OAI_ALPHA} / {SWIGLU_OAI_LIMIT}")
    bias = bool(cfg.get("attention_bias", True))
    if "layer_types" in cfg:
        local = _local_layers(cfg, num_layers, where)
    else:
        local = tuple(i % 2 == 0 for i in range(num_layers))
    return {
        "activation": "swiglu_oai",
        "attention_bias": bias,
        "attention_output_bias": bias,
        "attention_sinks": True,
        "sliding_window": int(number("sliding_window", 128)),
        "local_layers": local,
        "ffn_norm_name": "post_attention_norm",
        "expert_biases": True,
        "expert_softmax_after_topk": True,
    }


def _expert_traits(cfg: dict[str, Any], arch: str, num_layers: int, checkpoint: HFCheckpoint, number) -> dict:
    """ModelConfig's mixture-of-experts fields from config.json: `num_experts` (Qwen, OLMoE) or
    `num_local_experts` (Mixtral), `num_experts_per_tok`, the experts' width (`moe_intermediate_size`, else
    `intermediate_size`), `norm_topk_prob`, the dense layers (`mlp_only_layers`, and every layer i with
    (i + 1) % `decoder_sparse_step` != 0), and Qwen2-MoE's `shared_expert_intermediate_size`."""
    count = int(number("num_experts", cfg.get("num_local_experts")))
    used = int(number("num_experts_per_tok"))
    if not 0 < used <= count:
        raise ModelFileError(f"{checkpoint.path / 'config.json'}: num_experts_per_tok {used} is not 1 to {count}")
    step = int(cfg.get("decoder_sparse_step") or 1)
    dense = set(cfg.get("mlp_only_layers") or ())
    moe_layers = tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))
    width = cfg.get("moe_intermediate_size") or cfg.get("intermediate_size")
    shared = int(cfg.get("shared_expert_intermediate_size") or 0) if arch == "qwen2moe" else 0
    normalized = cfg.get("norm_topk_prob", _NORM_TOPK_BY_DEFAULT[arch]) if arch != "llama" else True
    return {
        "num_experts": count,
        "experts_per_token": used,
        "expert_intermediate_size": int(width),
        "expert_weights_normalized": bool(normalized),
        "moe_layers": moe_layers,
        "shared_expert_intermediate_size": shared,
    }


def _rope_traits(cfg: dict[str, Any], arch: str, head_dim: int, where, refuse) -> dict[str, Any]:
    """ModelConfig's rope fields (rope_theta, rope_scale, rope_freq_factors, local_rope_theta) from the rope
    parameters of each layer type; scaling only on the global layers, of the types "linear" and "llama3"."""
    per_type = _rope_parameters(cfg, arch)
    local = per_type.get("sliding_attention")
    if local is not None and local.get("rope_type", "default") != "default":
        raise refuse(f"rope scaling {local['rope_type']!r} on the sliding-window layers")
    full = per_type["full_attention"]
    theta = float(full.get("rope_theta", cfg.get("rope_theta", _DEFAULT_THETA.get(arch, 10000.0))))

    def parameter(key: str, value: Any) -> float:
        if value is None or isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise ModelFileError(f"{where}: rope scaling {full['rope_type']!r} needs a positive {key!r}")
        return float(value)

    traits: dict[str, Any] = {"rope_theta": theta}
    kind = full["rope_type"]
    if kind == "linear":
        traits["rope_scale"] = parameter("factor", full.get("factor"))
    elif kind == "llama3":
        # as transformers: the top level's original_max_position_embeddings first, then the rope parameters', then
        # max_position_embeddings
        original = cfg.get("original_max_position_embeddings") or full.get("original_max_position_embeddings")
        traits["rope_freq_factors"] = llama3_frequency_factors(
            head_dim,
            theta,
            *(parameter(key, full.get(key)) for key in ("factor", "low_freq_factor", "high_freq_factor")),
            int(parameter("original_max_position_embeddings", original or cfg.get("max_position_embeddings"))),
        )
    elif kind == "yarn":
        # transformers: the top level's original_max_position_embeddings first, then the rope parameters', then
        # max_position_embeddings; what it extends to counts as the trained length
        factor = parameter("factor", full.get("factor"))
        original = cfg.get("original_max_position_embeddings") or full.get("original_max_position_embeddings")
        original = int(parameter("original_max_position_embeddings", original or cfg.get("max_position_embeddings")))
        betas = [parameter(key, full.get(key) or default) for key, default in (("beta_fast", 32), ("beta_slow", 1))]
        traits["rope_freq_factors"] = yarn_frequency_factors(
            head_dim, theta, factor, original, *betas, truncate=full.get("truncate", True) is not False
        )
        attention = full.get("attention_factor")
        traits["rope_attention_factor"] = (
            parameter("attention_factor", attention)
            if attention is not None
            else yarn_attention_factor(factor, full.get("mscale"), full.get("mscale_all_dim"))
        )
        traits["extended_context"] = round(factor * original)
    elif kind != "default":
        raise refuse(f"rope scaling {kind!r}")  # dynamic NTK, LongRoPE: they change with the sequence's length
    if local is not None:
        traits["local_rope_theta"] = float(local.get("rope_theta", _DEFAULT_LOCAL_THETA))
    return traits


# transformers' default rope bases where config.json names none
_DEFAULT_THETA = {"gemma3": 1_000_000.0, "gpt-oss": 150_000.0}
_DEFAULT_LOCAL_THETA = 10_000.0


def _rope_parameters(cfg: dict[str, Any], arch: str) -> dict[str, dict[str, Any]]:
    """The rope parameters of each layer type ("full_attention", and "sliding_attention" for Gemma 3), from
    transformers 5's `rope_parameters` (flat, or per layer type) or older configs' `rope_theta` + `rope_scaling`
    (whose type may be named "type") + `rope_local_base_freq`."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and {"full_attention", "sliding_attention"} & params.keys():  # per layer type
        per_type = {kind: dict(p) for kind, p in params.items() if isinstance(p, dict)}
        per_type.setdefault("full_attention", {})
    elif isinstance(params, dict):
        per_type = {"full_attention": dict(params)}
    else:
        per_type = {"full_attention": dict(cfg.get("rope_scaling") or {})}
        if "rope_theta" in cfg:
            per_type["full_attention"]["rope_theta"] = cfg["rope_theta"]
        if arch == "gemma3":
            per_type["sliding_attention"] = {"rope_theta": cfg.get("rope_local_base_freq", _DEFAULT_LOCAL_THETA)}
    for p in per_type.values():
        p.setdefault("rope_type", p.get("type", "default"))
    if arch == "gemma3":
        per_type.setdefault("sliding_attention", {"rope_type": "default"})
    return per_type


def _local_layers(cfg: dict[str, Any], num_layers: int, where) -> tuple[bool, ...]:
    types = cfg.get("layer_types")
    if types is None:  # older configs: one global layer every `sliding_window_pattern`
        every = int(cfg.get("sliding_window_pattern", cfg.get("_sliding_window_pattern", 6)))
        return tuple((i + 1) % every != 0 for i in range(num_layers))
    if len(types) != num_layers or not set(types) <= {"sliding_attention", "full_attention"}:
        raise ModelFileError(f"{where}: layer_types must name sliding_attention or full_attention for every layer")
    return tuple(t == "sliding_attention" for t in types)
