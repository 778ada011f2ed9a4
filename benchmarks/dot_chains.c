/* How many vpdpbusd a core completes per second with R rows x STEPS steps per block and CH chains per row, the
 * activation as the embedded-broadcast memory operand (the shape of products.c's prompt tiles). issue 38: 8 rows x
 * 1 chain is latency-bound; two chains per row, or more rows, approach the ports' peak.
 *     cc -O3 -march=native -DR=8 -DSTEPS=8 -DCH=2 benchmarks/dot_chains.c -o /tmp/dot_chains && /tmp/dot_chains */
#include <immintrin.h>
#include <stdio.h>
#include <stdint.h>
#include <time.h>
#include <stdlib.h>
#include <string.h>
static inline __m512i dotb(__m512i acc, __m512i w, const int8_t *p) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const int32_t *)p));
    return acc;
}
static double now(void){struct timespec t; clock_gettime(CLOCK_MONOTONIC,&t); return t.tv_sec+t.tv_nsec*1e-9;}
#ifndef R
#define R 8
#endif
#ifndef STEPS
#define STEPS 8
#endif
#ifndef CH
#define CH 1
#endif
int main(void) {
    /* act: 16 KiB like a tile's 8 rows of k=2048 */
    int8_t *act = aligned_alloc(64, 1 << 16); memset(act, 1, 1 << 16);
    uint8_t *wq = aligned_alloc(64, 1 << 16); memset(wq, 2, 1 << 16);
    long iters = 2000000;
    __m512i tot = _mm512_setzero_si512();
    double t0 = now();
    for (long it = 0; it < iters; ++it) {
        const int off = (it & 63) * 256;     /* walk 16 KiB of activations */
        const uint8_t *wb = wq + (it & 31) * 512;
        __m512i acc[R][CH];
        for (int r = 0; r < R; ++r) for (int c = 0; c < CH; ++c) acc[r][c] = _mm512_setzero_si512();
#pragma GCC unroll 16
        for (int t = 0; t < STEPS; ++t) {
            __m512i w = _mm512_load_si512(wb + t * 64);
#pragma GCC unroll 16
            for (int r = 0; r < R; ++r) acc[r][t % CH] = dotb(acc[r][t % CH], w, act + off + t * 32 + 4 * r);
        }
        for (int r = 0; r < R; ++r) for (int c = 0; c < CH; ++c) tot = _mm512_add_epi32(tot, acc[r][c]);
    }
    double dt = now() - t0;
    int out[16]; _mm512_storeu_si512(out, tot);
    printf("R=%d STEPS=%d CH=%d: %.2f G dots/s (%d)\n", R, STEPS, CH, (double)iters * R * STEPS / dt / 1e9, out[0]);
}
