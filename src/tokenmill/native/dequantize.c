/* GGUF blocks to float32, as ggml's reference dequantization computes them (a 4-bit or 8-bit code times a
 * half-float scale is exact in float32, so a fused multiply-add rounds as the reference's separate multiply and
 * add do) */
#include "kernels.h"

/* Q4_1: per block of 20 bytes, half floats d and m, then byte i = q[i] | q[i + 16] << 4; w = q * d + m */
void tm_dequantize_q4_1(const uint8_t *blocks, int64_t n_blocks, float *out) {
#pragma omp parallel for schedule(dynamic, 16) num_threads(tm_threads())
    for (int64_t b = 0; b < n_blocks; ++b) {
        const uint8_t *block = blocks + b * 20;
        uint16_t dm[2];
        memcpy(dm, block, sizeof dm);
        const float d = half_to_float(dm[0]), m = half_to_float(dm[1]);
        float *o = out + b * QK;
        for (int i = 0; i < QK / 2; ++i) {
            o[i] = (float)(block[4 + i] & 0x0F) * d + m;
            o[i + QK / 2] = (float)(block[4 + i] >> 4) * d + m;
        }
    }
}

/* Q8_0: per block of 34 bytes, half float d, then 32 int8 codes q; w = q * d */
void tm_dequantize_q8_0(const uint8_t *blocks, int64_t n_blocks, float *out) {
#pragma omp parallel for schedule(dynamic, 16) num_threads(tm_threads())
    for (int64_t b = 0; b < n_blocks; ++b) {
        const uint8_t *block = blocks + b * 34;
        uint16_t dh;
        memcpy(&dh, block, sizeof dh);
        const float d = half_to_float(dh);
        const int8_t *q = (const int8_t *)(block + 2);
        float *o = out + b * QK;
        for (int i = 0; i < QK; ++i) o[i] = (float)q[i] * d;
    }
}
