/* The decoder layers of a llama model for the tokens of a decode step: norms, projections (products.c, any of
 * its weight types and parts), Q/K/V biases, rope, the KV-cache write, attention over the paged cache (with
 * gpt-oss's sinks) and the MLP or a mixture of experts, one team of threads per step (pool.c). */
#include "kernels.h"
#include "kv_elements.h"

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

/* the MLP's gate activation (tm_llama_model.activation): layers/activation.py's */
enum { TM_SILU = 0, TM_GELU_TANH = 1, TM_SWIGLU_OAI = 2 };
#define SWIGLU_OAI_ALPHA 1.702f
#define SWIGLU_OAI_LIMIT 7.0f

/* a[i] = act(g[i]) * u[i] for i < inter (gpt-oss: its clamps, its sharper sigmoid, and the up half plus 1) */
static void gated(int64_t activation, const float *g, const float *u, float *a, int64_t inter) {
    if (activation == TM_GELU_TANH) {
#pragma omp simd
        for (int64_t i = 0; i < inter; ++i) {
            const float v = g[i];
            a[i] = 0.5f * v * (1.0f + tanhf(0.7978845608028654f * (v + 0.044715f * v * v * v))) * u[i];
        }
    } else if (activation == TM_SWIGLU_OAI) {
#pragma omp simd
        for (int64_t i = 0; i < inter; ++i) {
            const float v = fminf(g[i], SWIGLU_OAI_LIMIT), up = fmaxf(fminf(u[i], SWIGLU_OAI_LIMIT), -SWIGLU_OAI_LIMIT);
            a[i] = (up + 1.0f) * (v / (1.0f + expf(-SWIGLU_OAI_ALPHA * v)));
        }
    } else {
#pragma omp simd
        for (int64_t i = 0; i < inter; ++i) a[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

/* A mixture's scratch: each token's (token, choice) pairs gathered by expert into rows of their own, each expert's
 * rows a segment, so that one product runs all chosen experts' weights over their rows (tm_segments_matmul) */
typedef struct {
    float *logits;               /* [m, n_experts] the router's */
    int64_t *expert;             /* [m, k] each token's experts, ascending */
    float *weight;               /* [m, k] their weights */
    int64_t *row;                /* [m, k] the gathered row of each */
    float *shared_weight;        /* [m] sigmoid(x . shared_gate) */
    int64_t *token_of, *expert_of; /* [m * k] each gathered row's token and expert */
    int64_t *count;              /* [n_experts] */
    tm_segment *segments;        /* [at most min(n_experts, m * k)] the chosen experts' (their gate/up weights, then
                                  * their downs: the same rows) */
    int64_t n_segments, rows;    /* this layer's */
    float *x, *gu, *act, *y;     /* [rows, h], [rows, 2 inter], [rows, inter], [rows, h] */
    float *shared;               /* [m, h] the shared expert's output */
    tm_qx qx;                    /* [rows, max(h, inter)] */
} tm_moe_scratch;

typedef struct {
    float *x, *qkv_out, *attn, *gu, *delta, *scores;
    float *partials; /* a long context's pieces: [m * heads * pieces, 2 + dim] (max, total, unnormalized sum) */
    tm_qx qx;       /* the quantized input of the current projection, [m, max(h, heads * dim, inter)] */
    int64_t passes; /* of the activations' quantization */
    tm_moe_scratch e; /* the mixtures' (allocated where the model has one) */
} tm_scratch;

/* y = x @ w.T through the scratch's quantized activations: two jobs of the step's team */
static void project(const float *x, int64_t m, const tm_weight *w, const tm_scratch *s, float *y) {
    tm_quantize_rows(x, m, w->parts[0].k, s->passes, tm_activation_group(w, s->passes), &s->qx);
    tm_weight_matmul(&s->qx, m, s->passes, w, y);
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
#elif defined(__AVX2__)
/* The sums of 8 vectors' lanes, as one vector in the vectors' order (three rounds of horizontal additions, then
 * the two 128-bit halves' partial sums added) */
static inline __m256 sum_lanes8(const __m256 v[8]) {
    const __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    /* a's lane i < 4: vector i's sum over its lower half, lane 4 + i over its upper half; b likewise for 4 + i */
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}
#endif

/* scores[j] = scale * q . k_j for the n keys at k_base + slots[j] * stride bytes (dim each, of type T; an int8
 * key times its own scale) */
ALWAYS_INLINE void qk_scores_of(const float *q, const void *k_base, int64_t stride, const int64_t *slots, int64_t n,
                                int64_t dim, float scale, float *scores, const int T) {
    const int64_t element = tm_kv_element_bytes(T);
    int64_t j = 0;
#if defined(__AVX512F__)
    if (dim % 16 == 0 && dim <= 256) {
        __m512 qv[16];
        for (int64_t i = 0; i < dim / 16; ++i) qv[i] = _mm512_loadu_ps(q + 16 * i);
        for (; j < n; j += 16) {
            __m512 dots[16]; /* per key, the products of q and k summed into 16 lanes */
            float key_scales[16];
            for (int key = 0; key < 16; ++key) {
                dots[key] = _mm512_setzero_ps();
                key_scales[key] = 0.0f;
                if (j + key >= n) continue;
                const char *k = (const char *)k_base + slots[j + key] * stride;
                for (int64_t i = 0; i < dim / 16; ++i)
                    dots[key] = _mm512_fmadd_ps(qv[i], kv_load16(k + 16 * i * element, T), dots[key]);
                key_scales[key] = kv_scale(k, dim, T) * scale;
            }
            const __m512 sums = _mm512_mul_ps(sum_lanes16(dots), _mm512_loadu_ps(key_scales));
            _mm512_mask_storeu_ps(scores + j, n - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - j)) - 1), sums);
        }
        return;
    }
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    if (dim % 8 == 0) {
        for (; j < n; j += 8) {
            __m256 dots[8]; /* per key, the products of q and k summed into 8 lanes */
            float key_scales[8];
            for (int key = 0; key < 8; ++key) {
                dots[key] = _mm256_setzero_ps();
                key_scales[key] = 0.0f;
                if (j + key >= n) continue;
                const char *k = (const char *)k_base + slots[j + key] * stride;
                for (int64_t i = 0; i < dim / 8; ++i)
                    dots[key] = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8 * i), kv_load8(k + 8 * i * element, T), dots[key]);
                key_scales[key] = kv_scale(k, dim, T) * scale;
            }
            float sums[8];
            _mm256_storeu_ps(sums, _mm256_mul_ps(sum_lanes8(dots), _mm256_loadu_ps(key_scales)));
            for (int key = 0; key < 8 && j + key < n; ++key) scores[j + key] = sums[key];
        }
        return;
    }
