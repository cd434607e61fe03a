/* Products of Q6_K matrices with many activation rows, as a ggml custom op (docs/ARCHITECTURE.md,
 * "The Q6_K product").
 *
 * ggml's CPU backend multiplies a Q6_K matrix row by row with one dot product per (weight row,
 * activation row) pair on x86, so each weight block is unpacked once per activation row: at 4 rows
 * a product costs about 2x what one row does, though the bytes read are the same. Here each block
 * is unpacked once and multiplied with every activation row, the activations quantized as ggml
 * quantizes them for Q6_K (q8_K: 256-value blocks, one float scale, int8 codes, sums per 16).
 *
 * A value of a Q6_K block is d * sc[i / 16] * (q[i] - 32), q in 0..63 (6 bits: 4 in ql, 2 in qh),
 * sc int8, d f16. The dot product of a block with an activation block (dx, c[256]) is
 *     d * dx * (sum_j sc[j] * sum_{i in j} q[i] c[i]  -  32 * sum_j sc[j] * bsum[j])
 * all integer but the two scales. Every variant sums in ggml's order (its AVX2 dot product, which
 * ggml runs on every x86 CPU with AVX2, AVX-512 ones included): 8 int32 lanes per block, lane l
 * holding values 32u + 4l .. 32u + 4l + 3 (u = 0..7) less 32 * (sc[2l] bsum[2l] + sc[2l+1] bsum[2l+1]),
 * then per lane acc = fma(d, lane, acc) block after block, and the 8 lanes added as ggml adds them.
 * So the products are ggml's bit for bit, and a row's result does not depend on the rows beside it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ggml_ops.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#define ROW_TILE 32 /* activation rows multiplied per pass over a weight row */
#define SINGLE_ROWS 0x100 /* userdata flag of the grouped op: one pair a pass over an expert's weight row */

typedef struct {
    uint8_t ql[QK / 2];     /* low 4 bits of the codes */
    uint8_t qh[QK / 4];     /* high 2 bits */
    int8_t scales[QK / 16]; /* one per 16 values */
    uint16_t d;             /* f16 */
} block_q6k;

_Static_assert(sizeof(block_q6k) == 210, "a Q6_K block is 210 bytes");


static float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exponent = (h >> 10) & 0x1F;
    uint32_t mantissa = h & 0x3FF;
    uint32_t bits;
    if (exponent == 0x1F) {
        bits = sign | 0x7F800000u | (mantissa << 13);
    } else if (exponent != 0) {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else if (mantissa == 0) {
        bits = sign;
    } else { /* subnormal: normalise */
        exponent = 113;
        while (!(mantissa & 0x400)) {
            mantissa <<= 1;
            exponent--;
        }
        bits = sign | (exponent << 23) | ((mantissa & 0x3FF) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* The activations of rows [r0, r0 + m), quantized. */
typedef struct {
    int64_t blocks; /* per row */
    int8_t *codes;  /* (m, blocks * 256) */
    float *scales;  /* (m, blocks) */
    int16_t *sums;  /* (m, blocks * 16) */
} quantized_rows;

/* ggml's hsum_float_8: ((x0 + x4) + (x2 + x6)) + ((x1 + x5) + (x3 + x7)). */
static float sum_lanes(const float *x) { return ((x[0] + x[4]) + (x[2] + x[6])) + ((x[1] + x[5]) + (x[3] + x[7])); }

static void dot_rows_scalar(const block_q6k *w, const quantized_rows *a, int m, float *out, size_t out_stride) {
    for (int r = 0; r < m; r++) {
        float acc[8] = {0};
        for (int64_t b = 0; b < a->blocks; b++) {
            const block_q6k *blk = w + b;
            const int8_t *c = a->codes + (r * a->blocks + b) * QK;
            const int16_t *bsum = a->sums + (r * a->blocks + b) * 16;
            uint8_t q[QK]; /* codes 0..63 in value order */
            for (int half = 0; half < 2; half++) {
                const uint8_t *ql = blk->ql + 64 * half;
                const uint8_t *qh = blk->qh + 32 * half;
                uint8_t *qv = q + 128 * half;
                for (int l = 0; l < 32; l++) {
                    qv[l] = (uint8_t)((ql[l] & 0xF) | ((qh[l] & 3) << 4));
                    qv[l + 32] = (uint8_t)((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4));
                    qv[l + 64] = (uint8_t)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4));
                    qv[l + 96] = (uint8_t)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4));
                }
            }
            const float d = half_to_float(blk->d) * a->scales[r * a->blocks + b];
            for (int l = 0; l < 8; l++) {
                int32_t lane = 0;
                for (int u = 0; u < 8; u++)
                    for (int t = 0; t < 4; t++) {
                        const int i = 32 * u + 4 * l + t;
                        lane += blk->scales[i / 16] * q[i] * c[i];
                    }
                lane -= 32 * (blk->scales[2 * l] * bsum[2 * l] + blk->scales[2 * l + 1] * bsum[2 * l + 1]);
                acc[l] = fmaf(d, (float)lane, acc[l]);
            }
        }
        out[r * out_stride] = sum_lanes(acc);
    }
}

