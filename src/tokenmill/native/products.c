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
#include "kernels.h"

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

/* Called by every thread of a parallel region (the blocks are shared out), or outside one (one thread does all). */
void tm_quantize_rows(const float *x, int64_t m, int64_t k, const tm_qx *a) {
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
void tm_grouped_matmul(const tm_qx *a, int64_t m, int64_t k, int bits, const uint8_t *qs, const uint16_t *d,
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

int tm_qx_alloc(tm_qx *a, int64_t m, int64_t k) {
    a->hi = malloc((size_t)(m * k));
    a->lo = malloc((size_t)(m * k));
    a->scale = malloc(sizeof(float) * m * (k / QK));
    a->sum = malloc(sizeof(float) * m * (k / QK));
    a->sum_hi = malloc(sizeof(int32_t) * m * (k / QK));
    a->sum_lo = malloc(sizeof(int32_t) * m * (k / QK));
    return a->hi && a->lo && a->scale && a->sum && a->sum_hi && a->sum_lo ? 0 : -2;
}

void tm_qx_free(tm_qx *a) {
    free(a->hi); free(a->lo); free(a->scale); free(a->sum); free(a->sum_hi); free(a->sum_lo);
}

static int product(const float *x, int64_t m, int64_t k, int bits, const uint8_t *qs, const uint16_t *d,
                   const uint16_t *mn, int64_t n, float *y) {
    tm_qx a;
    int rc = tm_qx_alloc(&a, m, k);
    if (rc == 0) {
#pragma omp parallel
        {
            tm_quantize_rows(x, m, k, &a); /* the end of its loop waits for every thread */
            tm_grouped_matmul(&a, m, k, bits, qs, d, mn, n, y);
        }
    }
    tm_qx_free(&a);
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
