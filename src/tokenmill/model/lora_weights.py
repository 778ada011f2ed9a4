"""A LoRA file (loader/lora_file.py) made into the products one model applies (layers/lora.py): checked against the
model's shapes, Q/K rows put in the model's order, fused like the base projections (Q/K/V, gate/up), and under
tensor parallelism cut as the base weights are (distributed/shard.py): a column-parallel projection's B by its
rows (its output), a row-parallel one's A by its columns (its input; the partial products join in the ranks' sum
that follows the base projection)."""

from typing import TYPE_CHECKING

import torch

from tokenmill.config.model_shape import ModelConfig
from tokenmill.layers.lora import AdapterWeights, LoRAProjection
from tokenmill.loader.lora_file import LoRAError, LoRAFile
from tokenmill.model.registry import expected_tensor_shapes
from tokenmill.model.weights import unpermute_rope_rows

if TYPE_CHECKING:
    from tokenmill.distributed.shard import ShardPlan

# the model's fused projections and the GGUF kinds stacked into each, in output order
FUSED = {
    "qkv_proj": ("attn_q", "attn_k", "attn_v"),
    "o_proj": ("attn_output",),
    "gate_up_proj": ("ffn_gate", "ffn_up"),
    "down_proj": ("ffn_down",),
}


def build_adapter(
    lora: LoRAFile,
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    plan: "ShardPlan | None" = None,
) -> AdapterWeights:
    """`config`: the whole model's; `plan`: this rank's part under tensor parallelism. Raises LoRAError when the
    adapter was made for another model (a layer or shape this one does not have, an MLP that is a mixture)."""
    shapes = expected_tensor_shapes(config)
    local = plan.local_config if plan is not None else config
    widths = {  # this process's output rows of each kind
        "attn_q": local.num_heads * local.head_dim,
        "attn_k": local.num_kv_heads * local.head_dim,
        "attn_v": local.num_kv_heads * local.head_dim,
        "attn_output": local.hidden_size,
        "ffn_gate": local.intermediate_size,
        "ffn_up": local.intermediate_size,
        "ffn_down": local.hidden_size,
    }
    pieces: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    for name, pair in lora.pairs.items():
        layer, kind = int(name.split(".")[1]), name.split(".")[2]
        if name not in shapes:
            why = "a mixture of experts" if layer < config.num_layers and config.is_moe(layer) else "no such weight"
            raise LoRAError(f"{lora.path}: changes {name}, which this {config.architecture} model lacks ({why})")
        out_features, in_features = shapes[name]
        a, b = pair.a, pair.b
        if a.shape[1] != in_features or b.shape[0] != out_features:
            raise LoRAError(
                f"{lora.path}: {name}'s A {tuple(a.shape)} and B {tuple(b.shape)} do not fit its weight "
                f"({out_features} x {in_features}): an adapter of another model?"
            )
        if lora.rope_rows_permuted and kind in ("attn_q", "attn_k"):
            b = unpermute_rope_rows(b, config.num_heads if kind == "attn_q" else config.num_kv_heads)
        cut = plan.cut(name) if plan is not None else None
        if cut is not None:
            axis, start, end = cut
            b, a = (b[start:end], a) if axis == 0 else (b, a[:, start:end])
        pieces[(layer, kind)] = (a, b * lora.scale)  # the scale folded into B, in float32
    projections: dict[tuple[int, str], LoRAProjection] = {}
    nbytes = 0
    for layer in range(config.num_layers):
        for attribute, kinds in FUSED.items():
            if not any((layer, k) in pieces for k in kinds):
                continue
            present = [k for k in kinds if (layer, k) in pieces]
            rank = sum(pieces[(layer, k)][0].shape[0] for k in present)
            b = torch.zeros(sum(widths[k] for k in kinds), rank)  # [out, R] block-diagonal (layers/lora.py)
            col = row = 0
            for kind in kinds:
                if (layer, kind) in pieces:
                    part = pieces[(layer, kind)][1]  # [out part, r]
                    b[col : col + widths[kind], row : row + part.shape[1]] = part
                    row += part.shape[1]
                col += widths[kind]
            a = torch.cat([pieces[(layer, k)][0] for k in present])  # [R, in]
            projection = LoRAProjection.of(a.to(device=device, dtype=dtype), b.to(device=device, dtype=dtype))
            nbytes += sum(t.numel() * t.element_size() for t in (projection.a, projection.b_blocks))
            projections[(layer, attribute)] = projection
    return AdapterWeights(projections, lora.rank, nbytes)
