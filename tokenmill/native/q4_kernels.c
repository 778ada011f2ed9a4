/* Matrix products with 4-bit weights for decode-sized batches (a few rows of activations).
 *
 * Weights are stored as GGUF's Q4_1 stores them, per row, per block of 32 input values:
 *   w[j] = d * q[j] + m,  q in 0..15,  byte i of a block holds q[i] (low nibble) and q[i + 16] (high nibble);
 * with d and m kept as float32 (GGUF stores them as half floats). Each weight block is dequantized in registers (w = q * d + m) and multiplied
 * into per-row vector accumulators, which are summed once per output: no reductions in the inner loop.
 * Activations stay float32 (no activation quantization, unlike llama.cpp).
 *
 * Vector paths: AVX-512 (16 floats), AVX2 + FMA (8 floats), and portable C; the compiler picks with
 * -march=native. Threads: OpenMP over output rows; tokenmill loads this library after torch, so
 * `libgomp.so.1` resolves to torch's copy and both share one thread pool.
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

#define QK 32
#define ROWS_PER_PASS 4 /* activation rows whose accumulators stay in registers */

void tm_set_threads(int n) { omp_set_num_threads(n); }

#if defined(__AVX512F__)
/* one block: 16 bytes of codes -> the 32 weights d * q + m, as two 16-float vectors. The block's 16 possible
 * weights are computed once (lut[c] = c * d + m, the same fused multiply-add as dequantizing each code), then
 * every code picks its weight with a lane permute, which reads only the low 4 bits of each index: byte i
 * widened to 32 bits indexes the low nibble (code i) as is, and shifted right by 4 the high one (code i + 16).
 * Five vector instructions per block instead of nine for converting each code to float and scaling it. */
static inline __attribute__((always_inline)) void dequant16x2(const uint8_t *q, float d, float m, __m512 *lo,
                                                              __m512 *hi) {
    const __m512 iota = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512 lut = _mm512_fmadd_ps(iota, _mm512_set1_ps(d), _mm512_set1_ps(m));
    const __m512i codes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)q));
    *lo = _mm512_permutexvar_ps(codes, lut);
    *hi = _mm512_permutexvar_ps(_mm512_srli_epi32(codes, 4), lut);
}
#endif

/* out[t] = one output for activation rows t0 + t, t < mt <= ROWS_PER_PASS. Always inlined with a constant mt (see the switch
 * below), so the loops over t unroll and the accumulators live in registers. */
