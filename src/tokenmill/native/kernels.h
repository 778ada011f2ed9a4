/* Shared declarations of tokenmill's native kernels: repack.c (GGUF blocks into the products' layout, and rows
 * back to float32), products.c (activation quantization and the integer products), decoder.c (a llama decode
 * step), dequantize.c (whole tensors at load).
 *
 * Vector paths: AVX-512 VNNI, AVX2 with FMA and F16C, and portable C; the compiler picks with -march=native.
 * Threads: teams of OpenMP threads whose jobs are claimed piece by piece (pool.c; tokenmill loads this library
 * after torch, so `libgomp.so.1` resolves to torch's copy and both share one thread pool).
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
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define TM_AVX512_VNNI 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define TM_AVX2 1
#endif

#define QK 32    /* inputs per block (and per activation block) */
#define QK_K 256 /* inputs per K-quant super-block */
#define GROUP 16 /* output rows interleaved per weight group */

#define LO_STEPS 254.0f /* the second activation pass resolves one step of the first into 254 */
#define Q6_OFFSET 32     /* Q6_K's codes are q - 32 */

/* ---- weights -------------------------------------------------------------------------------------------------
 * GGML's numbers for the block types the products take (MXFP4: gpt-oss's experts, 4-bit e2m1 codes and an E8M0
 * exponent per block of 32). */
enum {
    TM_Q4_0 = 2, TM_Q4_1 = 3, TM_Q5_0 = 6, TM_Q5_1 = 7, TM_Q8_0 = 8, TM_Q4_K = 12, TM_Q5_K = 13, TM_Q6_K = 14,
    TM_MXFP4 = 39
};

/* A weight is repacked per group of 16 rows: group g's bytes are contiguous, and hold three planes, each unit after
 * unit (a unit is one block of 32 inputs, or one K-quant super-block of 256):
 *   codes  tm_qs_bytes per unit: the file's 4-bit code bytes (or Q8_0's int8 codes) as 4-byte words, the word w of
 *          row j at w * 64 + j * 4: one 64-byte load gives 4 bytes of each of the 16 rows
 *   highs  tm_qh_bytes per unit: the 5th bit (Q5_x) or the 5th and 6th bits (Q6_K), words likewise
 *   scales tm_sc_bytes per unit: the file's scales, per row (lane j) in their integer or half-float form (MXFP4:
 *          its exponent bytes)
 * repack.c describes each type's planes. */
static inline int tm_type_known(int64_t type) {
    switch (type) {
    case TM_Q4_0: case TM_Q4_1: case TM_Q5_0: case TM_Q5_1: case TM_Q8_0: case TM_Q4_K: case TM_Q5_K: case TM_Q6_K:
    case TM_MXFP4:
        return 1;
    default:
        return 0;
    }
}
static inline int tm_is_k_quant(int64_t type) { return type == TM_Q4_K || type == TM_Q5_K || type == TM_Q6_K; }
/* inputs per unit */
static inline int64_t tm_unit_values(int64_t type) { return tm_is_k_quant(type) ? QK_K : QK; }
/* bytes of one row's unit in the GGUF file */
static inline int64_t tm_file_bytes(int64_t type) {
    switch (type) {
    case TM_Q4_0: return 18;
    case TM_Q4_1: return 20;
    case TM_Q5_0: return 22;
    case TM_Q5_1: return 24;
    case TM_Q8_0: return 34;
    case TM_Q4_K: return 144;
    case TM_Q5_K: return 176;
    case TM_Q6_K: return 210;
    case TM_MXFP4: return 17;
    default: return 0;
    }
}
/* bytes per group and unit of each plane */
static inline int64_t tm_qs_bytes(int64_t type) {
    return type == TM_Q8_0 ? GROUP * QK : GROUP * tm_unit_values(type) / 2;
}
static inline int64_t tm_qh_bytes(int64_t type) {
    switch (type) {
    case TM_Q5_0: case TM_Q5_1: return GROUP * 4;       /* 32 bits per row */
    case TM_Q5_K: return GROUP * QK_K / 8;              /* 1 bit per input */
    case TM_Q6_K: return GROUP * QK_K / 4;              /* 2 bits per input */
    default: return 0;
    }
}
static inline int64_t tm_sc_bytes(int64_t type) {
    switch (type) {
    case TM_Q4_0: case TM_Q5_0: case TM_Q8_0: return GROUP * 2;        /* d (half) */
    case TM_Q4_1: case TM_Q5_1: return GROUP * 4;                      /* d, m (halves) */
    case TM_Q4_K: case TM_Q5_K: return GROUP * (4 + 16);               /* d, dmin (halves); 8 scales, 8 mins (u8) */
    case TM_Q6_K: return GROUP * (2 + 16);                             /* d (half); 16 scales (int8) */
    case TM_MXFP4: return GROUP;                                       /* e (E8M0 exponent byte) */
    default: return 0;
    }
}
static inline int64_t tm_unit_bytes(int64_t type) { return tm_qs_bytes(type) + tm_qh_bytes(type) + tm_sc_bytes(type); }

