/* Matrix products with 4-bit and 8-bit weights for decode-sized batches (a few rows of activations), and the
 * decoder layers of a llama model for the tokens of a decode step.
 *
 * 4-bit weights: GGUF's Q4_1 scheme, w = d * q + m per block of 32 inputs (q in 0..15; d and m half floats, as
 * GGUF stores them), interleaved for the integer dot-product instructions: 16 output rows form a group, and per group and block the
 * 256 bytes hold, for u = 0..3, row j = 0..15 and i = 0..3, the byte q[8u + i] | q[8u + 4 + i] << 4 of row j
 * (tm_q4_interleave builds it from GGUF's packing). So one 64-byte load gives, per 32-bit lane, four codes of
 * one row: a u8 x s8 dot instruction (vpdpbusd) against four activation codes broadcast to every lane adds 4
 * products to each of 16 rows at once, and a block ends with 16 per-row sums in one vector, no reductions.
 *
 * Activations are quantized per row and block of 32 in two int8 passes: x ~ s * (hi + lo / 254), s = max|x| / 127,
 * hi = round(x / s), lo = round((x / s - hi) * 254). The second pass carries the residual that one pass (as
 * llama.cpp's Q8 activations) loses: the error is below max|x| / 64,516 per value; on the references greedy
 * decoding keeps all 32 tokens of float32, where a single int8 pass drifts away after 3 to 32 tokens.
 * Per block: dot(q, x) ~ s * (dot(q, hi) + dot(q, lo) / 254), and the minimum term m * sum(x) uses the sum of the
 * quantized values, so that each weight multiplies the same activation (the errors meet weights centred on 0).
 *
 * Vector paths: AVX-512 VNNI (16 rows per instruction), AVX2 with FMA and F16C (two halves of 8 rows; vpmaddubsw
 * + vpmaddwd), and portable C; the compiler picks with -march=native. Threads: OpenMP over row groups (and in the
 * decoder one parallel region per layer, which also shares out the rows' norms and activation blocks); tokenmill
 * loads this library after torch, so `libgomp.so.1` resolves to torch's copy and both share one thread pool.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
#define TM_AVX512_VNNI 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define TM_AVX2 1
#endif

#define QK 32
#define GROUP 16        /* output rows interleaved per weight group */
#define GROUP_BYTES 256 /* codes per group and block: 16 rows x 32 codes x 4 bits */
/* activation rows whose accumulators stay in registers: each pass reads a group's weights once for all its rows
 * (AVX-512 has 32 vector registers, AVX2 16) */
#if defined(TM_AVX512_VNNI)
#define ROWS_PER_PASS 8
#else
#define ROWS_PER_PASS 4
#endif
/* up to this many rows, two integer chains per pass and row (the dot-product instruction's latency); above it, one
 * (registers). The chains sum exact integers, so a row's result is the same bits either way. */
#define SPLIT_ROWS 2
#define LO_STEPS 254.0f /* the second activation pass resolves one step of the first into 254 */

void tm_set_threads(int n) { omp_set_num_threads(n); }

/* which vector path of the 4-bit product this build runs */
const char *tm_vector_path(void) {
#if defined(TM_AVX512_VNNI)
    return "avx512-vnni";
#elif defined(TM_AVX2)
    return "avx2";
#else
    return "portable";
#endif
}

/* GGUF-packed Q4 blocks (codes [n, nb, 16], byte i = q[i] | q[i + 16] << 4; d, m [n, nb] half floats) -> the
 * interleaved layout: codes [ceil(n/16), nb, 256], d and m [ceil(n/16), nb, 16]; rows past n are zero. */
void tm_q4_interleave(const uint8_t *qs, const uint16_t *d, const uint16_t *mn, int64_t n, int64_t nb,
                      uint8_t *out_qs, uint16_t *out_d, uint16_t *out_m) {
    const int64_t groups = (n + GROUP - 1) / GROUP;
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < groups; ++g) {
        for (int64_t b = 0; b < nb; ++b) {
            uint8_t *dst = out_qs + (g * nb + b) * GROUP_BYTES;
            for (int j = 0; j < GROUP; ++j) {
                const int64_t row = g * GROUP + j, at = (g * nb + b) * GROUP + j;
                uint8_t q[QK] = {0};
                if (row < n) {
                    const uint8_t *src = qs + (row * nb + b) * (QK / 2);
                    for (int i = 0; i < QK / 2; ++i) {
                        q[i] = src[i] & 0x0F;
                        q[i + QK / 2] = src[i] >> 4;
                    }
                }
                for (int u = 0; u < 4; ++u)
                    for (int i = 0; i < 4; ++i)
                        dst[u * 64 + j * 4 + i] = (uint8_t)(q[8 * u + i] | q[8 * u + 4 + i] << 4);
                out_d[at] = row < n ? d[row * nb + b] : 0;
                out_m[at] = row < n ? mn[row * nb + b] : 0;
            }
        }
    }
}

typedef struct {
    int8_t *hi, *lo;  /* [m, k] codes of the two passes */
    float *scale;     /* [m, k/32]: x ~ scale * (hi + lo / 254) */
    float *sum;       /* [m, k/32]: sum of the block's quantized values */
    int32_t *sum_hi, *sum_lo; /* [m, k/32]: sums of the codes of each pass */
} tm_qx;