#endif
    for (; j < n; ++j) {
        const void *k = (const char *)k_base + slots[j] * stride;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t i = 0; i < dim; ++i) dot += q[i] * kv_get(k, i, T);
        scores[j] = dot * (kv_scale(k, dim, T) * scale);
    }
}

static void qk_scores(const float *q, const void *k_base, int64_t stride, const int64_t *slots, int64_t n,
                      int64_t dim, float scale, float *scores, int64_t kv_dtype) {
    if (kv_dtype == TM_KV_F16) qk_scores_of(q, k_base, stride, slots, n, dim, scale, scores, TM_KV_F16);
    else if (kv_dtype == TM_KV_BF16) qk_scores_of(q, k_base, stride, slots, n, dim, scale, scores, TM_KV_BF16);
    else if (kv_dtype == TM_KV_I8) qk_scores_of(q, k_base, stride, slots, n, dim, scale, scores, TM_KV_I8);
    else qk_scores_of(q, k_base, stride, slots, n, dim, scale, scores, TM_KV_F32);
}

/* out [dim] = softmax(scores [n]) . the n values at v_base + slots[j] * stride bytes (of type T; an int8 value
 * row times its own scale); scores are overwritten. With `stats`, one piece of a longer context: out gets the
 * values weighted by exp(score - max) without dividing by their total, and stats [2] the max and the total. With
 * `sink` (gpt-oss; not with stats), one more logit joins the softmax, a key without a value. */
ALWAYS_INLINE void softmax_values_of(float *scores, const void *v_base, int64_t stride, const int64_t *slots,
                                     int64_t n, int64_t dim, float *out, float *stats, const float *sink,
                                     const int T) {
    const int64_t element = tm_kv_element_bytes(T);
    float best = sink ? *sink : -FLT_MAX;
    for (int64_t j = 0; j < n; ++j) best = scores[j] > best ? scores[j] : best;
    float total = sink ? expf(*sink - best) : 0.0f;
#pragma omp simd reduction(+ : total)
    for (int64_t j = 0; j < n; ++j) {
        scores[j] = expf(scores[j] - best);
        total += scores[j];
    }
    const float inv = stats ? 1.0f : 1.0f / total;
    if (stats) {
        stats[0] = best;
        stats[1] = total;
    }
#if defined(__AVX512F__)
    if (dim % 16 == 0 && dim <= 256) { /* the output stays in registers across the keys */
        __m512 acc[16];
        for (int64_t i = 0; i < dim / 16; ++i) acc[i] = _mm512_setzero_ps();
        for (int64_t j = 0; j < n; ++j) {
            const char *v = (const char *)v_base + slots[j] * stride;
            const __m512 p = _mm512_set1_ps(scores[j] * kv_scale(v, dim, T));
            for (int64_t i = 0; i < dim / 16; ++i) acc[i] = _mm512_fmadd_ps(p, kv_load16(v + 16 * i * element, T), acc[i]);
        }
        for (int64_t i = 0; i < dim / 16; ++i) _mm512_storeu_ps(out + 16 * i, _mm512_mul_ps(acc[i], _mm512_set1_ps(inv)));
        return;
    }
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    if (dim % 8 == 0) { /* 64 outputs at a time stay in registers across the keys */
        for (int64_t i0 = 0; i0 < dim; i0 += 64) {
            const int64_t vecs = dim - i0 < 64 ? (dim - i0) / 8 : 8;
            __m256 acc[8];
            for (int64_t i = 0; i < vecs; ++i) acc[i] = _mm256_setzero_ps();
            for (int64_t j = 0; j < n; ++j) {
                const char *v = (const char *)v_base + slots[j] * stride;
                const __m256 p = _mm256_set1_ps(scores[j] * kv_scale(v, dim, T));
                for (int64_t i = 0; i < vecs; ++i)
                    acc[i] = _mm256_fmadd_ps(p, kv_load8(v + (i0 + 8 * i) * element, T), acc[i]);
            }
            for (int64_t i = 0; i < vecs; ++i)
                _mm256_storeu_ps(out + i0 + 8 * i, _mm256_mul_ps(acc[i], _mm256_set1_ps(inv)));
        }
        return;
    }
#endif
    for (int64_t i = 0; i < dim; ++i) out[i] = 0.0f;
    for (int64_t j = 0; j < n; ++j) {
        const void *v = (const char *)v_base + slots[j] * stride;
        const float p = scores[j] * kv_scale(v, dim, T);
#pragma omp simd
        for (int64_t i = 0; i < dim; ++i) out[i] += p * kv_get(v, i, T);
    }
#pragma omp simd
    for (int64_t i = 0; i < dim; ++i) out[i] *= inv;
}

