/* Prompt attention over the paged KV cache (flash attention): each prompt chunk's queries against every key of
 * their context up to their own position, read from the cache through the chunk's slot list one block of keys at a
 * time (no gathered copy of the context), with an online softmax, float32 throughout.
 *
 * A tile is TILE_ROWS query rows of one chunk and one query head; a job is a run of a chunk's tiles for all the
 * query heads of one KV head, so that each block of keys and values is read and converted once for all of them.
 * A tile's rows are the lanes of the vectors: its queries are transposed once (Qt [dim][TILE_ROWS]) and the scores
 * of a block come out transposed (St [key][TILE_ROWS]), so the softmax's maxima, exponentials and sums run along
 * the lanes and a row never needs a horizontal reduction. Per block of BLOCK_KEYS keys (blocks begin at positions
 * that are multiples of BLOCK_KEYS):
 *     St = K_block . Qt * scale                     (8 keys x 3 vectors of rows of fused multiply-adds)
 *     m' = max(m, the row's valid scores); a = exp(m - m'); P = exp(St - m') where valid, else 0; l = l * a + sum P
 *     Ot = Ot * a + V_block^T . P                   (8 columns x 3 vectors of rows)
 * and at the end out = Ot / l (gpt-oss's sink joins l as one more logit with no value).
 *
 * Batch invariance: a row's arithmetic runs in its own lane, over the blocks in position order and the keys and
 * dimensions in order, so its bits do not depend on which rows share its tile or how the prompt was chunked. A
 * block where the row has no valid key (processed for its tile-mates) leaves its state as it was: its maximum
 * stays, the factor is exp(0) = 1 and every P is 0. Keys a row may see: position <= its own, and with a sliding
 * window, position > its own - window.
 *
 * Speed (SmolLM2-1.7B's 32 heads of 64, one layer, 512 queries at the end of an 8,192-token context, 2 threads):
 * benchmarks/README.md (torch's fused kernel over 128-query blocks with masks ran at 37 GMAC/s). */
#include "kernels.h"
#include "kv_elements.h"

#define BLOCK_KEYS 64 /* keys per block */
#define TILE_ROWS 48  /* query rows per job: 3 vectors of 16 lanes */
#define ROW_VECS (TILE_ROWS / 16)
#define KEY_STEP 8 /* keys per step of the scores' kernel; columns per step of the values' kernel */
#define FLOOR (-FLT_MAX) /* a row's maximum before its first valid key */

/* A job: one KV head's query heads over a run of tiles of one chunk (each K/V block is read from the cache once for
 * all of them: at 8k keys of SmolLM2-1.7B's 32 heads, one tile a job read 1.5 GB per layer's 512 queries) */
typedef struct {
    int64_t chunk, kv_head, tile0, tiles;
} attn_job;

typedef struct {
    const tm_prefill_attention_args *a;
    int64_t group, jobs, tiles_per_job;
    attn_job *list; /* [jobs], the most keys first */
    int failed;     /* a job found no memory for its scratch */
} attn_ctx;

/* one job's scratch: per (tile, head of the group) Qt, Ot [dim][TILE_ROWS] and m, l [TILE_ROWS]; the block's keys
 * and values as floats [BLOCK_KEYS][dim]; the scores and probabilities St, P [BLOCK_KEYS][TILE_ROWS]; per tile its
 * rows' positions */
typedef struct {
    float *qt, *ot, *m, *l;
    float *keys, *values, *st, *alpha;
    int64_t *pos;
} job_scratch;

/* one cache head of type T as dim floats (int8: times the head's scale) */
ALWAYS_INLINE void head_floats(const char *head, int64_t dim, float *row, const int T) {
    const float s = kv_scale(head, dim, T);
#if defined(__AVX512F__)
    if (dim % 16 == 0) {
        const __m512 sv = _mm512_set1_ps(s);
        for (int64_t i = 0; i < dim; i += 16)
            _mm512_storeu_ps(row + i, _mm512_mul_ps(kv_load16(head + i * tm_kv_element_bytes(T), T), sv));
        return;
    }
#elif defined(__AVX2__) && defined(__F16C__)
    if (dim % 8 == 0) {
        const __m256 sv = _mm256_set1_ps(s);
        for (int64_t i = 0; i < dim; i += 8)
            _mm256_storeu_ps(row + i, _mm256_mul_ps(kv_load8(head + i * tm_kv_element_bytes(T), T), sv));
        return;
    }
#endif
    for (int64_t i = 0; i < dim; ++i) row[i] = kv_get(head, i, T) * s;
}