#if defined(__x86_64__)
__attribute__((target("avx,sse3"))) static inline float sum_lanes8(__m256 x) {
    float lanes[8];
    _mm256_storeu_ps(lanes, x);
    return sum_lanes(lanes);
}

__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,f16c,fma")))
static void dot_rows_avx512(const block_q6k *w, const quantized_rows *a, int m, float *out, size_t out_stride) {
    __m256 acc[ROW_TILE]; /* ggml's 8 lanes: the 16 of a 512-bit sum fold into them (lane l + lane l + 8) */
    for (int r = 0; r < m; r++) acc[r] = _mm256_setzero_ps();
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    const __m512i bits45 = _mm512_set1_epi8(0x30); /* where a code's 2 high bits go */
    /* 16-bit lanes 0..15 of [qh | qh]: shift left by 4 (bits 0-1 to 4-5), lanes 16..31 by 2 (bits 2-3) */
    const __m512i shift_low = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
    /* for the high nibbles: bits 4-5 stay, bits 6-7 move right by 2 */
    const __m512i shift_high = _mm512_inserti64x4(_mm512_set1_epi16(0), _mm256_set1_epi16(2), 1);
    __m512i scale_index[4];
    for (int v = 0; v < 4; v++) {
        int16_t idx[32];
        for (int t = 0; t < 32; t++) idx[t] = (int16_t)(4 * v + t / 8);
        scale_index[v] = _mm512_loadu_si512(idx);
    }
    for (int64_t b = 0; b < a->blocks; b++) {
        const block_q6k *blk = w + b;
        __m512i q[4];
        for (int half = 0; half < 2; half++) {
            const __m512i ql = _mm512_loadu_si512(blk->ql + 64 * half);
            const __m256i qh256 = _mm256_loadu_si256((const __m256i *)(blk->qh + 32 * half));
            const __m512i qh = _mm512_inserti64x4(_mm512_castsi256_si512(qh256), qh256, 1);
            const __m512i hi_low = _mm512_and_si512(_mm512_sllv_epi16(qh, shift_low), bits45);
            const __m512i hi_high = _mm512_and_si512(_mm512_srlv_epi16(qh, shift_high), bits45);
            q[2 * half] = _mm512_or_si512(_mm512_and_si512(ql, low4), hi_low);
            q[2 * half + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), low4), hi_high);
        }
        const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)blk->scales));
        const __m512i sc512 = _mm512_castsi256_si512(sc16);
        __m512i sc[4];
        for (int v = 0; v < 4; v++) sc[v] = _mm512_permutexvar_epi16(scale_index[v], sc512);
        const float d = _cvtsh_ss(blk->d);
        for (int r = 0; r < m; r++) {
            const int8_t *c = a->codes + (r * a->blocks + b) * QK;
            __m512i sum = _mm512_madd_epi16(_mm512_maddubs_epi16(q[0], _mm512_loadu_si512(c)), sc[0]);
            for (int v = 1; v < 4; v++)
                sum = _mm512_add_epi32(
                    sum, _mm512_madd_epi16(_mm512_maddubs_epi16(q[v], _mm512_loadu_si512(c + 64 * v)), sc[v]));
            const __m256i sums = _mm256_loadu_si256((const __m256i *)(a->sums + (r * a->blocks + b) * 16));
            const __m256i bias = _mm256_slli_epi32(_mm256_madd_epi16(sc16, sums), 5);
            const __m256i lanes = _mm256_sub_epi32(
                _mm256_add_epi32(_mm512_castsi512_si256(sum), _mm512_extracti64x4_epi64(sum, 1)), bias);
            acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(d * a->scales[r * a->blocks + b]), _mm256_cvtepi32_ps(lanes), acc[r]);
        }
    }
    for (int r = 0; r < m; r++) out[r * out_stride] = sum_lanes8(acc[r]);
}

