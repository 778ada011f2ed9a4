/* Shared declarations of tokenmill's native kernels (products.c, dequantize.c, decoder.c).
 *
 * Vector paths: AVX-512 VNNI, AVX2 with FMA and F16C, and portable C; the compiler picks with -march=native.
 * Threads: OpenMP (tokenmill loads this library after torch, so `libgomp.so.1` resolves to torch's copy and both
 * share one thread pool).
 */
#ifndef TM_KERNELS_H
#define TM_KERNELS_H
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

#define LO_STEPS 254.0f /* the second activation pass resolves one step of the first into 254 */

typedef struct {
    int8_t *hi, *lo;  /* [m, k] codes of the two passes */
    float *scale;     /* [m, k/32]: x ~ scale * (hi + lo / 254) */
    float *sum;       /* [m, k/32]: sum of the block's quantized values */
    int32_t *sum_hi, *sum_lo; /* [m, k/32]: sums of the codes of each pass */
} tm_qx;

typedef struct {
    const uint8_t *qs; /* [n/16, k/32, 256] interleaved 4-bit codes (tm_q4_interleave), or 512 int8 codes (8 bits) */
    const uint16_t *d; /* [n/16, k/32, 16] block scales (half floats) */
    const uint16_t *m; /* [n/16, k/32, 16] block minimums (half floats); NULL for 8 bits */
    int64_t n, k;      /* output (a multiple of 16) and input features */
    int64_t bits;      /* 4 (Q4_1's scheme) or 8 (Q8_0's) */
} tm_packed_weight;

/* IEEE half -> float (dequantization and the portable path; the vector paths convert with vcvtph2ps) */
static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h >> 15) << 31, exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF;
    if (exponent == 0) return (sign ? -1.0f : 1.0f) * ldexpf((float)mantissa, -24); /* zero and subnormals */
    uint32_t bits = sign | (exponent == 31 ? 0x7F800000u | mantissa << 13 : (exponent + 112) << 23 | mantissa << 13);
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* products.c: the quantized activations and the products over them, for the decoder's parallel regions */
int tm_qx_alloc(tm_qx *a, int64_t m, int64_t k);
void tm_qx_free(tm_qx *a);
void tm_quantize_rows(const float *x, int64_t m, int64_t k, const tm_qx *a);
void tm_grouped_matmul(const tm_qx *a, int64_t m, int64_t k, int bits, const uint8_t *qs, const uint16_t *d,
                       const uint16_t *mn, int64_t n, float *y);

#endif