/* the block's n keys (or values) of one KV head as float rows [BLOCK_KEYS][dim] in `buf` (int8 times each head's
 * scale); rows past n repeat the last (computed, then masked). Copied even from a float32 cache: a context's rows
 * lie kv_heads * dim * 4 bytes apart (8 KiB at 32 heads of 64), the same L1 set for all of a block's 64 keys. */
static void block_rows(const tm_prefill_attention_args *a, const void *cache, const int64_t *slots, int64_t kvh,
                       int64_t n, float *buf) {
    const int64_t dim = a->dim, head_bytes = tm_kv_head_bytes(a->kv_dtype, dim);
    const int64_t slot_bytes = a->kv_heads * head_bytes;
    for (int64_t j = 0; j < BLOCK_KEYS; ++j) {
        const char *head = (const char *)cache + slots[j < n ? j : n - 1] * slot_bytes + kvh * head_bytes;
        float *row = buf + j * dim;
        switch (a->kv_dtype) {
        case TM_KV_F32: memcpy(row, head, sizeof(float) * dim); break;
        case TM_KV_F16: head_floats(head, dim, row, TM_KV_F16); break;
        case TM_KV_BF16: head_floats(head, dim, row, TM_KV_BF16); break;
        default: head_floats(head, dim, row, TM_KV_I8); break;
        }
    }
}

/* St [BLOCK_KEYS][TILE_ROWS] = the n keys [BLOCK_KEYS][dim] . Qt [dim][TILE_ROWS] * scale */
static void block_scores(const float *keys, int64_t n, const float *qt, int64_t dim, float scale,
                         float *st) {
#if defined(__AVX512F__)
    const __m512 sv = _mm512_set1_ps(scale);
    for (int64_t j0 = 0; j0 < n; j0 += KEY_STEP) {
        __m512 acc[KEY_STEP][ROW_VECS];
        for (int j = 0; j < KEY_STEP; ++j)
            for (int r = 0; r < ROW_VECS; ++r) acc[j][r] = _mm512_setzero_ps();
        for (int64_t d = 0; d < dim; ++d) {
            __m512 q[ROW_VECS];
            for (int r = 0; r < ROW_VECS; ++r) q[r] = _mm512_loadu_ps(qt + d * TILE_ROWS + 16 * r);
            for (int j = 0; j < KEY_STEP; ++j) {
                const __m512 k = _mm512_set1_ps(keys[(j0 + j) * dim + d]);
                for (int r = 0; r < ROW_VECS; ++r) acc[j][r] = _mm512_fmadd_ps(k, q[r], acc[j][r]);
            }
        }
        for (int j = 0; j < KEY_STEP; ++j)
            for (int r = 0; r < ROW_VECS; ++r)
                _mm512_storeu_ps(st + (j0 + j) * TILE_ROWS + 16 * r, _mm512_mul_ps(acc[j][r], sv));
    }
#elif defined(__AVX2__) && defined(__FMA__)
    /* 4 keys x 3 vectors of rows (12 accumulators of the 16 registers), one half of the tile's rows at a time */
    const __m256 sv = _mm256_set1_ps(scale);
    for (int64_t j0 = 0; j0 < n; j0 += 4)
        for (int half = 0; half < 2; ++half) {
            const float *qh = qt + half * (TILE_ROWS / 2);
            __m256 acc[4][3];
            for (int j = 0; j < 4; ++j)
                for (int r = 0; r < 3; ++r) acc[j][r] = _mm256_setzero_ps();
            for (int64_t d = 0; d < dim; ++d) {
                __m256 q[3];
                for (int r = 0; r < 3; ++r) q[r] = _mm256_loadu_ps(qh + d * TILE_ROWS + 8 * r);
                for (int j = 0; j < 4; ++j) {
                    const __m256 k = _mm256_broadcast_ss(keys + (j0 + j) * dim + d);
                    for (int r = 0; r < 3; ++r) acc[j][r] = _mm256_fmadd_ps(k, q[r], acc[j][r]);
                }
            }
            for (int j = 0; j < 4; ++j)
                for (int r = 0; r < 3; ++r)
                    _mm256_storeu_ps(st + (j0 + j) * TILE_ROWS + half * (TILE_ROWS / 2) + 8 * r,
                                     _mm256_mul_ps(acc[j][r], sv));
        }
#else
    for (int64_t j = 0; j < n; ++j) {
        float acc[TILE_ROWS] = {0};
        for (int64_t d = 0; d < dim; ++d) {
            const float k = keys[j * dim + d];
#pragma omp simd
            for (int r = 0; r < TILE_ROWS; ++r) acc[r] += k * qt[d * TILE_ROWS + r];
        }
#pragma omp simd
        for (int r = 0; r < TILE_ROWS; ++r) st[j * TILE_ROWS + r] = acc[r] * scale;
    }
#endif
}

