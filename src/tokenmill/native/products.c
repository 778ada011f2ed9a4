/* Matrix products y = x @ W.T with W in GGUF's block types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K,
 * MXFP4) as repack.c lays them out: integer dot products of the weights' codes with int8 activation codes, then per
 * block of 32 inputs one float step with the block's scales. W's values are the reference dequantization's
 * exactly, so the only error is the activations' quantization.
 *
 * Activations are quantized per row and block of 32: s = max|x| / 127, hi = round(x / s) in one pass (as
 * llama.cpp's Q8 activations: error up to s / 2 per value), and with a second pass lo = round((x / s - hi) * 254),
 * x ~ s * (hi + lo / 254), error below max|x| / 64,516 per value (on the references greedy decoding keeps all 32
 * tokens of float32 with two passes, where one pass drifts away after 3 to 32 tokens). Per block:
 *     dot(w, x) ~ s * dws * (dot(q, hi) [+ dot(q, lo) / 254])  - wm * sum(x)
 * with dws the block's weight scale (d, or d * sc for K-quants; MXFP4: d = 2^(e - 128) built from its exponent
 * byte), wm its minimum (Q4_1, Q5_1, K-quants' dmin * mn), and sum(x) the sum of the quantized values (so that each
 * weight multiplies the same activation). Codes with an offset (Q4_0: q - 8, Q5_0: q - 16, Q8_0's codes moved to
 * unsigned q + 128, Q6_K: q - 32 per 16 values, MXFP4: below) take offset * (the activation codes' sum) off the
 * integer dot, exactly.
 *
 * MXFP4's codes index e2m1's values doubled, -12 .. 12 (TM_MXFP4_VALUES): the vector paths look them up with one
 * byte shuffle (vpshufb) per 64 bytes of codes in a table of the values plus 16, 4 .. 28, unsigned for the dot
 * instructions, and take 16 * (the codes' sum) off as for Q5_0: per group and step one shuffle, where moving the
 * values' signs onto the activations (llama.cpp's way, vpsignb) would cost an operation per row and step.
 *
 * One pass into a weight with a K-quant part shares s over the 8 blocks of a super-block (256 values, as
 * llama.cpp's Q8_K; tm_activation_group): the AVX-512 path then sums each block's integer dot times the weight's
 * integer sub-block scale exactly over the super-block and takes one float step per super-block (tile_k256),
 * +3-10% on Q4_K, -3 to +7% on Q6_K on one core (paired against per-32 scales); the AVX2 path does the same
 * (its tile_k256: an integer scale per block by vpmaddwd, Q4_K at 512 rows about 2x its float form). The cost is
 * accuracy where activations have outliers: Gemma 3 270M's median top-10 drift 0.17 -> 0.30 (llama.cpp 0.18),
 * greedy tokens agreeing with HF float32 as long as llama.cpp's (benchmarks/README.md). The portable path computes
 * the same values with its per-block steps.
 *
 * The vector paths multiply 16 rows at once: a 64-byte load of a plane gives 4 codes of each of the 16 rows of a
 * group per 32-bit lane, and one unsigned x signed byte dot instruction (AVX-512 VNNI vpdpbusd, with the 4 codes
 * of the activation row broadcast to every lane) adds 4 products to each row's sum: a block ends with the 16 rows'
 * sums in one vector, no reductions. AVX2 does two halves of 8 rows with vpmaddubsw (16-bit pair sums, widened
 * with vpmaddwd before they could overflow) and the portable C path the same sums one by one.
 *
 * Tiling: a tile is R activation rows (R <= 8 on AVX-512, 4 elsewhere) times one group, over all of k: the
 * group's codes are loaded once per tile and serve its R rows. Up to that many rows (decode), each weight byte is
 * read once per call; prompt chunks are cut into blocks of rows whose quantized activations fit in L2, and each
 * block runs over all of the thread's groups (the weights stream from memory once per block of rows). With one
 * pass into a K-quant, a block of rows takes a group a panel of super-blocks at a time, its codes unpacked once for
 * all of the block's tiles (run_panels; AVX-512 and AVX2).
 *
 * Batch invariance: integer sums are exact, and each row's float accumulator takes its blocks in the same order
 * with the same operations whatever the tile's R, so a row's output is the same bits in any call.
 */
#include "kernels.h"

#define ALWAYS static inline __attribute__((always_inline))
/* -ffast-math lets the compiler reassociate products (say d * sc * xs as (d * xs) * sc, the factor d * xs shared
 * by a block's two halves) and decide so differently in each tile's copy: a weight scale made opaque once computed
 * is multiplied the same way in every copy, so a row's bits do not depend on the tile it is in */
#define OPAQUE_VECTOR(v) __asm__("" : "+v"(v))
#define OPAQUE_SCALAR(f) __asm__("" : "+g"(f))

/* Rows of a tile: its rows' integer and float accumulators stay in registers (AVX-512 has 32 vector registers,
 * AVX2 16). Tiles of 12 rows with one pass measured no faster than 8 (the weights' unpacking is not what limits). */
#if defined(TM_AVX512_VNNI)
#define MAX_ROWS 8
#else
#define MAX_ROWS 4
#endif
/* up to this many rows, two integer chains per pass and row (the dot instruction's latency); above, one */
#define SPLIT_ROWS 2
/* a block of prompt rows keeps its quantized activations within this many bytes (L2 is 1 MiB per core here) */
/* Each load of codes asks L2 for the line this far ahead in the group's codes (and then the next group's), the
 * highs and scales planes likewise in proportion: the loads from memory overlap the arithmetic. Into L2 and 32 KiB
 * ahead, at 1, 2, 4 and 8 rows: Q4_K +40%, +60%, +5%, +35% (into L1 8 KiB ahead: +7% at one row); at 512 rows no
 * change (medians of 7 alternating runs of a C timing loop). */
#define PREFETCH_BYTES 32768
#define PREFETCH_ROWS MAX_ROWS /* every tile */
#define PREFETCH(p) _mm_prefetch((const char *)(p), _MM_HINT_T1)
#define ROW_BLOCK_BYTES (384 * 1024)

/* which vector path this build runs */
const char *tm_vector_path(void) {
#if defined(TM_AVX512_VNNI)
    return "avx512-vnni";
#elif defined(TM_AVX2)
    return "avx2";
#else
    return "portable";
#endif
}

/* ---- activations ---------------------------------------------------------------------------------------------- */

static void *alloc_or_dummy(size_t bytes) { return malloc(bytes ? bytes : 1); }

int tm_qx_alloc(tm_qx *a, int64_t m, int64_t k, int64_t passes) {
    const size_t values = (size_t)tm_qx_code_bytes(m, k), blocks = (size_t)(m * (k / QK));
    memset(a, 0, sizeof *a);
    a->hi = alloc_or_dummy(values);
    a->scale = alloc_or_dummy(sizeof(float) * blocks);
    a->sum = alloc_or_dummy(sizeof(float) * blocks);
    a->sum_hi = alloc_or_dummy(sizeof(int32_t) * blocks);
    a->q6_start_hi = alloc_or_dummy(sizeof(int32_t) * 2 * blocks);
    a->bsum = alloc_or_dummy(sizeof(int16_t) * blocks);
    int ok = a->hi && a->scale && a->sum && a->sum_hi && a->q6_start_hi && a->bsum;
    if (passes == 2) {
        /* lo 2 KiB on from where its buffer starts: a row's hi and lo codes in other L1 sets than each other */
        a->lo_buffer = alloc_or_dummy(values + LO_SHIFT);
        a->lo = a->lo_buffer ? a->lo_buffer + LO_SHIFT : NULL;
        a->sum_lo = alloc_or_dummy(sizeof(int32_t) * blocks);
        a->q6_start_lo = alloc_or_dummy(sizeof(int32_t) * 2 * blocks);
        ok = ok && a->lo && a->sum_lo && a->q6_start_lo;
    }
#if defined(TM_AVX512_VNNI) /* only the AVX-512 panels read them (run_panels) */
    if (passes == 1) {
        a->q6_start8 = alloc_or_dummy(sizeof(int32_t) * (size_t)tm_qx_code_bytes(m, k) / 8);
        ok = ok && a->q6_start8;
    }
#elif defined(TM_AVX2) /* only AVX2's tile_k256 reads them */
    if (passes == 1) {
        a->sum16 = alloc_or_dummy(sizeof(int16_t) * 2 * blocks);
        ok = ok && a->sum16;
    }
#endif
    return ok ? 0 : -2;
}

void tm_qx_free(tm_qx *a) {
    free(a->hi); free(a->lo_buffer); free(a->scale); free(a->sum);
    free(a->sum_hi); free(a->sum_lo); free(a->q6_start_hi); free(a->q6_start_lo); free(a->q6_start8);
    free(a->bsum); free(a->sum16);
    memset(a, 0, sizeof *a);
}

/* One block's codes of one pass, per 16 values also their sums: v = x * inv (first pass) or the first pass's
 * residual times 254 (second), code = clamp(round-to-even(v), -127, 127). The vector path computes exactly the
 * scalar one's operations (a multiply, a rounding, two clamps), so the codes are the same bits. */
#if defined(TM_AVX512_VNNI)
static inline void quantize_block(const float *xb, float inv, int64_t passes, int8_t *hi, int8_t *lo, int32_t sum_hi[2],
                                  int32_t sum_lo[2], int32_t sum8[4]) {
    const __m512 top = _mm512_set1_ps(127.0f), bottom = _mm512_set1_ps(-127.0f);
    for (int half = 0; half < 2; ++half) {
        const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(xb + 16 * half), _mm512_set1_ps(inv));
        const __m512 h = _mm512_min_ps(_mm512_max_ps(_mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT), bottom), top);
        const __m512i hc = _mm512_cvtps_epi32(h);
        _mm_storeu_si128((__m128i *)(hi + 16 * half), _mm512_cvtepi32_epi8(hc));
        sum8[2 * half] = _mm512_mask_reduce_add_epi32(0x00FF, hc);
        sum8[2 * half + 1] = _mm512_mask_reduce_add_epi32(0xFF00, hc);
        sum_hi[half] = sum8[2 * half] + sum8[2 * half + 1];
        if (passes == 2) {
            const __m512 r = _mm512_mul_ps(_mm512_sub_ps(v, h), _mm512_set1_ps(LO_STEPS));
            const __m512 rounded = _mm512_roundscale_ps(r, _MM_FROUND_TO_NEAREST_INT);
            const __m512 l = _mm512_min_ps(_mm512_max_ps(rounded, bottom), top);
            const __m512i lc = _mm512_cvtps_epi32(l);
            _mm_storeu_si128((__m128i *)(lo + 16 * half), _mm512_cvtepi32_epi8(lc));
            sum_lo[half] = _mm512_reduce_add_epi32(lc);
        }
    }
}

