/* Products of Q8_0 matrices as a ggml custom op (docs/ARCHITECTURE.md, "The Q8_0 product").
 *
 * A Q8_0 block is 32 int8 codes and an f16 scale. ggml's CPU backend multiplies a Q8_0 matrix pair by pair
 * (its dot product, or llamafile's tiles on x86, which sum every pair the same way), the activation rows
 * quantized to Q8_0 first. A pair's sum is, per block, 8 int32 lanes (lane l: codes 4l .. 4l + 3 of both
 * blocks multiplied and added), turned to float and accumulated per lane as acc = fma(dw * dx, lane, acc),
 * block after block; then the 8 lanes added as ggml adds them. The integer lanes are exact whatever the
 * instructions (an activation code is never -128: its quantizer maps the largest magnitude to 127), so every
 * variant here gives ggml's bits for every pair, at any number of rows.
 *
 * Where ggml's one-row product waits on each pair's chain of fused adds (a 640-input row is 20 blocks, 20
 * dependent adds), here four weight rows are summed side by side, each weight block read once for up to
 * eight activation rows (two on AVX2), and the next rows' bytes are prefetched: four interleaved streams 680 bytes apart
 * are not a pattern the hardware prefetchers follow (measured: 12.1 against 4.7 ms over a 178 MB matrix).
 * The AVX-512 VNNI variant multiplies the codes as unsigned activation codes + 128 times signed weight
 * codes, the weight block's 128 x (sum of its codes) taken off once for every activation row, and sums two
 * weight rows in one 512-bit vector (8 lanes each): half the instructions of 256-bit vectors, which took
 * 1.2-1.7x its time on the EPYC-512 (docs/BENCHMARKS.md, "The Q8_0 product").
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

#define QK8 32
#define GROUP 4     /* weight rows summed side by side */
#define ACT_TILE 8  /* activation rows per pass over a group (16 of 32 registers; the AVX2 variant takes 2 at a time) */
#define PREFETCH 2  /* groups ahead whose bytes are prefetched */

typedef struct {
    uint16_t d; /* f16 */
    int8_t qs[QK8];
} block_q80;

_Static_assert(sizeof(block_q80) == 34, "a Q8_0 block is 34 bytes");

/* f16 to f32, exactly. */
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

/* f32 to f16, rounding to nearest (ties to even), as F16C's conversion does. */
static uint16_t float_to_half(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    const uint16_t sign = (uint16_t)((x >> 16) & 0x8000);
    const uint32_t ax = x & 0x7FFFFFFFu;
    if (ax > 0x7F800000u) return (uint16_t)(sign | 0x7E00 | ((ax >> 13) & 0x3FF)); /* NaN stays NaN */
    if (ax >= 0x477FF000u) return (uint16_t)(sign | 0x7C00);                       /* 65520 and up: infinity */
    if (ax < 0x38800000u) {                                                        /* below 2^-14: subnormal */
        float a;
        memcpy(&a, &ax, sizeof a);
        return (uint16_t)(sign | (uint16_t)lrintf(a * 16777216.0f)); /* units of 2^-24, exact scaling */
    }
    uint32_t h = ((ax >> 23) - 112) << 10 | ((ax >> 13) & 0x3FF);
    const uint32_t rest = ax & 0x1FFF;
    if (rest > 0x1000 || (rest == 0x1000 && (h & 1))) h++; /* a carry into the exponent is right too */
    return (uint16_t)(sign | h);
}

/* Activation rows quantized as ggml's quantize_row_q8_0 does: per 32 values d = max|x| / 127 stored as f16,
 * codes round(x * 127 / max|x|) to nearest, ties to even. */
typedef struct {
    int64_t blocks;   /* per row */
    int8_t *codes;    /* (m, blocks * 32) */
    uint8_t *shifted; /* codes + 128 (the VNNI variant's unsigned operand) */
    float *scales;    /* (m, blocks): each block's f16 scale, widened */
} q8_rows;

static void quantize_row(const float *x, int64_t blocks, int8_t *codes, uint8_t *shifted, float *scales) {
    for (int64_t b = 0; b < blocks; b++) {
        const float *xb = x + b * QK8;
        float amax = 0.0f;
        for (int i = 0; i < QK8; i++) amax = fmaxf(amax, fabsf(xb[i]));
        scales[b] = half_to_float(float_to_half(amax / 127.0f));
        const float inverse = amax != 0.0f ? 127.0f / amax : 0.0f;
        for (int i = 0; i < QK8; i++) {
            const long v = lrintf(xb[i] * inverse);
            const int8_t c = (int8_t)(v > 127 ? 127 : v < -128 ? -128 : v);
            codes[b * QK8 + i] = c;
            shifted[b * QK8 + i] = (uint8_t)(c + 128);
        }
    }
}