/* Ot [dim][TILE_ROWS] = Ot * alpha + the n values [BLOCK_KEYS][dim]^T . P [BLOCK_KEYS][TILE_ROWS] */
static void block_values(const float *values, int64_t n, const float *p, const float *alpha,
                         int64_t dim, float *ot) {
#if defined(__AVX512F__)
    __m512 av[ROW_VECS];
    for (int r = 0; r < ROW_VECS; ++r) av[r] = _mm512_loadu_ps(alpha + 16 * r);
    for (int64_t d0 = 0; d0 < dim; d0 += KEY_STEP) {
        __m512 acc[KEY_STEP][ROW_VECS];
        for (int c = 0; c < KEY_STEP; ++c)
            for (int r = 0; r < ROW_VECS; ++r)
                acc[c][r] = _mm512_mul_ps(_mm512_loadu_ps(ot + (d0 + c) * TILE_ROWS + 16 * r), av[r]);
        for (int64_t j = 0; j < n; ++j) {
            __m512 pv[ROW_VECS];
            for (int r = 0; r < ROW_VECS; ++r) pv[r] = _mm512_loadu_ps(p + j * TILE_ROWS + 16 * r);
            for (int c = 0; c < KEY_STEP; ++c) {
                const __m512 v = _mm512_set1_ps(values[j * dim + d0 + c]);
                for (int r = 0; r < ROW_VECS; ++r) acc[c][r] = _mm512_fmadd_ps(v, pv[r], acc[c][r]);
            }
        }
        for (int c = 0; c < KEY_STEP; ++c)
            for (int r = 0; r < ROW_VECS; ++r) _mm512_storeu_ps(ot + (d0 + c) * TILE_ROWS + 16 * r, acc[c][r]);
    }
#elif defined(__AVX2__) && defined(__FMA__)
    /* 4 columns x 3 vectors of rows, one half of the tile's rows at a time */
    for (int half = 0; half < 2; ++half) {
        const int64_t h0 = half * (TILE_ROWS / 2);
        __m256 av[3];
        for (int r = 0; r < 3; ++r) av[r] = _mm256_loadu_ps(alpha + h0 + 8 * r);
        for (int64_t d0 = 0; d0 < dim; d0 += 4) {
            __m256 acc[4][3];
            for (int c = 0; c < 4; ++c)
                for (int r = 0; r < 3; ++r)
                    acc[c][r] = _mm256_mul_ps(_mm256_loadu_ps(ot + (d0 + c) * TILE_ROWS + h0 + 8 * r), av[r]);
            for (int64_t j = 0; j < n; ++j) {
                __m256 pv[3];
                for (int r = 0; r < 3; ++r) pv[r] = _mm256_loadu_ps(p + j * TILE_ROWS + h0 + 8 * r);
                for (int c = 0; c < 4; ++c) {
                    const __m256 v = _mm256_broadcast_ss(values + j * dim + d0 + c);
                    for (int r = 0; r < 3; ++r) acc[c][r] = _mm256_fmadd_ps(v, pv[r], acc[c][r]);
                }
            }
            for (int c = 0; c < 4; ++c)
                for (int r = 0; r < 3; ++r) _mm256_storeu_ps(ot + (d0 + c) * TILE_ROWS + h0 + 8 * r, acc[c][r]);
        }
    }
#else
    for (int64_t d = 0; d < dim; ++d) {
        float *o = ot + d * TILE_ROWS;
#pragma omp simd
        for (int r = 0; r < TILE_ROWS; ++r) o[r] *= alpha[r];
        for (int64_t j = 0; j < n; ++j) {
            const float v = values[j * dim + d];
#pragma omp simd
            for (int r = 0; r < TILE_ROWS; ++r) o[r] += v * p[j * TILE_ROWS + r];
        }
    }
#endif
}

