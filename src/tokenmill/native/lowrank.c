/* LoRA's low-rank products for rows of activations: y[i] = B (A x[i]) with A [rank][in] and B given transposed,
 * bt [rank][out] (layers/lora.py folds the scale into B). torch's float32 GEMM picks its kernel and how its threads
 * split a sum by the row count, so a row's last bits changed with the rows beside it (benchmarks/lora_invariance.py:
 * an adapter row's log-probabilities moved by up to 0.01 between a batch and alone, through the int8 activations of
 * the native products that follow). Here each value has one order of operations whatever the row count and
 * whichever thread computes it: a row is one call of row_product, which is never inlined (one copy of its code),
 * and the threads split rows, never a sum.
 *
 *     t[r] = sum over k of a[r][k] * x[k]: 16 lanes (k mod 16), each summed in k order, then the lanes halved
 *            8, 4, 2, 1 (four ranks at a time: four independent chains keep the FMA unit busy)
 *     y[j] = sum over r of t[r] * bt[r][j], r in order (vectorized along j)
 *
 * Cost: rank * (in + out) multiply-adds a row, ~2-3% of the base projection's at rank 16. */
#include "kernels.h"

#define LANES 16
#define RANKS_AT_ONCE 4

typedef struct {
    const float *x, *a, *bt;
    int64_t in, rank, out;
    float *y, *t; /* t: per row of a piece, rank floats (pieces write their own rows' slots) */
} lowrank_args;

/* t[r0 .. r0 + RANKS_AT_ONCE) for one row; `count` <= RANKS_AT_ONCE of them are real */
static void dots(const float *x, const float *a, int64_t in, int64_t count, float *t) {
    float acc[RANKS_AT_ONCE][LANES] = {{0}};
    int64_t k = 0;
    for (; k + LANES <= in; k += LANES)
        for (int64_t r = 0; r < count; ++r)
            for (int l = 0; l < LANES; ++l) acc[r][l] += a[r * in + k + l] * x[k + l];
    for (int64_t r = 0; r < count; ++r)
        for (int l = 0; k + l < in; ++l) acc[r][l] += a[r * in + k + l] * x[k + l];
    for (int64_t r = 0; r < count; ++r) {
        for (int w = LANES / 2; w; w /= 2)
            for (int l = 0; l < w; ++l) acc[r][l] += acc[r][l + w];
        t[r] = acc[r][0];
    }
}

/* one row: the only code that computes a row's values */
__attribute__((noinline)) static void row_product(const lowrank_args *p, int64_t i, float *t) {
    const float *x = p->x + i * p->in;
    for (int64_t r = 0; r < p->rank; r += RANKS_AT_ONCE) {
        const int64_t count = p->rank - r < RANKS_AT_ONCE ? p->rank - r : RANKS_AT_ONCE;
        dots(x, p->a + r * p->in, p->in, count, t + r);
    }
    float *y = p->y + i * p->out;
    for (int64_t j = 0; j < p->out; ++j) y[j] = t[0] * p->bt[j];
    for (int64_t r = 1; r < p->rank; ++r) {
        const float tr = t[r], *b = p->bt + r * p->out;
        for (int64_t j = 0; j < p->out; ++j) y[j] += tr * b[j];
    }
}

static void rows(void *ctx, int64_t begin, int64_t end) {
    const lowrank_args *p = ctx;
    for (int64_t i = begin; i < end; ++i) row_product(p, i, p->t + i * p->rank);
}

/* y [n][out] = (x [n][in] . a [rank][in]^T) . bt [rank][out]; 0, or -1 on bad sizes, -2 out of memory */
int tm_lowrank_rows(const float *x, int64_t n, int64_t in, const float *a, int64_t rank, const float *bt, int64_t out,
                    float *y) {
    if (n < 0 || in < 1 || rank < 1 || out < 1) return -1;
    if (n == 0) return 0;
    float *t = malloc(sizeof(float) * (size_t)(n * rank));
    if (!t) return -2;
    lowrank_args p = {x, a, bt, in, rank, out, y, t};
    /* a piece of rows per thread-sized share, at least 8 rows: one row is ~rank * (in + out) multiply-adds */
    const int64_t pieces = n < 16 ? 1 : (n + 7) / 8;
    tm_pool_for(rows, &p, n, pieces);
    free(t);
    return 0;
}