static void softmax_values(float *scores, const void *v_base, int64_t stride, const int64_t *slots, int64_t n,
                           int64_t dim, float *out, float *stats, const float *sink, int64_t kv_dtype) {
    const int64_t t = kv_dtype;
    if (t == TM_KV_F16) softmax_values_of(scores, v_base, stride, slots, n, dim, out, stats, sink, TM_KV_F16);
    else if (t == TM_KV_BF16) softmax_values_of(scores, v_base, stride, slots, n, dim, out, stats, sink, TM_KV_BF16);
    else if (t == TM_KV_I8) softmax_values_of(scores, v_base, stride, slots, n, dim, out, stats, sink, TM_KV_I8);
    else softmax_values_of(scores, v_base, stride, slots, n, dim, out, stats, sink, TM_KV_F32);
}

/* Keys per piece of a long context (flash-decoding): a row's attention over more keys than this is split into
 * pieces of this many, each a job of the team, whose partial softmaxes are combined after (rescaled to the
 * largest max), so one long sequence keeps every thread busy however few its heads. A context of at most this
 * many keys is one piece, computed as before. The split depends on the row's own context only: its bits do not
 * depend on what else the step holds. */
#define TM_ATTN_PIECE 512

static inline int64_t attn_pieces(int64_t n) {
    return n <= TM_ATTN_PIECE ? 1 : (n + TM_ATTN_PIECE - 1) / TM_ATTN_PIECE;
}

/* One row's residual addition: ht += delta (normalized in place first when the layer has a norm there) */
static inline void add_to_residual(float *ht, float *dt, const float *norm, float eps, int64_t h) {
    if (norm) rms_norm(dt, norm, eps, h, dt);
#pragma omp simd
    for (int64_t i = 0; i < h; ++i) ht[i] += dt[i];
}

/* What a step's layers share (tm_llama_decode's arguments and scratch), and the layer now computed */
typedef struct {
    float *hidden;
    int64_t m, h, heads, kv_heads, dim, max_ctx, activation;
    int64_t pieces; /* of the longest context (attn_pieces(max_ctx)): attention's jobs are (row, head, piece) */
    int64_t piece_keys; /* the scores scratch of one job: max_ctx keys with one piece, else TM_ATTN_PIECE */
    float eps, scale;
    const int64_t *ctx_lens;
    tm_reduce_fn reduce;
    void *reduce_ctx;
    tm_scratch s;
    /* the layer's */
    const tm_llama_layer *layer;
    const float *cos_full, *sin_signed;
    const int64_t *slot_mapping, *ctx_slots;
} step_ctx;

/* rows [t0, t1): the attention block's input norm */
static void rows_norm1(void *p, int64_t t0, int64_t t1) {
    const step_ctx *c = p;
    for (int64_t t = t0; t < t1; ++t) rms_norm(c->hidden + t * c->h, c->layer->norm1, c->eps, c->h, c->s.x + t * c->h);
}

/* rows [t0, t1) of the Q/K/V projection's output: biases, QK-norm, rope, and K/V into the caches */
static void rows_qkv(void *p, int64_t t0, int64_t t1) {
    const step_ctx *c = p;
    const tm_llama_layer *layer = c->layer;
    const int64_t dim = c->dim, heads = c->heads, kv_heads = c->kv_heads, q_size = heads * dim;
    const int64_t kv_size = kv_heads * dim, qkv_n = tm_weight_n(&layer->qkv);
    const int64_t slot_bytes = kv_heads * tm_kv_head_bytes(layer->kv_dtype, dim);
    for (int64_t t = t0; t < t1; ++t) {
        float *row = c->s.qkv_out + t * qkv_n;
        if (layer->qkv_bias) {
#pragma omp simd
            for (int64_t i = 0; i < qkv_n; ++i) row[i] += layer->qkv_bias[i];
        }
        if (layer->q_norm && layer->qk_norm_whole) { /* all of Q, then all of K, before rope (OLMoE) */
            rms_norm(row, layer->q_norm, c->eps, q_size, row);
            rms_norm(row + q_size, layer->k_norm, c->eps, kv_size, row + q_size);
        } else if (layer->q_norm) { /* each head normalized on its own (in place), before rope */
            for (int64_t hd = 0; hd < heads; ++hd) rms_norm(row + hd * dim, layer->q_norm, c->eps, dim, row + hd * dim);
            for (int64_t hd = heads; hd < heads + kv_heads; ++hd)
                rms_norm(row + hd * dim, layer->k_norm, c->eps, dim, row + hd * dim);
        }
        for (int64_t hd = 0; hd < heads + kv_heads; ++hd)
            rope_head(row + hd * dim, c->cos_full + t * dim, c->sin_signed + t * dim, dim);
        char *k_cache = layer->k_cache, *v_cache = layer->v_cache;
        kv_store_heads(k_cache + c->slot_mapping[t] * slot_bytes, row + q_size, kv_heads, dim, (int)layer->kv_dtype);
        kv_store_heads(v_cache + c->slot_mapping[t] * slot_bytes, row + q_size + kv_size, kv_heads, dim,
                       (int)layer->kv_dtype);
    }
}

/* the keys row t's query sees in this layer: from `*skip` on, `n` of them (a local layer's query sees the last
 * `window` slots of its context, its own position last) */
static inline int64_t attended(const step_ctx *c, int64_t t, int64_t *skip) {
    const int64_t ctx_len = c->ctx_lens[t], window = c->layer->window;
    *skip = window > 0 && ctx_len > window ? ctx_len - window : 0;
    return ctx_len - *skip;
}

/* (row, head, piece) units [u0, u1): attention over one piece of the row's context in the caches; a context of one
 * piece goes straight to the output, the pieces of a longer one to the partials (pairs_combine) */