__attribute__((target("avx2,f16c,fma")))
static void dot_rows_avx2(const block_q6k *w, const quantized_rows *a, int m, float *out, size_t out_stride) {
    __m256 acc[ROW_TILE];
    for (int r = 0; r < m; r++) acc[r] = _mm256_setzero_ps();
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    const __m256i bits45 = _mm256_set1_epi8(0x30);
    /* int16 scale lanes of one 32-value vector: lanes 0..7 sub-block 2v, 8..15 sub-block 2v + 1 */
    const __m256i pick = _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3,
                                          2, 3, 2, 3, 2, 3);
    for (int64_t b = 0; b < a->blocks; b++) {
        const block_q6k *blk = w + b;
        __m256i q[8]; /* values 32v .. 32v + 31 */
        for (int half = 0; half < 2; half++) {
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk->qh + 32 * half));
            for (int p = 0; p < 2; p++) { /* ql bytes 0..31 then 32..63 of the half */
                const __m256i ql = _mm256_loadu_si256((const __m256i *)(blk->ql + 64 * half + 32 * p));
                const __m256i h_low = _mm256_and_si256(p ? _mm256_slli_epi16(qh, 2) : _mm256_slli_epi16(qh, 4), bits45);
                const __m256i h_high = _mm256_and_si256(p ? _mm256_srli_epi16(qh, 2) : qh, bits45);
                q[4 * half + p] = _mm256_or_si256(_mm256_and_si256(ql, low4), h_low);
                q[4 * half + 2 + p] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ql, 4), low4), h_high);
            }
        }
        const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)blk->scales));
        int32_t pairs[8]; /* the int16 scales of sub-blocks 2v, 2v + 1 */
        _mm256_storeu_si256((__m256i *)pairs, sc16);
        __m256i sc[8];
        for (int v = 0; v < 8; v++) {
            /* each of the two repeated over 8 lanes */
            const __m128i pair = _mm_set1_epi32(pairs[v]);
            sc[v] = _mm256_shuffle_epi8(_mm256_set_m128i(pair, pair), pick);
        }
        const float d = _cvtsh_ss(blk->d);
        for (int r = 0; r < m; r++) {
            const int8_t *c = a->codes + (r * a->blocks + b) * QK;
            __m256i sum = _mm256_madd_epi16(
                _mm256_maddubs_epi16(q[0], _mm256_loadu_si256((const __m256i *)c)), sc[0]);
            for (int v = 1; v < 8; v++)
                sum = _mm256_add_epi32(sum, _mm256_madd_epi16(_mm256_maddubs_epi16(
                                                 q[v], _mm256_loadu_si256((const __m256i *)(c + 32 * v))), sc[v]));
            const __m256i sums = _mm256_loadu_si256((const __m256i *)(a->sums + (r * a->blocks + b) * 16));
            sum = _mm256_sub_epi32(sum, _mm256_slli_epi32(_mm256_madd_epi16(sc16, sums), 5));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_set1_ps(d * a->scales[r * a->blocks + b]), acc[r]);
        }
    }
    for (int r = 0; r < m; r++) out[r * out_stride] = sum_lanes8(acc[r]);
}
#endif

typedef void (*dot_rows_fn)(const block_q6k *, const quantized_rows *, int, float *, size_t);

