/* How many 512-bit instructions of each kind one core retires per second (12 independent chains each, so
 * latency does not limit them): the figures behind "the 4-bit product is instruction-bound" in README.md.
 *
 *     cc -O2 -march=native -o /tmp/cpu_rates benchmarks/cpu_rates.c && /tmp/cpu_rates
 *
 * Needs AVX-512 with BF16 and VNNI (and AVX512-FP16 for the float16 lines, which are left out without it). */
#include <immintrin.h>
#include <stdio.h>
#include <time.h>

#define N 100000000L

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* runs `op` on 12 independent accumulators N times. They are 12 variables that the empty asm takes and gives
 * back in registers ("+v"): an array of them, as this file had until 2026-12-01, is kept in memory by the
 * compiler (a load and a store around every instruction), and measured the store-to-load chain instead (about
 * 1.3 G/s for every instruction; vpdpbusd's real rate here is about 3.6 G/s per core). */
#define STEP(x) x = OP(x)
#define RATE(name, T, init)                                                                                        \
    {                                                                                                              \
        T a0 = init, a1 = init, a2 = init, a3 = init, a4 = init, a5 = init;                                        \
        T a6 = init, a7 = init, a8 = init, a9 = init, a10 = init, a11 = init;                                      \
        double t = now();                                                                                          \
        for (long i = 0; i < N; ++i) {                                                                             \
            STEP(a0); STEP(a1); STEP(a2); STEP(a3); STEP(a4); STEP(a5);                                            \
            STEP(a6); STEP(a7); STEP(a8); STEP(a9); STEP(a10); STEP(a11);                                          \
            __asm__ volatile("" : "+v"(a0), "+v"(a1), "+v"(a2), "+v"(a3), "+v"(a4), "+v"(a5));                     \
            __asm__ volatile("" : "+v"(a6), "+v"(a7), "+v"(a8), "+v"(a9), "+v"(a10), "+v"(a11));                   \
        }                                                                                                          \
        t = now() - t;                                                                                             \
        printf("{\"instruction\": \"%s\", \"g_per_s\": %.2f}\n", name, N * 12 / t / 1e9);                          \
    }

/* vpdpbusd's rate with 4 other instructions (4 more chains) after every 8 of it: Zen 4 runs the multiplies
 * (vfmadd, vmulps, vpmulld, vpmaddwd, vpdpwssd) on vpdpbusd's two ports (8 : 4 gives 2/3 of its rate) and
 * conversions, integer additions, logic and shifts and float additions on the other two (no loss): the figures
 * behind products.c's "multiplies take the dot instruction's ports". */
#define DOT(x) x = _mm512_dpbusd_epi32(x, bi, ci)
#define MIXED(name, EXTRA)                                                                                         \
    {                                                                                                              \
        __m512i a0 = bi, a1 = ci, a2 = bi, a3 = ci, a4 = bi, a5 = ci, a6 = bi, a7 = ci, g0 = bi, g1 = ci, g2 = bi;  \
        __m512i g3 = ci;                                                                                           \
        __m512 f0 = b, f1 = c, f2 = b, f3 = c;                                                                     \
        double t = now();                                                                                          \
        for (long i = 0; i < N / 2; ++i) {                                                                         \
            DOT(a0); DOT(a1); DOT(a2); DOT(a3); DOT(a4); DOT(a5); DOT(a6); DOT(a7);                                \
            EXTRA;                                                                                                 \
            __asm__ volatile("" : "+v"(a0), "+v"(a1), "+v"(a2), "+v"(a3), "+v"(a4), "+v"(a5), "+v"(a6), "+v"(a7)); \
            __asm__ volatile("" : "+v"(f0), "+v"(f1), "+v"(f2), "+v"(f3), "+v"(g0), "+v"(g1), "+v"(g2), "+v"(g3)); \
        }                                                                                                          \
        t = now() - t;                                                                                             \
        printf("{\"vpdpbusd_with_4\": \"%s\", \"g_per_s\": %.2f}\n", name, N / 2 * 8 / t / 1e9);                  \
    }
#define FOUR(x, op) x##0 = op(x##0); x##1 = op(x##1); x##2 = op(x##2); x##3 = op(x##3)

#if defined(__AVX512FP16__)
_Float16 mem[64]; /* the broadcasts' source (each chain its own element: __COUNTER__) */
#endif

int main(void) {
    const __m512 b = _mm512_set1_ps(0.999f), c = _mm512_set1_ps(1e-4f);
    const __m512i bi = _mm512_set1_epi8(1), ci = _mm512_set1_epi8(2);
#define OP(x) _mm512_fmadd_ps(x, b, c)
    RATE("vfmadd231ps", __m512, _mm512_set1_ps(0.1f));
#undef OP
#define OP(x) _mm512_dpbf16_ps(x, (__m512bh)bi, (__m512bh)ci)
    RATE("vdpbf16ps", __m512, _mm512_set1_ps(0.1f));
#undef OP
#define OP(x) _mm512_dpbusd_epi32(x, bi, ci)
    RATE("vpdpbusd", __m512i, _mm512_set1_epi32(1));
#undef OP
#define OP(x) _mm512_permutexvar_ps(bi, x)
    RATE("vpermps", __m512, _mm512_set1_ps(0.1f));
#undef OP
#define FMA(x) _mm512_fmadd_ps(x, b, c)
#define MUL(x) _mm512_mul_ps(x, b)
#define ADDPS(x) _mm512_add_ps(x, b)
#define MULLD(x) _mm512_mullo_epi32(x, ci)
#define ADDD(x) _mm512_add_epi32(x, bi)
#define SHIFT(x) _mm512_srli_epi16(x, 1)
    MIXED("vfmadd231ps", FOUR(f, FMA));
    MIXED("vmulps", FOUR(f, MUL));
    MIXED("vpmulld", FOUR(g, MULLD));
    MIXED("vaddps", FOUR(f, ADDPS));
    MIXED("vpaddd", FOUR(g, ADDD));
    MIXED("vpsrlw", FOUR(g, SHIFT));
    MIXED("vcvtdq2ps", f0 = _mm512_cvtepi32_ps(g0); f1 = _mm512_cvtepi32_ps(g1); f2 = _mm512_cvtepi32_ps(g2);
          f3 = _mm512_cvtepi32_ps(g3));
#if defined(__AVX512FP16__)
    /* float16's multiply-add: 32 lanes an instruction (issue 38's float16 values' products) */
    const __m512h bh = _mm512_set1_ph((_Float16)0.999f), ch = _mm512_set1_ph((_Float16)1e-4f);
#define OP(x) _mm512_fmadd_ph(x, bh, ch)
    RATE("vfmadd231ph", __m512h, _mm512_set1_ph((_Float16)0.1f));
#undef OP
    /* ... with the other factor broadcast from memory as the instruction's operand ({1to32}: a load, no shuffle) */
#undef STEP
    /* (a base register and a displacement: with an index register too, Intel splits the instruction in two uops
     * before it is issued, and the loop ran at half the rate) */
#define STEP(x)                                                                                                    \
    __asm__("vfmadd231ph %c2(%1)%{1to32%}, %3, %0" : "+v"(x) : "r"(mem + (i & 31)), "i"(2 * (__COUNTER__ % 32)), "v"(bh))
    RATE("vfmadd231ph {1to32}", __m512h, _mm512_set1_ph((_Float16)0.1f));
#endif
    return 0;
}
