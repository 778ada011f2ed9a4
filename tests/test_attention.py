"""Prompt attention gives a position the same bits however its prompt was cut into chunks; a decode row the same
bits whatever other rows share its step."""

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from tokenmill.layers.attention import (
    AttentionMetadata,
    DecodeBatch,
    PrefillChunk,
    _causal_in_query_blocks,
    padded_context,
    paged_attention,
    windowed,
)


def test_a_position_gets_the_same_bits_in_any_chunk() -> None:
    """Rows of a 300-token prompt alone, and as the chunks [0, 37), [37, 200), [200, 300) (each attending to the
    context before it): equal bits, and the float64 causal attention's values (9 heads on 3 KV heads)."""
    g = torch.Generator().manual_seed(0)
    length, heads, kv_heads, dim = 300, 9, 3, 64
    q = torch.randn(1, heads, length, dim, generator=g)
    k = torch.randn(1, kv_heads, length, dim, generator=g)
    v = torch.randn(1, kv_heads, length, dim, generator=g)
    alone = _causal_in_query_blocks(q, k, v, None, 0.125)
    chunks = [(0, 37), (37, 200), (200, 300)]
    pieces = [_causal_in_query_blocks(q[:, :, a:b], k[:, :, :b], v[:, :, :b], None, 0.125) for a, b in chunks]
    assert torch.equal(torch.cat(pieces, dim=2), alone)
    reference = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True, scale=0.125,
                                               enable_gqa=True)  # fmt: skip
    assert torch.allclose(alone.double(), reference, atol=1e-5)


def test_a_sliding_window_band_is_kept() -> None:
    """With a band mask (a sliding-window layer), the blocks compute what one masked call does."""
    g = torch.Generator().manual_seed(1)
    length, window = 200, 50
    q, k, v = (torch.randn(1, 2, length, 16, generator=g) for _ in range(3))
    positions = torch.arange(length)
    band = (positions[None] <= positions[:, None]) & (positions[None] > positions[:, None] - window)
    out = _causal_in_query_blocks(q[:, :, 120:], k, v, band[120:].view(1, 1, 80, length), 0.25)
    reference = F.scaled_dot_product_attention(q[:, :, 120:].double(), k.double(), v.double(), attn_mask=band[120:],
                                               scale=0.25)  # fmt: skip
    assert torch.allclose(out.double(), reference, atol=1e-5)


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16])
def test_a_16_bit_cache_gives_a_prompt_the_same_bits_in_any_chunking(cache_dtype: torch.dtype) -> None:
    """A fresh prompt attends to its own new K/V, a later chunk to the cache's: with a 16-bit cache both must be
    the rounded values, or a prompt's numbers would depend on how it was chunked."""
    g = torch.Generator().manual_seed(2)
    length, heads, kv_heads, dim = 200, 4, 2, 32
    q = torch.randn(length, heads, dim, generator=g)
    k, v = (torch.randn(length, kv_heads, dim, generator=g) for _ in range(2))

    def run(chunks: list[tuple[int, int]]) -> torch.Tensor:
        k_cache, v_cache = (torch.zeros(length, kv_heads, dim, dtype=cache_dtype) for _ in range(2))
        outs = []
        for a, b in chunks:
            context = None if a == 0 else torch.arange(b)
            meta = AttentionMetadata(torch.arange(a, b), None, [PrefillChunk(0, b - a, context, None)])
            outs.append(paged_attention(q[a:b], k[a:b], v[a:b], k_cache, v_cache, meta, 0.125))
        assert torch.equal(k_cache, k.to(cache_dtype))  # every token's K written, rounded
        return torch.cat(outs)

    assert torch.equal(run([(0, length)]), run([(0, 37), (37, 150), (150, length)]))


def decode_step(contexts: list[torch.Tensor]) -> AttentionMetadata:
    """A decode step of one row per context (int64 slots of its positions; the row's token is the last)."""
    lens = [c.shape[0] for c in contexts]
    slots = torch.stack([F.pad(c, (0, max(lens) - c.shape[0])) for c in contexts])  # [S, max_ctx]
    decode = DecodeBatch(0, len(contexts), max(lens), slots.reshape(-1), torch.tensor(lens), slots, lens)
    return AttentionMetadata(torch.stack([c[-1] for c in contexts]), decode, [])


@pytest.mark.parametrize("window", [0, 40])
def test_a_decode_row_gets_the_same_bits_alone_and_beside_longer_rows(window: int) -> None:
    """Rows with contexts of 5 to 300 keys, all in one step and each alone: equal bits (a row padded to the step's
    longest context got other last bits from torch's attention), and the float64 attention's values."""
    g = torch.Generator().manual_seed(3)
    heads, kv_heads, dim, slots = 8, 2, 32, 1024
    lens = [5, 300, 17, 100, 33, 16, 290]
    contexts = [torch.randperm(slots, generator=g)[:n] for n in lens]  # scattered slots, as a paged cache has
    k_cache, v_cache = (torch.randn(slots, kv_heads, dim, generator=g) for _ in range(2))
    q = torch.randn(len(lens), heads, dim, generator=g)
    k, v = k_cache[torch.stack([c[-1] for c in contexts])], v_cache[torch.stack([c[-1] for c in contexts])]

    def attend(rows: list[int]) -> torch.Tensor:
        meta = decode_step([contexts[i] for i in rows])
        meta = windowed(meta, window) if window else meta
        return paged_attention(q[rows], k[rows], v[rows], k_cache, v_cache, meta, 0.125)

    together = attend(list(range(len(lens))))
    for i, n in enumerate(lens):
        assert torch.equal(attend([i]), together[i : i + 1]), n
        seen = contexts[i][-window:] if window else contexts[i]
        keys, values = k_cache[seen].double(), v_cache[seen].double()  # [n, KVH, D]
        scores = torch.einsum("hd,nhd->hn", q[i].double(), keys.repeat_interleave(heads // kv_heads, 1)) * 0.125
        reference = torch.einsum("hn,nhd->hd", scores.softmax(-1), values.repeat_interleave(heads // kv_heads, 1))
        assert torch.allclose(together[i].double(), reference, atol=1e-5), n


def test_importing_tokenmill_puts_mkl_in_strict_mode() -> None:
    """MKL (inside torch's attention) rounds by its operands' alignment unless in its strict reproducibility mode: on
    an AVX2 CPU with 2 threads the case above then failed. A fresh process, tokenmill imported, one MKL product:
    MKL's mode is AUTO | STRICT (2 | 0x10000, its service call's answer), where without tokenmill it is 1."""
    code = (
        "import ctypes, os, tokenmill, torch\n"
        "a = torch.randn(64, 64); (a @ a).sum()\n"
        "lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), 'lib', 'libtorch_cpu.so'))\n"
        "print(lib.mkl_serv_cbwr_get(-1))"
    )
    env = {k: v for k, v in os.environ.items() if k != "MKL_CBWR"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert int(out.stdout.split()[-1]) == 2 | 0x10000


def test_decode_contexts_pad_to_four_lengths_an_octave() -> None:
    assert [padded_context(n) for n in (1, 16, 17, 20, 21, 33, 100, 1000, 1025)] == [16, 16, 20, 20, 24, 40, 112,
                                                                                    1024, 1280]  # fmt: skip
    for n in range(17, 5000):
        assert n <= padded_context(n) <= 1.25 * n