/* The variants, best first; `route` picks one (0 = the best this CPU runs). */
static dot_rows_fn pick_variant(int route) {
#if defined(__x86_64__)
    const int sets = cpu_sets(), avx512 = sets & CPU_AVX512, avx2 = sets & CPU_AVX2;
    if (route == 0) return avx512 ? dot_rows_avx512 : avx2 ? dot_rows_avx2 : dot_rows_scalar;
    if (route == 1) return avx512 ? dot_rows_avx512 : NULL;
    if (route == 2) return avx2 ? dot_rows_avx2 : NULL;
#endif
    if (route == 0 || route == 3) return dot_rows_scalar;
    return NULL;
}

/* Which variant route 0 runs here: 1 AVX-512, 2 AVX2, 3 scalar. */
int skippy_q6k_best_route(void) {
    const dot_rows_fn best = pick_variant(0);
#if defined(__x86_64__)
    if (best == dot_rows_avx512) return 1;
    if (best == dot_rows_avx2) return 2;
#endif
    (void)best;
    return 3;
}

/* dst (m rows of n) = src[1] (m rows of k) times src[0] (n rows of k) transposed; src[0] Q6_K, src[1]
 * and dst float32 with contiguous rows. userdata: the variant's number (an intptr_t; q6k.VARIANTS).
 * This thread takes weight rows [ith * n / nth, (ith + 1) * n / nth). */
void skippy_q6k_mul_mat(struct tensor_abi *dst, int ith, int nth, void *userdata) {
    const struct tensor_abi *w = dst->src[0];
    const struct tensor_abi *x = dst->src[1];
    const int64_t k = w->ne[0], n = w->ne[1], m = x->ne[1];
    const int64_t first = ith * n / nth, last = (ith + 1) * n / nth;
    const dot_rows_fn dot = pick_variant((int)(intptr_t)userdata);
    if (first >= last || m == 0 || dot == NULL) return;
    quantized_rows a;
    a.blocks = k / QK;
    const int64_t tile = m < ROW_TILE ? m : ROW_TILE;
    /* every thread quantizes the rows it needs: they are few and small against the matrix */
    a.codes = (int8_t *)aligned_alloc(64, (size_t)(tile * k + 64));
    a.scales = (float *)malloc((size_t)(tile * a.blocks) * sizeof(float));
    a.sums = (int16_t *)malloc((size_t)(tile * a.blocks * 16) * sizeof(int16_t));
    if (a.codes == NULL || a.scales == NULL || a.sums == NULL) abort(); /* as ggml does when out of memory */
    for (int64_t r0 = 0; r0 < m; r0 += tile) {
        const int rows = (int)(m - r0 < tile ? m - r0 : tile);
        for (int r = 0; r < rows; r++)
            quantize_row_q8k((const float *)((const char *)x->data + (r0 + r) * x->nb[1]), k, 0, a.codes + r * k,
                         a.scales + r * a.blocks, a.sums + r * a.blocks * 16);
        for (int64_t row = first; row < last; row++) {
            const block_q6k *wr = (const block_q6k *)((const char *)w->data + row * w->nb[1]);
            float *out = (float *)((char *)dst->data + r0 * dst->nb[1]) + row;
            dot(wr, &a, rows, out, dst->nb[1] / sizeof(float));
        }
    }
    free(a.codes);
    free(a.scales);
    free(a.sums);
}

/* ggml_mul_mat_id's products (docs/ARCHITECTURE.md, "The expert layer"): dst (n, used, R) holds, for row r
 * of the pass and its slot s (0..used), expert ids[s, r]'s matrix times activation row (s % ne11, r), where
 * src[0] is the experts' Q6_K matrices (k, n, experts), src[1] the activations (k, ne11, R; ne11 is 1, the
 * rows' own input, or `used`, one per slot) and src[2] the I32 ids (used, R). Each (weight row, activation
 * row) sum is ggml's dot product's, as ggml_mul_mat_id takes it for every pair, so the bits are llama.cpp's.
 * The pairs are grouped by expert, each expert's rows multiplied in tiles of ROW_TILE, so a selected expert's
 * blocks are read once per tile where ggml reads them once per pair. userdata: the variant's number, with
 * SINGLE_ROWS for tiles of one pair (long matrices, as q6k.VARIANTS' long_k says). This thread takes weight
 * rows [ith * n / nth, (ith + 1) * n / nth) of every selected expert. */