static void pieces_attention(void *p, int64_t u0, int64_t u1) {
    const step_ctx *c = p;
    const tm_llama_layer *layer = c->layer;
    const int64_t dim = c->dim, heads = c->heads, group = heads / c->kv_heads;
    const int64_t qkv_n = tm_weight_n(&layer->qkv), head_bytes = tm_kv_head_bytes(layer->kv_dtype, dim);
    const int64_t slot_bytes = c->kv_heads * head_bytes;
    const char *k_cache = layer->k_cache, *v_cache = layer->v_cache;
    for (int64_t u = u0; u < u1; ++u) {
        const int64_t th = u / c->pieces, piece = u % c->pieces, t = th / heads, hd = th % heads, kvh = hd / group;
        int64_t skip;
        const int64_t n = attended(c, t, &skip), pieces = attn_pieces(n);
        if (piece >= pieces) continue; /* a shorter context than the step's longest */
        const int64_t start = piece * TM_ATTN_PIECE, len = n - start < TM_ATTN_PIECE ? n - start : TM_ATTN_PIECE;
        const float *q = c->s.qkv_out + t * qkv_n + hd * dim;
        float *sc = c->s.scores + u * c->piece_keys;
        const int64_t *slots = c->ctx_slots + t * c->max_ctx + skip + start;
        qk_scores(q, k_cache + kvh * head_bytes, slot_bytes, slots, len, dim, c->scale, sc, layer->kv_dtype);
        float *part = c->s.partials + u * (2 + dim);
        float *out = pieces == 1 ? c->s.attn + t * heads * dim + hd * dim : part + 2;
        const float *sink = layer->sinks && pieces == 1 ? layer->sinks + hd : NULL; /* pieces: pairs_combine's */
        softmax_values(sc, v_cache + kvh * head_bytes, slot_bytes, slots, len, dim, out, pieces == 1 ? NULL : part,
                       sink, layer->kv_dtype);
    }
}

/* (row, head) pairs [th0, th1) whose context came in pieces: their partial softmaxes rescaled to the largest max
 * and summed, then divided by the total (the online softmax's combination), the head's sink joining the total */
static void pairs_combine(void *p, int64_t th0, int64_t th1) {
    const step_ctx *c = p;
    const int64_t dim = c->dim, heads = c->heads;
    for (int64_t th = th0; th < th1; ++th) {
        int64_t skip;
        const int64_t pieces = attn_pieces(attended(c, th / heads, &skip));
        if (pieces == 1) continue;
        const float *parts = c->s.partials + th * c->pieces * (2 + dim), *sink = c->layer->sinks;
        float best = sink ? sink[th % heads] : -FLT_MAX;
        for (int64_t k = 0; k < pieces; ++k) best = parts[k * (2 + dim)] > best ? parts[k * (2 + dim)] : best;
        float total = sink ? expf(sink[th % heads] - best) : 0.0f;
        float *out = c->s.attn + th * dim; /* row th / heads, head th % heads: [m, heads, dim] */
        for (int64_t i = 0; i < dim; ++i) out[i] = 0.0f;
        for (int64_t k = 0; k < pieces; ++k) {
            const float *part = parts + k * (2 + dim), w = expf(part[0] - best);
            total += w * part[1];
#pragma omp simd
            for (int64_t i = 0; i < dim; ++i) out[i] += w * part[2 + i];
        }
        const float inv = 1.0f / total;
#pragma omp simd
        for (int64_t i = 0; i < dim; ++i) out[i] *= inv;
    }
}

/* rows [t0, t1): the attention block's output (plus the output projection's bias, after the sum over ranks) into
 * the residual, then the MLP block's input norm */
static void rows_residual1(void *p, int64_t t0, int64_t t1) {
    const step_ctx *c = p;
    const int64_t h = c->h;
    const float *bias = c->layer->o_bias;
    for (int64_t t = t0; t < t1; ++t) {
        if (bias) {
            float *dt = c->s.delta + t * h;
#pragma omp simd
            for (int64_t i = 0; i < h; ++i) dt[i] += bias[i];
        }
        add_to_residual(c->hidden + t * h, c->s.delta + t * h, c->layer->post_attn_norm, c->eps, h);
        rms_norm(c->hidden + t * h, c->layer->norm2, c->eps, h, c->s.x + t * h);
    }
}

/* rows [t0, t1): act(gate) * up, of the dense MLP (or the shared expert: its gate_up) */
static void rows_gate(void *p, int64_t t0, int64_t t1) {
    const step_ctx *c = p;
    const tm_weight *w = c->layer->moe ? &c->layer->moe->shared_gate_up : &c->layer->gate_up;
    const int64_t inter = tm_weight_n(w) / 2;
    for (int64_t t = t0; t < t1; ++t) {
        const float *g = c->s.gu + t * 2 * inter;
        gated(c->activation, g, g + inter, c->s.x + t * inter, inter);
    }
}

/* rows [t0, t1): the MLP block's output into the residual */
static void rows_residual2(void *p, int64_t t0, int64_t t1) {
    const step_ctx *c = p;
    for (int64_t t = t0; t < t1; ++t)
        add_to_residual(c->hidden + t * c->h, c->s.delta + t * c->h, c->layer->post_mlp_norm, c->eps, c->h);
}

/* ---- a mixture of experts in place of the MLP (layers/moe.py) -------------------------------------------------- */

/* the k largest of v [n] (ties to the lower index, as torch.topk), their indices into ids and values into top, in
 * descending order */
