"""The native prompt attention (tokenmill/native/attention.c through layers/native_attention.py): the float64
reference's values for every cache type, GQA, sliding windows and sinks; a position's bits whatever its chunking
and whatever else shares the call; and torch's path where the kernel is switched off."""

import pytest
import torch
import torch.nn.functional as F

from tests.vector_paths import OTHER_PATHS, rerun_on_path
from tokenmill import native
from tokenmill.layers import kv_quant, native_attention
from tokenmill.layers.attention import AttentionMetadata, PrefillChunk, attention_with_sinks, paged_attention, windowed

CACHE_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int8]


def random_qkv(length: int, heads: int, kv_heads: int, dim: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(length, heads, dim, generator=g)
    k, v = (torch.randn(length, kv_heads, dim, generator=g) for _ in range(2))
    return q, k, v


def chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    chunks: list[tuple[int, int]],
    cache_dtype: torch.dtype,
    window: int = 0,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's prompt through paged_attention in the chunks [a, b), each a step of its own (a later chunk
    attends to the cache) -> (its outputs [length, H, D], the K cache as written)."""
    length, kv_heads, dim = k.shape
    width = kv_quant.head_width(dim, cache_dtype)
    k_cache, v_cache = (torch.zeros(length, kv_heads, width, dtype=cache_dtype) for _ in range(2))
    outs = []
    for a, b in chunks:
        context = None if a == 0 else torch.arange(b)
        mask = None if a == 0 else (torch.arange(b)[None] <= torch.arange(a, b)[:, None]).view(1, 1, b - a, b)
        meta = AttentionMetadata(torch.arange(a, b), None, [PrefillChunk(0, b - a, context, mask)])
        if window:
            meta = windowed(meta, window)
        outs.append(paged_attention(q[a:b], k[a:b], v[a:b], k_cache, v_cache, meta, 0.125, sinks))
    return torch.cat(outs), k_cache


def reference(q, k, v, cache_dtype, window=0, sinks=None) -> torch.Tensor:
    """float64 attention over the K/V as the cache holds them (rounded to its type) -> [length, H, D]."""
    if cache_dtype == torch.int8:
        k, v = (kv_quant.decode(kv_quant.encode(x), torch.float64) for x in (k, v))
    else:
        k, v = (x.to(cache_dtype).double() for x in (k, v))
    length = q.shape[0]
    positions = torch.arange(length)
    allowed = positions[None] <= positions[:, None]
    if window:
        allowed &= positions[None] > positions[:, None] - window
    q4, k4, v4 = (x.double().transpose(0, 1).unsqueeze(0) for x in (q, k, v))
    if sinks is None:
        out = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=allowed, scale=0.125, enable_gqa=True)
    else:
        out = attention_with_sinks(q4, k4, v4, allowed, 0.125, sinks.double())
    return out[0].transpose(0, 1)


def test_the_kernel_runs_here() -> None:
    """The test machine builds the kernels (a compiler is a test requirement): the tests below exercise them."""
    q, _, _ = random_qkv(4, 2, 2, 64, 0)
    assert native.load() is not None
    assert native_attention.available(q, torch.zeros(4, 2, 64, dtype=torch.float16), None)


@pytest.mark.parametrize("cache_dtype", CACHE_DTYPES)
@pytest.mark.parametrize(("window", "with_sinks"), [(0, False), (50, False), (0, True), (70, True)])
def test_values_and_bits_in_any_chunking(cache_dtype: torch.dtype, window: int, with_sinks: bool) -> None:
    """A 300-token prompt of 9 heads on 3 KV heads: alone, and in the chunks [0, 37), [37, 200), [200, 300) (each
    attending to the cache before it), the same bits, and the float64 reference's values."""
    q, k, v = random_qkv(300, 9, 3, 64, seed=1)
    sinks = torch.randn(9, generator=torch.Generator().manual_seed(2)) if with_sinks else None
    alone, k_cache = chunked(q, k, v, [(0, 300)], cache_dtype, window, sinks)
    pieces, _ = chunked(q, k, v, [(0, 37), (37, 200), (200, 300)], cache_dtype, window, sinks)
    assert torch.equal(alone, pieces)
    assert torch.allclose(alone.double(), reference(q, k, v, cache_dtype, window, sinks), atol=2e-5)
    if cache_dtype != torch.int8:
        assert torch.equal(k_cache, k.to(cache_dtype))  # every token's K written, rounded to the cache's type


def test_a_chunk_beside_other_sequences_keeps_its_bits() -> None:
    """Three sequences' chunks in one step (a fresh prompt, a later chunk over a context in scattered slots, a
    one-token chunk) give each the bits it gets in a step of its own."""
    heads, kv_heads, dim, slots = 4, 2, 128, 1024
    k_cache, v_cache = (torch.zeros(slots, kv_heads, dim, dtype=torch.float16) for _ in range(2))
    g = torch.Generator().manual_seed(3)
    k_cache.copy_(torch.randn(slots, kv_heads, dim, generator=g))
    v_cache.copy_(torch.randn(slots, kv_heads, dim, generator=g))
    # (context slots, query rows): the last rows of each context are this step's
    contexts = [(torch.arange(500, 600), 100), (torch.randperm(400, generator=g), 70), (torch.arange(900, 950), 1)]
    q = torch.randn(sum(n for _, n in contexts), heads, dim, generator=g)
    together, alone, start = [], [], 0
    for slots_, n in contexts:
        together.append((start, n, slots_))
        alone.append(native_attention.prefill_attention(q[start : start + n], k_cache, v_cache, [(0, n, slots_)],
                                                        0.125))  # fmt: skip
        start += n
    out = native_attention.prefill_attention(q, k_cache, v_cache, together, 0.125)
    assert torch.equal(out, torch.cat(alone))


def test_torch_path_when_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """The switch the benchmarks use: off, paged_attention takes torch's kernels (the same values)."""
    q, k, v = random_qkv(130, 4, 4, 64, seed=4)
    native_out, _ = chunked(q, k, v, [(0, 130)], torch.float32)
    monkeypatch.setattr(native_attention, "enabled", False)
    torch_out, _ = chunked(q, k, v, [(0, 130)], torch.float32)
    assert not torch.equal(native_out, torch_out)  # two different computations
    assert torch.allclose(native_out, torch_out, atol=1e-5)


def test_bad_shapes_are_refused() -> None:
    """A head size the kernel does not take is a typed error from the call, not a crash."""
    q = torch.randn(4, 2, 12)
    cache = torch.zeros(4, 2, 12)
    assert not native_attention.available(q, cache, None)
    with pytest.raises(RuntimeError, match="native prompt attention failed"):
        native_attention.prefill_attention(q, cache, cache, [(0, 4, torch.arange(4))], 0.125)


@pytest.mark.slow
@pytest.mark.parametrize(("march", "path"), OTHER_PATHS)
def test_the_avx2_and_portable_paths_pass_these_tests(march: str, path: str) -> None:
    """This machine builds the AVX-512 path; older CPUs get the AVX2 tiles or the plain loops: build, run this."""
    rerun_on_path(__file__, march, path, "not avx2_and_portable")  # the child runs all but this test
