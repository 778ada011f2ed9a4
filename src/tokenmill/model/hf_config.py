"""The shape of a model, read from a Hugging Face `config.json` (what model/config.py reads from GGUF metadata).

Reads both the key names of transformers 5 (`rope_parameters`, `layer_types`) and of older checkpoints
(`rope_theta`, `rope_scaling`, `rope_local_base_freq`, `sliding_window_pattern`). Whatever the shared decoder does
not implement (rope scaling, logit soft-capping, biases other than Qwen2's Q/K/V ones, Qwen's sliding windows)
is refused here, by name, before any weight is read.
"""

from typing import Any

from tokenmill.errors import ModelFileError, UnsupportedModelError
from tokenmill.loader.hf_checkpoint import HFCheckpoint
from tokenmill.model.config import ModelConfig

_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
# tie_word_embeddings when config.json does not say (the defaults of transformers' config classes)
_TIED_BY_DEFAULT = {"llama": False, "qwen2": False, "qwen3": False, "gemma3": True}


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
    if cfg.get("attention_bias") and arch != "qwen2":
        raise refuse("attention_bias (biases on every attention projection)")
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if cfg.get(key) is not None:
            raise refuse(key)
    global_theta, local_theta = _rope_thetas(cfg, arch, refuse)
    traits: dict[str, Any] = {}
    if arch in ("qwen2", "qwen3") and cfg.get("use_sliding_window"):
        raise refuse("use_sliding_window")
    if arch == "qwen2":
        traits["attention_bias"] = True
    if arch in ("qwen3", "gemma3"):
        traits["qk_norm"] = True
    if arch == "gemma3":
        traits.update(
            sandwich_norms=True,
            embedding_scale=hidden**0.5,
            sliding_window=int(number("sliding_window")),
            local_layers=_local_layers(cfg, num_layers, where),
            local_rope_theta=local_theta,
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
        rope_theta=global_theta,
        rms_norm_eps=float(number("rms_norm_eps", 1e-6)),
        max_position=int(number("max_position_embeddings", 2048)),
        tie_word_embeddings="output.weight" not in checkpoint.tensors,
        activation=activation,
        rope_rows_permuted=False,  # HF stores Q/K rows as its own (neox-style) rope reads them
        **traits,
    )


def _rope_thetas(cfg: dict[str, Any], arch: str, refuse) -> tuple[float, float | None]:
    """(the rope base of global layers, that of local ones or None), refusing any rope scaling."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:  # per layer type (Gemma 3, transformers 5)
        per_type = {kind: p for kind, p in params.items() if isinstance(p, dict)}
    elif isinstance(params, dict):
        per_type = {"full_attention": params}
    else:
        per_type = {"full_attention": {"rope_type": "default", "rope_theta": cfg.get("rope_theta", 10000.0)}}
        if cfg.get("rope_scaling"):
            per_type["full_attention"]["rope_type"] = cfg["rope_scaling"].get("rope_type", "scaled")
        if arch == "gemma3":
            per_type["sliding_attention"] = {"rope_theta": cfg.get("rope_local_base_freq", 10000.0)}
    for kind, p in per_type.items():
        if p.get("rope_type", "default") != "default":
            raise refuse(f"rope scaling {p.get('rope_type')!r} ({kind})")
    local = per_type.get("sliding_attention")
    return float(per_type["full_attention"].get("rope_theta", 10000.0)), (
        float(local.get("rope_theta", 10000.0)) if local else None
    )


def _local_layers(cfg: dict[str, Any], num_layers: int, where) -> tuple[bool, ...]:
    types = cfg.get("layer_types")
    if types is None:  # older configs: one global layer every `sliding_window_pattern`
        every = int(cfg.get("sliding_window_pattern", cfg.get("_sliding_window_pattern", 6)))
        return tuple((i + 1) % every != 0 for i in range(num_layers))
    if len(types) != num_layers or not set(types) <= {"sliding_attention", "full_attention"}:
        raise ModelFileError(f"{where}: layer_types must name sliding_attention or full_attention for every layer")
    return tuple(t == "sliding_attention" for t in types)