/* e^x for the softmax's x <= 0 (a score less its row's maximum), 0 below -87 (e^-87 < 2e-38: nothing beside the
 * row's maximum's e^0 = 1). glibc's vector expf sends every lane of a vector that is out of its range to its scalar
 * expf, one call a lane: the masked scores (FLOOR less a maximum) of every block on a tile's diagonal, and a long
 * context's far keys. Clamped first, no lane leaves the vector path (one layer's 512-token chunk at 512 keys 1.17x,
 * benchmarks/README.md), and every other lane's bits are expf's as before. */
static inline float exp_nonpositive(float x) {
    const float e = expf(x < -87.0f ? -87.0f : x);
    return x < -87.0f ? 0.0f : e;
}

/* St's scores a row may not see (a key past its position, or out of its window) set to FLOOR; in 32-bit offsets
 * from k0, which vectorize (a block's offsets are below BLOCK_KEYS; positions fit: a context is below 2^31) */
static void mask_scores(float *st, int64_t n, int64_t k0, const int64_t *pos, int64_t window) {
    int32_t past[TILE_ROWS], before[TILE_ROWS]; /* a key offset j is hidden where j > past or j <= before */
    for (int r = 0; r < TILE_ROWS; ++r) {
        const int64_t hi = pos[r] - k0, lo = window > 0 ? pos[r] - window - k0 : -1;
        past[r] = (int32_t)(hi < -1 ? -1 : hi > BLOCK_KEYS ? BLOCK_KEYS : hi);
        before[r] = (int32_t)(lo < -1 ? -1 : lo > BLOCK_KEYS ? BLOCK_KEYS : lo);
    }
    for (int32_t j = 0; j < (int32_t)n; ++j) {
#pragma omp simd
        for (int r = 0; r < TILE_ROWS; ++r)
            st[j * TILE_ROWS + r] = j > past[r] || j <= before[r] ? FLOOR : st[j * TILE_ROWS + r];
    }
}

/* The online softmax's step for one block of n keys beginning at position k0: m, l [TILE_ROWS] updated, St turned
 * into P in place (0 where a row may not see the key), alpha [TILE_ROWS] the factor of the rows' earlier sums.
 * `all_seen`: every row may see every key of the block, nothing to mask. The exponentials run in one loop whatever
 * the mask (a compiler may vectorize two loops differently, and a scalar expf and a vector one differ in the last
 * bit): a row's bits do not depend on its tile-mates. */
static void block_softmax(float *st, int64_t n, int64_t k0, const int64_t *pos, int64_t window, float *m, float *l,
                          float *alpha, int all_seen) {
    if (!all_seen) mask_scores(st, n, k0, pos, window);
    float best[TILE_ROWS], total[TILE_ROWS];
#pragma omp simd
    for (int r = 0; r < TILE_ROWS; ++r) best[r] = m[r];
    for (int64_t j = 0; j < n; ++j) {
#pragma omp simd
        for (int r = 0; r < TILE_ROWS; ++r) best[r] = st[j * TILE_ROWS + r] > best[r] ? st[j * TILE_ROWS + r] : best[r];
    }
#pragma omp simd
    for (int r = 0; r < TILE_ROWS; ++r) {
        alpha[r] = m[r] == FLOOR ? 0.0f : exp_nonpositive(m[r] - best[r]); /* the first valid key: nothing earlier */
        total[r] = 0.0f;
    }
    for (int64_t j = 0; j < n; ++j) {
#pragma omp simd
        for (int r = 0; r < TILE_ROWS; ++r) {
            const float p = st[j * TILE_ROWS + r] > FLOOR ? exp_nonpositive(st[j * TILE_ROWS + r] - best[r]) : 0.0f;
            st[j * TILE_ROWS + r] = p;
            total[r] += p;
        }
    }
#pragma omp simd
    for (int r = 0; r < TILE_ROWS; ++r) {
        const int seen = best[r] != FLOOR; /* rows with no valid key yet keep m = FLOOR, l = 0, Ot = 0 */
        alpha[r] = seen ? alpha[r] : 1.0f;
        l[r] = seen ? l[r] * alpha[r] + total[r] : 0.0f;
        m[r] = best[r];
    }
}