static inline float block_amax(const float *xb) {
    const __m512 a = _mm512_abs_ps(_mm512_loadu_ps(xb)), b = _mm512_abs_ps(_mm512_loadu_ps(xb + 16));
    return _mm512_reduce_max_ps(_mm512_max_ps(a, b));
}
#else
static inline void quantize_block(const float *xb, float inv, int64_t passes, int8_t *hi, int8_t *lo, int32_t sum_hi[2],
                                  int32_t sum_lo[2], int32_t sum8[4]) {
    for (int i = 0; i < QK; ++i) {
        const float v = xb[i] * inv;
        const float h = fminf(fmaxf(nearbyintf(v), -127.0f), 127.0f);
        hi[i] = (int8_t)h;
        sum_hi[i / 16] += (int32_t)h;
        sum8[i / 8] += (int32_t)h;
        if (passes == 2) {
            const float l = fminf(fmaxf(nearbyintf((v - h) * LO_STEPS), -127.0f), 127.0f);
            lo[i] = (int8_t)l;
            sum_lo[i / 16] += (int32_t)l;
        }
    }
}

static inline float block_amax(const float *xb) {
    float amax = 0.0f;
    for (int i = 0; i < QK; ++i) amax = fmaxf(amax, fabsf(xb[i]));
    return amax;
}
#endif

typedef struct {
    const float *x;
    int64_t k, passes, group;
    const tm_qx *a;
} quantize_job;

/* groups [g0, g1) of `group` blocks of 32 (one scale each), in row order */
static void quantize_groups(void *p, int64_t g0, int64_t g1) {
    const quantize_job *q = p;
    const float *x = q->x;
    const int64_t k = q->k, passes = q->passes, nb = k / QK, group = q->group;
    const tm_qx *a = q->a;
    for (int64_t g = g0; g < g1; ++g) {
        float amax = 0.0f;
        for (int64_t tb = g * group; tb < (g + 1) * group; ++tb) amax = fmaxf(amax, block_amax(x + tb * QK));
        const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
        for (int64_t tb = g * group; tb < (g + 1) * group; ++tb) {
            int32_t sum_hi[2] = {0, 0}, sum_lo[2] = {0, 0}, sum8[4] = {0, 0, 0, 0}; /* per 16 and 8 values */
            int8_t hi[QK], lo[QK];
            quantize_block(x + tb * QK, inv, passes, hi, lo, sum_hi, sum_lo, sum8);
            for (int w = 0; w < QK / 4; ++w) { /* the block's 8 words to their places among the group's rows */
                const int64_t at = tm_qx_code(k, tb / nb, tb % nb * QK + 4 * w);
                memcpy(a->hi + at, hi + 4 * w, 4);
                if (passes == 2) memcpy(a->lo + at, lo + 4 * w, 4);
            }
            const int32_t total_hi = sum_hi[0] + sum_hi[1], total_lo = sum_lo[0] + sum_lo[1];
            a->scale[tb] = amax / 127.0f;
            a->sum[tb] = amax / 127.0f * ((float)(total_hi * (int32_t)LO_STEPS + total_lo) / LO_STEPS);
            a->sum_hi[tb] = total_hi;
            a->bsum[tb] = (int16_t)total_hi;
            a->q6_start_hi[2 * tb] = -Q6_OFFSET * sum_hi[0];
            a->q6_start_hi[2 * tb + 1] = -Q6_OFFSET * sum_hi[1];
            if (a->sum16) { /* one pass, AVX2 */
                a->sum16[2 * tb] = (int16_t)sum_hi[0];
                a->sum16[2 * tb + 1] = (int16_t)sum_hi[1];
            }
            if (a->q6_start8) /* one pass, AVX-512 */
                for (int e = 0; e < 4; ++e)
                    a->q6_start8[tm_qx_start8(k, tb / nb, tb % nb * QK + 8 * e)] = -Q6_OFFSET * sum8[e];
            if (passes == 2) {
                a->sum_lo[tb] = total_lo;
                a->q6_start_lo[2 * tb] = -Q6_OFFSET * sum_lo[0];
                a->q6_start_lo[2 * tb + 1] = -Q6_OFFSET * sum_lo[1];
            }
        }
    }
}

int64_t tm_activation_group(const tm_weight *w, int64_t passes) {
    if (passes != 1) return 1;
    for (int64_t p = 0; p < w->n_parts; ++p)
        if (tm_is_k_quant(w->parts[p].type)) return QK_K / QK; /* k is a multiple of 256 (tm_weight_check) */
    return 1;
}

/* x [m, k] -> a (codes interleaved as tm_qx_code says), as one job of the calling team (pool.c) in pieces of at
 * least 256 blocks; group: blocks per scale, 1 or 8 (k a multiple of 256). The first pass's codes are the same with
 * one pass or two. */
void tm_quantize_rows(const float *x, int64_t m, int64_t k, int64_t passes, int64_t group, const tm_qx *a) {
    quantize_job q = {x, k, passes, group, a};
    const int64_t blocks = m * (k / QK), pieces = blocks / 256 < 4 * tm_threads() ? blocks / 256 : 4 * tm_threads();
    tm_pool_for(quantize_groups, &q, blocks / group, pieces);
}

/* ---- per type: what the kernels ask of it -------------------------------------------------------------------- */

static inline int32_t four_codes(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* the offset of the unsigned codes the dot instructions see (subtracted via the activation codes' sums) */
ALWAYS int code_offset(const int T) {
    return T == TM_Q4_0 ? 8 : (T == TM_Q5_0 || T == TM_MXFP4) ? 16 : T == TM_Q8_0 ? 128 : 0; /* Q6_K's 32: q6_start */
}
/* blocks of 32 per chunk: the blocks that share loads of the codes (Q4_K/Q5_K: a pair's low and high nibbles;
 * Q6_K: the quarters q and q + 2 of a half super-block, low and high nibbles of the same bytes) */
ALWAYS int chunk_blocks(const int T) { return (T == TM_Q4_K || T == TM_Q5_K || T == TM_Q6_K) ? 2 : 1; }
/* the unit's block that is block b of chunk c (Q6_K's chunks take quarters 0 and 2, then 1 and 3, of each half: a
 * fixed order, the same in every tile) */
ALWAYS int block_of(const int T, const int c, const int b) {
    return T == TM_Q6_K ? 4 * (c >> 1) + (c & 1) + 2 * b : c * chunk_blocks(T) + b;
}

/* Where step t (inputs 4t .. 4t + 3) of block b of chunk c finds its codes: the word of the codes plane, whether
 * in the high nibbles, the word of the highs plane and the bit of each byte that holds the 5th bit (Q5_x; Q6_K:
 * the first of its 2 high bits); the vector kernels shift the highs by chunk_shift (the part of high_bit that
 * varies with the chunk, a variable count) first, then by high_bit - chunk_shift (a constant once unrolled). */
typedef struct {
    int word, high_nibble, high_word, high_bit, chunk_shift;
} code_site;

ALWAYS code_site site_of(const int T, const int c, const int b, const int t) {
    code_site s = {t, 0, 0, 0, 0};
    switch (T) {
    /* codes 0..15 low nibbles, 16..31 high; 5th bit t */
    case TM_Q4_0: case TM_Q4_1: case TM_Q5_0: case TM_Q5_1: case TM_MXFP4:
        s.word = t & 3;
        s.high_nibble = t >> 2;
        s.high_bit = t;
        break;
    case TM_Q4_K: case TM_Q5_K: /* chunk c = pair of sub-blocks 2c (low nibbles), 2c + 1 (high); 5th bit 2c + b */
        s.word = 8 * c + t;
        s.high_nibble = b;
        s.high_word = t;
        s.high_bit = 2 * c + b;
        s.chunk_shift = 2 * c;
        break;
    case TM_Q6_K: /* quarter q of half h (block 4h + q): low nibbles of the half's words 0..7 (q = 0) or 8..15 (q = 1),
                   * high nibbles of the same (q = 2, 3); high bits 2q, 2q + 1 of the half's qh words 0..7. Chunk c:
                   * half c >> 1, quarters (c & 1) + 2b */
        s.word = 16 * (c >> 1) + 8 * (c & 1) + t;
        s.high_nibble = b;
        s.high_word = 8 * (c >> 1) + t;
        s.high_bit = 2 * (c & 1) + 4 * b;
        s.chunk_shift = 2 * (c & 1);
        break;
    }
    return s;
}

#if defined(TM_AVX512_VNNI) || defined(TM_AVX2)
/* MXFP4's values plus its code offset (16): the codes the dot instructions see, 4 .. 28 */
ALWAYS __m128i mxfp4_table(void) { return _mm_add_epi8(_mm_setr_epi8(TM_MXFP4_VALUES), _mm_set1_epi8(16)); }

/* The K-quants' panels (run_panels: prompt rows over a panel of a group's units unpacked once, unpack_k256): each
 * step's codes as 64 bytes, the 16 rows' 4 codes (AVX2: its two halves' 32 side by side), then each path's scales */
#define UNPACKED_CODE_BYTES (4 * 2 * 8 * 64) /* chunks x blocks x steps, 64 bytes each: 4 KiB a unit */
ALWAYS int64_t unpacked_step(const int c, const int b, const int t) { return ((c * 2 + b) * 8 + t) * 64; }
#endif

/* ---- AVX-512 VNNI ----------------------------------------------------------------------------------------------- */
#if defined(TM_AVX512_VNNI)

/* acc += the unsigned codes w . the 4 signed activation codes at p, broadcast to every lane: one vpdpbusd with the
 * activation as its embedded-broadcast memory operand (one fused instruction). Written with the intrinsics, gcc
 * loaded each broadcast into a register of its own and, in the steps' loop, copied every accumulator to another
 * register and back around its vpdpbusd: four instructions per product where the dot ports take two a cycle. */
ALWAYS __m512i dot_broadcast(__m512i acc, __m512i w, const int8_t *p) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const int32_t *)p));
    return acc;
}

/* step t of block b of chunk c: 4 unsigned codes for each of 16 rows (R: the tile's rows) */
ALWAYS __m512i codes16(const int T, const int R, const uint8_t *qs, const uint8_t *qh, const int c, const int b,
                       const int t) {
    if (T == TM_Q8_0) { /* the sign bit flipped: q + 128, unsigned */
        if (R <= PREFETCH_ROWS) PREFETCH(qs + t * 64 + PREFETCH_BYTES);
        return _mm512_xor_si512(_mm512_loadu_si512((const void *)(qs + t * 64)), _mm512_set1_epi8((char)0x80));
    }
    const code_site s = site_of(T, c, b, t);
    if (R <= PREFETCH_ROWS) PREFETCH(qs + s.word * 64 + PREFETCH_BYTES);
    __m512i w = _mm512_loadu_si512((const void *)(qs + s.word * 64));
    if (s.high_nibble) w = _mm512_srli_epi16(w, 4);
    w = _mm512_and_si512(w, _mm512_set1_epi8(0x0F));
    if (T == TM_MXFP4) /* each 128-bit lane looks its bytes up in the same 16 values */
        return _mm512_shuffle_epi8(_mm512_broadcast_i32x4(mxfp4_table()), w);
    if (T == TM_Q5_0 || T == TM_Q5_1 || T == TM_Q5_K || T == TM_Q6_K) {
        if (R <= PREFETCH_ROWS && (s.word & 1) == 0) /* the highs plane: half or a quarter of the codes' bytes */
            PREFETCH(qh + s.high_word * 64 + PREFETCH_BYTES * tm_qh_bytes(T) / tm_qs_bytes(T));
        __m512i h = _mm512_loadu_si512((const void *)(qh + s.high_word * 64));
        if (T == TM_Q5_K || T == TM_Q6_K) h = _mm512_srl_epi16(h, _mm_cvtsi32_si128(s.chunk_shift));
        const int bit = s.high_bit - s.chunk_shift;
        /* the bit (bits) to bit 4 of each byte; what crosses from the next byte lands outside the mask */
        h = bit <= 4 ? _mm512_slli_epi16(h, 4 - bit) : _mm512_srli_epi16(h, bit - 4);
        const __m512i mask = _mm512_set1_epi8(T == TM_Q6_K ? 0x30 : 0x10);
        w = _mm512_ternarylogic_epi32(w, h, mask, 0xF8); /* w | (h & mask) */
    }
    return w;
}