static inline __attribute__((always_inline)) void q4_row(const float *x, int64_t t0, const int mt, int64_t k,
                                                         const uint8_t *qrow, const float *drow, const float *mrow,
                                                         int64_t nb, float *out) {
#if defined(__AVX512F__)
    /* blocks are taken two at a time into separate accumulators, so that the multiply-add chains overlap
     * instead of waiting on each other's latency */
    __m512 acc0[ROWS_PER_PASS], acc1[ROWS_PER_PASS], acc2[ROWS_PER_PASS], acc3[ROWS_PER_PASS];
    for (int t = 0; t < ROWS_PER_PASS; ++t) acc0[t] = acc1[t] = acc2[t] = acc3[t] = _mm512_setzero_ps();
    int64_t b = 0;
    for (; b + 1 < nb; b += 2) {
        __m512 wa_lo, wa_hi, wb_lo, wb_hi;
        dequant16x2(qrow + b * (QK / 2), drow[b], mrow[b], &wa_lo, &wa_hi);
        dequant16x2(qrow + (b + 1) * (QK / 2), drow[b + 1], mrow[b + 1], &wb_lo, &wb_hi);
        for (int t = 0; t < mt; ++t) {
            const float *xb = x + (t0 + t) * k + b * QK;
            acc0[t] = _mm512_fmadd_ps(wa_lo, _mm512_loadu_ps(xb), acc0[t]);
            acc1[t] = _mm512_fmadd_ps(wa_hi, _mm512_loadu_ps(xb + 16), acc1[t]);
            acc2[t] = _mm512_fmadd_ps(wb_lo, _mm512_loadu_ps(xb + 32), acc2[t]);
            acc3[t] = _mm512_fmadd_ps(wb_hi, _mm512_loadu_ps(xb + 48), acc3[t]);
        }
    }
    if (b < nb) {
        __m512 wa_lo, wa_hi;
        dequant16x2(qrow + b * (QK / 2), drow[b], mrow[b], &wa_lo, &wa_hi);
        for (int t = 0; t < mt; ++t) {
            const float *xb = x + (t0 + t) * k + b * QK;
            acc0[t] = _mm512_fmadd_ps(wa_lo, _mm512_loadu_ps(xb), acc0[t]);
            acc1[t] = _mm512_fmadd_ps(wa_hi, _mm512_loadu_ps(xb + 16), acc1[t]);
        }
    }
    for (int t = 0; t < mt; ++t) {
        const __m512 s = _mm512_add_ps(_mm512_add_ps(acc0[t], acc1[t]), _mm512_add_ps(acc2[t], acc3[t]));
        out[t] = _mm512_reduce_add_ps(s);
    }
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 acc[ROWS_PER_PASS][4];
    for (int t = 0; t < ROWS_PER_PASS; ++t)
        for (int i = 0; i < 4; ++i) acc[t][i] = _mm256_setzero_ps();
    const __m128i low_mask = _mm_set1_epi8(0x0F);
    for (int64_t b = 0; b < nb; ++b) {
        const __m128i bytes = _mm_loadu_si128((const __m128i *)(qrow + b * (QK / 2)));
        const __m128i lo_q = _mm_and_si128(bytes, low_mask);
        const __m128i hi_q = _mm_and_si128(_mm_srli_epi16(bytes, 4), low_mask);
        const __m256 vd = _mm256_set1_ps(drow[b]), vm = _mm256_set1_ps(mrow[b]);
        __m256 w[4];
        w[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo_q)), vd, vm);
        w[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo_q, 8))), vd, vm);
        w[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi_q)), vd, vm);
        w[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi_q, 8))), vd, vm);
        for (int t = 0; t < mt; ++t) {
            const float *xb = x + (t0 + t) * k + b * QK;
            for (int i = 0; i < 4; ++i) acc[t][i] = _mm256_fmadd_ps(w[i], _mm256_loadu_ps(xb + 8 * i), acc[t][i]);
        }
    }
    for (int t = 0; t < mt; ++t) {
        __m256 s = _mm256_add_ps(_mm256_add_ps(acc[t][0], acc[t][1]), _mm256_add_ps(acc[t][2], acc[t][3]));
        __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
        h = _mm_add_ps(h, _mm_movehl_ps(h, h));
        h = _mm_add_ss(h, _mm_movehdup_ps(h));
        out[t] = _mm_cvtss_f32(h);
    }
#else
    float acc[ROWS_PER_PASS][QK] = {{0}};
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t *q = qrow + b * (QK / 2);
        float w[QK];
        for (int j = 0; j < QK / 2; ++j) {
            w[j] = (float)(q[j] & 0x0F) * drow[b] + mrow[b];
            w[j + QK / 2] = (float)(q[j] >> 4) * drow[b] + mrow[b];
        }
        for (int t = 0; t < mt; ++t)
            for (int j = 0; j < QK; ++j) acc[t][j] += w[j] * x[(t0 + t) * k + b * QK + j];
    }
    for (int t = 0; t < mt; ++t) {
        float s = 0.0f;
        for (int j = 0; j < QK; ++j) s += acc[t][j];
        out[t] = s;
    }
#endif
}

/* x: [m, k] float32, row-major; qs: [n, k/32, 16] uint8; d, mn: [n, k/32] float32; y: [m, n] float32.
 * (Scales stay float32: rows are short (k/32 blocks), and converting half floats per row cost more time than
 * the 13 MB they would save.) */