static void top_k(const float *v, int64_t n, int64_t k, int64_t *ids, float *top) {
    for (int64_t j = 0; j < k; ++j) {
        int64_t best = -1;
        for (int64_t e = 0; e < n; ++e) {
            int taken = 0;
            for (int64_t i = 0; i < j; ++i) taken |= ids[i] == e;
            if (!taken && (best < 0 || v[e] > v[best])) best = e;
        }
        ids[j] = best;
        top[j] = v[best];
    }
}

#define ROUTER_EXPERTS 8 /* experts per unit of the router's job: a decode row's router spread over the team */

/* units [u0, u1) of (row, ROUTER_EXPERTS experts): the router's logits, in float64 (the float32 weights exact in
 * it) rounded to float32, as MixtureOfExperts.router_logits */
static void units_router(void *p, int64_t u0, int64_t u1) {
    const step_ctx *c = p;
    const tm_moe *moe = c->layer->moe;
    const int64_t h = c->h, n = moe->n_experts, chunks = (n + ROUTER_EXPERTS - 1) / ROUTER_EXPERTS;
    for (int64_t u = u0; u < u1; ++u) {
        const int64_t t = u / chunks, first = u % chunks * ROUTER_EXPERTS;
        const int64_t last = first + ROUTER_EXPERTS < n ? first + ROUTER_EXPERTS : n;
        const float *x = c->s.x + t * h;
        for (int64_t ex = first; ex < last; ++ex) {
            const float *w = moe->router + ex * h;
            double dot = 0.0;
#pragma omp simd reduction(+ : dot)
            for (int64_t i = 0; i < h; ++i) dot += (double)x[i] * (double)w[i];
            c->s.e.logits[t * n + ex] = (float)(moe->router_bias ? dot + moe->router_bias[ex] : dot);
        }
    }
}

/* rows [t0, t1): the token's k experts and weights from its logits (route), sorted by expert, and the shared
 * expert's gate */
static void rows_route(void *p, int64_t t0, int64_t t1) {
    const step_ctx *c = p;
    const tm_moe *moe = c->layer->moe;
    const tm_moe_scratch *e = &c->s.e;
    const int64_t h = c->h, n = moe->n_experts, k = moe->k;
    for (int64_t t = t0; t < t1; ++t) {
        const float *x = c->s.x + t * h;
        float *logits = e->logits + t * n;
        int64_t *ids = e->expert + t * k;
        float *weights = e->weight + t * k;
        if (moe->softmax_after_topk) { /* the k largest logits, then a softmax over them */
            top_k(logits, n, k, ids, weights);
            const float best = weights[0];
            float total = 0.0f;
            for (int64_t j = 0; j < k; ++j) total += weights[j] = expf(weights[j] - best);
            for (int64_t j = 0; j < k; ++j) weights[j] /= total;
        } else { /* a softmax over all experts (in place), the k largest kept, renormalized where asked */
            float best = -FLT_MAX, total = 0.0f;
            for (int64_t ex = 0; ex < n; ++ex) best = logits[ex] > best ? logits[ex] : best;
            for (int64_t ex = 0; ex < n; ++ex) total += logits[ex] = expf(logits[ex] - best);
            for (int64_t ex = 0; ex < n; ++ex) logits[ex] /= total;
            top_k(logits, n, k, ids, weights);
            if (moe->normalize) {
                float sum = 0.0f;
                for (int64_t j = 0; j < k; ++j) sum += weights[j];
                for (int64_t j = 0; j < k; ++j) weights[j] /= sum;
            }
        }
        for (int64_t j = 0; j < k; ++j) weights[j] *= moe->scale;
        for (int64_t j = 1; j < k; ++j) /* by expert (insertion sort of k): the sum's order, as the torch path's */
            for (int64_t i = j; i > 0 && ids[i - 1] > ids[i]; --i) {
                const int64_t id = ids[i];
                const float w = weights[i];
                ids[i] = ids[i - 1], weights[i] = weights[i - 1];
                ids[i - 1] = id, weights[i - 1] = w;
            }
        if (moe->shared_gate) {
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int64_t i = 0; i < h; ++i) dot += x[i] * moe->shared_gate[i];
            e->shared_weight[t] = 1.0f / (1.0f + expf(-dot));
        }
    }
}

/* On the calling thread: the chosen experts' segments (experts in order, each one's tokens in order, as the torch
 * path's stable sort) and each (token, choice)'s row in them */
static void place_rows(step_ctx *c) {
    const tm_moe *moe = c->layer->moe;
    tm_moe_scratch *e = &c->s.e;
    const int64_t n = moe->n_experts, k = moe->k, pairs = c->m * k;
    for (int64_t ex = 0; ex < n; ++ex) e->count[ex] = 0;
    for (int64_t i = 0; i < pairs; ++i) e->count[e->expert[i]]++;
    e->n_segments = e->rows = 0;
    for (int64_t ex = 0; ex < n; ++ex) {
        if (!e->count[ex]) continue;
        e->segments[e->n_segments++] = (tm_segment){&moe->gate_up[ex], e->rows, e->count[ex]};
        for (int64_t r = e->rows; r < e->rows + e->count[ex]; ++r) e->expert_of[r] = ex;
        const int64_t count = e->count[ex];
        e->count[ex] = e->rows; /* from here: the expert's next free row */
        e->rows += count;
    }
    for (int64_t i = 0; i < pairs; ++i) {
        const int64_t r = e->count[e->expert[i]]++;
        e->row[i] = r;
        e->token_of[r] = i / k;
    }
}

/* gathered rows [r0, r1): the token's normed input */
static void rows_gather(void *p, int64_t r0, int64_t r1) {
    const step_ctx *c = p;
    const tm_moe_scratch *e = &c->s.e;
    for (int64_t r = r0; r < r1; ++r) memcpy(e->x + r * c->h, c->s.x + e->token_of[r] * c->h, sizeof(float) * c->h);
}

