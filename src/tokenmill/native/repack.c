/* GGUF blocks into the products' layout (kernels.h), taken as the file has them: codes, sub-block scales and
 * half floats are moved, never re-coded, so a row dequantized from the layout (tm_weight_rows) is the reference's
 * float32 values exactly.
 *
 * Per type, the planes of one group of 16 rows and one unit (row j is lane j; "word w" of a plane is at
 * w * 64 + j * 4, 4 bytes of row j):
 *   Q4_0, Q4_1  codes: the block's 16 code bytes as words 0..3 (low nibbles: codes 0..15, high: 16..31).
 *               scales: d [16] (Q4_1: then m [16]), halves.
 *   Q5_0, Q5_1  as Q4_0/Q4_1, and highs: one word per row whose byte i, bit t is the 5th bit of code 4t + i (the
 *               code that the products' step t multiplies at lane byte i).
 *   Q8_0        codes: the 32 int8 codes as words 0..7. scales: d [16].
 *   Q4_K        codes: the 128 code bytes as words 0..31 (bytes 32p .. 32p + 31 hold sub-block 2p in their low
 *               nibbles and 2p + 1 in their high ones). scales: d [16], dmin [16] (halves), then the 6-bit scales
 *               [8][16] and mins [8][16] unpacked to bytes.
 *   Q5_K        as Q4_K, and highs: the file's 32 high-bit bytes as words 0..7 (byte l, bit b: the 5th bit of code
 *               l of sub-block b).
 *   Q6_K        codes: the 128 low-nibble bytes as words 0..31; highs: the 64 bytes of 2-bit pairs as words
 *               0..15; scales: d [16] (half), then the 16 int8 sub-block scales [16][16].
 *   MXFP4       codes: the block's 16 code bytes as words 0..3, as Q4_0's (a code is an index into e2m1's values,
 *               doubled: TM_MXFP4_VALUES). scales: e [16], the exponent bytes as the file has them (d = 2^(e - 128)
 *               is a power of two that a float holds exactly for every e, the two smallest as denormals: built
 *               from the byte where it is used, it is the reference's d bit for bit, in a quarter of a float's
 *               bytes and with memory the file's).
 * Memory: the file's bytes per row, plus 4 per super-block for Q4_K and Q5_K (their 12 bytes of packed 6-bit
 * scales and mins kept as 16 bytes: 2.8% and 2.3%).
 */
#include "kernels.h"

int64_t tm_weight_n(const tm_weight *w) {
    int64_t n = 0;
    for (int64_t p = 0; p < w->n_parts; ++p) n += w->parts[p].n;
    return n;
}

int tm_weight_check(const tm_weight *w) {
    if (w->n_parts < 1 || w->n_parts > TM_MAX_PARTS) return -1;
    for (int64_t p = 0; p < w->n_parts; ++p) {
        const tm_part *part = &w->parts[p];
        if (!tm_type_known(part->type) || part->n <= 0 || part->n % GROUP || part->k <= 0 || !part->data) return -1;
        if (part->k % tm_unit_values(part->type) || part->k != w->parts[0].k) return -1;
    }
    return 0;
}

/* bytes of the repacked weight of n rows (rounded up to whole groups) and k inputs; -1 for a type the products do
 * not take or a k that is not a whole number of units */
int64_t tm_repack_bytes(int64_t type, int64_t n, int64_t k) {
    if (!tm_type_known(type) || n < 0 || k <= 0 || k % tm_unit_values(type)) return -1;
    return (n + GROUP - 1) / GROUP * (k / tm_unit_values(type)) * tm_unit_bytes(type);
}

static inline uint16_t load_u16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* the 4-byte words of `bytes` (a multiple of 4) of one row into a plane: word w at w * 64 + j * 4 */
static inline void put_words(uint8_t *plane, int j, const uint8_t *src, int64_t bytes) {
    for (int64_t w = 0; w < bytes / 4; ++w) memcpy(plane + w * 64 + j * 4, src + w * 4, 4);
}

/* Q4_K/Q5_K's 12 bytes of 6-bit scales and mins -> 8 of each (as gguf.quants' get_scale_min) */
static void k_scales_mins(const uint8_t *s, uint8_t sc[8], uint8_t mn[8]) {
    for (int i = 0; i < 4; ++i) {
        sc[i] = s[i] & 0x3F;
        mn[i] = s[4 + i] & 0x3F;
        sc[4 + i] = (s[8 + i] & 0x0F) | ((s[i] >> 2) & 0x30);
        mn[4 + i] = (s[8 + i] >> 4) | ((s[4 + i] >> 2) & 0x30);
    }
}

/* Q5_0/Q5_1's 32 high bits (bit c: code c) -> the plane's word: byte i, bit t = the high bit of code 4t + i */
static inline uint32_t q5_high_word(uint32_t qh) {
    uint32_t out = 0;
    for (int t = 0; t < 8; ++t)
        for (int i = 0; i < 4; ++i) out |= ((qh >> (4 * t + i)) & 1u) << (8 * i + t);
    return out;
}