/* One homogeneous part of a weight: n rows (a multiple of 16: a part's last group is padded with zero rows by
 * tm_repack) of k inputs (a multiple of the type's unit), tm_repack_bytes(type, n, k) bytes at data. */
typedef struct {
    int64_t type, n, k;
    const uint8_t *data;
} tm_part;

/* A weight: up to TM_MAX_PARTS parts of the same k stacked along the outputs (a fused QKV whose V is another type,
 * gate + up); a product writes the parts' outputs side by side in part order, n = the sum of the parts' n. */
#define TM_MAX_PARTS 4
typedef struct {
    int64_t n_parts;
    tm_part parts[TM_MAX_PARTS];
} tm_weight;

/* bytes of one group of the part; the part's group g (its three planes) */
static inline int64_t tm_group_bytes(const tm_part *p) {
    return p->k / tm_unit_values(p->type) * tm_unit_bytes(p->type);
}
static inline const uint8_t *tm_group_base(const tm_part *p, int64_t g) { return p->data + g * tm_group_bytes(p); }
int64_t tm_weight_n(const tm_weight *w);
int tm_weight_check(const tm_weight *w); /* 0, or -1 when a part is malformed or the parts' k differ */

/* ---- activations ---------------------------------------------------------------------------------------------
 * Quantized per row and block of 32, in one or two int8 passes: x ~ s * hi (one), x ~ s * (hi + lo / 254) (two),
 * s = max|x| / 127 over the block, or over `group` blocks (a K-quant super-block of 256: one pass into K-quants,
 * as llama.cpp's Q8_K; tm_activation_group, products.c's header says why). The codes of each QX_ROWS rows are interleaved by 4-byte word:
 * word w (codes 4w .. 4w + 3) of the rows r0 .. r0 + 7 (r0 a multiple of 8) are 32 contiguous bytes, so that a
 * tile (its rows within one such group) reads all its rows' codes from one pointer with constant offsets: with a
 * pointer per row the AVX-512 tiles ran out of general registers (8 rows: ~50 moves to and from vector registers
 * per chunk), and measured 5% slower. The 8 rows of a tile are contiguous, so they do not share an L1 set (rows
 * k bytes apart did, for k a multiple of 4096). */
#define QX_ROWS 8
static inline int64_t tm_qx_code(int64_t k, int64_t row, int64_t col) {
    return row / QX_ROWS * (QX_ROWS * k) + col / 4 * (4 * QX_ROWS) + row % QX_ROWS * 4 + col % 4;
}
/* where the value of the 8 inputs from col (a multiple of 8) of row `row` is, for arrays of one value per 8 inputs
 * interleaved as the codes: a tile's rows' values of the same 8 inputs are contiguous */