/* Q6_K's two passes combine as 254 * hi + lo in integer shifts and additions (exact: |254 * hi| < 2^24 per half
 * block), one conversion per half: on Zen 4 multiplies take the dot instruction's ports, shifts and additions do
 * not. With Q6_K's two halves per block that saved 2 of its 6 float multiplies per row and block: 512 rows, two
 * passes, +24% (the other types, one half each, measured 2% slower with it: they keep the float form) */
ALWAYS int integer_passes(const int T, const int P) { return P == 2 && T == TM_Q6_K; }

/* block b of chunk c (of the unit whose scales are at sc): s0 = the 16 rows' weight scales (Q6_K: of the block's
 * first 16 inputs), s1 = their minimums (Q4_1, Q5_1, K-quants) or, for Q6_K, the scales of its last 16 inputs.
 * Q6_K's with two passes are / 254 (block_dot16) */
ALWAYS void scales16(const int T, const int P, const uint8_t *sc, const int c, const int b, __m512 *s0, __m512 *s1) {
    if (T == TM_MXFP4) { /* 2^(e - 128)'s bits as tm_e8m0_half builds them: (e - 1) << 23, e < 2: 0x00200000 << e */
        const __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128((const void *)sc));
        const __m512i normal = _mm512_slli_epi32(_mm512_sub_epi32(e, _mm512_set1_epi32(1)), 23);
        const __mmask16 small = _mm512_cmplt_epu32_mask(e, _mm512_set1_epi32(2));
        *s0 = _mm512_castsi512_ps(_mm512_mask_sllv_epi32(normal, small, _mm512_set1_epi32(0x00200000), e));
        *s1 = _mm512_setzero_ps();
        OPAQUE_VECTOR(*s0);
        OPAQUE_VECTOR(*s1);
        return;
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const void *)sc));
    const int block = block_of(T, c, b);
    *s0 = d;
    *s1 = _mm512_setzero_ps();
    if (T == TM_Q4_1 || T == TM_Q5_1) *s1 = _mm512_cvtph_ps(_mm256_loadu_si256((const void *)(sc + 32)));
    if (T == TM_Q4_K || T == TM_Q5_K) {
        const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const void *)(sc + 32)));
        const __m128i s = _mm_loadu_si128((const void *)(sc + 64 + 16 * block));
        const __m128i mn = _mm_loadu_si128((const void *)(sc + 192 + 16 * block));
        *s0 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(s)));
        *s1 = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(mn)));
    }
    if (T == TM_Q6_K) {
        const __m128i s_a = _mm_loadu_si128((const void *)(sc + 32 + 16 * (2 * block)));
        const __m128i s_b = _mm_loadu_si128((const void *)(sc + 32 + 16 * (2 * block + 1)));
        *s0 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(s_a)));
        *s1 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(s_b)));
    }
    if (integer_passes(T, P)) {
        *s0 = _mm512_mul_ps(*s0, _mm512_set1_ps(1.0f / LO_STEPS));
        *s1 = _mm512_mul_ps(*s1, _mm512_set1_ps(1.0f / LO_STEPS));
    }
    OPAQUE_VECTOR(*s0);
    OPAQUE_VECTOR(*s1);
}

/* log2 of code_offset (all powers of 2), for the vector paths' shifts */
ALWAYS int code_offset_shift(const int T) {
    return T == TM_Q4_0 ? 3 : (T == TM_Q5_0 || T == TM_MXFP4) ? 4 : T == TM_Q8_0 ? 7 : 0;
}

/* the block's dot of one row as a float: the integer sums of the passes, their code offsets taken off (with
 * integer_passes: 254 times that, scales16 divides the weight scales by 254). The offsets are the activation codes'
 * sums (sum_hi, sum_lo: the row and block's) broadcast from memory and shifted: no branch and no scalar product
 * moved into a vector per row and block (Q8_0, 8 rows: that was an imul, vmovd, vpbroadcastd and a branch) */
ALWAYS __m512 block_dot16(const int T, const int P, __m512i hi, __m512i lo, const int32_t *sum_hi,
                          const int32_t *sum_lo) {
    if (code_offset(T)) {
        hi = _mm512_sub_epi32(hi, _mm512_slli_epi32(_mm512_set1_epi32(*sum_hi), code_offset_shift(T)));
        if (P == 2) lo = _mm512_sub_epi32(lo, _mm512_slli_epi32(_mm512_set1_epi32(*sum_lo), code_offset_shift(T)));
    }
    if (integer_passes(T, P)) /* 254 hi + lo = 256 hi - 2 hi + lo */
        return _mm512_cvtepi32_ps(
            _mm512_add_epi32(_mm512_sub_epi32(_mm512_slli_epi32(hi, 8), _mm512_slli_epi32(hi, 1)), lo));
    const __m512 h = _mm512_cvtepi32_ps(hi);
    return P == 2 ? _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), _mm512_set1_ps(1.0f / LO_STEPS), h) : h;
}

/* Prompt rows: the K-quant tiles of a block of rows all read the same group's codes, and each tile unpacked them
 * again (the nibbles' shift and mask, Q6_K's high bits: 1 to 5 operations per step of 8 rows' dots, on the dot
 * instruction's two ports). unpack_k256 writes a panel of a group's units as the tiles' steps see them (codes16, 64
 * bytes a step) and the sub-block scales widened to 32 bits, once per panel; the tiles of the block of rows then
 * load them (loads take other ports). Same bits: the same codes and scales enter the same integer sums. 512 rows,
 * two threads (benchmarks/products_ab.py): Q4_K +8-12%, Q6_K +7% (and +7% more from q6_eighths, tile_k256). */
#define UNPACKED_UNIT_BYTES (UNPACKED_CODE_BYTES + 16 * 64) /* and 16 scale vectors (Q6_K's halves) */
#define PANEL_UNITS 4 /* units unpacked at a time: 20 KiB, in L1 (48 KiB); 2 units measured 2-4% slower, 8 1-3% */

ALWAYS void unpack_k256(const int T, const uint8_t *qs, const uint8_t *qh, const uint8_t *sc, int64_t u0, int64_t u1,
                        uint8_t *out) {
    for (int64_t u = u0; u < u1; ++u) {
        const uint8_t *qsu = qs + u * tm_qs_bytes(T), *qhu = qh + u * tm_qh_bytes(T), *scu = sc + u * tm_sc_bytes(T);
        uint8_t *wu = out + (u - u0) * UNPACKED_UNIT_BYTES, *su = wu + UNPACKED_CODE_BYTES;
        for (int c = 0; c < 4; ++c)
#pragma GCC unroll 2
            for (int b = 0; b < 2; ++b)
#pragma GCC unroll 8
                for (int t = 0; t < 8; ++t)
                    _mm512_store_si512((void *)(wu + unpacked_step(c, b, t)), codes16(T, 1, qsu, qhu, c, b, t));
        for (int sub = 0; sub < 8; ++sub)
            if (T == TM_Q6_K)
                for (int h = 0; h < 2; ++h)
                    _mm512_store_si512((void *)(su + 64 * (2 * sub + h)),
                                       _mm512_and_si512(_mm512_cvtepi8_epi32(_mm_loadu_si128(
                                                            (const void *)(scu + 32 + 16 * (2 * sub + h)))),
                                                        _mm512_set1_epi32(0xFFFF))); /* vpdpwssd's lower half */
            else
                _mm512_store_si512((void *)(su + 64 * (2 * sub)),
                                   _mm512_cvtepu8_epi32(_mm_loadu_si128((const void *)(scu + 64 + 16 * sub))));
    }
}

/* K-quants with one pass, whose activations have one scale per super-block (tm_activation_group): each block's
 * integer dot (Q6_K: each half's) times the weight's integer sub-block scale is summed exactly in 32 bits over the
 * super-block, the minimums' sum_j mn_j * (block j's code sum) likewise by pairs of 16-bit products (vpdpwssd), and
 * the super-block ends in one float step per row: acc += (d * s) * dot - (dmin * s) * mins. Per block and row that
 * is one integer multiply where the float form took a multiply and two fused multiply-adds, which share vpdpbusd's
 * ports on Zen 4 (Q4_K: two vpdpwssd, below). No overflow: |dot| <= 31 * 127 * 32 times a scale <= 63, 8 blocks
 * (Q5_K), or 32 * 127 * 16 times |scale| <= 128, 16 halves (Q6_K): below 2^27.
 * Q4_K and Q5_K keep two chains per row (the steps in turn): with one, the 8 rows' chains waited on vpdpbusd's
 * latency (benchmarks/dot_chains.c, 8 rows x 8 steps: 3.3 against 4.9 G products/s a core in one run, the ports'
 * peak 6.9; noisy here); Q4_K at 512 rows +7-14% (benchmarks/products_ab.py, [8192, 2048] and [2048, 2048], same
 * bits). */