/* gathered rows [r0, r1): the expert's gate/up bias, then act(gate) * up */
static void rows_expert_gate(void *p, int64_t r0, int64_t r1) {
    const step_ctx *c = p;
    const tm_moe *moe = c->layer->moe;
    const tm_moe_scratch *e = &c->s.e;
    const int64_t inter = moe->inter;
    for (int64_t r = r0; r < r1; ++r) {
        float *g = e->gu + r * 2 * inter;
        if (moe->gate_up_bias) {
            const float *b = moe->gate_up_bias + e->expert_of[r] * 2 * inter;
#pragma omp simd
            for (int64_t i = 0; i < 2 * inter; ++i) g[i] += b[i];
        }
        gated(c->activation, g, g + inter, e->act + r * inter, inter);
    }
}

/* rows [t0, t1): the token's experts' outputs (each plus its down bias) weighted and summed in expert order into
 * delta, then the shared expert's, gated */
static void rows_combine(void *p, int64_t t0, int64_t t1) {
    const step_ctx *c = p;
    const tm_moe *moe = c->layer->moe;
    const tm_moe_scratch *e = &c->s.e;
    const int64_t h = c->h, k = moe->k;
    for (int64_t t = t0; t < t1; ++t) {
        float *out = c->s.delta + t * h;
        for (int64_t i = 0; i < h; ++i) out[i] = 0.0f;
        for (int64_t j = 0; j < k; ++j) {
            const float w = e->weight[t * k + j], *y = e->y + e->row[t * k + j] * h;
            const float *b = moe->down_bias ? moe->down_bias + e->expert[t * k + j] * h : NULL;
            if (b) {
#pragma omp simd
                for (int64_t i = 0; i < h; ++i) out[i] += (y[i] + b[i]) * w;
            } else {
#pragma omp simd
                for (int64_t i = 0; i < h; ++i) out[i] += y[i] * w;
            }
        }
        if (moe->shared_gate) {
            const float w = e->shared_weight[t], *y = e->shared + t * h;
#pragma omp simd
            for (int64_t i = 0; i < h; ++i) out[i] += y[i] * w;
        }
    }
}

/* The mixture of the layer (c->layer->moe) over the MLP block's normed input s.x [m, h], into s.delta [m, h]: the
 * router, the rows gathered by expert, all chosen experts' gate/up products in one job, their activations, their
 * down products in one job, and the weighted sums; Qwen2-MoE's shared expert through the dense MLP's steps. */
static void mixture(step_ctx *c) {
    const tm_moe *moe = c->layer->moe;
    tm_moe_scratch *e = &c->s.e;
    const int64_t m = c->m, h = c->h;
    const int64_t router_units = m * ((moe->n_experts + ROUTER_EXPERTS - 1) / ROUTER_EXPERTS);
    tm_pool_for(units_router, c, router_units, router_units);
    tm_pool_for(rows_route, c, m, m);
    place_rows(c);
    tm_pool_for(rows_gather, c, e->rows, e->rows);
    tm_quantize_rows(e->x, e->rows, h, c->s.passes, tm_activation_group(&moe->gate_up[0], c->s.passes), &e->qx);
    tm_segments_matmul(&e->qx, c->s.passes, e->segments, e->n_segments, e->gu, 2 * moe->inter);
    tm_pool_for(rows_expert_gate, c, e->rows, e->rows);
    tm_quantize_rows(e->act, e->rows, moe->inter, c->s.passes, tm_activation_group(&moe->down[0], c->s.passes),
                     &e->qx);
    for (int64_t s = 0; s < e->n_segments; ++s) /* the same rows through each expert's down */
        e->segments[s].w = moe->down + (e->segments[s].w - moe->gate_up);
    tm_segments_matmul(&e->qx, c->s.passes, e->segments, e->n_segments, e->y, h);
    if (moe->shared_gate) { /* s.x is free now: the gathered rows have it */
        project(c->s.x, m, &moe->shared_gate_up, &c->s, c->s.gu);
        tm_pool_for(rows_gate, c, m, m);
        project(c->s.x, m, &moe->shared_down, &c->s, e->shared);
    }
    tm_pool_for(rows_combine, c, m, m);
}

/* Under tensor parallelism, the sum of a block's output over the ranks (on the calling thread). 0, or -3 when the
 * sum failed. */
static int sum_over_ranks(const step_ctx *c) {
    return c->reduce && c->reduce(c->reduce_ctx, c->s.delta, c->m * c->h) ? -3 : 0;
}

/* One decoder layer (c->layer). hidden [m, h] is updated in place (both residual additions). The K/V of each
 * token go to its slot in the caches before attention; token t then attends to the ctx_lens[t] cache slots listed
 * in ctx_slots[t * max_ctx ...] (its own position last). The calling thread runs the steps in order; each is one
 * job of the team (pool.c): rows, (row, head, piece) units of attention, activation blocks and weight groups. */
static int decode_layer(step_ctx *c) {
    const tm_llama_layer *layer = c->layer;
    const int64_t m = c->m, rows_pieces = m;
    tm_pool_for(rows_norm1, c, m, rows_pieces);
    project(c->s.x, m, &layer->qkv, &c->s, c->s.qkv_out);
    tm_pool_for(rows_qkv, c, m, rows_pieces);
    const int64_t units = m * c->heads * c->pieces;
    tm_pool_for(pieces_attention, c, units, units);
    if (c->pieces > 1) tm_pool_for(pairs_combine, c, m * c->heads, m * c->heads);
    project(c->s.attn, m, &layer->o, &c->s, c->s.delta);
    if (sum_over_ranks(c)) return -3;
    tm_pool_for(rows_residual1, c, m, rows_pieces);
    if (layer->moe) {
        mixture(c);
    } else {
        project(c->s.x, m, &layer->gate_up, &c->s, c->s.gu);
        tm_pool_for(rows_gate, c, m, rows_pieces);
        project(c->s.x, m, &layer->down, &c->s, c->s.delta);
    }
    if (sum_over_ranks(c)) return -3;
    tm_pool_for(rows_residual2, c, m, rows_pieces);
    return 0;
}