void skippy_q6k_mul_mat_id(struct tensor_abi *dst, int ith, int nth, void *userdata) {
    const struct tensor_abi *w = dst->src[0], *x = dst->src[1], *ids = dst->src[2];
    const int64_t k = w->ne[0], n = w->ne[1], experts = w->ne[2];
    const int64_t used = ids->ne[0], passes = ids->ne[1], inputs = x->ne[1];
    const int64_t first = ith * n / nth, last = (ith + 1) * n / nth, width = last - first;
    const int flags = (int)(intptr_t)userdata;
    const dot_rows_fn dot = pick_variant(flags & 0xff);
    const int64_t most = flags & SINGLE_ROWS ? 1 : ROW_TILE;
    if (width <= 0 || passes == 0 || used == 0 || dot == NULL) return;
    const int64_t blocks = k / QK, pairs = used * passes, rows = inputs * passes;
    /* every thread quantizes every activation row: against an expert's blocks they are little work */
    int8_t *codes = (int8_t *)aligned_alloc(64, (size_t)(rows * k + 64));
    float *scales = (float *)malloc((size_t)(rows * blocks) * sizeof(float));
    int16_t *sums = (int16_t *)malloc((size_t)(rows * blocks * 16) * sizeof(int16_t));
    int64_t *count = (int64_t *)calloc((size_t)experts + 1, sizeof(int64_t));
    int64_t *next = (int64_t *)malloc((size_t)experts * sizeof(int64_t));
    int64_t *order = (int64_t *)malloc((size_t)pairs * sizeof(int64_t)); /* pair indices s + used * r by expert */
    quantized_rows tile = {blocks, (int8_t *)aligned_alloc(64, (size_t)(ROW_TILE * k + 64)),
                           (float *)malloc((size_t)(ROW_TILE * blocks) * sizeof(float)),
                           (int16_t *)malloc((size_t)(ROW_TILE * blocks * 16) * sizeof(int16_t))};
    float *out = (float *)malloc((size_t)(ROW_TILE * width) * sizeof(float));
    if (!codes || !scales || !sums || !count || !next || !order || !tile.codes || !tile.scales || !tile.sums || !out)
        abort(); /* as ggml does when out of memory */
    for (int64_t r = 0; r < passes; r++)
        for (int64_t i = 0; i < inputs; i++) {
            const int64_t row = i + inputs * r;
            quantize_row_q8k((const float *)((const char *)x->data + i * x->nb[1] + r * x->nb[2]), k, 0,
                             codes + row * k, scales + row * blocks, sums + row * blocks * 16);
        }
    group_pairs(ids, experts, count, next, order);
    for (int64_t e = 0; e < experts; e++) {
        const char *matrix = (const char *)w->data + e * w->nb[2];
        for (int64_t t0 = count[e]; t0 < count[e + 1]; t0 += most) {
            const int m = (int)(count[e + 1] - t0 < most ? count[e + 1] - t0 : most);
            for (int j = 0; j < m; j++) {
                const int64_t p = order[t0 + j], row = (p % used) % inputs + inputs * (p / used);
                memcpy(tile.codes + j * k, codes + row * k, (size_t)k);
                memcpy(tile.scales + j * blocks, scales + row * blocks, (size_t)blocks * sizeof(float));
                memcpy(tile.sums + j * blocks * 16, sums + row * blocks * 16, (size_t)blocks * 16 * sizeof(int16_t));
            }
            for (int64_t i = first; i < last; i++)
                dot((const block_q6k *)(matrix + i * w->nb[1]), &tile, m, out + (i - first), (size_t)width);
            for (int j = 0; j < m; j++) {
                const int64_t p = order[t0 + j];
                float *o = (float *)((char *)dst->data + (p % used) * dst->nb[1] + (p / used) * dst->nb[2]);
                memcpy(o + first, out + j * width, (size_t)width * sizeof(float));
            }
        }
    }
    free(next);
    free(out);
    free(tile.sums);
    free(tile.scales);
    free(tile.codes);
    free(order);
    free(count);
    free(sums);
    free(scales);
    free(codes);
}

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_q6k",
                                    "The Q6_K product as a ggml custom op (skippy_zmq/compute/q6k.py).", -1, NULL};

PyMODINIT_FUNC PyInit__q6k(void) { return PyModule_Create(&module); }