ALWAYS void tile_k256(const int T, const int R, const tm_qx *a, int64_t r0, int64_t k, const uint8_t *qs,
                      const uint8_t *qh, const uint8_t *sc, float *y, int64_t ldy, const int U, int64_t u0, int64_t u1,
                      const uint8_t *unpacked) {
    const int64_t nb = k / QK;
    const int halves = T == TM_Q6_K;
    /* Q6_K over unpacked codes: two chains per half of 8 inputs each (q6_start8), scaled by vpdpwssd (the scratch
     * keeps its scales' lower 16 bits): 4 uops per row and block where the one chain per half took 6 (vpmulld and
     * an addition per half); unpacking had left no registers for them */
    const int q6_eighths = halves && U;
    const int64_t codes0 = tm_qx_code(k, r0, 0), starts0 = tm_qx_start8(k, r0, 0);
    for (int64_t u = u0; u < u1; ++u) {
        const uint8_t *qsu = qs + u * tm_qs_bytes(T), *qhu = qh + u * tm_qh_bytes(T), *scu = sc + u * tm_sc_bytes(T);
        const uint8_t *wu = unpacked + (u - u0) * UNPACKED_UNIT_BYTES, *su = wu + UNPACKED_CODE_BYTES;
        if (!U && R <= PREFETCH_ROWS)
            for (int64_t line = 0; line < tm_sc_bytes(T); line += 64)
                PREFETCH(scu + line + PREFETCH_BYTES * tm_sc_bytes(T) / tm_qs_bytes(T));
        __m512i isum[MAX_ROWS];
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) isum[r] = _mm512_setzero_si512();
#pragma GCC unroll 1
        for (int c = 0; c < 4; ++c) {
#pragma GCC unroll 2
            for (int b = 0; b < 2; ++b) {
                const int sub = block_of(T, c, b); /* the block within the super-block */
                const int64_t block = u * (QK_K / QK) + sub;
                __m512i s_a, s_b = _mm512_setzero_si512(); /* the 16 rows' integer scales (Q6_K: of each half) */
                if (U) {
                    s_a = _mm512_load_si512((const void *)(su + 64 * (2 * sub)));
                    if (halves) s_b = _mm512_load_si512((const void *)(su + 64 * (2 * sub + 1)));
                } else if (T == TM_Q6_K) {
                    s_a = _mm512_cvtepi8_epi32(_mm_loadu_si128((const void *)(scu + 32 + 16 * (2 * sub))));
                    s_b = _mm512_cvtepi8_epi32(_mm_loadu_si128((const void *)(scu + 32 + 16 * (2 * sub + 1))));
                } else
                    s_a = _mm512_cvtepu8_epi32(_mm_loadu_si128((const void *)(scu + 64 + 16 * sub)));
                /* Q4_K, Q5_K: two chains per row (above). Q6_K: one per half (two over unpacked codes:
                 * q6_eighths), done with after its 4 steps (scaled into isum before the next half starts: 8 rows'
                 * chains, isum and the scales fit in the 32 registers; two chains per half while unpacking measured
                 * slower). The float accumulators wait in y between super-blocks, so that the chains have the
                 * registers */
#pragma GCC unroll 2
                for (int h = 0; h < 1 + halves; ++h) {
                    __m512i hi[MAX_ROWS][2];
#pragma GCC unroll 8
                    for (int r = 0; r < R; ++r) {
                        hi[r][0] = hi[r][1] = _mm512_setzero_si512();
                        if (q6_eighths) /* each chain starts at -32 * the codes' sum over its 8 inputs */
                            for (int e = 0; e < 2; ++e) {
                                const int64_t at = starts0 + (block * 4 + 2 * h + e) * QX_ROWS + r;
                                hi[r][e] = _mm512_set1_epi32(a->q6_start8[at]);
                            }
                        else if (halves)
                            hi[r][0] = _mm512_set1_epi32(a->q6_start_hi[2 * ((r0 + r) * nb + block) + h]);
                    }
#pragma GCC unroll 8
                    for (int i = 0; i < (halves ? 4 : 8); i += 2) {
#pragma GCC unroll 2
                        for (int j = 0; j < 2; ++j) {
                            /* h is 0 without halves. Q6_K in eighths: steps 4h + (0, 2, 1, 3), the chains in turn */
                            const int t = q6_eighths ? 4 * h + 2 * j + i / 2 : 4 * h + i + j;
                            const int chain = halves && !q6_eighths ? 0 : j;
                            const __m512i w = U ? _mm512_load_si512((const void *)(wu + unpacked_step(c, b, t)))
                                                : codes16(T, R, qsu, qhu, c, b, t);
#pragma GCC unroll 8
                            for (int r = 0; r < R; ++r) {
                                const int64_t at = codes0 + block * (QK * QX_ROWS) + t * (4 * QX_ROWS) + 4 * r;
                                hi[r][chain] = dot_broadcast(hi[r][chain], w, a->hi + at);
                            }
                        }
                    }
#pragma GCC unroll 8
                    for (int r = 0; r < R; ++r) {
                        if (T == TM_Q4_K || q6_eighths) { /* each chain's products fit in 16 bits (Q4_K: 16 of
                                             * them, 15 * 127 * 16 < 2^15; Q6_K: 8 with the offset, 32 * 127 * 8), and
                                             * the scales' upper 16 bits are 0: vpdpwssd scales and adds in one uop,
                                             * where vpmulld is two on Intel */
                            isum[r] = _mm512_dpwssd_epi32(isum[r], hi[r][0], h ? s_b : s_a);
                            isum[r] = _mm512_dpwssd_epi32(isum[r], hi[r][1], h ? s_b : s_a);
                        } else
                            isum[r] = _mm512_add_epi32(
                                isum[r], _mm512_mullo_epi32(halves ? hi[r][0] : _mm512_add_epi32(hi[r][0], hi[r][1]),
                                                            h ? s_b : s_a));
                    }
                }
            }
        }
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const void *)scu));
        __m512i mn[4]; /* Q4_K/Q5_K: the minimums of blocks 2i, 2i + 1 as 16-bit pairs */
        __m512 dmin = _mm512_setzero_ps();
        if (!halves) {
            dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const void *)(scu + 32)));
            for (int i = 0; i < 4; ++i) {
                const __m512i lo = _mm512_cvtepu8_epi32(_mm_loadu_si128((const void *)(scu + 192 + 16 * (2 * i))));
                const __m512i up = _mm512_cvtepu8_epi32(_mm_loadu_si128((const void *)(scu + 192 + 16 * (2 * i + 1))));
                mn[i] = _mm512_or_si512(lo, _mm512_slli_epi32(up, 16));
            }
        }
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
            const int64_t tb = (r0 + r) * nb + u * (QK_K / QK);
            const __m512 xs = _mm512_set1_ps(a->scale[tb]);
            float *yr = y + (r0 + r) * ldy;
            __m512 acc = u ? _mm512_loadu_ps(yr) : _mm512_setzero_ps();
            __m512 dx = _mm512_mul_ps(d, xs);
            OPAQUE_VECTOR(dx);
            acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), dx, acc);
            if (!halves) {
                __m512i mins = _mm512_setzero_si512();
                for (int i = 0; i < 4; ++i) {
                    int32_t pair;
                    memcpy(&pair, a->bsum + tb + 2 * i, sizeof pair);
                    mins = _mm512_dpwssd_epi32(mins, mn[i], _mm512_set1_epi32(pair));
                }
                __m512 mx = _mm512_mul_ps(dmin, xs);
                OPAQUE_VECTOR(mx);
                acc = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(mins), mx, acc);
            }
            _mm512_storeu_ps(yr, acc);
        }
    }
}

/* y[(r0 + r) * ldy + j] = row j of the group (planes qs, qh, sc) . activation row r0 + r, r < R */
ALWAYS void tile(const int T, const int R, const int P, const tm_qx *a, int64_t r0, int64_t k, const uint8_t *qs,
                 const uint8_t *qh, const uint8_t *sc, float *y, int64_t ldy) {
    const int64_t units = k / tm_unit_values(T), nb = k / QK;
    if (tm_is_k_quant(T) && P == 1) {
        tile_k256(T, R, a, r0, k, qs, qh, sc, y, ldy, 0, 0, k / QK_K, NULL);
        return;
    }
    const int CB = chunk_blocks(T), chunks = (int)(tm_unit_values(T) / QK) / CB;
    /* chains per row and pass: Q6_K's two halves of a block have their own scales; else two with few rows */
    const int halves = T == TM_Q6_K, split = !halves && R <= SPLIT_ROWS;
    const int64_t codes0 = tm_qx_code(k, r0, 0); /* the tile's rows are in r0's group of QX_ROWS (run_tile) */
    __m512 acc[MAX_ROWS];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t u = 0; u < units; ++u) {
        const uint8_t *qsu = qs + u * tm_qs_bytes(T), *qhu = qh + u * tm_qh_bytes(T), *scu = sc + u * tm_sc_bytes(T);
        if (R <= PREFETCH_ROWS)
            for (int64_t line = 0; line < tm_sc_bytes(T); line += 64)
                PREFETCH(scu + line + PREFETCH_BYTES * tm_sc_bytes(T) / tm_qs_bytes(T));
#pragma GCC unroll 1
        for (int c = 0; c < chunks; ++c) {
#pragma GCC unroll 4
            for (int b = 0; b < CB; ++b) {
                const int64_t block = u * (tm_unit_values(T) / QK) + block_of(T, c, b);
                __m512 s0, s1;
                scales16(T, P, scu, c, b, &s0, &s1);
                __m512i hi[MAX_ROWS][2], lo[MAX_ROWS][2];
#pragma GCC unroll 8
                for (int r = 0; r < R; ++r) {
                    hi[r][0] = hi[r][1] = lo[r][0] = lo[r][1] = _mm512_setzero_si512();
                    if (halves) /* Q6_K's chains start at -32 * (the codes' sum): its offset, taken off by loads */
                        for (int h = 0; h < 2; ++h) {
                            const int64_t at = 2 * ((r0 + r) * nb + block) + h;
                            hi[r][h] = _mm512_set1_epi32(a->q6_start_hi[at]);
                            if (P == 2) lo[r][h] = _mm512_set1_epi32(a->q6_start_lo[at]);
                        }
                }
#pragma GCC unroll 8
                for (int t = 0; t < 8; ++t) {
                    const __m512i w = codes16(T, R, qsu, qhu, c, b, t);
                    const int chain = halves ? t >> 2 : (split ? t & 1 : 0);
#pragma GCC unroll 8
                    for (int r = 0; r < R; ++r) {
                        const int64_t at = codes0 + block * (QK * QX_ROWS) + t * (4 * QX_ROWS) + 4 * r;
                        hi[r][chain] = dot_broadcast(hi[r][chain], w, a->hi + at);
                        if (P == 2) lo[r][chain] = dot_broadcast(lo[r][chain], w, a->lo + at);
                    }
                }
#pragma GCC unroll 8
                for (int r = 0; r < R; ++r) {
                    const int64_t tb = (r0 + r) * nb + block;
                    const __m512 xs = _mm512_set1_ps(a->scale[tb]);
                    if (halves) { /* (dot_a * s_a + dot_b * s_b) * xs */
                        __m512 dot[2];
                        for (int h = 0; h < 2; ++h) dot[h] = block_dot16(T, P, hi[r][h], lo[r][h], NULL, NULL);
                        const __m512 both = _mm512_fmadd_ps(dot[1], s1, _mm512_mul_ps(dot[0], s0));
                        acc[r] = _mm512_fmadd_ps(both, xs, acc[r]);
                        continue;
                    }
                    const __m512i hs = split ? _mm512_add_epi32(hi[r][0], hi[r][1]) : hi[r][0];
                    const __m512i ls = split ? _mm512_add_epi32(lo[r][0], lo[r][1]) : lo[r][0];
                    const __m512 dot = block_dot16(T, P, hs, ls, a->sum_hi + tb, P == 2 ? a->sum_lo + tb : NULL);
                    acc[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(s0, xs), acc[r]);
                    if (T == TM_Q4_1 || T == TM_Q5_1) acc[r] = _mm512_fmadd_ps(s1, _mm512_set1_ps(a->sum[tb]), acc[r]);
                    if (T == TM_Q4_K || T == TM_Q5_K) acc[r] = _mm512_fnmadd_ps(s1, _mm512_set1_ps(a->sum[tb]), acc[r]);
                }
            }
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + (r0 + r) * ldy, acc[r]);
}