typedef struct {
    step_ctx *c;
    const tm_llama_model *model;
    const tm_decode_step *step;
    int rc;
} layers_args;

/* every layer in order: the body of the step's one team */
static void layers_body(void *p) {
    layers_args *a = p;
    step_ctx *c = a->c;
    const tm_decode_step *st = a->step;
    for (int64_t l = 0; a->rc == 0 && l < a->model->n_layers; ++l) {
        const tm_llama_layer *layer = &a->model->layers[l];
        c->layer = layer;
        c->cos_full = layer->local_rope ? st->local_cos_full : st->cos_full;
        c->sin_signed = layer->local_rope ? st->local_sin_signed : st->sin_signed;
        c->slot_mapping = layer->window > 0 ? st->local_slot_mapping : st->slot_mapping;
        c->ctx_slots = layer->window > 0 ? st->local_ctx_slots : st->ctx_slots;
        a->rc = decode_layer(c);
    }
}

/* a mixture's weights of the model's sizes: every expert [2 inter, h] and [h, inter], one activation group for
 * all experts' gate/up and one for their downs (the products' rows are quantized once for all), a shared expert
 * [2 its width, h] and [h, its width] with its gate, or none; 0, else -1 */
static int moe_check(const tm_moe *e, int64_t h, int64_t passes) {
    if (e->n_experts < 1 || e->k < 1 || e->k > e->n_experts || e->inter < 1 || !e->router || !e->gate_up || !e->down)
        return -1;
    for (int64_t ex = 0; ex < e->n_experts; ++ex) {
        const tm_weight *gu = &e->gate_up[ex], *d = &e->down[ex];
        if (tm_weight_check(gu) || tm_weight_check(d) || gu->parts[0].k != h || tm_weight_n(gu) != 2 * e->inter ||
            d->parts[0].k != e->inter || tm_weight_n(d) != h)
            return -1;
        if (tm_activation_group(gu, passes) != tm_activation_group(&e->gate_up[0], passes) ||
            tm_activation_group(d, passes) != tm_activation_group(&e->down[0], passes))
            return -1;
    }
    if (!e->shared_gate) return e->shared_gate_up.n_parts || e->shared_down.n_parts ? -1 : 0;
    const tm_weight *gu = &e->shared_gate_up, *d = &e->shared_down;
    if (tm_weight_check(gu) || tm_weight_check(d) || gu->parts[0].k != h || tm_weight_n(gu) % 2 ||
        d->parts[0].k != tm_weight_n(gu) / 2 || tm_weight_n(d) != h)
        return -1;
    return 0;
}

/* the widest MLP input of the model's dense MLPs and shared experts (0 where there are none) */
static int64_t dense_width(const tm_llama_model *md) {
    int64_t widest = 0;
    for (int64_t l = 0; l < md->n_layers; ++l) {
        const tm_llama_layer *y = &md->layers[l];
        const tm_weight *w = y->moe ? &y->moe->shared_gate_up : &y->gate_up;
        const int64_t inter = w->n_parts ? tm_weight_n(w) / 2 : 0;
        widest = inter > widest ? inter : widest;
    }
    return widest;
}

/* the model's first mixture (every mixture of a model has its sizes), or NULL */
static const tm_moe *first_moe(const tm_llama_model *md) {
    for (int64_t l = 0; l < md->n_layers; ++l)
        if (md->layers[l].moe) return md->layers[l].moe;
    return NULL;
}

/* 0 when the model's description is one the decoder computes (sizes, types and every layer's weights agree),
 * else -1. tm_llama_decode checks it too; the binding checks it once, where a bad table is built. */
int tm_llama_check(const tm_llama_model *md) {
    const int64_t h = md->h, heads = md->heads, kv_heads = md->kv_heads, dim = md->dim;
    if (md->n_layers < 1 || dim > 512 || dim % 2 || kv_heads < 1 || heads % kv_heads) return -1;
    if ((md->activation != TM_SILU && md->activation != TM_GELU_TANH && md->activation != TM_SWIGLU_OAI) ||
        (md->passes != 1 && md->passes != 2))
        return -1;
    const int64_t qkv_n = (heads + 2 * kv_heads) * dim;
    const tm_moe *moe = first_moe(md);
    for (int64_t l = 0; l < md->n_layers; ++l) {
        const tm_llama_layer *y = &md->layers[l];
        if (tm_weight_check(&y->qkv) || tm_weight_check(&y->o) || !tm_kv_dtype_ok(y->kv_dtype)) return -1;
        if (y->qkv.parts[0].k != h || tm_weight_n(&y->qkv) != qkv_n || y->o.parts[0].k != heads * dim ||
            tm_weight_n(&y->o) != h)
            return -1;
        if (y->qk_norm_whole && !(y->q_norm && y->k_norm)) return -1;
        if (y->moe) {
            if (moe_check(y->moe, h, md->passes) || y->moe->n_experts != moe->n_experts || y->moe->k != moe->k ||
                y->moe->inter != moe->inter)
                return -1;
            continue;
        }
        if (tm_weight_check(&y->gate_up) || tm_weight_check(&y->down)) return -1;
        const int64_t inter = tm_weight_n(&y->gate_up) / 2;
        if (y->gate_up.parts[0].k != h || tm_weight_n(&y->gate_up) != 2 * inter || y->down.parts[0].k != inter ||
            tm_weight_n(&y->down) != h)
            return -1;
    }
    return 0;
}