/* Called by every thread of a parallel region (the blocks are shared out), or outside one (one thread does all). */
static void quantize_rows(const float *x, int64_t m, int64_t k, const tm_qx *a) {
    const int64_t nb = k / QK;
#pragma omp for schedule(static)
    for (int64_t tb = 0; tb < m * nb; ++tb) {
        const float *xb = x + tb * QK;
        int8_t *hi = a->hi + tb * QK, *lo = a->lo + tb * QK;
        float amax = 0.0f;
        for (int i = 0; i < QK; ++i) amax = fmaxf(amax, fabsf(xb[i]));
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        int32_t sum_hi = 0, sum_lo = 0;
        for (int i = 0; i < QK; ++i) {
            const float v = xb[i] * inv;
            const float h = fminf(fmaxf(nearbyintf(v), -127.0f), 127.0f);
            const float l = fminf(fmaxf(nearbyintf((v - h) * LO_STEPS), -127.0f), 127.0f);
            hi[i] = (int8_t)h;
            lo[i] = (int8_t)l;
            sum_hi += (int32_t)h;
            sum_lo += (int32_t)l;
        }
        a->scale[tb] = amax / 127.0f;
        a->sum[tb] = amax / 127.0f * ((float)(sum_hi * (int32_t)LO_STEPS + sum_lo) / LO_STEPS);
        a->sum_hi[tb] = sum_hi;
        a->sum_lo[tb] = sum_lo;
    }
}

/* IEEE half -> float (dequantization and the portable path; the vector paths convert with vcvtph2ps) */
static float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h >> 15) << 31, exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF;
    if (exponent == 0) return (sign ? -1.0f : 1.0f) * ldexpf((float)mantissa, -24); /* zero and subnormals */
    uint32_t bits = sign | (exponent == 31 ? 0x7F800000u | mantissa << 13 : (exponent + 112) << 23 | mantissa << 13);
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* ---- GGUF blocks to float32, as ggml's reference dequantization computes them ----------------------------
 * (a 4-bit or 8-bit code times a half-float scale is exact in float32, so a fused multiply-add rounds as the
 * reference's separate multiply and add do) */

/* Q4_1: per block of 20 bytes, half floats d and m, then byte i = q[i] | q[i + 16] << 4; w = q * d + m */
void tm_dequantize_q4_1(const uint8_t *blocks, int64_t n_blocks, float *out) {
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < n_blocks; ++b) {
        const uint8_t *block = blocks + b * 20;
        uint16_t dm[2];
        memcpy(dm, block, sizeof dm);
        const float d = half_to_float(dm[0]), m = half_to_float(dm[1]);
        float *o = out + b * QK;
        for (int i = 0; i < QK / 2; ++i) {
            o[i] = (float)(block[4 + i] & 0x0F) * d + m;
            o[i + QK / 2] = (float)(block[4 + i] >> 4) * d + m;
        }
    }
}

/* Q8_0: per block of 34 bytes, half float d, then 32 int8 codes q; w = q * d */
void tm_dequantize_q8_0(const uint8_t *blocks, int64_t n_blocks, float *out) {
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < n_blocks; ++b) {
        const uint8_t *block = blocks + b * 34;
        uint16_t dh;
        memcpy(&dh, block, sizeof dh);
        const float d = half_to_float(dh);
        const int8_t *q = (const int8_t *)(block + 2);
        float *o = out + b * QK;
        for (int i = 0; i < QK; ++i) o[i] = (float)q[i] * d;
    }
}

static inline int32_t four_codes(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* out[t * 16 + j] = output of row j of one group for activation rows t0 + t, t < mt <= ROWS_PER_PASS. Always
 * inlined with a constant mt (see group_pass), so the loops over t unroll into registers. */
static inline __attribute__((always_inline)) void q4_group(const tm_qx *a, int64_t t0, const int mt, int64_t k,
                                                           const uint8_t *qg, const uint16_t *dg, const uint16_t *mg,
                                                           float *out) {
    const int64_t nb = k / QK;
#if defined(TM_AVX512_VNNI)
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    const __m512 inv_steps = _mm512_set1_ps(1.0f / LO_STEPS);
    const int split = mt <= SPLIT_ROWS; /* a constant in each inlined copy */
    __m512 acc[ROWS_PER_PASS];
#pragma GCC unroll 8
    for (int t = 0; t < mt; ++t) acc[t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        /* per activation row, integer chains for the first and second pass; with few rows, two each (low and high
         * nibbles), which add up to the same sums */
        __m512i hi0[ROWS_PER_PASS], hi1[ROWS_PER_PASS], lo0[ROWS_PER_PASS], lo1[ROWS_PER_PASS];
#pragma GCC unroll 8
        for (int t = 0; t < mt; ++t) hi0[t] = hi1[t] = lo0[t] = lo1[t] = _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int u = 0; u < 4; ++u) {
            const __m512i w = _mm512_loadu_si512((const void *)(qg + b * GROUP_BYTES + u * 64));
            const __m512i w_low = _mm512_and_si512(w, low4);                       /* codes 8u .. 8u + 3 */
            const __m512i w_high = _mm512_and_si512(_mm512_srli_epi16(w, 4), low4); /* codes 8u + 4 .. 8u + 7 */
#pragma GCC unroll 8
            for (int t = 0; t < mt; ++t) {
                const int8_t *h = a->hi + (t0 + t) * k + b * QK + 8 * u, *l = a->lo + (t0 + t) * k + b * QK + 8 * u;
                hi0[t] = _mm512_dpbusd_epi32(hi0[t], w_low, _mm512_set1_epi32(four_codes(h)));
                lo0[t] = _mm512_dpbusd_epi32(lo0[t], w_low, _mm512_set1_epi32(four_codes(l)));
                if (split) {
                    hi1[t] = _mm512_dpbusd_epi32(hi1[t], w_high, _mm512_set1_epi32(four_codes(h + 4)));
                    lo1[t] = _mm512_dpbusd_epi32(lo1[t], w_high, _mm512_set1_epi32(four_codes(l + 4)));
                } else {
                    hi0[t] = _mm512_dpbusd_epi32(hi0[t], w_high, _mm512_set1_epi32(four_codes(h + 4)));
                    lo0[t] = _mm512_dpbusd_epi32(lo0[t], w_high, _mm512_set1_epi32(four_codes(l + 4)));
                }
            }
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const void *)(dg + b * GROUP)));
        const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const void *)(mg + b * GROUP)));