void tm_q4_matmul(const float *x, int64_t m, int64_t k, const uint8_t *qs, const float *d, const float *mn,
                  int64_t n, float *y) {
    const int64_t nb = k / QK;
#pragma omp parallel for schedule(static)
    for (int64_t row = 0; row < n; ++row) {
        const uint8_t *qrow = qs + row * nb * (QK / 2);
        const float *drow = d + row * nb, *mrow = mn + row * nb;
        for (int64_t t0 = 0; t0 < m; t0 += ROWS_PER_PASS) {
            float part[ROWS_PER_PASS];
            const int64_t mt = m - t0 < ROWS_PER_PASS ? m - t0 : ROWS_PER_PASS;
            switch (mt) {
            case 1: q4_row(x, t0, 1, k, qrow, drow, mrow, nb, part); break;
            case 2: q4_row(x, t0, 2, k, qrow, drow, mrow, nb, part); break;
            case 3: q4_row(x, t0, 3, k, qrow, drow, mrow, nb, part); break;
            default: q4_row(x, t0, 4, k, qrow, drow, mrow, nb, part); break;
            }
            for (int64_t t = 0; t < mt; ++t) y[(t0 + t) * n + row] = part[t];
        }
    }
}

/* ---- 8-bit weights (GGUF's Q8_0: w = d * q, q int8, one scale d per block of 32, kept as float32) --------- */

#if defined(__AVX512F__)
/* out[t] = one output for activation rows t0 + t, t < mt <= ROWS_PER_PASS (inlined with a constant mt, as
 * q4_row). Per block, the codes are converted to float once for all rows; each row then takes
 * d * (q[0:16] . x[0:16] + q[16:32] . x[16:32]): three vector operations, the scale applied once per block
 * instead of to every weight. Blocks alternate between two accumulators so their chains overlap. */
static inline __attribute__((always_inline)) void q8_row(const float *x, int64_t t0, const int mt, int64_t k,
                                                         const int8_t *qrow, const float *drow, int64_t nb,
                                                         float *out) {
    __m512 acc[2][ROWS_PER_PASS];
    for (int t = 0; t < ROWS_PER_PASS; ++t) acc[0][t] = acc[1][t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        const __m512 w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(qrow + b * QK))));
        const __m512 w1 =
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(qrow + b * QK + 16))));
        const __m512 vd = _mm512_set1_ps(drow[b]);
        for (int t = 0; t < mt; ++t) {
            const float *xb = x + (t0 + t) * k + b * QK;
            const __m512 p = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xb + 16), _mm512_mul_ps(w0, _mm512_loadu_ps(xb)));
            acc[b & 1][t] = _mm512_fmadd_ps(p, vd, acc[b & 1][t]);
        }
    }
    for (int t = 0; t < mt; ++t) out[t] = _mm512_reduce_add_ps(_mm512_add_ps(acc[0][t], acc[1][t]));
}
#else
static inline void q8_row(const float *x, int64_t t0, const int mt, int64_t k, const int8_t *qrow,
                          const float *drow, int64_t nb, float *out) {
    for (int t = 0; t < mt; ++t) {
        const float *xt = x + (t0 + t) * k;
        float acc = 0.0f;
        for (int64_t b = 0; b < nb; ++b) {
            float s = 0.0f;
#pragma omp simd reduction(+ : s)
            for (int j = 0; j < QK; ++j) s += (float)qrow[b * QK + j] * xt[b * QK + j];
            acc += drow[b] * s;
        }
        out[t] = acc;
    }
}
#endif