static inline int64_t tm_qx_start8(int64_t k, int64_t row, int64_t col) {
    return row / QX_ROWS * (QX_ROWS * (k / 8)) + col / 8 * QX_ROWS + row % QX_ROWS;
}
/* bytes of the codes of m rows (the last group of QX_ROWS rows whole) */
static inline int64_t tm_qx_code_bytes(int64_t m, int64_t k) { return (m + QX_ROWS - 1) / QX_ROWS * QX_ROWS * k; }
#define LO_SHIFT 2048
typedef struct {
    int8_t *hi, *lo;              /* [m, stride] codes of the passes (lo only with two) */
    int8_t *lo_buffer;            /* lo's allocation (lo = lo_buffer + LO_SHIFT) */
    float *scale;                 /* [m, k/32] s */
    float *sum;                   /* [m, k/32] the sum of the block's quantized values (minimum terms) */
    int32_t *sum_hi, *sum_lo;     /* [m, k/32] sums of the codes of each pass (code offsets: Q4_0, Q5_0, Q8_0) */
    int32_t *q6_start_hi, *q6_start_lo; /* [m, k/16] -32 * the codes' sums per 16 values: Q6_K's offset (its
                                         * sub-blocks are 16), where its integer chains start */
    int32_t *q6_start8; /* the same per 8 values, one pass only (Q6_K over unpacked codes), at tm_qx_start8 */
    int16_t *sum16;     /* [m, k/16] the codes' sums per 16 values, one pass only, AVX2 (Q6_K's offset by pairs) */
    int16_t *bsum;                /* [m, k/32] sum_hi in 16 bits (|sum| <= 32 * 127): K-quants' minimums by pairs */
} tm_qx;