/* the job's scratch for `units` (tile, head) pairs and `tiles` tiles; NULL without memory */
static float *job_alloc(job_scratch *s, int64_t units, int64_t tiles, int64_t dim) {
    const size_t plane = (size_t)dim * TILE_ROWS;
    float *mem = malloc(sizeof(float) * (2 * units * plane + 2 * units * TILE_ROWS + 2 * BLOCK_KEYS * dim +
                                         BLOCK_KEYS * TILE_ROWS + TILE_ROWS) +
                        sizeof(int64_t) * tiles * TILE_ROWS);
    if (!mem) return NULL;
    s->qt = mem;
    s->ot = s->qt + units * plane;
    s->m = s->ot + units * plane;
    s->l = s->m + units * TILE_ROWS;
    s->keys = s->l + units * TILE_ROWS;
    s->values = s->keys + BLOCK_KEYS * dim;
    s->st = s->values + BLOCK_KEYS * dim;
    s->alpha = s->st + BLOCK_KEYS * TILE_ROWS;
    s->pos = (int64_t *)(s->alpha + TILE_ROWS);
    return mem;
}

/* jobs [j0, j1) of the list */
static void attention_jobs(void *p, int64_t j0, int64_t j1) {
    attn_ctx *c = p;
    const tm_prefill_attention_args *a = c->a;
    const int64_t dim = a->dim, group = c->group, row_stride = a->heads * dim;
    const size_t plane = (size_t)dim * TILE_ROWS;
    job_scratch s;
    float *mem = job_alloc(&s, c->tiles_per_job * group, c->tiles_per_job, dim);
    if (!mem) {
        __atomic_store_n(&c->failed, 1, __ATOMIC_RELAXED);
        return;
    }
    for (int64_t job = j0; job < j1; ++job) {
        const attn_job *jb = &c->list[job];
        const tm_attn_chunk *ch = &a->chunks[jb->chunk];
        const int64_t kvh = jb->kv_head, first_pos = ch->ctx_len - ch->q_len; /* the chunk's first position */
        int64_t last = 0; /* the job's last position */
        for (int64_t t = 0; t < jb->tiles; ++t) {
            const int64_t r0 = (jb->tile0 + t) * TILE_ROWS;
            for (int64_t r = 0; r < TILE_ROWS; ++r) {
                const int64_t pos = r0 + r < ch->q_len ? first_pos + r0 + r : -1; /* padding rows see no key */
                s.pos[t * TILE_ROWS + r] = pos;
                last = pos > last ? pos : last;
            }
            for (int64_t g = 0; g < group; ++g) {
                const int64_t hd = kvh * group + g, u = t * group + g;
                float *qt = s.qt + u * plane;
                for (int64_t d = 0; d < dim; ++d)
                    for (int64_t r = 0; r < TILE_ROWS; ++r)
                        qt[d * TILE_ROWS + r] = r0 + r < ch->q_len
                                                    ? a->q[(ch->token_start + r0 + r) * row_stride + hd * dim + d]
                                                    : 0.0f;
                memset(s.ot + u * plane, 0, sizeof(float) * plane);
                for (int64_t r = 0; r < TILE_ROWS; ++r) {
                    s.m[u * TILE_ROWS + r] = FLOOR;
                    s.l[u * TILE_ROWS + r] = 0.0f;
                }
            }
        }
        const int64_t job_first = first_pos + jb->tile0 * TILE_ROWS;
        const int64_t lowest = a->window > 0 && job_first - a->window + 1 > 0 ? job_first - a->window + 1 : 0;
        for (int64_t k0 = lowest / BLOCK_KEYS * BLOCK_KEYS; k0 <= last; k0 += BLOCK_KEYS) {
            const int64_t n = last + 1 - k0 < BLOCK_KEYS ? last + 1 - k0 : BLOCK_KEYS;
            block_rows(a, a->k_cache, ch->slots + k0, kvh, n, s.keys);
            block_rows(a, a->v_cache, ch->slots + k0, kvh, n, s.values);
            for (int64_t t = 0; t < jb->tiles; ++t) {
                const int64_t *pos = s.pos + t * TILE_ROWS, tile_first = pos[0];
                int64_t tile_last = pos[0];
                for (int64_t r = 1; r < TILE_ROWS; ++r) tile_last = pos[r] > tile_last ? pos[r] : tile_last;
                if (tile_last < k0 || (a->window > 0 && k0 + n - 1 <= tile_first - a->window))
                    continue; /* no row of the tile sees a key of the block */
                const int64_t nt = tile_last + 1 - k0 < n ? tile_last + 1 - k0 : n;
                /* every row of the tile (padding rows too: their results are dropped) sees every key */
                const int all_seen = k0 + nt - 1 <= tile_first && (a->window <= 0 || k0 > tile_last - a->window);
                for (int64_t g = 0; g < group; ++g) {
                    const int64_t u = t * group + g;
                    block_scores(s.keys, nt, s.qt + u * plane, dim, a->scale, s.st);
                    block_softmax(s.st, nt, k0, pos, a->window, s.m + u * TILE_ROWS, s.l + u * TILE_ROWS, s.alpha,
                                  all_seen);
                    block_values(s.values, nt, s.st, s.alpha, dim, s.ot + u * plane);
                }
            }
        }
        for (int64_t t = 0; t < jb->tiles; ++t) {
            const int64_t r0 = (jb->tile0 + t) * TILE_ROWS, rows = ch->q_len - r0 < TILE_ROWS ? ch->q_len - r0 : TILE_ROWS;
            for (int64_t g = 0; g < group; ++g) {
                const int64_t hd = kvh * group + g, u = t * group + g;
                const float *ot = s.ot + u * plane, *m = s.m + u * TILE_ROWS, *l = s.l + u * TILE_ROWS;
                for (int64_t r = 0; r < rows; ++r) {
                    float factor = 1.0f, total = l[r];
                    if (a->sinks) { /* one more logit, no value: the total grows, the sums rescaled if it leads */
                        const float sink = a->sinks[hd], best = sink > m[r] ? sink : m[r];
                        factor = expf(m[r] - best);
                        total = l[r] * factor + expf(sink - best);
                    }
                    const float inv = factor / total;
                    float *out = a->out + (ch->token_start + r0 + r) * row_stride + hd * dim;
                    for (int64_t d = 0; d < dim; ++d) out[d] = ot[d * TILE_ROWS + r] * inv;
                }
            }
        }
    }
    free(mem);
}

