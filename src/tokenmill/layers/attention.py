"""Attention over a paged KV cache, for a flattened batch of sequences.

The runner lays out one step's new tokens as a flat list [T] (decodes first, then prefill chunks) and
describes how they attend in `AttentionMetadata`, built once per step and shared by every layer:

    new tokens:   | dec0 | dec1 | chunk A: q0 q1 q2 q3 | chunk B: q0 q1 |     (T = 8 rows of q, k, v)
    slot_mapping: |  17  |  40  |  64  65  66  67      |   90  91       |     (slot = block * block_size + offset)

- Decodes (one query each) attend in groups: each row's context is gathered from the cache and padded to a
  length that depends on its own context length only (padded_context), with a mask for the padding; rows of the
  same padded length attend in one call. torch's attention gives a row other last bits beside more padded keys,
  so padding to the batch's longest context made a row's numbers depend on its neighbours.
- A prefill chunk with no earlier context (a fresh prompt) attends to its own new K/V: plain causal attention,
  nothing gathered. A chunk that continues earlier tokens (a later chunk, or after a prefix-cache hit) gathers
  its context from the cache, and its causal mask is aligned to the end of that context.
"""

from dataclasses import dataclass, replace
from functools import cached_property

import torch
import torch.nn.functional as F

from tokenmill.layers import kv_quant, native_attention


@dataclass
class DecodeGroup:
    """Decode rows whose contexts are padded to the same length: one attention call."""

    rows: torch.Tensor  # [n] int64: which rows of the decode batch
    length: int  # context positions each row is padded to (padded_context of its own context length)
    kv_index: torch.Tensor  # [n * length] int64: cache slot of each position (padding: slot 0)
    mask: torch.Tensor | None  # [n, 1, 1, length] bool: True for keys the row sees; None: every key


@dataclass
class DecodeBatch:
    token_start: int
    num_seqs: int
    max_context: int
    # [S * max_ctx] int64: cache slot of each context position, padded to the longest (slot 0): the native
    # decoder's layout, which reads each row's own context_lens positions only
    kv_index: torch.Tensor
    context_lens: torch.Tensor  # [S] int64
    slots: torch.Tensor  # [S, max_ctx] int64 on the CPU: kv_index before it went to the device
    lens: list[int]  # context_lens as a list
    window: int = 0  # a sliding-window layer's copy (windowed): each row sees its `window` latest keys

    @cached_property
    def groups(self) -> list[DecodeGroup]:
        """The torch path's layout: the rows by padded context length. Made on first use: a step the native
        decoder runs never needs it."""
        return decode_groups(self.slots, self.lens, self.kv_index.device, self.window)


def padded_context(length: int) -> int:
    """The keys a decode row attends over in the torch path: its context length rounded up to 16, 20, 24, 28, 32,
    40, 48, 56, 64, 80, ... (four lengths an octave: at most 25% padding, few distinct lengths in a step)."""
    if length <= 16:
        return 16
    octave = 1 << (length - 1).bit_length()  # the power of two at or above length
    step = octave // 8  # octave / 2 + 1..4 steps
    return octave // 2 + -(-(length - octave // 2) // step) * step


def decode_groups(slots: torch.Tensor, lens: list[int], device: torch.device, window: int = 0) -> list[DecodeGroup]:
    """slots [S, >= max(lens)] int64 (row i's context slots first, anything after), lens: the rows' context
    lengths -> the rows grouped by padded_context, each group's slots padded with slot 0; window > 0: each row's
    mask keeps its `window` latest keys only."""
    by_length: dict[int, list[int]] = {}
    for row, n in enumerate(lens):
        by_length.setdefault(padded_context(n), []).append(row)
    groups = []
    for length, rows in sorted(by_length.items()):
        group = slots[rows, : min(length, slots.shape[1])]  # [n, <= length]
        group = F.pad(group, (0, length - group.shape[1]))  # [n, length]
        group_lens = torch.tensor([lens[r] for r in rows])  # [n]
        positions = torch.arange(length).unsqueeze(0)  # [1, length]
        valid = positions < group_lens.unsqueeze(1)  # [n, length]
        seen = valid & (positions >= group_lens.unsqueeze(1) - window) if window else valid
        every = not window and all(lens[r] == length for r in rows)
        mask = None if every else seen.view(len(rows), 1, 1, length).to(device)
        index = group.masked_fill(~valid, 0).reshape(-1).to(device)
        rows_ = torch.tensor(rows, dtype=torch.int64, device=device)
        groups.append(DecodeGroup(rows_, length, index, mask))
    return groups