/* one row's unit (src: its bytes in the file) into the group's planes at lane j */
static void repack_unit(int64_t type, const uint8_t *src, int j, uint8_t *qs, uint8_t *qh, uint8_t *sc) {
    uint16_t *half = (uint16_t *)sc; /* the halves come first in every scales plane */
    switch (type) {
    case TM_Q4_0:
        half[j] = load_u16(src);
        put_words(qs, j, src + 2, 16);
        break;
    case TM_Q4_1:
        half[j] = load_u16(src);
        half[GROUP + j] = load_u16(src + 2);
        put_words(qs, j, src + 4, 16);
        break;
    case TM_Q5_0:
    case TM_Q5_1: {
        const int off = type == TM_Q5_1 ? 4 : 2; /* Q5_1: d, m; Q5_0: d */
        half[j] = load_u16(src);
        if (type == TM_Q5_1) half[GROUP + j] = load_u16(src + 2);
        uint32_t bits;
        memcpy(&bits, src + off, 4);
        const uint32_t word = q5_high_word(bits);
        memcpy(qh + j * 4, &word, 4);
        put_words(qs, j, src + off + 4, 16);
        break;
    }
    case TM_Q8_0:
        half[j] = load_u16(src);
        put_words(qs, j, src + 2, 32);
        break;
    case TM_Q4_K:
    case TM_Q5_K: {
        half[j] = load_u16(src);
        half[GROUP + j] = load_u16(src + 2);
        uint8_t s[8], m[8];
        k_scales_mins(src + 4, s, m);
        for (int b = 0; b < 8; ++b) {
            sc[4 * GROUP + b * GROUP + j] = s[b];
            sc[12 * GROUP + b * GROUP + j] = m[b];
        }
        if (type == TM_Q5_K) {
            put_words(qh, j, src + 16, 32);
            put_words(qs, j, src + 48, 128);
        } else {
            put_words(qs, j, src + 16, 128);
        }
        break;
    }
    case TM_Q6_K:
        put_words(qs, j, src, 128);
        put_words(qh, j, src + 128, 64);
        for (int s = 0; s < 16; ++s) sc[2 * GROUP + s * GROUP + j] = src[192 + s];
        half[j] = load_u16(src + 208);
        break;
    case TM_MXFP4:
        sc[j] = src[0];
        put_words(qs, j, src + 1, 16);
        break;
    }
}

typedef struct {
    int64_t type, n, k;
    const uint8_t *raw;
    uint8_t *out;
} repack_job;

/* groups [g0, g1) */
static void repack_groups(void *p, int64_t g0, int64_t g1) {
    const repack_job *r = p;
    const int64_t type = r->type, n = r->n, units = r->k / tm_unit_values(type);
    const uint8_t *raw = r->raw;
    uint8_t *out = r->out;
    const int64_t row_bytes = units * tm_file_bytes(type), unit_bytes = tm_unit_bytes(type);
    const int64_t qs_bytes = tm_qs_bytes(type), qh_bytes = tm_qh_bytes(type), sc_bytes = tm_sc_bytes(type);
    for (int64_t g = g0; g < g1; ++g) {
        uint8_t *base = out + g * units * unit_bytes;
        uint8_t *qs = base, *qh = base + units * qs_bytes, *sc = qh + units * qh_bytes;
        if ((g + 1) * GROUP > n) memset(base, 0, (size_t)(units * unit_bytes)); /* the padded last group */
        for (int64_t u = 0; u < units; ++u)
            for (int j = 0; j < GROUP && g * GROUP + j < n; ++j)
                repack_unit(type, raw + (g * GROUP + j) * row_bytes + u * tm_file_bytes(type), j, qs + u * qs_bytes,
                            qh + u * qh_bytes, sc + u * sc_bytes);
    }
}

/* raw: n rows of a GGUF tensor of `type` ([n, k / unit * file bytes], as stored) -> out: tm_repack_bytes(type, n,
 * k) bytes in the products' layout, rows past n zero (their outputs are 0), in pieces of 16 groups shared by the
 * threads (pool.c). Returns 0, or -1 as tm_repack_bytes. */
int tm_repack(int64_t type, const uint8_t *raw, int64_t n, int64_t k, uint8_t *out) {
    if (tm_repack_bytes(type, n, k) < 0) return -1;
    const int64_t groups = (n + GROUP - 1) / GROUP;
    repack_job r = {type, n, k, raw, out};
    tm_pool_for(repack_groups, &r, groups, (groups + 15) / 16);
    return 0;
}

/* ---- rows back to float32, exactly as the reference dequantization (gguf.quants, ggml) computes them ---------
 * (each code times its float32 scale is exact, so contracting the one addition into an FMA rounds alike) */

/* byte i of row j's word w of a plane */
static inline uint8_t plane_byte(const uint8_t *plane, int64_t w, int j, int i) { return plane[w * 64 + j * 4 + i]; }