/* (tile, head) pairs a job holds at most: its scratch stays within L2 (24 KiB a pair at head size 64) */
#define JOB_UNITS 16
/* jobs per thread at least, where the tiles allow: the pool balances causal attention's unequal jobs */
#define JOBS_PER_THREAD 4

/* 0 on success; 1 for shapes it does not take, 2 for a chunk's bad lengths, 3 without memory */
int tm_prefill_attention(const tm_prefill_attention_args *a) {
    if (a->n_chunks < 1 || a->kv_heads < 1 || a->heads % a->kv_heads || a->dim % KEY_STEP ||
        !tm_kv_dtype_ok(a->kv_dtype))
        return 1;
    int64_t tiles = 0;
    for (int64_t i = 0; i < a->n_chunks; ++i) {
        if (a->chunks[i].q_len < 1 || a->chunks[i].ctx_len < a->chunks[i].q_len) return 2;
        tiles += (a->chunks[i].q_len + TILE_ROWS - 1) / TILE_ROWS;
    }
    attn_ctx c = {.a = a, .group = a->heads / a->kv_heads, .failed = 0};
    /* as many tiles a job as its scratch allows, fewer where that would leave threads without enough jobs */
    const int64_t most = JOB_UNITS / c.group > 1 ? JOB_UNITS / c.group : 1;
    const int64_t wanted = (int64_t)tm_threads() * JOBS_PER_THREAD, pairs = tiles * a->kv_heads;
    c.tiles_per_job = pairs / wanted < 1 ? 1 : pairs / wanted < most ? pairs / wanted : most;
    int64_t jobs = 0;
    for (int64_t i = 0; i < a->n_chunks; ++i) {
        const int64_t t = (a->chunks[i].q_len + TILE_ROWS - 1) / TILE_ROWS;
        jobs += a->kv_heads * ((t + c.tiles_per_job - 1) / c.tiles_per_job);
    }
    c.list = malloc(sizeof(attn_job) * jobs);
    if (!c.list) return 3;
    /* the list, each chunk's last runs of tiles (the most keys) first, then the earlier ones */
    c.jobs = 0;
    for (int64_t i = 0; i < a->n_chunks; ++i) {
        const int64_t t = (a->chunks[i].q_len + TILE_ROWS - 1) / TILE_ROWS, runs = (t + c.tiles_per_job - 1) / c.tiles_per_job;
        for (int64_t run = runs - 1; run >= 0; --run)
            for (int64_t h = 0; h < a->kv_heads; ++h) {
                const int64_t t0 = run * c.tiles_per_job;
                c.list[c.jobs++] = (attn_job){i, h, t0, t - t0 < c.tiles_per_job ? t - t0 : c.tiles_per_job};
            }
    }
    tm_pool_for(attention_jobs, &c, c.jobs, c.jobs);
    free(c.list);
    return c.failed ? 3 : 0;
}