@dataclass
class PrefillChunk:
    token_start: int
    token_end: int
    kv_index: torch.Tensor | None  # [context_len] int64 slots of the whole context; None for a fresh prompt
    # [1, 1, q_len, context_len] bool causal mask aligned to the end; None when fresh (plain causal), except in
    # a sliding-window layer's copy of the step (windowed), where a long fresh prompt has its band here
    mask: torch.Tensor | None
    window: int = 0  # a sliding-window layer's copy: the keys each query sees (the native kernel's form of mask)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: cache slot where each new token's K and V are written
    decode: DecodeBatch | None
    prefills: list[PrefillChunk]


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [T, H, D], k/v [T, KVH, D]; caches [num_slots, KVH, D] (written in place; int8 ones [num_slots, KVH,
    D + 4], layers/kv_quant.py) -> output [T, H, D]. `sinks` float32 [H] (gpt-oss): a learned logit per head that
    joins every query's softmax as a key with no value (attention_with_sinks).

    Caches of another element type than q (16-bit or int8 K/V in a float32 model) hold k and v rounded to it; the
    new tokens' own k and v are rounded the same way before they are attended to, so a position's attention sees
    the same keys whether they came from this step or from the cache (a prompt's bits do not depend on its
    chunking)."""
    if k_cache.dtype == torch.int8:
        k_rows, v_rows = kv_quant.encode(k), kv_quant.encode(v)
        k_cache.index_copy_(0, meta.slot_mapping, k_rows)
        v_cache.index_copy_(0, meta.slot_mapping, v_rows)
        k, v = kv_quant.decode(k_rows, q.dtype), kv_quant.decode(v_rows, q.dtype)
    else:
        if k_cache.dtype != k.dtype:
            k, v = k.to(k_cache.dtype), v.to(v_cache.dtype)
        k_cache.index_copy_(0, meta.slot_mapping, k)
        v_cache.index_copy_(0, meta.slot_mapping, v)
        k, v = k.to(q.dtype), v.to(q.dtype)  # no copy when the cache has q's type
    heads, dim = q.shape[1], q.shape[2]
    kv_heads = k.shape[1]
    outputs = []
    d = meta.decode
    if d is not None:
        q_dec = q[d.token_start : d.token_start + d.num_seqs]  # [S, H, D]
        out = q_dec.new_empty(q_dec.shape)
        for g in d.groups:
            n = g.rows.shape[0]
            keys = _read(k_cache, g.kv_index, q.dtype).view(n, g.length, kv_heads, dim).transpose(1, 2)
            values = _read(v_cache, g.kv_index, q.dtype).view(n, g.length, kv_heads, dim).transpose(1, 2)
            q_g = q_dec.index_select(0, g.rows).unsqueeze(2)  # [n, H, 1, D]
            out.index_copy_(0, g.rows, _attend(q_g, keys, values, g.mask, scale, sinks).view(n, heads, dim))
        outputs.append(out)
    if meta.prefills and native_attention.available(q, k_cache, sinks):
        chunks = [
            (c.token_start, c.token_end - c.token_start, meta.slot_mapping[c.token_start : c.token_end])
            if c.kv_index is None
            else (c.token_start, c.token_end - c.token_start, c.kv_index)
            for c in meta.prefills
        ]
        window = meta.prefills[0].window
        outputs.append(native_attention.prefill_attention(q, k_cache, v_cache, chunks, scale, window, sinks))
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs)
    for chunk in meta.prefills:
        q_c = q[chunk.token_start : chunk.token_end].transpose(0, 1).unsqueeze(0)  # [1, H, q_len, D]
        if chunk.kv_index is None:  # a fresh prompt: its own new K/V are the whole context
            keys = k[chunk.token_start : chunk.token_end].transpose(0, 1).unsqueeze(0)  # [1, KVH, q_len, D]
            values = v[chunk.token_start : chunk.token_end].transpose(0, 1).unsqueeze(0)
        else:
            keys = _read(k_cache, chunk.kv_index, q.dtype).transpose(0, 1).unsqueeze(0)  # [1, KVH, ctx, D]
            values = _read(v_cache, chunk.kv_index, q.dtype).transpose(0, 1).unsqueeze(0)
        out = _causal_in_query_blocks(q_c, keys, values, chunk.mask, scale, sinks)  # [1, H, q_len, D]
        outputs.append(out[0].transpose(0, 1))  # [q_len, H, D]
    return outputs[0] if len(outputs) == 1 else torch.cat(outputs)


def _attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """q [B, H, Lq, D] against keys / values [B, KVH, Lk, D], `mask` bool broadcast to [B, H, Lq, Lk] (True: may
    attend; None: every key) -> [B, H, Lq, D]: torch's fused attention, or with sinks attention_with_sinks."""
    if sinks is None:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
    return attention_with_sinks(q, keys, values, mask, scale, sinks)