/* a mixture's scratch for m rows (moe NULL: none); 0, or -2 when out of memory */
static int moe_alloc(tm_moe_scratch *e, const tm_moe *moe, int64_t m, int64_t h, int64_t passes) {
    memset(e, 0, sizeof *e);
    if (!moe) return 0;
    const int64_t n = moe->n_experts, pairs = m * moe->k, inter = moe->inter;
    const int64_t chosen = n < pairs ? n : pairs, rows = pairs;
    e->logits = malloc(sizeof(float) * m * n);
    e->expert = malloc(sizeof(int64_t) * pairs);
    e->weight = malloc(sizeof(float) * pairs);
    e->row = malloc(sizeof(int64_t) * pairs);
    e->shared_weight = malloc(sizeof(float) * m);
    e->token_of = malloc(sizeof(int64_t) * rows);
    e->expert_of = malloc(sizeof(int64_t) * rows);
    e->count = malloc(sizeof(int64_t) * n);
    e->segments = malloc(sizeof(tm_segment) * chosen);
    e->x = malloc(sizeof(float) * rows * h);
    e->gu = malloc(sizeof(float) * rows * 2 * inter);
    e->act = malloc(sizeof(float) * rows * inter);
    e->y = malloc(sizeof(float) * rows * h);
    e->shared = malloc(sizeof(float) * m * h);
    int rc = tm_qx_alloc(&e->qx, rows, h > inter ? h : inter, passes);
    if (!e->logits || !e->expert || !e->weight || !e->row || !e->shared_weight || !e->token_of || !e->expert_of ||
        !e->count || !e->segments || !e->x || !e->gu || !e->act || !e->y || !e->shared)
        rc = -2;
    return rc;
}

static void moe_free(tm_moe_scratch *e, const tm_moe *moe) {
    free(e->logits); free(e->expert); free(e->weight); free(e->row); free(e->shared_weight); free(e->token_of);
    free(e->expert_of); free(e->count); free(e->segments); free(e->x); free(e->gu); free(e->act);
    free(e->y); free(e->shared);
    if (moe) tm_qx_free(&e->qx);
}

/* Every decoder layer of `md` for the step's m decode tokens (one call per step): see tm_llama_model and
 * tm_decode_step in kernels.h. One team of threads for the whole step (pool.c). Returns 0, or a negative code on
 * a bad description (-1) or exhausted memory (-2) or a failed reduce (-3). */
int tm_llama_decode(const tm_llama_model *md, const tm_decode_step *st) {
    if (tm_llama_check(md) || st->m < 0) return -1;
    const int64_t h = md->h, heads = md->heads, kv_heads = md->kv_heads, dim = md->dim, m = st->m;
    const int64_t inter = dense_width(md), qkv_n = (heads + 2 * kv_heads) * dim;
    int64_t widest = h > inter ? h : inter;
    widest = widest > heads * dim ? widest : heads * dim;
    step_ctx c = {.hidden = st->hidden, .m = m, .h = h, .heads = heads, .kv_heads = kv_heads, .dim = dim,
                  .max_ctx = st->max_ctx, .activation = md->activation, .eps = md->eps, .scale = md->scale,
                  .ctx_lens = st->ctx_lens, .reduce = md->reduce, .reduce_ctx = md->reduce_ctx,
                  .pieces = attn_pieces(st->max_ctx)};
    c.piece_keys = c.pieces == 1 ? (st->max_ctx > 0 ? st->max_ctx : 1) : TM_ATTN_PIECE;
    tm_scratch *s = &c.s;
    const tm_moe *moe = first_moe(md);
    s->x = malloc(sizeof(float) * (m > 0 ? m : 1) * (h > inter ? h : inter));
    s->qkv_out = malloc(sizeof(float) * m * qkv_n);
    s->attn = malloc(sizeof(float) * m * heads * dim);
    s->gu = malloc(sizeof(float) * (m > 0 ? m : 1) * (inter > 0 ? 2 * inter : 1));
    s->delta = malloc(sizeof(float) * m * h);
    s->scores = malloc(sizeof(float) * m * heads * c.pieces * c.piece_keys);
    s->partials = c.pieces > 1 ? malloc(sizeof(float) * m * heads * c.pieces * (2 + dim)) : NULL; /* one piece: none */
    s->passes = md->passes;
    int rc = tm_qx_alloc(&s->qx, m, widest, md->passes);
    const int moe_rc = moe_alloc(&s->e, moe, m, h, md->passes);
    rc = rc ? rc : moe_rc;
    if (!s->x || !s->qkv_out || !s->attn || !s->gu || !s->delta || !s->scores || (c.pieces > 1 && !s->partials))
        rc = -2;
    if (rc == 0) {
        layers_args a = {&c, md, st, 0};
        tm_team_run(layers_body, &a);
        rc = a.rc;
    }
    free(s->x); free(s->qkv_out); free(s->attn); free(s->gu); free(s->delta); free(s->scores); free(s->partials);
    tm_qx_free(&s->qx);
    moe_free(&s->e, moe);
    return rc;
}

/* dst = src's n floats in the cache element type kv_dtype, as the decoder writes K and V (for the tests: torch's
 * conversion gives the same bits). Returns 0, or -1 for an unknown type. */
int tm_kv_store(void *dst, const float *src, int64_t n, int64_t kv_dtype) {
    if (!tm_kv_dtype_ok(kv_dtype) || n < 0) return -1;
    kv_store_row(dst, src, n, (int)kv_dtype);
    return 0;
}