/* ---- AVX2 (+FMA, F16C) ---------------------------------------------------------------------------------------- */
#elif defined(TM_AVX2)

/* step t of block b of chunk c for the 8 rows of one half of the group */
ALWAYS __m256i codes8(const int T, const uint8_t *qs, const uint8_t *qh, const int c, const int b, const int t,
                      const int half) {
    const code_site s = site_of(T, c, b, t);
    if (half == 0) PREFETCH(qs + (T == TM_Q8_0 ? t : s.word) * 64 + PREFETCH_BYTES); /* the second half finds it */
    if (T == TM_Q8_0) return _mm256_loadu_si256((const void *)(qs + t * 64 + half * 32)); /* signed: see below */
    __m256i w = _mm256_loadu_si256((const void *)(qs + s.word * 64 + half * 32));
    if (s.high_nibble) w = _mm256_srli_epi16(w, 4);
    w = _mm256_and_si256(w, _mm256_set1_epi8(0x0F));
    if (T == TM_MXFP4) /* each 128-bit lane looks its bytes up in the same 16 values */
        return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(mxfp4_table()), w);
    if (T == TM_Q5_0 || T == TM_Q5_1 || T == TM_Q5_K || T == TM_Q6_K) {
        if (half == 0 && (s.word & 1) == 0)
            PREFETCH(qh + s.high_word * 64 + PREFETCH_BYTES * tm_qh_bytes(T) / tm_qs_bytes(T));
        __m256i h = _mm256_loadu_si256((const void *)(qh + s.high_word * 64 + half * 32));
        if (T == TM_Q5_K || T == TM_Q6_K) h = _mm256_srl_epi16(h, _mm_cvtsi32_si128(s.chunk_shift));
        const int bit = s.high_bit - s.chunk_shift;
        h = bit <= 4 ? _mm256_slli_epi16(h, 4 - bit) : _mm256_srli_epi16(h, bit - 4);
        w = _mm256_or_si256(w, _mm256_and_si256(h, _mm256_set1_epi8(T == TM_Q6_K ? 0x30 : 0x10)));
    }
    return w;
}

ALWAYS void scales8(const int T, const uint8_t *sc, const int c, const int b, const int half, __m256 *s0,
                    __m256 *s1) {
    if (T == TM_MXFP4) { /* 2^(e - 128) as tm_e8m0_half builds it (scales16) */
        const __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const void *)(sc + half * 8)));
        const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
        const __m256i small = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
        const __m256i is_small = _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e);
        *s0 = _mm256_castsi256_ps(_mm256_blendv_epi8(normal, small, is_small));
        *s1 = _mm256_setzero_ps();
        OPAQUE_VECTOR(*s0);
        OPAQUE_VECTOR(*s1);
        return;
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const void *)(sc + half * 16)));
    const int block = block_of(T, c, b);
    *s0 = d;
    *s1 = _mm256_setzero_ps();
    if (T == TM_Q4_1 || T == TM_Q5_1) *s1 = _mm256_cvtph_ps(_mm_loadu_si128((const void *)(sc + 32 + half * 16)));
    if (T == TM_Q4_K || T == TM_Q5_K) {
        const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const void *)(sc + 32 + half * 16)));
        const __m128i s = _mm_loadl_epi64((const void *)(sc + 64 + 16 * block + half * 8));
        const __m128i mn = _mm_loadl_epi64((const void *)(sc + 192 + 16 * block + half * 8));
        *s0 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(s)));
        *s1 = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(mn)));
    }
    if (T == TM_Q6_K) {
        const __m128i s_a = _mm_loadl_epi64((const void *)(sc + 32 + 16 * (2 * block) + half * 8));
        const __m128i s_b = _mm_loadl_epi64((const void *)(sc + 32 + 16 * (2 * block + 1) + half * 8));
        *s0 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(s_a)));
        *s1 = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(s_b)));
    }
    OPAQUE_VECTOR(*s0);
    OPAQUE_VECTOR(*s1);
}

ALWAYS __m256 block_dot8(const int P, __m256i hi, __m256i lo, int32_t off_hi, int32_t off_lo) {
    if (off_hi | off_lo) {
        hi = _mm256_sub_epi32(hi, _mm256_set1_epi32(off_hi));
        if (P == 2) lo = _mm256_sub_epi32(lo, _mm256_set1_epi32(off_lo));
    }
    const __m256 h = _mm256_cvtepi32_ps(hi);
    return P == 2 ? _mm256_fmadd_ps(_mm256_cvtepi32_ps(lo), _mm256_set1_ps(1.0f / LO_STEPS), h) : h;
}

/* vpmaddubsw's pair sums stay in 16 bits for this many steps before vpmaddwd widens them: 2 * 15 * 127 * 8,
 * 2 * 31 * 127 * 4 (MXFP4's codes up to 28 likewise) and 2 * 63 * 127 * 2 are below 32,768 (Q8_0 widens every
 * step: |q| * 127 * 2 fills 16 bits) */
ALWAYS int steps_per_widening(const int T) {
    if (T == TM_Q8_0) return 1;
    if (T == TM_Q6_K) return 2;
    return (T == TM_Q5_0 || T == TM_Q5_1 || T == TM_Q5_K || T == TM_MXFP4) ? 4 : 8;
}

/* acc16 + the pair sums of w (4 unsigned codes of each of 8 rows) times the 4 signed activation codes at p. The
 * sum is made opaque: gcc otherwise reassociates a chain's additions into a tree, computes the products of many
 * steps ahead and spills them (Q4_K's tile of 4 rows: 72 spill moves per 64 products) */
ALWAYS __m256i dot_pairs(__m256i acc16, __m256i w, const int8_t *p) {
    __m256i sum = _mm256_add_epi16(acc16, _mm256_maddubs_epi16(w, _mm256_set1_epi32(four_codes(p))));
    OPAQUE_VECTOR(sum);
    return sum;
}

/* 8 lanes' integer values v (|v| < 2^15) as the 16-bit pairs (lo, hi) vpmaddwd multiplies a lane's two pair sums by */
ALWAYS __m256i pairs16(__m256i lo, __m256i hi) {
    return _mm256_or_si256(_mm256_and_si256(lo, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(hi, 16));
}

/* the integer sub-block scales of a K-quant unit as vpmaddwd's pairs, per block `sub` and half of the group: (s, s)
 * (Q6_K: s of the block's first 16 inputs), Q6_K's (s_b, s_b) of its last 16 and (32 s_a, 32 s_b) for its offset */
ALWAYS void scale_pairs(const int T, const uint8_t *scu, const int sub, const int half, __m256i *s_a, __m256i *s_b,
                        __m256i *s_off) {
    if (T == TM_Q6_K) {
        const __m256i a8 = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const void *)(scu + 32 + 16 * (2 * sub) + half * 8)));
        const __m256i b8 =
            _mm256_cvtepi8_epi32(_mm_loadl_epi64((const void *)(scu + 32 + 16 * (2 * sub + 1) + half * 8)));
        *s_a = pairs16(a8, a8);
        *s_b = pairs16(b8, b8);
        *s_off = pairs16(_mm256_slli_epi32(a8, 5), _mm256_slli_epi32(b8, 5)); /* |32 s| <= 4,096 */
        return;
    }
    const __m256i s8 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const void *)(scu + 64 + 16 * sub + half * 8)));
    *s_a = pairs16(s8, s8);
    *s_b = *s_off = _mm256_setzero_si256();
}

/* Prompt rows: a block of rows' tiles all read the same group's codes, and each tile unpacked them again (the
 * nibbles' shift and mask; Q6_K's high bits: 7 operations a step, on the ports vpmaddubsw and its additions take).
 * unpack_k256 writes a panel of a group's units as codes8 gives them (64 bytes a step, the halves' 32 side by side)
 * and the scales as scale_pairs gives them, once per panel; the tiles then load them. Same bits: the same codes
 * and scales enter the same integer sums. */
#define UNPACKED_UNIT_BYTES (UNPACKED_CODE_BYTES + 3 * 8 * 64) /* and three pairs of scales per block */
#define PANEL_UNITS 4 /* units unpacked at a time: 22 KiB, in L1 (32 KiB) */

ALWAYS void unpack_k256(const int T, const uint8_t *qs, const uint8_t *qh, const uint8_t *sc, int64_t u0, int64_t u1,
                        uint8_t *out) {
    for (int64_t u = u0; u < u1; ++u) {
        const uint8_t *qsu = qs + u * tm_qs_bytes(T), *qhu = qh + u * tm_qh_bytes(T), *scu = sc + u * tm_sc_bytes(T);
        uint8_t *wu = out + (u - u0) * UNPACKED_UNIT_BYTES, *su = wu + UNPACKED_CODE_BYTES;
        for (int c = 0; c < 4; ++c)
#pragma GCC unroll 2
            for (int b = 0; b < 2; ++b)
#pragma GCC unroll 8
                for (int t = 0; t < 8; ++t)
#pragma GCC unroll 2
                    for (int half = 0; half < 2; ++half)
                        _mm256_store_si256((void *)(wu + unpacked_step(c, b, t) + 32 * half),
                                           codes8(T, qsu, qhu, c, b, t, half));
        for (int sub = 0; sub < 8; ++sub)
            for (int half = 0; half < 2; ++half) {
                __m256i s_a, s_b, s_off;
                scale_pairs(T, scu, sub, half, &s_a, &s_b, &s_off);
                _mm256_store_si256((void *)(su + 64 * (3 * sub) + 32 * half), s_a);
                _mm256_store_si256((void *)(su + 64 * (3 * sub + 1) + 32 * half), s_b);
                _mm256_store_si256((void *)(su + 64 * (3 * sub + 2) + 32 * half), s_off);
            }
    }
}

/* K-quants with one pass (activations with one scale per super-block, tm_activation_group), 8 rows of the group
 * (one half) at a time: per block each row's pair sums (vpmaddubsw, widened every steps_per_widening steps) are
 * multiplied by the weight's integer sub-block scale and summed in 32 bits by one vpmaddwd (the scale as a pair
 * (s, s); Q6_K per half of the block); the minimums' sum_j mn_j * (block j's code sum) and Q6_K's offset
 * 32 * sum_h s_h * (half h's code sum) likewise by pairs of 16-bit products; one float step per row and
 * super-block: y += (d * s) * dot - (dmin * s) * mins. The float form (tile) took per row and block a conversion,
 * a multiply and two fused multiply-adds beside the widening. Exact in 32 bits: Q4_K/Q5_K |dot| <= 31 * 127 * 32
 * times a scale <= 63, 8 blocks; Q6_K 63 * 127 * 16 times |s| <= 128, 16 halves, its offset 32 * 2,032 * 128 * 16:
 * all below 2^31. A row's float accumulator waits in y between super-blocks (its registers go to the chains).
 * Units [u0, u1); U: their codes and scales from `unpacked` (unpack_k256), else from the planes. */
