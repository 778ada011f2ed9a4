/* LoRA's low-rank products for rows of activations: y[i] = B (A x[i]) with A [rank][in] and B given transposed
 * in blocks of 64 output columns, bt [ceil(out / 64)][rank][64] (layers/lora.py folds the scale into B, and zeros
 * past out). torch's float32 GEMM picks its kernel and how its threads split a sum by the row count, so a row's
 * last bits changed with the rows beside it (benchmarks/lora_invariance.py: an adapter row's log-probability moved
 * by up to 0.01 between a batch and alone, through the int8 activations of the native products that follow). Here each value has one sequence of operations whatever the row count, the
 * tile its row falls in and the thread that computes it (threads split rows, never a sum):
 *
 *     t[r] = sum over k of a[r][k] * x[k]: 16 lanes (k mod 16), each a chain of fused multiply-adds from 0 in k
 *            order (the last partial run of 16 masked to zeros), then the lanes summed by one fixed reduction
 *     y[j] = sum over r of t[r] * B[j][r]: a chain of fused multiply-adds from 0 in r order
 *
 * The AVX-512 path computes tiles of ROW_TILE rows (each loaded weight vector serves them all) and the leftover
 * rows one at a time, with the same operations per value; the plain-C path one row at a time, in one function that
 * is never inlined (one copy of its code). */
#include "kernels.h"

#define ROW_TILE 4

typedef struct {
    const float *x, *a, *bt;
    int64_t in, rank, out;
    float *y, *t; /* t [n][rank]: each row's A x */
} lowrank_args;

#if defined(__AVX512F__)
/* t[i][r0 .. r0 + 4) for `rows` (1 or ROW_TILE) rows from i0; ranks past `rank` are not written */
static inline void dots_tile(const lowrank_args *p, int64_t i0, int64_t rows, int64_t r0) {
    __m512 acc[ROW_TILE][4];
    const int64_t ranks = p->rank - r0 < 4 ? p->rank - r0 : 4;
    for (int64_t i = 0; i < rows; ++i)
        for (int r = 0; r < 4; ++r) acc[i][r] = _mm512_setzero_ps();
    for (int64_t k = 0; k < p->in; k += 16) {
        const __mmask16 m = p->in - k >= 16 ? 0xFFFF : (__mmask16)((1u << (p->in - k)) - 1);
        __m512 w[4];
        for (int r = 0; r < 4; ++r)
            w[r] = r < ranks ? _mm512_maskz_loadu_ps(m, p->a + (r0 + r) * p->in + k) : _mm512_setzero_ps();
        for (int64_t i = 0; i < rows; ++i) {
            const __m512 xv = _mm512_maskz_loadu_ps(m, p->x + (i0 + i) * p->in + k);
            for (int r = 0; r < 4; ++r) acc[i][r] = _mm512_fmadd_ps(w[r], xv, acc[i][r]);
        }
    }
    for (int64_t i = 0; i < rows; ++i)
        for (int r = 0; r < ranks; ++r) p->t[(i0 + i) * p->rank + r0 + r] = _mm512_reduce_add_ps(acc[i][r]);
}

/* y[i][j0 .. j0 + 64) for `rows` rows from i0 (columns past `out` are not written) */
static inline void sums_tile(const lowrank_args *p, int64_t i0, int64_t rows, int64_t j0) {
    __m512 acc[ROW_TILE][4];
    __mmask16 m[4];
    for (int c = 0; c < 4; ++c) {
        const int64_t left = p->out - (j0 + 16 * c);
        m[c] = left >= 16 ? 0xFFFF : left <= 0 ? 0 : (__mmask16)((1u << left) - 1);
    }
    for (int64_t i = 0; i < rows; ++i)
        for (int c = 0; c < 4; ++c) acc[i][c] = _mm512_setzero_ps();
    for (int64_t r = 0; r < p->rank; ++r) {
        __m512 b[4];
        const float *row = p->bt + j0 * p->rank + r * 64; /* block j0 / 64's 64 columns of rank r */
        for (int c = 0; c < 4; ++c) b[c] = _mm512_loadu_ps(row + 16 * c);
        for (int64_t i = 0; i < rows; ++i) {
            const __m512 tv = _mm512_set1_ps(p->t[(i0 + i) * p->rank + r]);
            for (int c = 0; c < 4; ++c) acc[i][c] = _mm512_fmadd_ps(tv, b[c], acc[i][c]);
        }
    }
    for (int64_t i = 0; i < rows; ++i)
        for (int c = 0; c < 4; ++c) _mm512_mask_storeu_ps(p->y + (i0 + i) * p->out + j0 + 16 * c, m[c], acc[i][c]);
}