#pragma GCC unroll 8
        for (int t = 0; t < mt; ++t) {
            const int64_t tb = (t0 + t) * nb + b;
            const __m512i hi_dot = split ? _mm512_add_epi32(hi0[t], hi1[t]) : hi0[t];
            const __m512i lo_dot = split ? _mm512_add_epi32(lo0[t], lo1[t]) : lo0[t];
            const __m512 dot = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo_dot), inv_steps, _mm512_cvtepi32_ps(hi_dot));
            acc[t] = _mm512_fmadd_ps(dot, _mm512_mul_ps(d, _mm512_set1_ps(a->scale[tb])), acc[t]);
            acc[t] = _mm512_fmadd_ps(m, _mm512_set1_ps(a->sum[tb]), acc[t]);
        }
    }
#pragma GCC unroll 8
    for (int t = 0; t < mt; ++t) _mm512_storeu_ps(out + t * GROUP, acc[t]);
#elif defined(TM_AVX2)
    /* two halves of 8 rows. vpmaddubsw multiplies u8 codes by s8 activations into pairwise 16-bit sums (at most
     * 2 * 15 * 127); the 8 sums of a pass add up to at most 30,480 in 16 bits, then vpmaddwd widens them. */
    const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    const __m256 inv_steps = _mm256_set1_ps(1.0f / LO_STEPS);
    for (int half = 0; half < 2; ++half) {
        __m256 acc[ROWS_PER_PASS];
        for (int t = 0; t < ROWS_PER_PASS; ++t) acc[t] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; ++b) {
            __m256i hi[ROWS_PER_PASS], lo[ROWS_PER_PASS];
            for (int t = 0; t < mt; ++t) hi[t] = lo[t] = _mm256_setzero_si256();
            for (int u = 0; u < 4; ++u) {
                const __m256i w = _mm256_loadu_si256((const void *)(qg + b * GROUP_BYTES + u * 64 + half * 32));
                const __m256i w_low = _mm256_and_si256(w, low4);
                const __m256i w_high = _mm256_and_si256(_mm256_srli_epi16(w, 4), low4);
                for (int t = 0; t < mt; ++t) {
                    const int8_t *h = a->hi + (t0 + t) * k + b * QK + 8 * u, *l = a->lo + (t0 + t) * k + b * QK + 8 * u;
                    hi[t] = _mm256_add_epi16(hi[t], _mm256_maddubs_epi16(w_low, _mm256_set1_epi32(four_codes(h))));
                    hi[t] = _mm256_add_epi16(hi[t], _mm256_maddubs_epi16(w_high, _mm256_set1_epi32(four_codes(h + 4))));
                    lo[t] = _mm256_add_epi16(lo[t], _mm256_maddubs_epi16(w_low, _mm256_set1_epi32(four_codes(l))));
                    lo[t] = _mm256_add_epi16(lo[t], _mm256_maddubs_epi16(w_high, _mm256_set1_epi32(four_codes(l + 4))));
                }
            }
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const void *)(dg + b * GROUP + half * 8)));
            const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const void *)(mg + b * GROUP + half * 8)));
            for (int t = 0; t < mt; ++t) {
                const int64_t tb = (t0 + t) * nb + b;
                const __m256 dot = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(lo[t], ones)), inv_steps,
                                                   _mm256_cvtepi32_ps(_mm256_madd_epi16(hi[t], ones)));
                acc[t] = _mm256_fmadd_ps(dot, _mm256_mul_ps(d, _mm256_set1_ps(a->scale[tb])), acc[t]);
                acc[t] = _mm256_fmadd_ps(m, _mm256_set1_ps(a->sum[tb]), acc[t]);
            }
        }
        for (int t = 0; t < mt; ++t) _mm256_storeu_ps(out + t * GROUP + half * 8, acc[t]);
    }
#else
    for (int t = 0; t < mt; ++t)
        for (int j = 0; j < GROUP; ++j) out[t * GROUP + j] = 0.0f;
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t *wb = qg + b * GROUP_BYTES;
        for (int t = 0; t < mt; ++t) {
            const int8_t *h = a->hi + (t0 + t) * k + b * QK, *l = a->lo + (t0 + t) * k + b * QK;
            const int64_t tb = (t0 + t) * nb + b;
            for (int j = 0; j < GROUP; ++j) {
                int32_t dot_hi = 0, dot_lo = 0;
                for (int u = 0; u < 4; ++u)
                    for (int i = 0; i < 4; ++i) {
                        const int32_t c = wb[u * 64 + j * 4 + i], q_low = c & 0x0F, q_high = c >> 4;
                        dot_hi += q_low * h[8 * u + i] + q_high * h[8 * u + 4 + i];
                        dot_lo += q_low * l[8 * u + i] + q_high * l[8 * u + 4 + i];
                    }
                const float dot = (float)dot_hi + (float)dot_lo / LO_STEPS;
                const float d = half_to_float(dg[b * GROUP + j]), m = half_to_float(mg[b * GROUP + j]);
                out[t * GROUP + j] += dot * (d * a->scale[tb]) + m * a->sum[tb];
            }
        }
    }
#endif
}

/* ---- 8-bit weights (GGUF's Q8_0: w = d * q, q in -127..127, one half-float scale d per block of 32) ---------
 * Interleaved like the 4-bit ones: per group of 16 rows and block, 512 bytes: for u = 0..7, row j and i = 0..3,
 * the code q[4u + i] of row j. vpdpbusd multiplies unsigned by signed bytes, so the AVX-512 path flips each
 * code's sign bit (q + 128, unsigned) and takes 128 * (the activations' code sum) off again in integers, exactly;
 * the AVX2 path multiplies |q| by the activation carrying q's sign (vpsignb), whose pairwise sums fit 16 bits. */

/* codes [n, nb * 32] and scales [n, nb] (half floats) -> codes [ceil(n/16), nb, 512], scales [ceil(n/16), nb, 16];
 * rows past n are zero */