/* x: [m, k] float32; qs: [n, k] int8; d: [n, k/32] float32; y: [m, n] float32 */
void tm_q8_matmul(const float *x, int64_t m, int64_t k, const int8_t *qs, const float *d, int64_t n, float *y) {
    const int64_t nb = k / QK;
#pragma omp parallel for schedule(static)
    for (int64_t row = 0; row < n; ++row) {
        const int8_t *qrow = qs + row * k;
        const float *drow = d + row * nb;
        for (int64_t t0 = 0; t0 < m; t0 += ROWS_PER_PASS) {
            float part[ROWS_PER_PASS];
            const int64_t mt = m - t0 < ROWS_PER_PASS ? m - t0 : ROWS_PER_PASS;
            switch (mt) {
            case 1: q8_row(x, t0, 1, k, qrow, drow, nb, part); break;
            case 2: q8_row(x, t0, 2, k, qrow, drow, nb, part); break;
            case 3: q8_row(x, t0, 3, k, qrow, drow, nb, part); break;
            default: q8_row(x, t0, 4, k, qrow, drow, nb, part); break;
            }
            for (int64_t t = 0; t < mt; ++t) y[(t0 + t) * n + row] = part[t];
        }
    }
}

/* ---- one decoder layer of a llama-style model, for a few decode tokens ------------------------------------ */

typedef struct {
    const uint8_t *qs; /* [n, k/32, 16] codes */
    const float *d;    /* [n, k/32] block scales */
    const float *m;    /* [n, k/32] block minimums */
    int64_t n, k;      /* output and input features */
} tm_q4_weight;

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
    tm_q4_weight qkv, o, gate_up, down;          /* projections (gate_up: gate rows, then up rows) */
    float *k_cache, *v_cache;                    /* [slots, kv_heads, dim] */
} tm_llama_layer;

typedef struct {
    float *x, *qkv_out, *attn, *gu, *delta, *scores;
} tm_scratch;

/* One decoder layer. hidden [m, h] is updated in place (both residual additions). The K/V of each token go to
 * its slot in the caches before attention; token t then attends to the ctx_lens[t] cache slots listed in
 * ctx_slots[t * max_ctx ...] (its own position last). */
static void decode_layer(float *hidden, int64_t m, int64_t h, const tm_llama_layer *layer, float eps,
                         const float *cos_full, const float *sin_signed, const int64_t *slot_mapping,
                         const int64_t *ctx_slots, const int64_t *ctx_lens, int64_t max_ctx, int64_t heads,
                         int64_t kv_heads, int64_t dim, float scale, const tm_scratch *s) {
    const tm_q4_weight *qkv = &layer->qkv, *o = &layer->o, *gate_up = &layer->gate_up, *down = &layer->down;
    const float *norm1 = layer->norm1, *norm2 = layer->norm2;
    float *k_cache = layer->k_cache, *v_cache = layer->v_cache;
    const int64_t q_size = heads * dim, kv_size = kv_heads * dim, inter = gate_up->n / 2;
    float *x = s->x, *qkv_out = s->qkv_out, *attn = s->attn, *gu = s->gu, *delta = s->delta, *scores = s->scores;
    /* attention block */
    for (int64_t t = 0; t < m; ++t) rms_norm(hidden + t * h, norm1, eps, h, x + t * h);
    tm_q4_matmul(x, m, h, qkv->qs, qkv->d, qkv->m, qkv->n, qkv_out);
    for (int64_t t = 0; t < m; ++t) {
        float *row = qkv_out + t * qkv->n;
        for (int64_t hd = 0; hd < heads + kv_heads; ++hd) rope_head(row + hd * dim, cos_full + t * dim, sin_signed + t * dim, dim);
        memcpy(k_cache + slot_mapping[t] * kv_size, row + q_size, sizeof(float) * kv_size);
        memcpy(v_cache + slot_mapping[t] * kv_size, row + q_size + kv_size, sizeof(float) * kv_size);
    }
    const int64_t group = heads / kv_heads;
#pragma omp parallel for schedule(static)
    for (int64_t th = 0; th < m * heads; ++th) {
        const int64_t t = th / heads, hd = th % heads, kvh = hd / group, n_ctx = ctx_lens[t];
        const float *q = qkv_out + t * qkv->n + hd * dim;
        float *sc = scores + th * max_ctx;
        float best = -FLT_MAX;
        for (int64_t j = 0; j < n_ctx; ++j) {
            const float *kv = k_cache + ctx_slots[t * max_ctx + j] * kv_size + kvh * dim;
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int64_t i = 0; i < dim; ++i) dot += q[i] * kv[i];
            sc[j] = dot * scale;
            if (sc[j] > best) best = sc[j];
        }
        float total = 0.0f;
#pragma omp simd reduction(+ : total)
        for (int64_t j = 0; j < n_ctx; ++j) {
            sc[j] = expf(sc[j] - best);
            total += sc[j];
        }
        float *out = attn + t * q_size + hd * dim;
        for (int64_t i = 0; i < dim; ++i) out[i] = 0.0f;
        for (int64_t j = 0; j < n_ctx; ++j) {
            const float p = sc[j] / total;
            const float *vv = v_cache + ctx_slots[t * max_ctx + j] * kv_size + kvh * dim;
#pragma omp simd
            for (int64_t i = 0; i < dim; ++i) out[i] += p * vv[i];
        }
    }
    tm_q4_matmul(attn, m, q_size, o->qs, o->d, o->m, o->n, delta);
