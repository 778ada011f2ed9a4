"""Architecture name (GGUF `general.architecture`, or config.json's mapped by loader/hf_checkpoint.py) -> model
class, and building a loaded model from either source."""

from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from tokenmill import native
from tokenmill.config.model_shape import ModelConfig
from tokenmill.distributed.shard import ShardedGGUF, ShardPlan
from tokenmill.errors import ModelFileError, UnsupportedModelError
from tokenmill.loader.model_source import ModelSource
from tokenmill.loader.weight_cache import IN_MEMORY, InMemoryWeights, open_weight_cache
from tokenmill.model.config_from_source import model_config_from_source
from tokenmill.model.llama import LlamaForCausalLM

if TYPE_CHECKING:
    from tokenmill.distributed.group import ParallelGroup

# one decoder for every architecture: what differs is declared in ModelConfig (model/config.py)
_ARCHITECTURES: dict[str, type[nn.Module]] = {
    "llama": LlamaForCausalLM,
    "gemma3": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
    "qwen2moe": LlamaForCausalLM,
    "qwen3moe": LlamaForCausalLM,
    "olmoe": LlamaForCausalLM,
    "gpt-oss": LlamaForCausalLM,
}
SUPPORTED_ARCHITECTURES = tuple(sorted(_ARCHITECTURES))