void tm_q8_interleave(const int8_t *qs, const uint16_t *d, int64_t n, int64_t nb, int8_t *out_qs, uint16_t *out_d) {
    const int64_t groups = (n + GROUP - 1) / GROUP;
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < groups; ++g) {
        for (int64_t b = 0; b < nb; ++b) {
            int8_t *dst = out_qs + (g * nb + b) * GROUP * QK;
            for (int j = 0; j < GROUP; ++j) {
                const int64_t row = g * GROUP + j;
                const int8_t *src = qs + (row * nb + b) * QK;
                for (int u = 0; u < QK / 4; ++u)
                    for (int i = 0; i < 4; ++i) dst[u * 64 + j * 4 + i] = row < n ? src[4 * u + i] : 0;
                out_d[(g * nb + b) * GROUP + j] = row < n ? d[row * nb + b] : 0;
            }
        }
    }
}

/* out[t * 16 + j] = output of row j of one group for activation rows t0 + t (as q4_group) */
static inline __attribute__((always_inline)) void q8_group(const tm_qx *a, int64_t t0, const int mt, int64_t k,
                                                           const int8_t *qg, const uint16_t *dg, float *out) {
    const int64_t nb = k / QK;
#if defined(TM_AVX512_VNNI)
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    const __m512 inv_steps = _mm512_set1_ps(1.0f / LO_STEPS);
    const int split = mt <= SPLIT_ROWS; /* as in q4_group: with few rows, two chains per pass (even and odd u) */
    __m512 acc[ROWS_PER_PASS];
#pragma GCC unroll 8
    for (int t = 0; t < mt; ++t) acc[t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        __m512i hi0[ROWS_PER_PASS], hi1[ROWS_PER_PASS], lo0[ROWS_PER_PASS], lo1[ROWS_PER_PASS];
#pragma GCC unroll 8
        for (int t = 0; t < mt; ++t) hi0[t] = hi1[t] = lo0[t] = lo1[t] = _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int u = 0; u < QK / 4; u += 2) {
            const __m512i w0 = _mm512_xor_si512(_mm512_loadu_si512((const void *)(qg + b * GROUP * QK + u * 64)), flip);
            const __m512i w1 = _mm512_xor_si512(_mm512_loadu_si512((const void *)(qg + b * GROUP * QK + u * 64 + 64)), flip);
#pragma GCC unroll 8
            for (int t = 0; t < mt; ++t) {
                const int8_t *h = a->hi + (t0 + t) * k + b * QK + 4 * u, *l = a->lo + (t0 + t) * k + b * QK + 4 * u;
                hi0[t] = _mm512_dpbusd_epi32(hi0[t], w0, _mm512_set1_epi32(four_codes(h)));
                lo0[t] = _mm512_dpbusd_epi32(lo0[t], w0, _mm512_set1_epi32(four_codes(l)));
                if (split) {
                    hi1[t] = _mm512_dpbusd_epi32(hi1[t], w1, _mm512_set1_epi32(four_codes(h + 4)));
                    lo1[t] = _mm512_dpbusd_epi32(lo1[t], w1, _mm512_set1_epi32(four_codes(l + 4)));
                } else {
                    hi0[t] = _mm512_dpbusd_epi32(hi0[t], w1, _mm512_set1_epi32(four_codes(h + 4)));
                    lo0[t] = _mm512_dpbusd_epi32(lo0[t], w1, _mm512_set1_epi32(four_codes(l + 4)));
                }
            }
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const void *)(dg + b * GROUP)));
#pragma GCC unroll 8
        for (int t = 0; t < mt; ++t) {
            const int64_t tb = (t0 + t) * nb + b;
            const __m512i hi_sum = split ? _mm512_add_epi32(hi0[t], hi1[t]) : hi0[t];
            const __m512i lo_sum = split ? _mm512_add_epi32(lo0[t], lo1[t]) : lo0[t];
            const __m512i hi_dot = _mm512_sub_epi32(hi_sum, _mm512_set1_epi32(128 * a->sum_hi[tb]));
            const __m512i lo_dot = _mm512_sub_epi32(lo_sum, _mm512_set1_epi32(128 * a->sum_lo[tb]));
            const __m512 dot = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo_dot), inv_steps, _mm512_cvtepi32_ps(hi_dot));
            acc[t] = _mm512_fmadd_ps(dot, _mm512_mul_ps(d, _mm512_set1_ps(a->scale[tb])), acc[t]);
        }
    }
#pragma GCC unroll 8
    for (int t = 0; t < mt; ++t) _mm512_storeu_ps(out + t * GROUP, acc[t]);
#elif defined(TM_AVX2)
    const __m256i ones = _mm256_set1_epi16(1);
    const __m256 inv_steps = _mm256_set1_ps(1.0f / LO_STEPS);
    for (int half = 0; half < 2; ++half) {
        __m256 acc[ROWS_PER_PASS];
        for (int t = 0; t < ROWS_PER_PASS; ++t) acc[t] = _mm256_setzero_ps();
        for (int64_t b = 0; b < nb; ++b) {
            __m256i hi[ROWS_PER_PASS], lo[ROWS_PER_PASS];
            for (int t = 0; t < mt; ++t) hi[t] = lo[t] = _mm256_setzero_si256();
            for (int u = 0; u < QK / 4; ++u) {
                const __m256i w = _mm256_loadu_si256((const void *)(qg + b * GROUP * QK + u * 64 + half * 32));
                const __m256i w_abs = _mm256_abs_epi8(w);
                for (int t = 0; t < mt; ++t) {
                    const int8_t *h = a->hi + (t0 + t) * k + b * QK + 4 * u, *l = a->lo + (t0 + t) * k + b * QK + 4 * u;
                    const __m256i h_signed = _mm256_sign_epi8(_mm256_set1_epi32(four_codes(h)), w);
                    const __m256i l_signed = _mm256_sign_epi8(_mm256_set1_epi32(four_codes(l)), w);
                    hi[t] = _mm256_add_epi32(hi[t], _mm256_madd_epi16(_mm256_maddubs_epi16(w_abs, h_signed), ones));
                    lo[t] = _mm256_add_epi32(lo[t], _mm256_madd_epi16(_mm256_maddubs_epi16(w_abs, l_signed), ones));
                }
            }
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const void *)(dg + b * GROUP + half * 8)));
            for (int t = 0; t < mt; ++t) {
                const int64_t tb = (t0 + t) * nb + b;
                const __m256 dot = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo[t]), inv_steps, _mm256_cvtepi32_ps(hi[t]));
                acc[t] = _mm256_fmadd_ps(dot, _mm256_mul_ps(d, _mm256_set1_ps(a->scale[tb])), acc[t]);
            }
        }
        for (int t = 0; t < mt; ++t) _mm256_storeu_ps(out + t * GROUP + half * 8, acc[t]);
    }
