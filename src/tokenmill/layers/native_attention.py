"""Prompt chunks' attention through the native flash-attention kernel (tokenmill/native/attention.c): every chunk
of a step in one call per layer, the context's keys and values read from the paged cache in place.

torch's fused CPU kernel, called per block of 128 queries with a mask (layers/attention.py's way of keeping a
position's bits independent of chunking), ran SmolLM2-1.7B's 32 heads at 25-37 GMAC/s; the kernel computes each
query row in its own vector lane, so its bits are chunking-independent by construction (benchmarks/README.md has
the speeds). It takes float32 queries on the CPU and the caches' four element types; anything else (CUDA, a
bfloat16 model, no compiler) stays on torch's path.
"""

import ctypes

import torch

from tokenmill import native

# kv_elements.h's TM_KV_*: the caches' element types the kernel reads (int8 rows carry a float32 scale per head)
KV_DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.int8: 3}
_DIM_MULTIPLE = 8  # attention.c's KEY_STEP: head sizes it takes


class Chunk(ctypes.Structure):
    """kernels.h's tm_attn_chunk."""

    _fields_ = [
        ("token_start", ctypes.c_int64),
        ("q_len", ctypes.c_int64),
        ("ctx_len", ctypes.c_int64),
        ("slots", ctypes.c_void_p),
    ]


class Args(ctypes.Structure):
    """kernels.h's tm_prefill_attention_args."""

    _fields_ = [
        ("q", ctypes.c_void_p),
        ("out", ctypes.c_void_p),
        ("k_cache", ctypes.c_void_p),
        ("v_cache", ctypes.c_void_p),
        ("kv_dtype", ctypes.c_int64),
        ("heads", ctypes.c_int64),
        ("kv_heads", ctypes.c_int64),
        ("dim", ctypes.c_int64),
        ("window", ctypes.c_int64),
        ("scale", ctypes.c_float),
        ("sinks", ctypes.c_void_p),
        ("chunks", ctypes.c_void_p),
        ("n_chunks", ctypes.c_int64),
    ]


enabled = True  # tests and benchmarks switch it off to compare with torch's path


def available(q: torch.Tensor, k_cache: torch.Tensor, sinks: torch.Tensor | None) -> bool:
    """Whether the kernel takes this layer's prompt attention: float32 queries and contiguous caches on the CPU."""
    return (
        enabled
        and q.device.type == "cpu"
        and q.dtype == torch.float32
        and k_cache.dtype in KV_DTYPE_CODES
        and k_cache.is_contiguous()
        and q.shape[-1] % _DIM_MULTIPLE == 0
        and (sinks is None or sinks.dtype == torch.float32)
        and native.load() is not None
    )


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    chunks: list[tuple[int, int, torch.Tensor]],
    scale: float,
    window: int = 0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [T, H, D] float32; caches [slots, KVH, D] (int8: [slots, KVH, D + 4]) holding every context's K/V;
    chunks: (first row in q, rows, slots [ctx] int64 of the context, the rows being its last positions) ->
    [rows of all chunks, H, D] in chunk order. window > 0: each query sees that many latest keys."""
    q = q.contiguous()
    heads, dim = q.shape[1], q.shape[2]
    first = chunks[0][0]
    rows = sum(n for _, n, _ in chunks)
    out = q.new_empty(q.shape)
    slot_lists = [slots.to(torch.int64).contiguous() for _, _, slots in chunks]  # kept alive for the call
    table = (Chunk * len(chunks))(
        *(Chunk(start, n, s.shape[0], s.data_ptr()) for (start, n, _), s in zip(chunks, slot_lists, strict=True))
    )
    sinks_ = None if sinks is None else sinks.contiguous()
    args = Args(
        q.data_ptr(),
        out.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        KV_DTYPE_CODES[k_cache.dtype],
        heads,
        k_cache.shape[1],
        dim,
        window,
        scale,
        None if sinks_ is None else sinks_.data_ptr(),
        ctypes.addressof(table),
        len(chunks),
    )
    rc = native.load().tm_prefill_attention(ctypes.byref(args))
    if rc:
        raise RuntimeError(f"native prompt attention failed ({rc})")
    return out[first : first + rows]