ALWAYS void tile_k256(const int T, const int R, const tm_qx *a, int64_t r0, int64_t k, const uint8_t *qs,
                      const uint8_t *qh, const uint8_t *sc, float *y, int64_t ldy, const int U, int64_t u0, int64_t u1,
                      const uint8_t *unpacked) {
    const int64_t nb = k / QK, codes0 = tm_qx_code(k, r0, 0);
    const int W = steps_per_widening(T);
    for (int half = 0; half < 2; ++half) {
#pragma GCC unroll 1
        for (int64_t u = u0; u < u1; ++u) {
            const uint8_t *qsu = qs + u * tm_qs_bytes(T), *qhu = qh + u * tm_qh_bytes(T);
            const uint8_t *scu = sc + u * tm_sc_bytes(T);
            const uint8_t *wu = unpacked + (u - u0) * UNPACKED_UNIT_BYTES, *su = wu + UNPACKED_CODE_BYTES;
            if (!U && half == 0)
                for (int64_t line = 0; line < tm_sc_bytes(T); line += 64)
                    PREFETCH(scu + line + PREFETCH_BYTES * tm_sc_bytes(T) / tm_qs_bytes(T));
            __m256i isum[MAX_ROWS];
#pragma GCC unroll 4
            for (int r = 0; r < R; ++r) isum[r] = _mm256_setzero_si256();
#pragma GCC unroll 1
            for (int c = 0; c < 4; ++c) {
#pragma GCC unroll 2
                for (int b = 0; b < 2; ++b) {
                    const int sub = block_of(T, c, b);
                    const int64_t block = u * (QK_K / QK) + sub;
                    /* from the panel each scale is loaded where it is used (an operand of vpmaddwd: in registers
                     * for the whole block, Q6_K's three left its chains spilling) */
                    const __m256i *su_pairs = (const __m256i *)(su + 64 * (3 * sub) + 32 * half);
                    __m256i s_a = _mm256_setzero_si256(), s_b = s_a, s_off = s_a;
                    if (!U) scale_pairs(T, scu, sub, half, &s_a, &s_b, &s_off);
#pragma GCC unroll 8
                    for (int t0 = 0; t0 < 8; t0 += W) {
                        __m256i p16[MAX_ROWS];
#pragma GCC unroll 4
                        for (int r = 0; r < R; ++r) p16[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
                        for (int t = t0; t < t0 + W; ++t) {
                            const __m256i w =
                                U ? _mm256_load_si256((const void *)(wu + unpacked_step(c, b, t) + 32 * half))
                                  : codes8(T, qsu, qhu, c, b, t, half);
#pragma GCC unroll 4
                            for (int r = 0; r < R; ++r)
                                p16[r] = dot_pairs(p16[r], w,
                                                   a->hi + codes0 + block * (QK * QX_ROWS) + t * (4 * QX_ROWS) + 4 * r);
                        }
                        const int second = T == TM_Q6_K && t0 >= 4; /* Q6_K's last 16 inputs */
                        const __m256i s = U ? _mm256_load_si256(su_pairs + 2 * second) : second ? s_b : s_a;
#pragma GCC unroll 4
                        for (int r = 0; r < R; ++r) {
                            isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(p16[r], s));
                            OPAQUE_VECTOR(isum[r]); /* in order, as dot_pairs's sums */
                        }
                    }
                    if (T == TM_Q6_K) {
#pragma GCC unroll 4
                        for (int r = 0; r < R; ++r) {
                            int32_t pair; /* the row's code sums of the block's two halves */
                            memcpy(&pair, a->sum16 + 2 * ((r0 + r) * nb + block), sizeof pair);
                            const __m256i off = U ? _mm256_load_si256(su_pairs + 4) : s_off;
                            isum[r] = _mm256_sub_epi32(isum[r], _mm256_madd_epi16(off, _mm256_set1_epi32(pair)));
                            OPAQUE_VECTOR(isum[r]);
                        }
                    }
                }
            }
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const void *)(scu + half * 16)));
            __m256 dmin = _mm256_setzero_ps();
            __m256i mn[4]; /* Q4_K/Q5_K: the minimums of blocks 2i, 2i + 1 as 16-bit pairs */
            if (T != TM_Q6_K) {
                dmin = _mm256_cvtph_ps(_mm_loadu_si128((const void *)(scu + 32 + half * 16)));
                for (int i = 0; i < 4; ++i)
                    mn[i] = pairs16(
                        _mm256_cvtepu8_epi32(_mm_loadl_epi64((const void *)(scu + 192 + 16 * (2 * i) + half * 8))),
                        _mm256_cvtepu8_epi32(_mm_loadl_epi64((const void *)(scu + 192 + 16 * (2 * i + 1) + half * 8))));
            }
#pragma GCC unroll 4
            for (int r = 0; r < R; ++r) {
                const int64_t tb = (r0 + r) * nb + u * (QK_K / QK);
                const __m256 xs = _mm256_set1_ps(a->scale[tb]);
                float *yr = y + (r0 + r) * ldy + half * 8;
                __m256 acc = u ? _mm256_loadu_ps(yr) : _mm256_setzero_ps();
                __m256 dx = _mm256_mul_ps(d, xs);
                OPAQUE_VECTOR(dx);
                acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), dx, acc);
                if (T != TM_Q6_K) {
                    __m256i mins = _mm256_setzero_si256();
                    for (int i = 0; i < 4; ++i) {
                        int32_t pair;
                        memcpy(&pair, a->bsum + tb + 2 * i, sizeof pair);
                        mins = _mm256_add_epi32(mins, _mm256_madd_epi16(mn[i], _mm256_set1_epi32(pair)));
                    }
                    __m256 mx = _mm256_mul_ps(dmin, xs);
                    OPAQUE_VECTOR(mx);
                    acc = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(mins), mx, acc);
                }
                _mm256_storeu_ps(yr, acc);
            }
        }
    }
}

ALWAYS void tile(const int T, const int R, const int P, const tm_qx *a, int64_t r0, int64_t k, const uint8_t *qs,
                 const uint8_t *qh, const uint8_t *sc, float *y, int64_t ldy) {
    if (tm_is_k_quant(T) && P == 1) {
        tile_k256(T, R, a, r0, k, qs, qh, sc, y, ldy, 0, 0, k / QK_K, NULL);
        return;
    }
    const int64_t units = k / tm_unit_values(T), nb = k / QK, codes0 = tm_qx_code(k, r0, 0);
    const int CB = chunk_blocks(T), chunks = (int)(tm_unit_values(T) / QK) / CB, W = steps_per_widening(T);
    const int halves = T == TM_Q6_K;
    const int64_t off = T == TM_Q8_0 ? 0 : code_offset(T); /* Q8_0 multiplies |q| by the activation with q's sign */
    const __m256i ones = _mm256_set1_epi16(1);
    for (int half = 0; half < 2; ++half) {
        __m256 acc[MAX_ROWS];
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
#pragma GCC unroll 1
        for (int64_t u = 0; u < units; ++u) {
            const uint8_t *qsu = qs + u * tm_qs_bytes(T), *qhu = qh + u * tm_qh_bytes(T);
            const uint8_t *scu = sc + u * tm_sc_bytes(T);
            if (half == 0)
                for (int64_t line = 0; line < tm_sc_bytes(T); line += 64)
                    PREFETCH(scu + line + PREFETCH_BYTES * tm_sc_bytes(T) / tm_qs_bytes(T));
#pragma GCC unroll 1
            for (int c = 0; c < chunks; ++c) {
#pragma GCC unroll 2
                for (int b = 0; b < CB; ++b) {
                    const int64_t block = u * (tm_unit_values(T) / QK) + block_of(T, c, b);
                    __m256 s0, s1;
                    scales8(T, scu, c, b, half, &s0, &s1);
                    __m256i hi[MAX_ROWS][2], lo[MAX_ROWS][2], hi16[MAX_ROWS], lo16[MAX_ROWS];
#pragma GCC unroll 4
                    for (int r = 0; r < R; ++r) {
                        hi[r][0] = hi[r][1] = lo[r][0] = lo[r][1] = _mm256_setzero_si256();
                        hi16[r] = lo16[r] = _mm256_setzero_si256();
                        if (halves) /* Q6_K's chains start at -32 * (the codes' sum) */
                            for (int h = 0; h < 2; ++h) {
                                const int64_t at = 2 * ((r0 + r) * nb + block) + h;
                                hi[r][h] = _mm256_set1_epi32(a->q6_start_hi[at]);
                                if (P == 2) lo[r][h] = _mm256_set1_epi32(a->q6_start_lo[at]);
                            }
                    }
#pragma GCC unroll 8
                    for (int t = 0; t < 8; ++t) {
                        const __m256i w = codes8(T, qsu, qhu, c, b, t, half);
                        const __m256i w_abs = T == TM_Q8_0 ? _mm256_abs_epi8(w) : w;
                        const int chain = halves ? t >> 2 : 0;
#pragma GCC unroll 4
                        for (int r = 0; r < R; ++r) {
                            const int64_t at = codes0 + block * (QK * QX_ROWS) + t * (4 * QX_ROWS) + 4 * r;
                            __m256i xh = _mm256_set1_epi32(four_codes(a->hi + at)), xl = _mm256_setzero_si256();
                            if (P == 2) xl = _mm256_set1_epi32(four_codes(a->lo + at));
                            if (T == TM_Q8_0) {
                                xh = _mm256_sign_epi8(xh, w);
                                xl = _mm256_sign_epi8(xl, w);
                            }
                            /* the sums opaque, in order: as dot_pairs's */
                            hi16[r] = _mm256_add_epi16(hi16[r], _mm256_maddubs_epi16(w_abs, xh));
                            OPAQUE_VECTOR(hi16[r]);
                            if (P == 2) {
                                lo16[r] = _mm256_add_epi16(lo16[r], _mm256_maddubs_epi16(w_abs, xl));
                                OPAQUE_VECTOR(lo16[r]);
                            }
                            if ((t + 1) % W == 0) {
                                hi[r][chain] = _mm256_add_epi32(hi[r][chain], _mm256_madd_epi16(hi16[r], ones));
                                OPAQUE_VECTOR(hi[r][chain]);
                                hi16[r] = _mm256_setzero_si256();
                                if (P == 2) {
                                    lo[r][chain] = _mm256_add_epi32(lo[r][chain], _mm256_madd_epi16(lo16[r], ones));
                                    OPAQUE_VECTOR(lo[r][chain]);
                                    lo16[r] = _mm256_setzero_si256();
                                }
                            }
                        }
                    }
#pragma GCC unroll 4
                    for (int r = 0; r < R; ++r) {
                        const int64_t tb = (r0 + r) * nb + block;
                        const __m256 xs = _mm256_set1_ps(a->scale[tb]);
                        if (halves) { /* (dot_a * s_a + dot_b * s_b) * xs */
                            __m256 dot[2];
                            for (int h = 0; h < 2; ++h) dot[h] = block_dot8(P, hi[r][h], lo[r][h], 0, 0);
                            const __m256 both = _mm256_fmadd_ps(dot[1], s1, _mm256_mul_ps(dot[0], s0));
                            acc[r] = _mm256_fmadd_ps(both, xs, acc[r]);
                            continue;
                        }
                        const int32_t oh = (int32_t)off * a->sum_hi[tb], ol = P == 2 ? (int32_t)off * a->sum_lo[tb] : 0;
                        const __m256 dot = block_dot8(P, hi[r][0], lo[r][0], oh, ol);
                        acc[r] = _mm256_fmadd_ps(dot, _mm256_mul_ps(s0, xs), acc[r]);
                        const __m256 xsum = _mm256_set1_ps(a->sum[tb]);
                        if (T == TM_Q4_1 || T == TM_Q5_1) acc[r] = _mm256_fmadd_ps(s1, xsum, acc[r]);
                        if (T == TM_Q4_K || T == TM_Q5_K) acc[r] = _mm256_fnmadd_ps(s1, xsum, acc[r]);
                    }
                }
            }
        }
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + (r0 + r) * ldy + half * 8, acc[r]);
    }
}