#else
    for (int t = 0; t < mt; ++t)
        for (int j = 0; j < GROUP; ++j) out[t * GROUP + j] = 0.0f;
    for (int64_t b = 0; b < nb; ++b) {
        const int8_t *wb = qg + b * GROUP * QK;
        for (int t = 0; t < mt; ++t) {
            const int8_t *h = a->hi + (t0 + t) * k + b * QK, *l = a->lo + (t0 + t) * k + b * QK;
            const int64_t tb = (t0 + t) * nb + b;
            for (int j = 0; j < GROUP; ++j) {
                int32_t dot_hi = 0, dot_lo = 0;
                for (int u = 0; u < QK / 4; ++u)
                    for (int i = 0; i < 4; ++i) {
                        dot_hi += wb[u * 64 + j * 4 + i] * h[4 * u + i];
                        dot_lo += wb[u * 64 + j * 4 + i] * l[4 * u + i];
                    }
                const float dot = (float)dot_hi + (float)dot_lo / LO_STEPS;
                out[t * GROUP + j] += dot * (half_to_float(dg[b * GROUP + j]) * a->scale[tb]);
            }
        }
    }
#endif
}

/* ---- the products: row groups over the threads, up to ROWS_PER_PASS activation rows per pass ------------- */

typedef struct {
    const uint8_t *qs; /* [n/16, k/32, 256] interleaved 4-bit codes (tm_q4_interleave), or 512 int8 codes (8 bits) */
    const uint16_t *d; /* [n/16, k/32, 16] block scales (half floats) */
    const uint16_t *m; /* [n/16, k/32, 16] block minimums (half floats); NULL for 8 bits */
    int64_t n, k;      /* output (a multiple of 16) and input features */
    int64_t bits;      /* 4 (Q4_1's scheme) or 8 (Q8_0's) */
} tm_packed_weight;

/* one pass over one group for `bits`-bit weights (4: Q4_1 with minimums mg, 8: Q8_0), with a constant row count
 * in each call so that q4_group and q8_group unroll */
static inline void group_pass(const tm_qx *a, int64_t t0, int64_t mt, int64_t k, int bits, const uint8_t *qg,
                              const uint16_t *dg, const uint16_t *mg, float *part) {
    const int8_t *q8 = (const int8_t *)qg;
#define TM_PASS(rows)                                                                                              \
    case rows:                                                                                                     \
        bits == 4 ? q4_group(a, t0, rows, k, qg, dg, mg, part) : q8_group(a, t0, rows, k, q8, dg, part);          \
        break;
    switch (mt) {
        TM_PASS(1)
        TM_PASS(2)
        TM_PASS(3)
#if ROWS_PER_PASS == 8
        TM_PASS(4)
        TM_PASS(5)
        TM_PASS(6)
        TM_PASS(7)
    default: bits == 4 ? q4_group(a, t0, 8, k, qg, dg, mg, part) : q8_group(a, t0, 8, k, q8, dg, part); break;
#else
    default: bits == 4 ? q4_group(a, t0, 4, k, qg, dg, mg, part) : q8_group(a, t0, 4, k, q8, dg, part); break;
#endif
    }
#undef TM_PASS
}

/* y [m, n] = x [m, k] @ w.T, x already quantized into a; n a multiple of 16. Called by every thread of a parallel
 * region (the groups are shared out). */
static void grouped_matmul(const tm_qx *a, int64_t m, int64_t k, int bits, const uint8_t *qs, const uint16_t *d,
                           const uint16_t *mn, int64_t n, float *y) {
    const int64_t nb = k / QK, group_bytes = GROUP * QK * bits / 8;
#pragma omp for schedule(static)
    for (int64_t g = 0; g < n / GROUP; ++g) {
        const uint16_t *mg = mn ? mn + g * nb * GROUP : NULL;
        for (int64_t t0 = 0; t0 < m; t0 += ROWS_PER_PASS) {
            float part[ROWS_PER_PASS * GROUP];
            const int64_t mt = m - t0 < ROWS_PER_PASS ? m - t0 : ROWS_PER_PASS;
            group_pass(a, t0, mt, k, bits, qs + g * nb * group_bytes, d + g * nb * GROUP, mg, part);
            for (int64_t t = 0; t < mt; ++t)
                memcpy(y + (t0 + t) * n + g * GROUP, part + t * GROUP, sizeof(float) * GROUP);
        }
    }
}

static int qx_alloc(tm_qx *a, int64_t m, int64_t k) {
    a->hi = malloc((size_t)(m * k));
    a->lo = malloc((size_t)(m * k));
    a->scale = malloc(sizeof(float) * m * (k / QK));
    a->sum = malloc(sizeof(float) * m * (k / QK));
    a->sum_hi = malloc(sizeof(int32_t) * m * (k / QK));
    a->sum_lo = malloc(sizeof(int32_t) * m * (k / QK));
    return a->hi && a->lo && a->scale && a->sum && a->sum_hi && a->sum_lo ? 0 : -2;
}

static void qx_free(tm_qx *a) {
    free(a->hi); free(a->lo); free(a->scale); free(a->sum); free(a->sum_hi); free(a->sum_lo);
}

static int product(const float *x, int64_t m, int64_t k, int bits, const uint8_t *qs, const uint16_t *d,
                   const uint16_t *mn, int64_t n, float *y) {
    tm_qx a;
    int rc = qx_alloc(&a, m, k);
    if (rc == 0) {
#pragma omp parallel
        {
            quantize_rows(x, m, k, &a); /* the end of its loop waits for every thread */
            grouped_matmul(&a, m, k, bits, qs, d, mn, n, y);
        }
    }
    qx_free(&a);
    return rc;
}

