/* How many 512-bit instructions of each kind one core retires per second (12 independent chains each, so
 * latency does not limit them): the figures behind "the 4-bit product is instruction-bound" in README.md.
 *
 *     cc -O2 -march=native -o /tmp/cpu_rates benchmarks/cpu_rates.c && /tmp/cpu_rates
 *
 * Needs AVX-512 with BF16 and VNNI. */
#include <immintrin.h>
#include <stdio.h>
#include <time.h>

#define N 100000000L

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* runs `op` on 12 independent accumulators N times; the empty asm keeps them live */
#define RATE(name, T, init, op)                                                                                    \
    {                                                                                                              \
        T a[12];                                                                                                   \
        for (int i = 0; i < 12; ++i) a[i] = init;                                                                  \
        double t = now();                                                                                          \
        for (long i = 0; i < N; ++i) {                                                                             \
            for (int j = 0; j < 12; ++j) a[j] = op;                                                                \
            __asm__ volatile("" ::"v"(a[0]), "v"(a[1]), "v"(a[2]), "v"(a[3]), "v"(a[4]), "v"(a[5]), "v"(a[6]),    \
                             "v"(a[7]), "v"(a[8]), "v"(a[9]), "v"(a[10]), "v"(a[11]));                             \
        }                                                                                                          \
        t = now() - t;                                                                                             \
        printf("{\"instruction\": \"%s\", \"g_per_s\": %.2f}\n", name, N * 12 / t / 1e9);                          \
    }

int main(void) {
    const __m512 b = _mm512_set1_ps(0.999f), c = _mm512_set1_ps(1e-4f);
    const __m512i bi = _mm512_set1_epi8(1), ci = _mm512_set1_epi8(2);
    RATE("vfmadd231ps", __m512, _mm512_set1_ps(0.1f), _mm512_fmadd_ps(a[j], b, c));
    RATE("vdpbf16ps", __m512, _mm512_set1_ps(0.1f), _mm512_dpbf16_ps(a[j], (__m512bh)bi, (__m512bh)ci));
    RATE("vpdpbusd", __m512i, _mm512_set1_epi32(1), _mm512_dpbusd_epi32(a[j], bi, ci));
    RATE("vpermps", __m512, _mm512_set1_ps(0.1f), _mm512_permutexvar_ps(bi, a[j]));
    return 0;
}