def attention_with_sinks(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    sinks: torch.Tensor,
) -> torch.Tensor:
    """Attention whose softmax has one more term per head, exp(sinks[h]), that adds nothing to the output (gpt-oss,
    as transformers' eager attention and llama.cpp's soft_max with sinks): a head can attend to nothing. torch's
    fused kernels have no such term, so this is the scores' own products, batched per KV head (the query heads
    that share one KV head as one matrix: no copy of K or V). Shapes as _attend's; sinks float32 [H]."""
    b, heads, lq, dim = q.shape
    kv_heads, lk = keys.shape[1], keys.shape[2]
    grouped = q.reshape(b, kv_heads, heads // kv_heads * lq, dim)  # heads kvh * G + g, each Lq rows
    scores = torch.matmul(grouped, keys.transpose(-1, -2)).view(b, heads, lq, lk) * scale  # [B, H, Lq, Lk]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.to(scores.dtype).view(1, heads, 1, 1).expand(b, heads, lq, 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :lk]  # the sink's share dropped
    out = torch.matmul(probs.reshape(b, kv_heads, heads // kv_heads * lq, lk), values)  # [B, KVH, G * Lq, D]
    return out.view(b, heads, lq, dim)


def _read(cache: torch.Tensor, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The cache's slots at index [n] -> [n, KVH, D] of dtype (int8 rows decoded with their scales)."""
    rows = cache.index_select(0, index)
    return kv_quant.decode(rows, dtype) if cache.dtype == torch.int8 else rows.to(dtype)


QUERY_BLOCK = 128  # prompt positions per attention call past the first block
FIRST_BLOCKS = (16, 32, 64, 128)  # the first 128 positions' blocks end here: a short prompt pads to 16, 32 or 64


def query_blocks(start: int, end: int) -> list[tuple[int, int]]:
    """The blocks [a, b) of sequence positions that cover start..end-1. Where a block begins and ends depends on
    the positions alone, never on how a prompt was chunked: 0-15, 16-31, 32-63, 64-127, then 128 at a time."""
    blocks, a = [], 0
    while a < end:
        b = next((e for e in FIRST_BLOCKS if e > a), a + QUERY_BLOCK)
        if b > start:
            blocks.append((a, b))
        a = b
    return blocks


def _causal_in_query_blocks(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of a chunk's queries q [1, H, q_len, D], the last q_len positions of the context keys /
    values [1, KVH, ctx, D] -> [1, H, q_len, D], in blocks of positions fixed by the sequence (query_blocks). Each
    block is one call of the same shapes whatever the chunking: its rows (the chunk's, zeros elsewhere) against
    the keys of every position up to the block's end (zeros past the context, masked). torch's kernels (flash and
    math alike) give a row different bits beside a different number of rows or keys, so without this a prompt's
    numbers depended on how its steps were cut (chunked prefill next to other requests), which one int8
    activation pass turns into different greedy tokens (3 of 12 prompts). The small first blocks keep a short
    prompt (a chat turn, an embedding input) from paying for 128 x 128. `mask` [1, 1, q_len, ctx] bool: a sliding
    window's band (None: plain causal). 4-D inputs: torch's CPU flash kernel takes only those (3-D ones fall back
    to the math path, 3.4x slower at 512 tokens of 32 heads)."""
    heads, q_len, dim = q.shape[1], q.shape[2], q.shape[3]
    ctx = keys.shape[2]
    start = ctx - q_len  # the chunk's first position in its sequence
    blocks = query_blocks(start, ctx)
    base, span = blocks[0][0], blocks[-1][1]  # the first block's first position; the last one's end
    padded_keys = F.pad(keys, (0, 0, 0, span - ctx)) if span > ctx else keys  # [1, KVH, span, D]
    padded_values = F.pad(values, (0, 0, 0, span - ctx)) if span > ctx else values
    positions = torch.arange(span, device=q.device)
    # [span - base, span]: which key each of the blocks' rows may see
    allowed = (positions.unsqueeze(0) <= positions[base:].unsqueeze(1)) & (positions < ctx)
    if mask is not None:
        allowed[start - base : ctx - base, :ctx] &= mask[0, 0]
    allowed[: start - base, 0] = True  # rows outside the chunk (padding) attend to something: no NaN
    allowed[ctx - base :, 0] = True
    if start == base and ctx == span:  # the chunk fills its blocks: its own rows
        queries = q
    else:
        queries = q.new_zeros(1, heads, span - base, dim)  # the blocks' rows, the chunk's in place
        queries[:, :, start - base : ctx - base] = q
    outs = []
    for a, b in blocks:
        rows = slice(a - base, b - base)
        mask_rows = allowed[rows, :b]  # [b - a, b]
        keys_b, values_b = padded_keys[:, :, :b], padded_values[:, :, :b]
        outs.append(_attend(queries[:, :, rows], keys_b, values_b, mask_rows, scale, sinks))
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)  # [1, H, span - base, D]
    return out[:, :, start - base : ctx - base]


def windowed(meta: AttentionMetadata, window: int) -> AttentionMetadata:
    """The step as the layers with a sliding window see it: a query at position p attends to the keys at
    positions p - window < k <= p (the `window` latest, itself included), as HF transformers' Gemma 3 does."""
    d = meta.decode
    if d is not None:
        d = replace(d, window=window)  # its groups' masks keep each row's window (the query is its context's last)
    prefills = []
    for chunk in meta.prefills:
        q_len = chunk.token_end - chunk.token_start
        context = q_len if chunk.kv_index is None else chunk.kv_index.shape[0]
        if context <= window:  # nothing falls out of the window
            prefills.append(replace(chunk, window=window))
            continue
        device = meta.slot_mapping.device
        query_positions = torch.arange(context - q_len, context, device=device).unsqueeze(1)  # [q_len, 1]
        keys = torch.arange(context, device=device)  # [context]
        band = (keys <= query_positions) & (keys > query_positions - window)  # [q_len, context]
        prefills.append(replace(chunk, mask=band.view(1, 1, q_len, context), window=window))
    return replace(meta, decode=d, prefills=prefills)