/* x: [m, k] float32, row-major; qs, d, mn: interleaved (tm_q4_interleave) for n rows, n a multiple of 16;
 * y: [m, n] float32. Returns 0, or -2 when out of memory. */
int tm_q4_matmul(const float *x, int64_t m, int64_t k, const uint8_t *qs, const uint16_t *d, const uint16_t *mn,
                 int64_t n, float *y) {
    return product(x, m, k, 4, qs, d, mn, n, y);
}

/* x: [m, k] float32; qs, d: interleaved (tm_q8_interleave) for n rows, n a multiple of 16; y: [m, n] float32.
 * Returns 0, or -2 when out of memory. */
int tm_q8_matmul(const float *x, int64_t m, int64_t k, const int8_t *qs, const uint16_t *d, int64_t n, float *y) {
    return product(x, m, k, 8, (const uint8_t *)qs, d, NULL, n, y);
}

/* ---- one decoder layer of a llama-style model, for a few decode tokens ------------------------------------ */

static void rms_norm(const float *x, const float *w, float eps, int64_t h, float *out) {
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < h; ++i) ss += x[i] * x[i];
    const float inv = 1.0f / sqrtf(ss / (float)h + eps);
#pragma omp simd
    for (int64_t i = 0; i < h; ++i) out[i] = w[i] * (x[i] * inv);
}

/* rotate one head in place: x * cos_full + roll(x, half) * sin_signed ("neox" layout) */
static void rope_head(float *x, const float *cos_full, const float *sin_signed, int64_t dim) {
    float tmp[512];
    const int64_t half = dim / 2;
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) tmp[i] = x[i] * cos_full[i] + x[i + half] * sin_signed[i];
#pragma omp simd
    for (int64_t i = half; i < dim; ++i) tmp[i] = x[i] * cos_full[i] + x[i - half] * sin_signed[i];
    memcpy(x, tmp, sizeof(float) * dim);
}

typedef struct {
    const float *norm1, *norm2;                  /* [hidden] RMSNorm weights before attention and before the MLP */
    tm_packed_weight qkv, o, gate_up, down;          /* projections (gate_up: gate rows, then up rows) */
    float *k_cache, *v_cache;                    /* [slots, kv_heads, dim] */
    /* what other architectures add (NULL / 0: llama's) */
    const float *q_norm, *k_norm;                /* [dim]: RMSNorm of each query and key head before rope (QK-norm) */
    const float *post_attn_norm, *post_mlp_norm; /* [hidden]: norms of the blocks' outputs before the residual sums */
    int64_t window;                              /* > 0: attends to its `window` latest positions only (local layer) */
    int64_t local_rope;                          /* 1: rotates with the local rope tables (their own base) */
} tm_llama_layer;

enum { TM_SILU = 0, TM_GELU_TANH = 1 }; /* the MLP's gate activation */

/* sums the n floats at x over the tensor-parallel ranks in place (ctx: the caller's state, say a shared-memory
 * group); returns 0, or not 0 when the collective failed */
typedef int (*tm_reduce_fn)(void *ctx, float *x, int64_t n);

typedef struct {
    float *x, *qkv_out, *attn, *gu, *delta, *scores;
    tm_qx qx; /* the quantized input of the current projection, [m, max(h, heads * dim, inter)] */
} tm_scratch;

/* y = x @ w.T through the scratch's quantized activations; called by every thread of decode_layer's region */
static void project(const float *x, int64_t m, const tm_packed_weight *w, const tm_scratch *s, float *y) {
    quantize_rows(x, m, w->k, &s->qx);
    grouped_matmul(&s->qx, m, w->k, (int)w->bits, w->qs, w->d, w->m, w->n, y);
}

#if defined(__AVX512F__)
/* The sums of 16 vectors' lanes, as one vector in the vectors' order: pairs of vectors are folded together in
 * four rounds of two lane shuffles and one addition (45 instructions, against about 8 for reducing each vector
 * alone). After the rounds lane 4i + s holds vector i + 4s; one permute puts them in order. */
