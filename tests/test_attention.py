"""Prompt attention gives a position the same bits however its prompt was cut into chunks."""

import pytest
import torch
import torch.nn.functional as F

from tokenmill.layers.attention import AttentionMetadata, PrefillChunk, _causal_in_query_blocks, paged_attention


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