/* ---- portable C ---------------------------------------------------------------------------------------------- */
#else

/* the unsigned code the vector paths see at step t, byte i of lane j (Q8_0: the signed code itself) */
ALWAYS int code_at(const int T, const uint8_t *qs, const uint8_t *qh, int c, int b, int t, int j, int i) {
    if (T == TM_Q8_0) return (int8_t)qs[t * 64 + j * 4 + i];
    const code_site s = site_of(T, c, b, t);
    int q = (qs[s.word * 64 + j * 4 + i] >> (4 * s.high_nibble)) & 0x0F;
    if (T == TM_MXFP4) { /* the value plus its offset, as the vector paths' table has it */
        static const int8_t values[16] = {TM_MXFP4_VALUES};
        return values[q] + code_offset(T);
    }
    if (T == TM_Q5_0 || T == TM_Q5_1 || T == TM_Q5_K) q |= ((qh[s.high_word * 64 + j * 4 + i] >> s.high_bit) & 1) << 4;
    if (T == TM_Q6_K) q |= ((qh[s.high_word * 64 + j * 4 + i] >> s.high_bit) & 3) << 4;
    return q;
}

/* lane j's weight scale (Q6_K: of block half h) and minimum for block b of chunk c */
ALWAYS void scales1(const int T, const uint8_t *sc, int c, int b, int j, int h, float *s0, float *s1) {
    const uint16_t *half = (const uint16_t *)sc;
    const int block = block_of(T, c, b);
    const float d = T == TM_MXFP4 ? tm_e8m0_half(sc[j]) : half_to_float(half[j]);
    *s0 = d;
    *s1 = (T == TM_Q4_1 || T == TM_Q5_1) ? half_to_float(half[GROUP + j]) : 0.0f;
    if (T == TM_Q4_K || T == TM_Q5_K) {
        *s0 = d * (float)sc[64 + 16 * block + j];
        *s1 = half_to_float(half[GROUP + j]) * (float)sc[192 + 16 * block + j];
    }
    if (T == TM_Q6_K) *s0 = d * (float)(int8_t)sc[32 + 16 * (2 * block + h) + j];
    OPAQUE_SCALAR(*s0);
    OPAQUE_SCALAR(*s1);
}

ALWAYS void tile(const int T, const int R, const int P, const tm_qx *a, int64_t r0, int64_t k, const uint8_t *qs,
                 const uint8_t *qh, const uint8_t *sc, float *y, int64_t ldy) {
    const int64_t units = k / tm_unit_values(T), nb = k / QK;
    const int CB = chunk_blocks(T), chunks = (int)(tm_unit_values(T) / QK) / CB;
    const int halves = T == TM_Q6_K;
    const int32_t off = T == TM_Q8_0 ? 0 : code_offset(T);
    float acc[MAX_ROWS][GROUP] = {{0}};
    for (int64_t u = 0; u < units; ++u) {
        const uint8_t *qsu = qs + u * tm_qs_bytes(T), *qhu = qh + u * tm_qh_bytes(T), *scu = sc + u * tm_sc_bytes(T);
        for (int c = 0; c < chunks; ++c)
            for (int b = 0; b < CB; ++b) {
                const int64_t block = u * (tm_unit_values(T) / QK) + block_of(T, c, b);
                int8_t codes[GROUP][QK]; /* [lane][input]: as the vector paths see them */
                for (int j = 0; j < GROUP; ++j)
                    for (int t = 0; t < 8; ++t)
                        for (int i = 0; i < 4; ++i) codes[j][4 * t + i] = (int8_t)code_at(T, qsu, qhu, c, b, t, j, i);
                for (int r = 0; r < R; ++r) {
                    const int64_t tb = (r0 + r) * nb + block;
                    int8_t xh[QK], xl[QK]; /* the row's codes of the block, in order */
                    for (int i = 0; i < QK; i += 4) {
                        const int64_t at = tm_qx_code(k, r0 + r, block * QK + i);
                        memcpy(xh + i, a->hi + at, 4);
                        if (P == 2) memcpy(xl + i, a->lo + at, 4);
                    }
                    const float xs = a->scale[tb];
                    for (int j = 0; j < GROUP; ++j) {
                        int32_t dh[2] = {0, 0}, dl[2] = {0, 0}; /* Q6_K: per half of the block */
                        for (int i = 0; i < QK; ++i) {
                            const int32_t q = T == TM_Q8_0 ? codes[j][i] : (uint8_t)codes[j][i];
                            dh[i / 16] += q * xh[i];
                            if (P == 2) dl[i / 16] += q * xl[i];
                        }
                        float s0, s1;
                        if (halves) { /* (dot_a * s_a + dot_b * s_b) * xs */
                            float both = 0.0f;
                            for (int h = 0; h < 2; ++h) {
                                const int32_t ih = dh[h] + a->q6_start_hi[2 * tb + h];
                                const int32_t il = P == 2 ? dl[h] + a->q6_start_lo[2 * tb + h] : 0;
                                const float dot = P == 2 ? (float)il * (1.0f / LO_STEPS) + (float)ih : (float)ih;
                                scales1(T, scu, c, b, j, h, &s0, &s1);
                                both += dot * s0;
                            }
                            acc[r][j] += both * xs;
                            continue;
                        }
                        const int32_t ih = dh[0] + dh[1] - off * a->sum_hi[tb];
                        const int32_t il = P == 2 ? dl[0] + dl[1] - off * a->sum_lo[tb] : 0;
                        const float dot = P == 2 ? (float)il * (1.0f / LO_STEPS) + (float)ih : (float)ih;
                        scales1(T, scu, c, b, j, 0, &s0, &s1);
                        acc[r][j] += dot * (s0 * xs);
                        if (T == TM_Q4_1 || T == TM_Q5_1) acc[r][j] += s1 * a->sum[tb];
                        if (T == TM_Q4_K || T == TM_Q5_K) acc[r][j] -= s1 * a->sum[tb];
                    }
                }
            }
    }
    for (int r = 0; r < R; ++r) memcpy(y + (r0 + r) * ldy, acc[r], sizeof(float) * GROUP);
}
#endif

/* ---- dispatch and the loops over groups and rows ------------------------------------------------------------ */

/* One function per type, tile rows and passes (each with its arguments constant, so its loops unroll into
 * registers), found through a table. */
typedef void (*tile_fn)(const tm_qx *a, int64_t r0, int64_t k, const uint8_t *qs, const uint8_t *qh,
                        const uint8_t *sc, float *y, int64_t ldy);
#define TM_TILE_FN(T, R, P)                                                                                        \
    static __attribute__((noinline)) void tile_##T##_##R##_##P(const tm_qx *a, int64_t r0, int64_t k,              \
                                                               const uint8_t *qs, const uint8_t *qh,               \
                                                               const uint8_t *sc, float *y, int64_t ldy) {         \
        tile(T, R, P, a, r0, k, qs, qh, sc, y, ldy);                                                               \
    }
/* X(T, R, P) for R = 1 .. MAX_ROWS */
#define TM_ROWS4(X, T, P) X(T, 1, P) X(T, 2, P) X(T, 3, P) X(T, 4, P)
#if MAX_ROWS == 8
#define TM_ROWS(X, T, P) TM_ROWS4(X, T, P) X(T, 5, P) X(T, 6, P) X(T, 7, P) X(T, 8, P)
#else
#define TM_ROWS(X, T, P) TM_ROWS4(X, T, P)
#endif
#define TM_ENTRY(T, R, P) tile_##T##_##R##_##P,
#define TM_TYPE(T) TM_ROWS(TM_TILE_FN, T, 1) TM_ROWS(TM_TILE_FN, T, 2)
TM_TYPE(TM_Q4_0)
TM_TYPE(TM_Q4_1)
TM_TYPE(TM_Q5_0)
TM_TYPE(TM_Q5_1)
TM_TYPE(TM_Q8_0)
TM_TYPE(TM_Q4_K)
TM_TYPE(TM_Q5_K)
TM_TYPE(TM_Q6_K)
TM_TYPE(TM_MXFP4)
#define TM_TABLE(T) {{TM_ROWS(TM_ENTRY, T, 1)}, {TM_ROWS(TM_ENTRY, T, 2)}}

/* [type][passes - 1][rows - 1], types in the order of type_index */
static const tile_fn TILES[9][2][MAX_ROWS] = {
    TM_TABLE(TM_Q4_0), TM_TABLE(TM_Q4_1), TM_TABLE(TM_Q5_0), TM_TABLE(TM_Q5_1), TM_TABLE(TM_Q8_0),
    TM_TABLE(TM_Q4_K), TM_TABLE(TM_Q5_K), TM_TABLE(TM_Q6_K), TM_TABLE(TM_MXFP4),
};

#if defined(TM_AVX512_VNNI) || defined(TM_AVX2)
/* the K-quants' tiles over a panel of unpacked units (unpack_k256), one pass */
typedef void (*panel_fn)(const tm_qx *a, int64_t r0, int64_t k, const uint8_t *sc, float *y, int64_t ldy,
                         int64_t u0, int64_t u1, const uint8_t *unpacked);
#define TM_PANEL_FN(T, R, P)                                                                                       \
    static __attribute__((noinline)) void panel_##T##_##R(const tm_qx *a, int64_t r0, int64_t k,                   \
                                                          const uint8_t *sc, float *y, int64_t ldy, int64_t u0,    \
                                                          int64_t u1, const uint8_t *unpacked) {                   \
        tile_k256(T, R, a, r0, k, NULL, NULL, sc, y, ldy, 1, u0, u1, unpacked);                                     \
    }
#define TM_PANEL_ENTRY(T, R, P) panel_##T##_##R,
TM_ROWS(TM_PANEL_FN, TM_Q4_K, 1)
TM_ROWS(TM_PANEL_FN, TM_Q5_K, 1)
TM_ROWS(TM_PANEL_FN, TM_Q6_K, 1)
static const panel_fn PANELS[3][MAX_ROWS] = {{TM_ROWS(TM_PANEL_ENTRY, TM_Q4_K, 1)},
                                             {TM_ROWS(TM_PANEL_ENTRY, TM_Q5_K, 1)},
                                             {TM_ROWS(TM_PANEL_ENTRY, TM_Q6_K, 1)}};