static inline __m512 sum_lanes16(__m512 v[16]) {
    __m512 c[8], e[4], f[2];
    for (int i = 0; i < 8; ++i) /* halves: [a's 8 partial sums, b's 8] */
        c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int i = 0; i < 4; ++i) /* quarters: 4 partial sums each of vectors 4i .. 4i + 3 */
        e[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    for (int i = 0; i < 2; ++i) /* quarter q: 2 partial sums of vectors 8i + q and 8i + q + 4 */
        f[i] = _mm512_add_ps(_mm512_shuffle_ps(e[2 * i], e[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(e[2 * i], e[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m512 g = _mm512_add_ps(_mm512_shuffle_ps(f[0], f[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                   _mm512_shuffle_ps(f[0], f[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
    return _mm512_permutexvar_ps(order, g);
}
#endif

/* scores[j] = scale * q . k_j for the n keys at k_base + slots[j] * stride (dim floats each) */
static void qk_scores(const float *q, const float *k_base, int64_t stride, const int64_t *slots, int64_t n,
                      int64_t dim, float scale, float *scores) {
    int64_t j = 0;
#if defined(__AVX512F__)
    if (dim % 16 == 0 && dim <= 256) {
        __m512 qv[16];
        for (int64_t i = 0; i < dim / 16; ++i) qv[i] = _mm512_loadu_ps(q + 16 * i);
        for (; j < n; j += 16) {
            __m512 dots[16]; /* per key, the products of q and k summed into 16 lanes */
            for (int key = 0; key < 16; ++key) {
                dots[key] = _mm512_setzero_ps();
                if (j + key >= n) continue;
                const float *k = k_base + slots[j + key] * stride;
                for (int64_t i = 0; i < dim / 16; ++i) dots[key] = _mm512_fmadd_ps(qv[i], _mm512_loadu_ps(k + 16 * i), dots[key]);
            }
            const __m512 sums = _mm512_mul_ps(sum_lanes16(dots), _mm512_set1_ps(scale));
            _mm512_mask_storeu_ps(scores + j, n - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - j)) - 1), sums);
        }
        return;
    }
#endif
    for (; j < n; ++j) {
        const float *k = k_base + slots[j] * stride;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t i = 0; i < dim; ++i) dot += q[i] * k[i];
        scores[j] = dot * scale;
    }
}

/* out [dim] = softmax(scores [n]) . the n values at v_base + slots[j] * stride; scores are overwritten */
static void softmax_values(float *scores, const float *v_base, int64_t stride, const int64_t *slots, int64_t n,
                           int64_t dim, float *out) {
    float best = -FLT_MAX;
    for (int64_t j = 0; j < n; ++j) best = scores[j] > best ? scores[j] : best;
    float total = 0.0f;
#pragma omp simd reduction(+ : total)
    for (int64_t j = 0; j < n; ++j) {
        scores[j] = expf(scores[j] - best);
        total += scores[j];
    }
    const float inv = 1.0f / total;
#if defined(__AVX512F__)
    if (dim % 16 == 0 && dim <= 256) { /* the output stays in registers across the keys */
        __m512 acc[16];
        for (int64_t i = 0; i < dim / 16; ++i) acc[i] = _mm512_setzero_ps();
        for (int64_t j = 0; j < n; ++j) {
            const __m512 p = _mm512_set1_ps(scores[j]);
            const float *v = v_base + slots[j] * stride;
            for (int64_t i = 0; i < dim / 16; ++i) acc[i] = _mm512_fmadd_ps(p, _mm512_loadu_ps(v + 16 * i), acc[i]);
        }
        for (int64_t i = 0; i < dim / 16; ++i) _mm512_storeu_ps(out + 16 * i, _mm512_mul_ps(acc[i], _mm512_set1_ps(inv)));
        return;
    }
#endif
    for (int64_t i = 0; i < dim; ++i) out[i] = 0.0f;
    for (int64_t j = 0; j < n; ++j) {
        const float p = scores[j];
        const float *v = v_base + slots[j] * stride;
#pragma omp simd
        for (int64_t i = 0; i < dim; ++i) out[i] += p * v[i];
    }
#pragma omp simd
    for (int64_t i = 0; i < dim; ++i) out[i] *= inv;
}

/* Under tensor parallelism, the sum of a block's output over the ranks: the calling thread runs it while the
 * region's other threads wait (every thread calls this). Returns *rc, shared, set to -3 when the sum failed. */
static int sum_over_ranks(tm_reduce_fn reduce, void *reduce_ctx, float *delta, int64_t n, int *rc) {
    if (reduce) { /* the same branch on every thread */
#pragma omp master
        if (reduce(reduce_ctx, delta, n)) *rc = -3;
#pragma omp barrier
    }
    return *rc;
}

/* One row's residual addition: ht += delta (normalized in place first when the layer has a norm there) */
static inline void add_to_residual(float *ht, float *dt, const float *norm, float eps, int64_t h) {
    if (norm) rms_norm(dt, norm, eps, h, dt);
#pragma omp simd
    for (int64_t i = 0; i < h; ++i) ht[i] += dt[i];
}

/* One decoder layer. hidden [m, h] is updated in place (both residual additions). The K/V of each token go to
 * its slot in the caches before attention; token t then attends to the ctx_lens[t] cache slots listed in
 * ctx_slots[t * max_ctx ...] (its own position last). One parallel region: the threads share out the rows (norms,
 * rope, SwiGLU: each row on one thread, with the code it has alone), the activation blocks, the weight groups and
 * the (row, head) pairs of attention; `reduce` runs on the calling thread. */
static int decode_layer(float *hidden, int64_t m, int64_t h, const tm_llama_layer *layer, float eps,
                        const float *cos_full, const float *sin_signed, const int64_t *slot_mapping,
                        const int64_t *ctx_slots, const int64_t *ctx_lens, int64_t max_ctx, int64_t heads,
                        int64_t kv_heads, int64_t dim, float scale, int64_t activation, tm_reduce_fn reduce,
                        void *reduce_ctx, const tm_scratch *s) {
    const tm_packed_weight *qkv = &layer->qkv, *o = &layer->o, *gate_up = &layer->gate_up, *down = &layer->down;
    const float *norm1 = layer->norm1, *norm2 = layer->norm2;
    float *k_cache = layer->k_cache, *v_cache = layer->v_cache;
    const int64_t q_size = heads * dim, kv_size = kv_heads * dim, inter = gate_up->n / 2;
    float *x = s->x, *qkv_out = s->qkv_out, *attn = s->attn, *gu = s->gu, *delta = s->delta, *scores = s->scores;
    const int64_t group = heads / kv_heads;
    int rc = 0; /* shared; read only after a barrier */
#pragma omp parallel
    {
        /* attention block */
#pragma omp for schedule(static)
        for (int64_t t = 0; t < m; ++t) rms_norm(hidden + t * h, norm1, eps, h, x + t * h);
        project(x, m, qkv, s, qkv_out);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < m; ++t) {
            float *row = qkv_out + t * qkv->n;
            if (layer->q_norm) { /* each head normalized on its own (in place), before rope */
                for (int64_t hd = 0; hd < heads; ++hd) rms_norm(row + hd * dim, layer->q_norm, eps, dim, row + hd * dim);
                for (int64_t hd = heads; hd < heads + kv_heads; ++hd)
                    rms_norm(row + hd * dim, layer->k_norm, eps, dim, row + hd * dim);
            }
            for (int64_t hd = 0; hd < heads + kv_heads; ++hd)
                rope_head(row + hd * dim, cos_full + t * dim, sin_signed + t * dim, dim);
            memcpy(k_cache + slot_mapping[t] * kv_size, row + q_size, sizeof(float) * kv_size);
            memcpy(v_cache + slot_mapping[t] * kv_size, row + q_size + kv_size, sizeof(float) * kv_size);
        }
#pragma omp for schedule(static)
        for (int64_t th = 0; th < m * heads; ++th) {
            const int64_t t = th / heads, hd = th % heads, kvh = hd / group;
            /* a local layer's query sees the last `window` slots of its context (its own position last) */
            const int64_t skip = layer->window > 0 && ctx_lens[t] > layer->window ? ctx_lens[t] - layer->window : 0;
            const int64_t n_ctx = ctx_lens[t] - skip;
            const float *q = qkv_out + t * qkv->n + hd * dim;
            float *sc = scores + th * max_ctx;
            const int64_t *slots = ctx_slots + t * max_ctx + skip;
            qk_scores(q, k_cache + kvh * dim, kv_size, slots, n_ctx, dim, scale, sc);
            softmax_values(sc, v_cache + kvh * dim, kv_size, slots, n_ctx, dim, attn + t * q_size + hd * dim);
        }
        project(attn, m, o, s, delta);
        if (sum_over_ranks(reduce, reduce_ctx, delta, m * h, &rc) == 0) {
#pragma omp for schedule(static)
            for (int64_t t = 0; t < m; ++t) {
                add_to_residual(hidden + t * h, delta + t * h, layer->post_attn_norm, eps, h);
                /* MLP block */
                rms_norm(hidden + t * h, norm2, eps, h, x + t * h);
            }
            project(x, m, gate_up, s, gu);
#pragma omp for schedule(static)
            for (int64_t t = 0; t < m; ++t) {
                const float *g = gu + t * gate_up->n, *u = g + inter;
                float *a = x + t * inter;
                if (activation == TM_GELU_TANH) {
#pragma omp simd
                    for (int64_t i = 0; i < inter; ++i) {
                        const float v = g[i];
                        a[i] = 0.5f * v * (1.0f + tanhf(0.7978845608028654f * (v + 0.044715f * v * v * v))) * u[i];
                    }
                } else {
#pragma omp simd
                    for (int64_t i = 0; i < inter; ++i) a[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
                }
            }
            project(x, m, down, s, delta);
            if (sum_over_ranks(reduce, reduce_ctx, delta, m * h, &rc) == 0) {
#pragma omp for schedule(static)
                for (int64_t t = 0; t < m; ++t)
                    add_to_residual(hidden + t * h, delta + t * h, layer->post_mlp_norm, eps, h);
            }
        }
    }
    return rc;
}

/* Every decoder layer for m decode tokens (one call per step). Under tensor parallelism the layers are one rank's
 * shards and `reduce` (else NULL) sums the output and down projections' partial results over the ranks, in
 * place, with `reduce_ctx`. cos_full/sin_signed: [m, dim] rope tables of the rows' positions; local_cos_full and
 * local_sin_signed those of the layers with local_rope set (may be the same). The layers with a window read
 * local_slot_mapping and local_ctx_slots (their own pool's slots; may be the same as the others').
 * activation: TM_SILU or TM_GELU_TANH.
 * Returns 0, or a negative code on bad sizes or exhausted memory (-2) or a failed reduce (-3). */
int tm_llama_decode(float *hidden, int64_t m, int64_t h, const tm_llama_layer *layers, int64_t n_layers, float eps,
                    const float *cos_full, const float *sin_signed, const float *local_cos_full,
                    const float *local_sin_signed, const int64_t *slot_mapping, const int64_t *ctx_slots,
                    const int64_t *local_slot_mapping, const int64_t *local_ctx_slots, const int64_t *ctx_lens,
                    int64_t max_ctx, int64_t heads, int64_t kv_heads, int64_t dim,
                    float scale, int64_t activation, tm_reduce_fn reduce, void *reduce_ctx) {
    if (n_layers < 1 || dim > 512 || dim % 2 || heads % kv_heads || (activation != TM_SILU && activation != TM_GELU_TANH))
        return -1;
    for (int64_t l = 0; l < n_layers; ++l) {
        const tm_packed_weight *w[4] = {&layers[l].qkv, &layers[l].o, &layers[l].gate_up, &layers[l].down};
        for (int i = 0; i < 4; ++i)
            if (w[i]->n % GROUP || w[i]->k % QK || (w[i]->bits != 4 && w[i]->bits != 8) || (w[i]->bits == 4 && !w[i]->m))
                return -1;
    }
    const int64_t inter = layers[0].gate_up.n / 2;
    int64_t widest = h > inter ? h : inter;
    widest = widest > heads * dim ? widest : heads * dim;
    tm_scratch s;
    s.x = malloc(sizeof(float) * m * (h > inter ? h : inter));
    s.qkv_out = malloc(sizeof(float) * m * layers[0].qkv.n);
    s.attn = malloc(sizeof(float) * m * heads * dim);
    s.gu = malloc(sizeof(float) * m * layers[0].gate_up.n);
    s.delta = malloc(sizeof(float) * m * h);
    s.scores = malloc(sizeof(float) * m * heads * (max_ctx > 0 ? max_ctx : 1));
    int rc = qx_alloc(&s.qx, m, widest);
    if (!s.x || !s.qkv_out || !s.attn || !s.gu || !s.delta || !s.scores) rc = -2;
    for (int64_t l = 0; rc == 0 && l < n_layers; ++l)
        rc = decode_layer(hidden, m, h, &layers[l], eps, layers[l].local_rope ? local_cos_full : cos_full,
                          layers[l].local_rope ? local_sin_signed : sin_signed,
                          layers[l].window > 0 ? local_slot_mapping : slot_mapping,
                          layers[l].window > 0 ? local_ctx_slots : ctx_slots, ctx_lens, max_ctx, heads, kv_heads,
                          dim, scale, activation, reduce, reduce_ctx, &s);
    free(s.x); free(s.qkv_out); free(s.attn); free(s.gu); free(s.delta); free(s.scores);
    qx_free(&s.qx);
    return rc;
}