/* the unit's values of lane j (out: tm_unit_values(type) floats) */
static void unit_row(int64_t type, const uint8_t *qs, const uint8_t *qh, const uint8_t *sc, int j, float *out) {
    const uint16_t *half = (const uint16_t *)sc;
    switch (type) {
    case TM_Q4_0: case TM_Q4_1: case TM_Q5_0: case TM_Q5_1: {
        const float d = half_to_float(half[j]);
        const int five = type == TM_Q5_0 || type == TM_Q5_1, with_min = type == TM_Q4_1 || type == TM_Q5_1;
        const float m = with_min ? half_to_float(half[GROUP + j]) : 0.0f;
        const int offset = with_min ? 0 : (five ? 16 : 8);
        for (int c = 0; c < QK; ++c) {
            const int t = c / 4, i = c % 4; /* code c is at step t, byte i (codes 16.. in the high nibbles) */
            int q = (plane_byte(qs, t & 3, j, i) >> (t >= 4 ? 4 : 0)) & 0x0F;
            if (five) q |= ((plane_byte(qh, 0, j, i) >> t) & 1) << 4;
            out[c] = with_min ? d * (float)q + m : d * (float)(q - offset);
        }
        break;
    }
    case TM_Q8_0: {
        const float d = half_to_float(half[j]);
        for (int c = 0; c < QK; ++c) out[c] = d * (float)(int8_t)plane_byte(qs, c / 4, j, c % 4);
        break;
    }
    case TM_Q4_K: case TM_Q5_K: {
        const float d = half_to_float(half[j]), dmin = half_to_float(half[GROUP + j]);
        for (int b = 0; b < 8; ++b) {
            const float scale = d * (float)sc[4 * GROUP + b * GROUP + j];
            const float min = dmin * (float)sc[12 * GROUP + b * GROUP + j];
            for (int l = 0; l < QK; ++l) {
                int q = (plane_byte(qs, 8 * (b / 2) + l / 4, j, l % 4) >> (4 * (b % 2))) & 0x0F;
                if (type == TM_Q5_K) q |= ((plane_byte(qh, l / 4, j, l % 4) >> b) & 1) << 4;
                out[32 * b + l] = scale * (float)q - min;
            }
        }
        break;
    }
    case TM_Q6_K: {
        const float d = half_to_float(half[j]);
        for (int c = 0; c < 8; ++c) { /* block of 32 c: half c / 4, quarter c % 4 of the half's 128 values */
            const int hh = c / 4, q4 = c % 4;
            for (int l = 0; l < QK; ++l) {
                const int low = (plane_byte(qs, 16 * hh + 8 * (q4 % 2) + l / 4, j, l % 4) >> (4 * (q4 / 2))) & 0x0F;
                const int high = (plane_byte(qh, 8 * hh + l / 4, j, l % 4) >> (2 * q4)) & 0x03;
                const float scale = d * (float)(int8_t)sc[2 * GROUP + (2 * c + l / 16) * GROUP + j];
                out[32 * c + l] = scale * (float)((low | high << 4) - 32);
            }
        }
        break;
    }
    case TM_MXFP4: {
        static const int8_t values[16] = {TM_MXFP4_VALUES};
        const float d = tm_e8m0_half(sc[j]);
        for (int c = 0; c < QK; ++c) {
            const int t = c / 4, i = c % 4; /* as Q4_0's */
            out[c] = d * (float)values[(plane_byte(qs, t & 3, j, i) >> (t >= 4 ? 4 : 0)) & 0x0F];
        }
        break;
    }
    }
}

typedef struct {
    const tm_weight *w;
    const int64_t *ids;
    float *out;
} rows_job;

/* rows [r0, r1) of the ids */
static void weight_rows(void *p, int64_t r0, int64_t r1) {
    const rows_job *j = p;
    const tm_weight *w = j->w;
    const int64_t *ids = j->ids, k = w->parts[0].k;
    float *out = j->out;
    for (int64_t r = r0; r < r1; ++r) {
        int64_t row = ids[r], p = 0;
        while (row >= w->parts[p].n) row -= w->parts[p++].n;
        const tm_part *part = &w->parts[p];
        const int64_t type = part->type, units = k / tm_unit_values(type);
        const uint8_t *base = tm_group_base(part, row / GROUP);
        const uint8_t *qs = base, *qh = qs + units * tm_qs_bytes(type), *sc = qh + units * tm_qh_bytes(type);
        for (int64_t u = 0; u < units; ++u)
            unit_row(type, qs + u * tm_qs_bytes(type), qh + u * tm_qh_bytes(type), sc + u * tm_sc_bytes(type),
                     (int)(row % GROUP), out + r * k + u * tm_unit_values(type));
    }
}

/* out [count, k] = rows ids (0 .. tm_weight_n(w) - 1: the parts' rows in order, padding included) of w, in pieces
 * of 16 rows shared by the threads (pool.c). Returns 0, or -1 for a malformed weight or an id out of range. */
int tm_weight_rows(const tm_weight *w, const int64_t *ids, int64_t count, float *out) {
    if (tm_weight_check(w)) return -1;
    const int64_t n = tm_weight_n(w);
    for (int64_t r = 0; r < count; ++r)
        if (ids[r] < 0 || ids[r] >= n) return -1;
    rows_job j = {w, ids, out};
    tm_pool_for(weight_rows, &j, count, (count + 15) / 16);
    return 0;
}