static void unpack_panel(int64_t type, const uint8_t *qs, const uint8_t *qh, const uint8_t *sc, int64_t u0,
                         int64_t u1, uint8_t *out) {
    if (type == TM_Q4_K) unpack_k256(TM_Q4_K, qs, qh, sc, u0, u1, out);
    else if (type == TM_Q5_K) unpack_k256(TM_Q5_K, qs, qh, sc, u0, u1, out);
    else unpack_k256(TM_Q6_K, qs, qh, sc, u0, u1, out);
}

/* rows [rb0, rb1) of a block of prompt rows against group g of a K-quant part, one pass: panel by panel, each
 * unpacked once for all of the block's tiles */
static void run_panels(const tm_part *p, int64_t g, const tm_qx *a, int64_t rb0, int64_t rb1, float *y,
                       int64_t ldy) {
    static __thread uint8_t unpacked[PANEL_UNITS * UNPACKED_UNIT_BYTES] __attribute__((aligned(64)));
    const int64_t units = p->k / QK_K;
    const uint8_t *qs = tm_group_base(p, g), *qh = qs + units * tm_qs_bytes(p->type);
    const uint8_t *sc = qh + units * tm_qh_bytes(p->type);
    const panel_fn *fns = PANELS[p->type == TM_Q4_K ? 0 : p->type == TM_Q5_K ? 1 : 2];
    for (int64_t u0 = 0; u0 < units; u0 += PANEL_UNITS) {
        const int64_t u1 = u0 + PANEL_UNITS < units ? u0 + PANEL_UNITS : units;
        unpack_panel(p->type, qs, qh, sc, u0, u1, unpacked);
        for (int64_t r0 = rb0; r0 < rb1; r0 += MAX_ROWS) {
            const int rows = (int)(rb1 - r0 < MAX_ROWS ? rb1 - r0 : MAX_ROWS);
            fns[rows - 1](a, r0, p->k, sc, y, ldy, u0, u1, unpacked);
        }
    }
}
#endif

static int type_index(int64_t type) {
    switch (type) {
    case TM_Q4_0: return 0;
    case TM_Q4_1: return 1;
    case TM_Q5_0: return 2;
    case TM_Q5_1: return 3;
    case TM_Q8_0: return 4;
    case TM_Q4_K: return 5;
    case TM_Q5_K: return 6;
    case TM_Q6_K: return 7;
    default: return 8; /* TM_MXFP4 (tm_weight_check has refused the rest) */
    }
}

/* one tile of `rows` (<= MAX_ROWS) activation rows from r0 against group g of part p */
static void run_tile(const tm_part *p, int64_t g, const tm_qx *a, int64_t r0, int rows, int64_t passes, float *y,
                     int64_t ldy) {
    const int64_t units = p->k / tm_unit_values(p->type);
    const uint8_t *qs = tm_group_base(p, g), *qh = qs + units * tm_qs_bytes(p->type);
    const uint8_t *sc = qh + units * tm_qh_bytes(p->type);
    TILES[type_index(p->type)][passes - 1][rows - 1](a, r0, p->k, qs, qh, sc, y, ldy);
}

/* Rows per tile of prompt rows (a divisor of QX_ROWS: tiles stay within groups of QX_ROWS rows). Q6_K's two
 * chains per row and pass (its 16-value halves) with 8 rows spill accumulators (189 spills per chunk with two
 * passes): 4 rows with two passes measured +9% against 8 (512 rows [2048, 8192], one thread, CPU time, medians of
 * 5 alternating runs; with one pass 6 rows measured +4%, 4 rows +2%: within the noise, kept at 8). */
static int64_t tile_rows(int64_t type, int64_t passes) {
#if MAX_ROWS == 8
    if (type == TM_Q6_K && passes == 2) return 4;
#endif
    (void)type, (void)passes;
    return MAX_ROWS;
}

/* rows per block of prompt rows: a multiple of QX_ROWS whose quantized activations fit in ROW_BLOCK_BYTES */
static int64_t row_block(int64_t m, int64_t k, int64_t passes) {
    int64_t rows = ROW_BLOCK_BYTES / (k * passes) / QX_ROWS * QX_ROWS; /* whole groups of codes (tm_qx_code) */
    rows = rows < QX_ROWS ? QX_ROWS : rows;
    return rows < m ? rows : m;
}

typedef struct {
    const tm_qx *a;
    int64_t m, passes, groups, row_block;
    const tm_weight *w;
    float *y;
    int64_t ldy;
} matmul_job;

/* the part of global group g (the parts' groups in order), its group there and its first output */
static const tm_part *locate(const tm_weight *w, int64_t g, int64_t *group, int64_t *col) {
    int64_t pi = 0;
    *col = 0;
    for (; g >= w->parts[pi].n / GROUP; ++pi) {
        g -= w->parts[pi].n / GROUP;
        *col += w->parts[pi].n;
    }
    *group = g;
    *col += g * GROUP;
    return &w->parts[pi];
}

/* Decode rows (m <= MAX_ROWS): groups [g0, g1) of all parts, in order, one tile each (a contiguous run of the
 * weights: each thread streams its pieces from memory, the prefetches within them) */
static void matmul_groups(void *p, int64_t g0, int64_t g1) {
    const matmul_job *j = p;
    for (int64_t g = g0; g < g1; ++g) {
        int64_t group, col;
        const tm_part *part = locate(j->w, g, &group, &col);
        run_tile(part, group, j->a, 0, (int)j->m, j->passes, j->y + col, j->ldy);
    }
}

/* Prompt rows: work items [i0, i1) of one block of rows (row_block) times one group, block after block. A thread
 * that runs slower or later (a machine shared with other work; Q6_K's groups cost more per byte than Q4_K's)
 * leaves its items to the others (pool.c). */
static void matmul_items(void *p, int64_t i0, int64_t i1) {
    const matmul_job *j = p;
    for (int64_t item = i0; item < i1; ++item) {
        const int64_t rb0 = item / j->groups * j->row_block;
        const int64_t rb1 = rb0 + j->row_block < j->m ? rb0 + j->row_block : j->m;
        int64_t group, col;
        const tm_part *part = locate(j->w, item % j->groups, &group, &col);
#if defined(TM_AVX512_VNNI) || defined(TM_AVX2)
        if (tm_is_k_quant(part->type) && j->passes == 1 && rb1 - rb0 > MAX_ROWS) {
            run_panels(part, group, j->a, rb0, rb1, j->y + col, j->ldy);
            continue;
        }
#endif
        const int64_t tr = tile_rows(part->type, j->passes);
        for (int64_t r0 = rb0; r0 < rb1; r0 += tr)
            run_tile(part, group, j->a, r0, (int)(rb1 - r0 < tr ? rb1 - r0 : tr), j->passes, j->y + col, j->ldy);
    }
}

/* One job of the calling team (pool.c); y is complete on return. A row's output does not depend on which thread
 * computes it. Decode rows: 8 pieces per thread (a thread that is descheduled holds up at most one). */
void tm_weight_matmul(const tm_qx *a, int64_t m, int64_t passes, const tm_weight *w, float *y) {
    const int64_t k = w->parts[0].k;
    int64_t groups = 0;
    for (int64_t p = 0; p < w->n_parts; ++p) groups += w->parts[p].n / GROUP;
    matmul_job j = {a, m, passes, groups, row_block(m, k, passes), w, y, tm_weight_n(w)};
    if (m <= MAX_ROWS)
        tm_pool_for(matmul_groups, &j, groups, 8 * tm_threads());
    else {
        const int64_t items = (m + j.row_block - 1) / j.row_block * groups;
        tm_pool_for(matmul_items, &j, items, items);
    }
}

typedef struct {
    const tm_qx *a;
    int64_t passes, ldy;
    const tm_segment *segments;
    const int64_t *first_unit; /* [n + 1]: each segment's first unit (one unit per group of its weight) */
    float *y;
} segments_job;

/* units [u0, u1): (segment, group of its weight) pairs, segment after segment; each unit's rows in tiles of at most
 * tile_rows that stay within their group of QX_ROWS rows (a tile's rows read their codes from one pointer) */
static void segment_units(void *p, int64_t u0, int64_t u1) {
    const segments_job *j = p;
    int64_t s = 0;
    for (int64_t u = u0; u < u1; ++u) {
        while (u >= j->first_unit[s + 1]) ++s;
        const tm_segment *seg = &j->segments[s];
        int64_t group, col;
        const tm_part *part = locate(seg->w, u - j->first_unit[s], &group, &col);
        const int64_t tr = tile_rows(part->type, j->passes), end = seg->r0 + seg->rows;
        for (int64_t r0 = seg->r0, rows; r0 < end; r0 += rows) {
            rows = end - r0 < tr ? end - r0 : tr;
            rows = rows < QX_ROWS - r0 % QX_ROWS ? rows : QX_ROWS - r0 % QX_ROWS;
            run_tile(part, group, j->a, r0, (int)rows, j->passes, j->y + col, j->ldy);
        }
    }
}

void tm_segments_matmul(const tm_qx *a, int64_t passes, const tm_segment *segments, int64_t n, float *y, int64_t ldy) {
    int64_t first_unit[n + 1];
    first_unit[0] = 0;
    for (int64_t s = 0; s < n; ++s) {
        int64_t groups = 0;
        for (int64_t p = 0; p < segments[s].w->n_parts; ++p) groups += segments[s].w->parts[p].n / GROUP;
        first_unit[s + 1] = first_unit[s] + groups;
    }
    segments_job j = {a, passes, ldy, segments, first_unit, y};
    if (first_unit[n] > 0) tm_pool_for(segment_units, &j, first_unit[n], 8 * tm_threads());
}

typedef struct {
    const tm_weight *w;
    const float *x;
    int64_t m, passes;
    float *y;
    tm_qx a;
} qmatmul_args;

static void qmatmul_body(void *p) {
    qmatmul_args *q = p;
    tm_quantize_rows(q->x, q->m, q->w->parts[0].k, q->passes, tm_activation_group(q->w, q->passes), &q->a);
    tm_weight_matmul(&q->a, q->m, q->passes, q->w, q->y);
}

/* y [m, tm_weight_n(w)] = x [m, k] @ w.T, x float32 row-major, activations quantized in `passes` (1 or 2) int8
 * passes. Each part's outputs are its n columns (its padding rows' outputs 0). Returns 0, -1 for a malformed
 * weight or passes, -2 when out of memory. */
int tm_qmatmul(const tm_weight *w, const float *x, int64_t m, int64_t passes, float *y) {
    if (tm_weight_check(w) || (passes != 1 && passes != 2) || m < 0) return -1;
    if (m == 0) return 0;
    const int64_t k = w->parts[0].k;
    qmatmul_args q = {.w = w, .x = x, .m = m, .passes = passes, .y = y};
    int rc = tm_qx_alloc(&q.a, m, k, passes);
    if (rc == 0) tm_team_run(qmatmul_body, &q);
    tm_qx_free(&q.a);
    return rc;
}
