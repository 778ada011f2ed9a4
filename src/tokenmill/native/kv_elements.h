/* The KV cache's element types (tm_llama_layer.kv_dtype): decoder.c writes each token's K and V rows in the cache's
 * type and its attention reads them back as floats. A 16-bit cache halves the bytes that decode's attention reads
 * and the cache's memory (llama.cpp keeps 16-bit K/V by default). Conversions round to nearest even, as torch's
 * .to(torch.float16 / torch.bfloat16) do: a token's K/V are the same bits whether the torch path (prompt tokens)
 * or this one (generated tokens) wrote them. The int8 cache (layers/kv_quant.py) holds each head as dim int8
 * values and then its float32 scale (max |x| / 127): a head is dim + 4 bytes, and the readers here return its raw
 * values, which the attention multiplies by the scale (kv_scale). */
#ifndef TOKENMILL_KV_ELEMENTS_H
#define TOKENMILL_KV_ELEMENTS_H

#include "kernels.h"

/* the readers are instantiated per type: their branches on T fold away */
#define ALWAYS_INLINE static inline __attribute__((always_inline))

enum { TM_KV_F32 = 0, TM_KV_F16 = 1, TM_KV_BF16 = 2, TM_KV_I8 = 3 };

static inline int tm_kv_dtype_ok(int64_t t) { return t >= TM_KV_F32 && t <= TM_KV_I8; }
static inline int64_t tm_kv_element_bytes(int64_t t) { return t == TM_KV_F32 ? 4 : t == TM_KV_I8 ? 1 : 2; }
/* bytes of one head of one token in the cache (an int8 head carries its scale) */
static inline int64_t tm_kv_head_bytes(int64_t t, int64_t dim) {
    return t == TM_KV_I8 ? dim + 4 : dim * tm_kv_element_bytes(t);
}

/* an int8 head's scale (1 for the other types, whose values are the floats themselves) */
ALWAYS_INLINE float kv_scale(const void *head, int64_t dim, const int T) {
    if (T != TM_KV_I8) return 1.0f;
    float s;
    memcpy(&s, (const char *)head + dim, sizeof s);
    return s;
}

/* float -> IEEE half, round to nearest even (infinities for what exceeds the half range, NaN kept a NaN) */
static inline uint16_t float_to_half(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    const uint16_t sign = (uint16_t)((x >> 16) & 0x8000);
    x &= 0x7FFFFFFFu;
    if (x >= 0x7F800000u) return sign | 0x7C00 | (x > 0x7F800000u ? 0x200 : 0);
    if (x >= 0x477FF000u) return sign | 0x7C00; /* from 65520 on: rounds past the largest half, 65504 */
    if (x < 0x38800000u) {                      /* below 2^-14: a subnormal half, in steps of 2^-24 (or zero) */
        float a;
        memcpy(&a, &x, sizeof a);
        return sign | (uint16_t)nearbyintf(a * 16777216.0f); /* 1024 (rounded up) is the smallest normal: right */
    }
    uint32_t h = (x >> 13) - ((uint32_t)(127 - 15) << 10); /* exponent rebiased, 10 mantissa bits */
    const uint32_t rest = x & 0x1FFFu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1))) ++h; /* a carry into the exponent is right too */
    return sign | (uint16_t)h;
}

/* float -> bfloat16, round to nearest even (torch's formula; NaN kept a NaN) */
static inline uint16_t float_to_bf16(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    if ((x & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
    return (uint16_t)((x + 0x7FFFu + ((x >> 16) & 1)) >> 16);
}

static inline float bf16_to_float(uint16_t b) {
    const uint32_t bits = (uint32_t)b << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* element i of a cache row of type T, as a float */
ALWAYS_INLINE float kv_get(const void *base, int64_t i, const int T) {
    if (T == TM_KV_F32) return ((const float *)base)[i];
    if (T == TM_KV_I8) return (float)((const int8_t *)base)[i];
    const uint16_t u = ((const uint16_t *)base)[i];
    if (T == TM_KV_BF16) return bf16_to_float(u);
#if defined(__F16C__)
    return _cvtsh_ss(u);
#else
    return half_to_float(u);
#endif
}

#if defined(__AVX2__) && defined(__F16C__)
/* 8 elements of type T from p, as floats */
ALWAYS_INLINE __m256 kv_load8(const void *p, const int T) {
    if (T == TM_KV_F32) return _mm256_loadu_ps(p);
    if (T == TM_KV_I8) return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
    const __m128i u = _mm_loadu_si128((const __m128i *)p);
    if (T == TM_KV_F16) return _mm256_cvtph_ps(u);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(u), 16));
}
#endif

#if defined(__AVX512F__)
/* 16 elements of type T from p, as floats */
ALWAYS_INLINE __m512 kv_load16(const void *p, const int T) {
    if (T == TM_KV_F32) return _mm512_loadu_ps(p);
    if (T == TM_KV_I8) return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
    const __m256i u = _mm256_loadu_si256((const __m256i *)p);
    if (T == TM_KV_F16) return _mm512_cvtph_ps(u);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(u), 16));
}
#endif

/* one int8 head: src's dim floats times 1 / scale (scale = max |x| * (1 / 127)), rounded to nearest even and
 * clamped to +-127, then the scale. Products and one reciprocal only, as layers/kv_quant.py's encode computes them:
 * -ffast-math may turn x / s into x * (1 / s), which rounds otherwise, but leaves these alone, so both paths give
 * the same bits. */
static inline void kv_store_int8_head(void *dst, const float *src, int64_t dim) {
    float amax = 0.0f;
    for (int64_t i = 0; i < dim; ++i) amax = fabsf(src[i]) > amax ? fabsf(src[i]) : amax;
    const float scale = amax * (1.0f / 127.0f), inverse = 1.0f / (scale > 0.0f ? scale : 1.0f);
    int8_t *out = dst;
    for (int64_t i = 0; i < dim; ++i) {
        float q = nearbyintf(src[i] * inverse);
        out[i] = (int8_t)(q > 127.0f ? 127.0f : q < -127.0f ? -127.0f : q);
    }
    memcpy(out + dim, &scale, sizeof scale);
}

/* dst[0 .. n) = src's n floats in type T (for int8: n is one head's dim) */
static inline void kv_store_row(void *dst, const float *src, int64_t n, const int T) {
    if (T == TM_KV_I8) {
        kv_store_int8_head(dst, src, n);
        return;
    }
    if (T == TM_KV_F32) {
        memcpy(dst, src, sizeof(float) * n);
        return;
    }
    uint16_t *out = dst;
    int64_t i = 0;
    if (T == TM_KV_F16) {
#if defined(__AVX512F__)
        for (; i + 16 <= n; i += 16)
            _mm256_storeu_si256((__m256i *)(out + i),
                                _mm512_cvtps_ph(_mm512_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#elif defined(__F16C__)
        for (; i + 8 <= n; i += 8)
            _mm_storeu_si128((__m128i *)(out + i),
                             _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
        for (; i < n; ++i) out[i] = float_to_half(src[i]);
        return;
    }
    for (; i < n; ++i) out[i] = float_to_bf16(src[i]);
}

/* one token's heads [heads, dim] of floats into its cache slot, in type T */
static inline void kv_store_heads(void *dst, const float *src, int64_t heads, int64_t dim, const int T) {
    if (T != TM_KV_I8) {
        kv_store_row(dst, src, heads * dim, T);
        return;
    }
    for (int64_t h = 0; h < heads; ++h) kv_store_int8_head((char *)dst + h * (dim + 4), src + h * dim, dim);
}

#endif