#pragma omp simd
    for (int64_t i = 0; i < m * h; ++i) hidden[i] += delta[i];
    /* MLP block */
    for (int64_t t = 0; t < m; ++t) rms_norm(hidden + t * h, norm2, eps, h, x + t * h);
    tm_q4_matmul(x, m, h, gate_up->qs, gate_up->d, gate_up->m, gate_up->n, gu);
    for (int64_t t = 0; t < m; ++t) {
        const float *g = gu + t * gate_up->n, *u = g + inter;
        float *a = x + t * inter;
#pragma omp simd
        for (int64_t i = 0; i < inter; ++i) a[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
    tm_q4_matmul(x, m, inter, down->qs, down->d, down->m, down->n, delta);
#pragma omp simd
    for (int64_t i = 0; i < m * h; ++i) hidden[i] += delta[i];
}

/* Every decoder layer for m decode tokens (one call per step). Returns 0, or a negative code on bad sizes or
 * exhausted memory. */
int tm_llama_decode(float *hidden, int64_t m, int64_t h, const tm_llama_layer *layers, int64_t n_layers, float eps,
                    const float *cos_full, const float *sin_signed, const int64_t *slot_mapping,
                    const int64_t *ctx_slots, const int64_t *ctx_lens, int64_t max_ctx, int64_t heads,
                    int64_t kv_heads, int64_t dim, float scale) {
    if (n_layers < 1 || dim > 512 || dim % 2 || heads % kv_heads) return -1;
    const int64_t inter = layers[0].gate_up.n / 2;
    tm_scratch s;
    s.x = malloc(sizeof(float) * m * (h > inter ? h : inter));
    s.qkv_out = malloc(sizeof(float) * m * layers[0].qkv.n);
    s.attn = malloc(sizeof(float) * m * heads * dim);
    s.gu = malloc(sizeof(float) * m * layers[0].gate_up.n);
    s.delta = malloc(sizeof(float) * m * h);
    s.scores = malloc(sizeof(float) * m * heads * (max_ctx > 0 ? max_ctx : 1));
    int rc = 0;
    if (!s.x || !s.qkv_out || !s.attn || !s.gu || !s.delta || !s.scores) rc = -2;
    for (int64_t l = 0; rc == 0 && l < n_layers; ++l)
        decode_layer(hidden, m, h, &layers[l], eps, cos_full, sin_signed, slot_mapping, ctx_slots, ctx_lens, max_ctx,
                     heads, kv_heads, dim, scale, &s);
    free(s.x); free(s.qkv_out); free(s.attn); free(s.gu); free(s.delta); free(s.scores);
    return rc;
}