/* ggml's hsum_float_8: ((x0 + x4) + (x2 + x6)) + ((x1 + x5) + (x3 + x7)). */
static float sum_lanes(const float *x) { return ((x[0] + x[4]) + (x[2] + x[6])) + ((x[1] + x[5]) + (x[3] + x[7])); }

/* Weight rows w[0 .. g) (each `blocks` blocks, `stride` bytes apart) times activation rows r0 .. r0 + m:
 * out[r * out_stride + t] for row t of the group and activation row r. */
typedef void (*group_fn)(const char *w, size_t stride, int g, const q8_rows *a, int64_t r0, int m, float *out,
                         size_t out_stride);

static void group_scalar(const char *w, size_t stride, int g, const q8_rows *a, int64_t r0, int m, float *out,
                         size_t out_stride) {
    for (int t = 0; t < g; t++) {
        const block_q80 *x = (const block_q80 *)(w + t * stride);
        for (int r = 0; r < m; r++) {
            const int8_t *c = a->codes + (r0 + r) * a->blocks * QK8;
            const float *dy = a->scales + (r0 + r) * a->blocks;
            float acc[8] = {0};
            for (int64_t b = 0; b < a->blocks; b++) {
                const float d = half_to_float(x[b].d) * dy[b];
                for (int l = 0; l < 8; l++) {
                    int32_t lane = 0;
                    for (int i = 4 * l; i < 4 * l + 4; i++) lane += x[b].qs[i] * c[b * QK8 + i];
                    acc[l] = fmaf(d, (float)lane, acc[l]);
                }
            }
            out[r * out_stride + t] = sum_lanes(acc);
        }
    }
}

#if defined(__x86_64__)
__attribute__((target("avx,sse3"))) static inline float sum_lanes8(__m256 x) {
    float lanes[8];
    _mm256_storeu_ps(lanes, x);
    return sum_lanes(lanes);
}

static inline void prefetch_group(const char *w, size_t stride) {
    const char *next = w + (size_t)PREFETCH * GROUP * stride;
    for (size_t at = 0; at < GROUP * stride; at += 64) __builtin_prefetch(next + at, 0, 3);
}

#define VNNI_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,f16c,fma")))

/* One weight row (`blocks` blocks at x) times activation row `row`: ggml's sum of the pair. */
VNNI_TARGET static float pair_vnni(const block_q80 *x, const q8_rows *a, int64_t row) {
    __m256 acc = _mm256_setzero_ps();
    const __m256i ones = _mm256_set1_epi8(1);
    for (int64_t b = 0; b < a->blocks; b++) {
        const __m256i qx = _mm256_loadu_si256((const __m256i *)x[b].qs);
        /* -128 x the codes' sums per lane: what adding 128 to the activation codes adds */
        const __m256i bias = _mm256_sub_epi32(
            _mm256_setzero_si256(), _mm256_slli_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), ones, qx), 7));
        const int64_t at = row * a->blocks + b;
        const __m256i y = _mm256_loadu_si256((const __m256i *)(a->shifted + at * QK8));
        const __m256 lanes = _mm256_cvtepi32_ps(_mm256_dpbusd_epi32(bias, y, qx));
        /* dw * dx rounded once, in every lane, as ggml's scalar product broadcast */
        acc = _mm256_fmadd_ps(_mm256_set1_ps(_cvtsh_ss(x[b].d) * a->scales[at]), lanes, acc);
    }
    return sum_lanes8(acc);
}

/* A group of GROUP weight rows x M activation rows (M a constant where it is inlined), two weight rows to a
 * 512-bit vector: lanes 0-7 sum the first row's pair with activation row r, lanes 8-15 the second's, each lane
 * in ggml's order as in pair_vnni. */