/* rows [begin, end): every row's t first, then y a block of 64 columns at a time over all the rows, so that the
 * block's bt (rank x 64 floats) stays in L1 for every tile (read from L2 per tile it capped the sums at a third of
 * the FMA rate) */
static void rows_product(void *ctx, int64_t begin, int64_t end) {
    const lowrank_args *p = ctx;
    for (int64_t i = begin; i < end;) {
        const int64_t rows = end - i >= ROW_TILE ? ROW_TILE : 1;
        for (int64_t r0 = 0; r0 < p->rank; r0 += 4) {
            if (rows == ROW_TILE)
                dots_tile(p, i, ROW_TILE, r0);
            else
                dots_tile(p, i, 1, r0);
        }
        i += rows;
    }
    for (int64_t j0 = 0; j0 < p->out; j0 += 64) {
        for (int64_t i = begin; i < end;) {
            const int64_t rows = end - i >= ROW_TILE ? ROW_TILE : 1;
            if (rows == ROW_TILE)
                sums_tile(p, i, ROW_TILE, j0);
            else
                sums_tile(p, i, 1, j0);
            i += rows;
        }
    }
}
#else
/* one row: the only code that computes a row's values */
__attribute__((noinline)) static void row_product(const lowrank_args *p, int64_t i) {
    const float *x = p->x + i * p->in;
    float *t = p->t + i * p->rank, *y = p->y + i * p->out;
    for (int64_t r = 0; r < p->rank; ++r) {
        const float *a = p->a + r * p->in;
        float lanes[16] = {0};
        for (int64_t k = 0; k < p->in; ++k) lanes[k % 16] += a[k] * x[k];
        for (int w = 8; w; w /= 2)
            for (int l = 0; l < w; ++l) lanes[l] += lanes[l + w];
        t[r] = lanes[0];
    }
    for (int64_t j = 0; j < p->out; ++j) y[j] = 0.0f;
    for (int64_t r = 0; r < p->rank; ++r)
        for (int64_t j = 0; j < p->out; ++j) y[j] += t[r] * p->bt[j / 64 * 64 * p->rank + r * 64 + j % 64];
}

static void rows_product(void *ctx, int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) row_product(ctx, i);
}
#endif

/* y [n][out] = (x [n][in] . a [rank][in]^T) . B^T, bt as above; 0, or -1 on bad sizes, -2 out of memory */
int tm_lowrank_rows(const float *x, int64_t n, int64_t in, const float *a, int64_t rank, const float *bt, int64_t out,
                    float *y) {
    if (n < 0 || in < 1 || rank < 1 || out < 1) return -1;
    if (n == 0) return 0;
    float *t = malloc(sizeof(float) * (size_t)(n * rank));
    if (!t) return -2;
    lowrank_args p = {x, a, bt, in, rank, out, y, t};
    /* pieces of whole tiles; one row is rank * (in + out) multiply-adds: a few rows are not worth a thread */
    const int64_t pieces = n < 2 * ROW_TILE ? 1 : n / ROW_TILE;
    tm_pool_for(rows_product, &p, n, pieces);
    free(t);
    return 0;
}