/* IEEE half -> float (dequantization and the portable path; the vector paths convert with vcvtph2ps) */
static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h >> 15) << 31, exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF;
    if (exponent == 0) return (sign ? -1.0f : 1.0f) * ldexpf((float)mantissa, -24); /* zero and subnormals */
    uint32_t bits = sign | (exponent == 31 ? 0x7F800000u | mantissa << 13 : (exponent + 112) << 23 | mantissa << 13);
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* MXFP4's block scale from its exponent byte e: 2^(e - 128), the half of E8M0's 2^(e - 127) (the codes' table holds
 * e2m1's values doubled), its bits built as ggml's ggml_e8m0_to_fp32_half: e < 2 the denormals 2^-128, 2^-127 */
static inline float tm_e8m0_half(uint8_t e) {
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}
/* MXFP4's codes 0..15 -> e2m1's values doubled (ggml's kvalues_mxfp4), as a list: an array's initializer, or the
 * arguments of _mm_setr_epi8 (the vector paths' table) */
#define TM_MXFP4_VALUES 0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12

/* ---- pool.c: a team of threads and its jobs ---------------------------------------------------------------
 * tm_team_run(body, ctx) runs body(ctx) on the calling thread while the team's other threads serve the jobs it
 * starts; tm_pool_for(fn, ctx, n, items) is one job: fn(ctx, begin, end) over [0, n) in `items` contiguous
 * pieces, claimed by whichever thread is free, complete on return (outside a team body it makes a team for
 * itself). fn must not start jobs itself. */
typedef void (*tm_range_fn)(void *ctx, int64_t begin, int64_t end);
void tm_team_run(void (*body)(void *), void *ctx);
void tm_pool_for(tm_range_fn fn, void *ctx, int64_t n, int64_t items);
void tm_set_threads(int n); /* threads of a team, the caller included */
int tm_threads(void);
int64_t tm_pool_stalls(void); /* waits for a descheduled helper so far (each starts a while of solo jobs) */
int tm_pool_solo(void);       /* 1 while jobs run on their caller alone after a stall */

/* for the tests: jobs whose pieces take caller_us on the caller and helper_us on a helper */
void tm_pool_probe(int64_t jobs, int64_t pieces, int64_t caller_us, int64_t helper_us, int64_t *caller_pieces);

/* ---- the matrix units (matrix_units.c) ---------------------------------------------------------------------- */
int tm_amx_reported(void);   /* 1 where CPUID reports AMX-TILE and AMX-INT8 */
int tm_amx_request(void);    /* asks Linux for the tile state: 0 granted */
int tm_amx_tile_check(void); /* one tile product against plain C: 0 right (SIGILL without the tile state) */

/* products.c, for the decoder: jobs of the calling team */
/* rows [r0, r0 + rows) of a product's quantized activations times w */
typedef struct {
    const tm_weight *w;
    int64_t r0, rows;
} tm_segment;
/* for each segment, y[r * ldy + j] (r its rows, j < tm_weight_n of its weight) = activation row r . row j of its
 * weight: one job over every segment's weight groups (a mixture's chosen experts in one pass of the team) */
void tm_segments_matmul(const tm_qx *a, int64_t passes, const tm_segment *segments, int64_t n, float *y, int64_t ldy);

/* ---- the decoder (decoder.c) ------------------------------------------------------------------------------ */
/* A mixture of experts in place of a layer's MLP (layers/moe.py): a float64 router scores the n_experts for each
 * token, the k best are its experts (a softmax over all then the top k, renormalized where `normalize`, or with
 * `softmax_after_topk` the top k logits then a softmax over them; times `scale`), and their gated MLPs' outputs
 * are summed, weighted, in expert order. */
typedef struct {
    int64_t n_experts, k, inter;         /* experts, chosen a token, each expert's width */
    int64_t normalize, softmax_after_topk;
    float scale;
    const float *router;                 /* [n_experts, h] (its products summed in float64) */
    const double *router_bias;           /* [n_experts] or NULL */
    const tm_weight *gate_up, *down;     /* [n_experts] each: [2 inter, h] (gate rows, then up), [h, inter] */
    const float *gate_up_bias;           /* [n_experts, 2 inter] or NULL (gpt-oss) */
    const float *down_bias;              /* [n_experts, h] or NULL */
    tm_weight shared_gate_up, shared_down; /* Qwen2-MoE's shared expert (n_parts 0: none), every token's */
    const float *shared_gate;            /* [h]: the shared expert's output times sigmoid(x . shared_gate) */
} tm_moe;

/* One layer of a llama-family model as the decoder reads it: its weights, its caches, and the traits other
 * architectures add, as data (NULL / 0: llama's). Built once, from the model, by layers/native_decode.py. */
typedef struct {
    const float *norm1, *norm2;                  /* [hidden] RMSNorm weights before attention and before the MLP */
    tm_weight qkv, o, gate_up, down;             /* projections (gate_up: gate rows, then up rows) */
    void *k_cache, *v_cache;                     /* [slots, kv_heads, dim] of kv_dtype (int8: dim + 4) */
    /* what other architectures add (NULL / 0: llama's) */
    const float *q_norm, *k_norm;                /* [dim]: RMSNorm of each query and key head before rope (QK-norm) */
    const float *post_attn_norm, *post_mlp_norm; /* [hidden]: norms of the blocks' outputs before the residual sums */
    int64_t window;                              /* > 0: attends to its `window` latest positions only (local layer) */
    int64_t local_rope;                          /* 1: rotates with the local rope tables (their own base) */
    const float *qkv_bias;                       /* [qkv's n]: added to the Q/K/V projection's output (Qwen2) */
    int64_t kv_dtype;                            /* the caches' element type: TM_KV_F32, _F16, _BF16 or _I8 */
    const tm_moe *moe;                           /* a mixture of experts in place of gate_up and down (unused) */
    int64_t qk_norm_whole;                       /* 1: q_norm [heads * dim] and k_norm [kv_heads * dim] norm the
                                                  * whole Q and K (OLMoE), not each head */
    const float *o_bias;                         /* [h]: added to the output projection's (gpt-oss) */
    const float *sinks;                          /* [heads]: each head's sink logit in its softmax (gpt-oss) */
} tm_llama_layer;


/* sums the n floats at x over the tensor-parallel ranks in place (ctx: the caller's state, say a shared-memory
 * group); returns 0, or not 0 when the collective failed */
typedef int (*tm_reduce_fn)(void *ctx, float *x, int64_t n);

/* What the model is, for every step (built once with the KV cache). Under tensor parallelism the layers are one
 * rank's shards and `reduce` (else NULL) sums the output and down projections' partial results over the ranks, in
 * place, with `reduce_ctx`. Each layer's weights may be of any of the products' types, in parts (tm_weight):
 * qkv [(heads + 2 kv_heads) * dim, h], o [h, heads * dim], gate_up [2 inter, h], down [h, inter], every part's
 * rows a multiple of 16; activation: TM_SILU, TM_GELU_TANH or TM_SWIGLU_OAI (decoder.c), the dense MLPs' and the
 * experts'; passes: the projections' activation
 * quantization (1 or 2 int8 passes). */
typedef struct {
    const tm_llama_layer *layers;
    int64_t n_layers, h, heads, kv_heads, dim;
    float eps, scale; /* RMSNorm's epsilon; attention's softmax scale */
    int64_t activation, passes;
    tm_reduce_fn reduce;
    void *reduce_ctx;
} tm_llama_model;

/* One step's m decode rows (one query each). cos_full/sin_signed: [m, dim] rope tables of the rows' positions;
 * local_cos_full and local_sin_signed those of the layers with local_rope set (may be the same). slot_mapping [m]:
 * where each row's K/V go; ctx_slots [m, max_ctx]: the slots of each row's context, ctx_lens [m] long; the layers
 * with a window read local_slot_mapping and local_ctx_slots (their own pool's slots; may be the same). */
typedef struct {
    float *hidden; /* [m, h], updated in place */
    int64_t m, max_ctx;
    const float *cos_full, *sin_signed, *local_cos_full, *local_sin_signed;
    const int64_t *slot_mapping, *ctx_slots, *local_slot_mapping, *local_ctx_slots, *ctx_lens;
} tm_decode_step;

int tm_llama_check(const tm_llama_model *model);
int tm_llama_decode(const tm_llama_model *model, const tm_decode_step *step);

/* ---- prompt attention (attention.c) ----------------------------------------------------------------------- */
/* A prompt chunk: q_len query rows from token_start of the step's rows, the last q_len positions of a context of
 * ctx_len positions whose cache slots are slots [ctx_len] (its own K/V already written there) */
typedef struct {
    int64_t token_start, q_len, ctx_len;
    const int64_t *slots;
} tm_attn_chunk;

/* One layer's prompt attention: q, out [T, heads, dim] float32 (the step's rows); the caches [slots, kv_heads,
 * head] of kv_elements.h's type kv_dtype; window > 0: a sliding window of that many keys; sinks [heads] or NULL */
typedef struct {
    const float *q;
    float *out;
    const void *k_cache, *v_cache;
    int64_t kv_dtype, heads, kv_heads, dim, window;
    float scale;
    const float *sinks;
    const tm_attn_chunk *chunks;
    int64_t n_chunks;
} tm_prefill_attention_args;

int tm_prefill_attention(const tm_prefill_attention_args *args);

/* lowrank.c: y [n][out] = (x [n][in] . a [rank][in]^T) . B^T, B^T as bt [ceil(out / 64)][rank][64]; each row's
 * bits its own (LoRA) */
int tm_lowrank_rows(const float *x, int64_t n, int64_t in, const float *a, int64_t rank, const float *bt, int64_t out,
                    float *y);

int tm_qx_alloc(tm_qx *a, int64_t m, int64_t k, int64_t passes);
void tm_qx_free(tm_qx *a);
/* the activations' group for a product with w: 8 (a scale per 256) with one pass into a weight with a K-quant
 * part, else 1 */
int64_t tm_activation_group(const tm_weight *w, int64_t passes);
void tm_quantize_rows(const float *x, int64_t m, int64_t k, int64_t passes, int64_t group, const tm_qx *a);
/* y [m, tm_weight_n(w)] = x @ w.T over a's quantized rows (y is complete on return) */
void tm_weight_matmul(const tm_qx *a, int64_t m, int64_t passes, const tm_weight *w, float *y);

#endif