VNNI_TARGET static inline __attribute__((always_inline)) void tile_vnni512(const char *w, size_t stride,
                                                                          const q8_rows *a, int64_t r0, const int M,
                                                                          float *out, size_t out_stride) {
    __m512 acc[GROUP / 2][ACT_TILE];
    for (int p = 0; p < GROUP / 2; p++)
        for (int r = 0; r < M; r++) acc[p][r] = _mm512_setzero_ps();
    const __m512i ones = _mm512_set1_epi8(1);
    const int64_t blocks = a->blocks;
    for (int64_t b = 0; b < blocks; b++) {
        for (int p = 0; p < GROUP / 2; p++) {
            const block_q80 *x0 = (const block_q80 *)(w + 2 * p * stride) + b;
            const block_q80 *x1 = (const block_q80 *)(w + (2 * p + 1) * stride) + b;
            const __m512i qx = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)x0->qs)),
                                                  _mm256_loadu_si256((const __m256i *)x1->qs), 1);
            const __m512i bias = _mm512_sub_epi32(
                _mm512_setzero_si512(), _mm512_slli_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), ones, qx), 7));
            const __m512 dx = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_set1_ps(_cvtsh_ss(x0->d))),
                                                 _mm256_set1_ps(_cvtsh_ss(x1->d)), 1);
            for (int r = 0; r < M; r++) {
                const int64_t at = (r0 + r) * blocks + b;
                const __m512i y = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(a->shifted + at * QK8)));
                const __m512 lanes = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(bias, y, qx));
                acc[p][r] = _mm512_fmadd_ps(_mm512_mul_ps(dx, _mm512_set1_ps(a->scales[at])), lanes, acc[p][r]);
            }
        }
    }
    for (int p = 0; p < GROUP / 2; p++)
        for (int r = 0; r < M; r++) {
            out[r * out_stride + 2 * p] = sum_lanes8(_mm512_castps512_ps256(acc[p][r]));
            out[r * out_stride + 2 * p + 1] = sum_lanes8(_mm512_extractf32x8_ps(acc[p][r], 1));
        }
}

VNNI_TARGET static void group_vnni(const char *w, size_t stride, int g, const q8_rows *a, int64_t r0, int m,
                                   float *out, size_t out_stride) {
    if (g == GROUP) {
        switch (m) {
        case 1: tile_vnni512(w, stride, a, r0, 1, out, out_stride); return;
        case 2: tile_vnni512(w, stride, a, r0, 2, out, out_stride); return;
        case 3: tile_vnni512(w, stride, a, r0, 3, out, out_stride); return;
        case 4: tile_vnni512(w, stride, a, r0, 4, out, out_stride); return;
        case 5: tile_vnni512(w, stride, a, r0, 5, out, out_stride); return;
        case 6: tile_vnni512(w, stride, a, r0, 6, out, out_stride); return;
        case 7: tile_vnni512(w, stride, a, r0, 7, out, out_stride); return;
        default: tile_vnni512(w, stride, a, r0, 8, out, out_stride); return;
        }
    }
    for (int t = 0; t < g; t++) /* the range's last rows, one at a time */
        for (int r = 0; r < m; r++) out[r * out_stride + t] = pair_vnni((const block_q80 *)(w + t * stride), a, r0 + r);
}

#define AVX2_TARGET __attribute__((target("avx2,f16c,fma")))

/* G weight rows x M activation rows (constants where it is inlined) with ggml's AVX2 products: |w| times the
 * activation codes signed as w is, pairs added; per lane in ggml's order as in pair_vnni. */
AVX2_TARGET static inline __attribute__((always_inline)) void tile_avx2(const char *w, size_t stride, const int G,
                                                                       const q8_rows *a, int64_t r0, const int M,
                                                                       float *out, size_t out_stride) {
    __m256 acc[GROUP][2];
    for (int t = 0; t < G; t++)
        for (int r = 0; r < M; r++) acc[t][r] = _mm256_setzero_ps();
    const __m256i ones16 = _mm256_set1_epi16(1);
    const int64_t blocks = a->blocks;
    for (int64_t b = 0; b < blocks; b++) {
        for (int t = 0; t < G; t++) {
            const block_q80 *x = (const block_q80 *)(w + t * stride) + b;
            const __m256i qx = _mm256_loadu_si256((const __m256i *)x->qs);
            const __m256i ax = _mm256_sign_epi8(qx, qx);
            const float dx = _cvtsh_ss(x->d);
            for (int r = 0; r < M; r++) {
                const int64_t at = (r0 + r) * blocks + b;
                const __m256i y = _mm256_loadu_si256((const __m256i *)(a->codes + at * QK8));
                const __m256i dot = _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(y, qx)), ones16);
                acc[t][r] = _mm256_fmadd_ps(_mm256_set1_ps(dx * a->scales[at]), _mm256_cvtepi32_ps(dot), acc[t][r]);
            }
        }
    }
    for (int t = 0; t < G; t++)
        for (int r = 0; r < M; r++) out[r * out_stride + t] = sum_lanes8(acc[t][r]);
}

