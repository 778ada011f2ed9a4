"""Attention over a paged KV cache, for a flattened batch of sequences.

The runner lays out one step's new tokens as a flat list [T] (all sequences back to back) and describes how they
attend in `AttentionMetadata`, built once per step and shared by every layer:

    new tokens:   | seq0 q0 q1 q2 | seq1 q0 | seq2 q0 |          (T = 5 rows of q, k, v)
    slot_mapping: |  17  18  19   |   40    |   65    |          (cache slot = block * block_size + offset)

Sequences are grouped (decodes together, prefill chunks together); each group is attended as a padded batch:
queries [S, max_q], keys gathered from the cache through `kv_slots` [S, max_ctx], and a boolean mask that lets
query i of a sequence see cache positions 0 .. (context_len - query_len + i), so prefix-cache hits and earlier
chunks are read from the cache like any other context.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionGroup:
    """Sequences attended together. Their query rows are the contiguous range [token_start, token_end)."""

    token_start: int
    token_end: int
    num_seqs: int
    max_query_len: int
    kv_slots: torch.Tensor  # [S, max_ctx] int64: cache slot of each context position (padding: 0, masked)
    mask: torch.Tensor  # [S, 1, max_q, max_ctx] bool: True where the query may attend the key
    query_index: torch.Tensor | None  # [S, max_q] int64 rows within the group (padding: 0); None when unpadded
    query_valid: torch.Tensor | None  # [S * max_q] bool: which padded rows are real queries; None when unpadded


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: cache slot where each new token's K and V are written
    groups: list[AttentionGroup]


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q [T, H, D], k/v [T, KVH, D]; caches [num_slots, KVH, D] (written in place) -> output [T, H, D]."""
    k_cache.index_copy_(0, meta.slot_mapping, k)
    v_cache.index_copy_(0, meta.slot_mapping, v)
    outputs = []
    for group in meta.groups:
        q_group = q[group.token_start : group.token_end]
        if group.query_index is None:
            q_group = q_group.view(group.num_seqs, group.max_query_len, *q.shape[1:])
        else:
            q_group = q_group[group.query_index]  # [S, max_q, H, D]
        keys = k_cache[group.kv_slots]  # [S, max_ctx, KVH, D]
        values = v_cache[group.kv_slots]
        out = F.scaled_dot_product_attention(
            q_group.transpose(1, 2),
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=group.mask,
            scale=scale,
            enable_gqa=True,
        )  # [S, H, max_q, D]
        out = out.transpose(1, 2).reshape(-1, *q.shape[1:])
        outputs.append(out if group.query_valid is None else out[group.query_valid])
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs)
