/* How many 256-bit integer-product instructions one core retires per second on an AVX2 CPU (12 independent chains,
 * each kept in a register by an empty volatile asm, so latency does not limit them and the compiler cannot merge
 * them): the ceiling of native/products.c's AVX2 path, whose products are vpmaddubsw (32 multiply-adds each) with
 * a vpaddw beside each, and a vpmaddwd per block for the scales. cpu_rates.c is its AVX-512 counterpart.
 *
 *     cc -O2 -march=native -o /tmp/avx2_rates benchmarks/avx2_rates.c && /tmp/avx2_rates
 */
#include <immintrin.h>
#include <stdio.h>
#include <time.h>

#define N 50000000L
#define KEEP(x) __asm__ volatile("" : "+x"(x))

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(void) {
    const __m256i w = _mm256_set1_epi8(3);
    __m256i a[12];
    for (int i = 0; i < 12; ++i) a[i] = _mm256_set1_epi8((char)(i + 1));
    double t = now();
    for (long i = 0; i < N; ++i)
#pragma GCC unroll 12
        for (int j = 0; j < 12; ++j) {
            a[j] = _mm256_maddubs_epi16(w, a[j]);
            KEEP(a[j]);
        }
    t = now() - t;
    printf("vpmaddubsw alone: %.2f G/s (%.1f GMAC/s)\n", 12.0 * N / t / 1e9, 32 * 12.0 * N / t / 1e9);
    __m256i acc[12], x[12];
    for (int i = 0; i < 12; ++i) acc[i] = _mm256_set1_epi16((short)i), x[i] = _mm256_set1_epi8((char)(i + 7));
    t = now();
    for (long i = 0; i < N; ++i)
#pragma GCC unroll 12
        for (int j = 0; j < 12; ++j) {
            __m256i p = _mm256_maddubs_epi16(w, x[j]);
            KEEP(p);
            acc[j] = _mm256_add_epi16(acc[j], p);
            KEEP(acc[j]);
        }
    t = now() - t;
    printf("vpmaddubsw + vpaddw: %.2f G pairs/s\n", 12.0 * N / t / 1e9);
    t = now();
    for (long i = 0; i < N; ++i)
#pragma GCC unroll 12
        for (int j = 0; j < 12; ++j) {
            a[j] = _mm256_madd_epi16(w, a[j]);
            KEEP(a[j]);
        }
    t = now() - t;
    printf("vpmaddwd alone: %.2f G/s\n", 12.0 * N / t / 1e9);
    __m256 f[12];
    for (int i = 0; i < 12; ++i) f[i] = _mm256_set1_ps((float)i);
    const __m256 m = _mm256_set1_ps(0.999f), c = _mm256_set1_ps(0.001f);
    t = now();
    for (long i = 0; i < N; ++i)
#pragma GCC unroll 12
        for (int j = 0; j < 12; ++j) {
            f[j] = _mm256_fmadd_ps(f[j], m, c);
            KEEP(f[j]);
        }
    t = now() - t;
    printf("vfmadd231ps: %.2f G/s (%.1f GFLOP/s)\n", 12.0 * N / t / 1e9, 16 * 12.0 * N / t / 1e9);
    long s = 0;
    for (int j = 0; j < 12; ++j) s += _mm256_extract_epi16(acc[j], 0) + _mm256_extract_epi16(a[j], 0) + (long)f[j][0];
    printf("(checksum %ld)\n", s);
    return 0;
}