AVX2_TARGET static void group_avx2(const char *w, size_t stride, int g, const q8_rows *a, int64_t r0, int m,
                                   float *out, size_t out_stride) {
    for (int done = 0; done < m; done += 2) { /* two activation rows a pass: 8 sums in 16 registers */
        float *o = out + done * out_stride;
        if (g == GROUP && m - done >= 2) {
            tile_avx2(w, stride, GROUP, a, r0 + done, 2, o, out_stride);
        } else if (g == GROUP) {
            tile_avx2(w, stride, GROUP, a, r0 + done, 1, o, out_stride);
        } else {
            for (int t = 0; t < g; t++)
                for (int r = done; r < m && r < done + 2; r++)
                    tile_avx2(w + t * stride, stride, 1, a, r0 + r, 1, out + r * out_stride + t, 0);
        }
    }
}
#endif

/* The variants, best first; `route` picks one (0 = the best this CPU runs). */
static group_fn pick_variant(int route) {
#if defined(__x86_64__)
    const int sets = cpu_sets(), avx2 = sets & CPU_AVX2, vnni = avx2 && (sets & CPU_VNNI);
    if (route == 0) return vnni ? group_vnni : avx2 ? group_avx2 : group_scalar;
    if (route == 1) return vnni ? group_vnni : NULL;
    if (route == 2) return avx2 ? group_avx2 : NULL;
#endif
    if (route == 0 || route == 3) return group_scalar;
    return NULL;
}

/* Which variant route 0 runs here: 1 AVX-512 VNNI, 2 AVX2, 3 scalar. */
int skippy_q80_best_route(void) {
    const group_fn best = pick_variant(0);
#if defined(__x86_64__)
    if (best == group_vnni) return 1;
    if (best == group_avx2) return 2;
#endif
    (void)best;
    return 3;
}

/* dst (m rows of n) = src[1] (m rows of k) times src[0] (n rows of k) transposed; src[0] Q8_0 (not repacked),
 * src[1] and dst float32 with contiguous rows. userdata: the variant's number (an intptr_t; q80.VARIANTS).
 * This thread takes weight rows [ith * n / nth, (ith + 1) * n / nth), GROUP at a time, each group with every
 * activation row (ACT_TILE at a time) while its blocks are in cache. */
void skippy_q80_mul_mat(struct tensor_abi *dst, int ith, int nth, void *userdata) {
    const struct tensor_abi *w = dst->src[0];
    const struct tensor_abi *x = dst->src[1];
    const int64_t k = w->ne[0], n = w->ne[1], m = x->ne[1];
    const int64_t first = ith * n / nth, last = (ith + 1) * n / nth;
    const group_fn group = pick_variant((int)(intptr_t)userdata);
    if (first >= last || m == 0 || group == NULL) return;
    q8_rows a;
    a.blocks = k / QK8;
    /* every thread quantizes every activation row: they are few and small against the matrix */
    a.codes = (int8_t *)malloc((size_t)(m * k));
    a.shifted = (uint8_t *)malloc((size_t)(m * k));
    a.scales = (float *)malloc((size_t)(m * a.blocks) * sizeof(float));
    if (!a.codes || !a.shifted || !a.scales) abort(); /* as ggml does when out of memory */
    for (int64_t r = 0; r < m; r++)
        quantize_row((const float *)((const char *)x->data + r * x->nb[1]), a.blocks, a.codes + r * k,
                     a.shifted + r * k, a.scales + r * a.blocks);
    const size_t stride = w->nb[1], out_stride = dst->nb[1] / sizeof(float);
    for (int64_t row = first; row < last; row += GROUP) {
        const int g = (int)(last - row < GROUP ? last - row : GROUP);
        const char *rows = (const char *)w->data + row * stride;
#if defined(__x86_64__)
        if (row + (PREFETCH + 1) * GROUP <= last) prefetch_group(rows, stride);
#endif
        for (int64_t r0 = 0; r0 < m; r0 += ACT_TILE) {
            const int tile = (int)(m - r0 < ACT_TILE ? m - r0 : ACT_TILE);
            group(rows, stride, g, &a, r0, tile, (float *)dst->data + r0 * out_stride + row, out_stride);
        }
    }
    free(a.codes);
    free(a.shifted);
    free(a.scales);
}

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_q80",
                                    "The Q8_0 product as a ggml custom op (skippy_zmq/compute/q80.py).", -1, NULL};

PyMODINIT_FUNC PyInit__q80(void) { return PyModule_Create(&module); }