def model_class_for(gguf: ModelSource) -> type[nn.Module]:
    arch = gguf.architecture
    model_class = _ARCHITECTURES.get(arch)
    if model_class is None:
        raise UnsupportedModelError(
            f"{gguf.path}: architecture {arch!r} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    return model_class


def build_model(
    gguf: ModelSource,
    dtype: torch.dtype,
    device: torch.device,
    quantization: str | None = None,
    parallel: "tuple[ShardPlan, ParallelGroup] | None" = None,
    weight_cache: bool = False,
) -> tuple[nn.Module, ModelConfig]:
    """Instantiate the architecture of `gguf`, build its weights from the file in `quantization` mode's kernels
    (model/weights.py) and move them to `device`.
    With `parallel`, only this rank's shard of every weight is read and held. With `weight_cache`, the native
    kernels' buffers are kept in a file under the cache directory and mapped from it by later loads
    (loader/weight_cache.py). Returns the model and the whole model's config."""
    model_class = model_class_for(gguf)
    config = model_config_from_source(gguf)
    check_tensor_shapes(gguf, config)  # before any weight is read
    if parallel is None:
        model = model_class(config, dtype)
    else:
        plan, group = parallel
        gguf = ShardedGGUF(gguf, plan)  # type: ignore[assignment]
        model = model_class(plan.local_config, dtype)
        model.parallel, model.vocab_start = group, plan.vocab[0]
    store = _weight_store(gguf, quantization, parallel) if weight_cache else IN_MEMORY
    try:
        model.load_weights(gguf, quantization, store)
    except BaseException:
        store.abandon()
        raise
    store.finish()
    model.weight_store = store  # its state: "off", "read" (mapped from the cache) or "written" (being written)
    placeholders = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if placeholders:  # a bug: every weight must have been built
        raise RuntimeError(f"weights left unloaded: {', '.join(placeholders[:4])}")
    return model.to(device).eval(), config


def _weight_store(
    gguf: ModelSource, quantization: str | None, parallel: "tuple[ShardPlan, ParallelGroup] | None"
) -> InMemoryWeights:
    """The weight cache of this model file, quantization and rank (only the native kernels' buffers are cached)."""
    library = native.load()
    if quantization not in ("auto", "int4") or library is None:
        return IN_MEMORY
    rank, world = (parallel[1].rank, parallel[1].world_size) if parallel is not None else (0, 1)
    options = {"quantization": quantization, "rank": rank, "world_size": world}
    files = getattr(gguf, "files", None)  # a GGUF's files (a split one's shards); a checkpoint's: its directory's
    return open_weight_cache(Path(gguf.path), options, Path(library._name).name, files=files)


def expected_tensor_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the shared decoder reads (GGUF names) and its logical shape (rows, columns)."""
    c = config
    q, kv, d = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "token_embd.weight": (c.vocab_size, c.hidden_size),
        "output_norm.weight": (c.hidden_size,),
    }
    if not c.tie_word_embeddings:
        shapes["output.weight"] = (c.vocab_size, c.hidden_size)
    for i in range(c.num_layers):
        p = f"blk.{i}."
        shapes.update(
            {
                p + "attn_norm.weight": (c.hidden_size,),
                p + c.ffn_norm_name + ".weight": (c.hidden_size,),
                p + "attn_q.weight": (q, c.hidden_size),
                p + "attn_k.weight": (kv, c.hidden_size),
                p + "attn_v.weight": (kv, c.hidden_size),
                p + "attn_output.weight": (c.hidden_size, q),
            }
        )
        shapes.update(_mlp_shapes(c, i))
        if c.attention_bias:
            shapes.update({p + "attn_q.bias": (q,), p + "attn_k.bias": (kv,), p + "attn_v.bias": (kv,)})
        if c.attention_output_bias:
            shapes[p + "attn_output.bias"] = (c.hidden_size,)
        if c.attention_sinks:
            shapes[p + "attn_sinks.weight"] = (c.num_heads,)
        if c.qk_norm:
            q_norm, k_norm = (q, kv) if c.qk_norm_whole else (d, d)
            shapes.update({p + "attn_q_norm.weight": (q_norm,), p + "attn_k_norm.weight": (k_norm,)})
        if c.sandwich_norms:
            shapes.update(
                {p + "post_attention_norm.weight": (c.hidden_size,), p + "post_ffw_norm.weight": (c.hidden_size,)}
            )
    return shapes


def _mlp_shapes(c: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """Layer `layer`'s MLP tensors: the dense gate/up/down, or a mixture's router [E, hidden] and 3-D expert
    tensors [E, rows, columns], and its shared expert where it has one."""
    p, h = f"blk.{layer}.", c.hidden_size
    if not c.is_moe(layer):
        i = c.intermediate_size
        return {p + "ffn_gate.weight": (i, h), p + "ffn_up.weight": (i, h), p + "ffn_down.weight": (h, i)}
    e, i = c.num_experts, c.expert_intermediate_size
    shapes = {
        p + "ffn_gate_inp.weight": (e, h),
        p + "ffn_gate_exps.weight": (e, i, h),
        p + "ffn_up_exps.weight": (e, i, h),
        p + "ffn_down_exps.weight": (e, h, i),
    }
    if c.expert_biases:
        shapes.update(
            {
                p + "ffn_gate_inp.bias": (e,),
                p + "ffn_gate_exps.bias": (e, i),
                p + "ffn_up_exps.bias": (e, i),
                p + "ffn_down_exps.bias": (e, h),
            }
        )
    if (s := c.shared_expert_intermediate_size) > 0:
        shapes.update(
            {
                p + "ffn_gate_inp_shexp.weight": (h,),  # or [1, hidden], as HF and the converter store it
                p + "ffn_gate_shexp.weight": (s, h),
                p + "ffn_up_shexp.weight": (s, h),
                p + "ffn_down_shexp.weight": (h, s),
            }
        )
    return shapes


# tensors a file may hold that no layer reads: model/config.py reads them into the config (Llama 3's rope scaling)
_READ_INTO_CONFIG = frozenset({"rope_freqs.weight"})


def check_tensor_shapes(source: ModelSource, config: ModelConfig) -> None:
    """Raise ModelFileError naming every missing tensor and every one of the wrong shape (at most a few of each),
    and UnsupportedModelError naming the tensors no layer would read: a variant of the architecture (biases on
    other projections, say) that the shared decoder does not implement, whose weights it must not drop silently."""
    expected = expected_tensor_shapes(config)
    missing, wrong = [], []
    for name, shape in expected.items():
        tensor = source.tensors.get(name)
        if tensor is None:
            missing.append(name)
        elif tuple(tensor.shape) != shape and tuple(tensor.shape) != (1, *shape):  # a vector as a [1, n] matrix
            wrong.append(f"{name} is {tuple(tensor.shape)}, expected {shape}")
    if missing or wrong:
        parts = []
        if missing:
            parts.append(
                f"{len(missing)} tensors missing ({', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''})"
            )
        if wrong:
            parts.append(f"{len(wrong)} of the wrong shape ({'; '.join(wrong[:4])}{'; ...' if len(wrong) > 4 else ''})")
        raise ModelFileError(
            f"{source.path}: does not match its own {config.architecture} config "
            f"(hidden {config.hidden_size}, {config.num_layers} layers, {config.num_heads} heads of {config.head_dim}, "
            f"{config.num_kv_heads} KV heads, MLP {config.intermediate_size}, vocabulary {config.vocab_size}): "
            + "; ".join(parts)
        )
    unread = sorted(set(source.tensors) - expected.keys() - _READ_INTO_CONFIG)
    if unread:
        raise UnsupportedModelError(
            f"{source.path}: holds {len(unread)} tensors that tokenmill's {config.architecture} decoder does not "
            f"implement ({', '.join(unread[:4])}{', ...' if len(unread) > 4 else ''})"
        )
