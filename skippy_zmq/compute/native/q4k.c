/* Products of Q4_K matrices, as ggml repacks them, with 2 or more activation rows: a ggml custom op
 * (docs/ARCHITECTURE.md, "The Q4_K product").
 *
 * ggml's CPU backend repacks a Q4_K matrix 8 weight rows at a time (block_q4_Kx8: the 8 rows' scales,
 * then their codes interleaved 8 bytes at a time) and multiplies it with a GEMM kernel in groups of 4
 * activation rows, whose unpacking of the weights is shared by 4 rows only, and with its one-row GEMV
 * kernel for the rows left over (2 and 3 rows: twice and three times the one-row cost). Here each block
 * is unpacked once for all rows, and the codes meet the activations in AVX-512 VNNI dot products.
 *
 * A Q4_K value is d * sc[j] * q - dmin * m[j] in sub-block j of 32 (q 0..15, sc and m 6 bits, d and
 * dmin f16); with the activations in q8_K (dx, codes c, sums per 16) the product of a block is
 *     dx * (d * sum_j sc[j] * sum_{i in j} q[i] c[i]  -  dmin * sum_j m[j] * (bsum[2j] + bsum[2j+1]))
 * all integer but the scales. The sums are ggml's: rows in whole groups of 4 as its GEMM adds them (one
 * FMA per 64 values for the codes and one for the minimums, quantized by its 4-row quantizer), the
 * rows after them as its GEMV (one FMA of each per block, quantized as quantize_row_q8_K does), so the
 * products are llama.cpp's bit for bit at every row count this op takes.
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

#define ROW_TILE 32 /* activation rows multiplied per pass over a group of weight rows */

/* ggml's block_q4_Kx8 (repack.h): 8 weight rows' superblock of 256 values. */
typedef struct {
    uint16_t d[8];
    uint16_t dmin[8];
    uint8_t scales[96];
    uint8_t qs[1024];
} block_q4kx8;
_Static_assert(sizeof(block_q4kx8) == 1152, "block_q4_Kx8 is 1152 bytes");


/* The activation rows, quantized. */
typedef struct {
    int64_t blocks; /* per row */
    int m;
    int grouped; /* rows [0, grouped) sum as ggml's GEMM, the rest as its GEMV */
    int8_t *codes;  /* (m, blocks * 256) */
    float *scales;  /* (m, blocks) */
    int16_t *sums;  /* (m, blocks * 16) */
} qrows;

/* The 8 weight rows' 6-bit scales (bytes 0..7 of `out`) and minimums (8..15) of one sub-block, from its
 * 12 bytes, packed across the rows as a Q4_K block packs its 8 sub-blocks (make_block_q4_Kx8). */
static void unpack_scales(const uint8_t *q, uint8_t *out) {
    uint32_t u[4];
    memcpy(u, q, 12);
    u[3] = ((u[2] >> 4) & 0x0f0f0f0fu) | (((u[1] >> 6) & 0x03030303u) << 4);
    const uint32_t mins_low = u[1] & 0x3f3f3f3fu;
    u[1] = (u[2] & 0x0f0f0f0fu) | (((u[0] >> 6) & 0x03030303u) << 4);
    u[2] = mins_low;
    u[0] &= 0x3f3f3f3fu;
    memcpy(out, u, 16);
}

#if defined(__x86_64__)
/* Int16 lane p of a part's scales: 128-bit lane L = p / 8 holds weight rows 2L and 2L + 1, each twice (its
 * two 32-bit lanes), first for the part's low sub-block (indices 0..7), then its high one (8..15). */
static const int16_t PICK_SCALES[32] = {0, 0, 1, 1, 8, 8, 9, 9, 2, 2, 3, 3, 10, 10, 11, 11,
                                        4, 4, 5, 5, 12, 12, 13, 13, 6, 6, 7, 7, 14, 14, 15, 15};
/* Each weight row's low sub-block minimum, then its high one's, side by side for vpmaddwd. */
static const int16_t PICK_MINS[16] = {0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15};

/* out[r * stride + c] for the 8 weight rows of `w` (one 8-row group, its blocks in order) and every row r of
 * `a`. A 64-value part of a block is 4 zmm loads of codes, 8 weight rows x 8 bytes each: a 32-bit lane
 * holds 4 codes of one weight row, multiplied with vpdpbusd by the 4 activation codes they meet, which a
 * 64-bit broadcast puts beside every row's two lanes. The two lanes of a weight row hold at most 16 codes
 * each, so their sums fit int16 and one vpmaddwd takes each sub-block's scale and adds the two lanes. */
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,f16c,fma")))
static void cols8_vnni(const block_q4kx8 *w, const qrows *a, float *out, size_t stride) {
    __m512 acc[ROW_TILE]; /* lanes 0..7: the codes' sums of the 8 weight rows; 8..15: the minimums' */
    for (int r = 0; r < a->m; r++) acc[r] = _mm512_setzero_ps();
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    const __m512i scale_index = _mm512_loadu_si512(PICK_SCALES);
    const __m256i min_index = _mm256_loadu_si256((const __m256i *)PICK_MINS);
    /* after vpmaddwd a 128-bit lane L is [low 2L, low 2L+1, high 2L, high 2L+1]; adding its halves swapped
     * gives each weight row's part sum twice: take one per row, then the 8 minimums' sums */
    const __m512i gather = _mm512_setr_epi32(0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 18, 19, 20, 21, 22, 23);
    const int64_t k = a->blocks * QK;
    for (int64_t b = 0; b < a->blocks; b++) {
        const block_q4kx8 *blk = w + b;
        const __m512 dcol = _mm512_insertf32x8(
            _mm512_castps256_ps512(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk->d))),
            _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk->dmin)), 1);
        uint8_t sm[8][16]; /* sub-block s: the 8 weight rows' scales, then their minimums */
        for (int s = 0; s < 8; s++) unpack_scales(blk->scales + 12 * s, sm[s]);
        __m512i iacc[ROW_TILE]; /* GEMV rows: the block's integer sums, laid out as acc */
        for (int r = a->grouped; r < a->m; r++) iacc[r] = _mm512_setzero_si512();
        for (int g = 0; g < 4; g++) {
            __m512i lo[4], hi[4];
            for (int t = 0; t < 4; t++) {
                const __m512i raw = _mm512_loadu_si512(blk->qs + 64 * (4 * g + t));
                lo[t] = _mm512_and_si512(raw, low4);
                hi[t] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low4);
            }
            /* bytes 0..7 the low sub-block's scales, 8..15 the high one's; then the same for minimums */
            uint8_t scales16[16], mins16[16];
            memcpy(scales16, sm[2 * g], 8);
            memcpy(scales16 + 8, sm[2 * g + 1], 8);
            memcpy(mins16, sm[2 * g] + 8, 8);
            memcpy(mins16 + 8, sm[2 * g + 1] + 8, 8);
            const __m512i scales = _mm512_permutexvar_epi16(
                scale_index, _mm512_castsi256_si512(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)scales16))));
            const __m256i mins = _mm256_permutexvar_epi16(
                min_index, _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)mins16)));
            for (int r = 0; r < a->m; r++) {
                const int8_t *c = a->codes + r * k + b * QK + 64 * g;
                __m512i s_lo = _mm512_setzero_si512(), s_hi = _mm512_setzero_si512();
                for (int t = 0; t < 4; t++) {
                    int64_t c_lo, c_hi;
                    memcpy(&c_lo, c + 8 * t, 8);
                    memcpy(&c_hi, c + 32 + 8 * t, 8);
                    s_lo = _mm512_dpbusd_epi32(s_lo, lo[t], _mm512_set1_epi64(c_lo));
                    s_hi = _mm512_dpbusd_epi32(s_hi, hi[t], _mm512_set1_epi64(c_hi));
                }
                const __m512i parts = _mm512_madd_epi16(_mm512_packs_epi32(s_lo, s_hi), scales);
                const __m512i both = _mm512_add_epi32(parts, _mm512_shuffle_epi32(parts, _MM_PERM_BADC));
                const int16_t *bs = a->sums + (r * a->blocks + b) * 16 + 4 * g;
                const uint32_t pair = (uint16_t)(bs[0] + bs[1]) | ((uint32_t)(uint16_t)(bs[2] + bs[3]) << 16);
                const __m256i imin = _mm256_madd_epi16(mins, _mm256_set1_epi32((int32_t)pair));
                const __m512i sums = _mm512_permutex2var_epi32(both, gather, _mm512_castsi256_si512(imin));
                if (r < a->grouped) {
                    const __m512 dd = _mm512_mul_ps(dcol, _mm512_set1_ps(a->scales[r * a->blocks + b]));
                    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), dd, acc[r]);
                } else {
                    iacc[r] = _mm512_add_epi32(iacc[r], sums);
                }
            }
        }
        for (int r = a->grouped; r < a->m; r++) {
            const __m512 dd = _mm512_mul_ps(dcol, _mm512_set1_ps(a->scales[r * a->blocks + b]));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iacc[r]), dd, acc[r]);
        }
    }
    for (int r = 0; r < a->m; r++)
        _mm256_storeu_ps(out + r * stride, _mm256_sub_ps(_mm512_castps512_ps256(acc[r]),
                                                         _mm512_extractf32x8_ps(acc[r], 1)));
}
#endif

/* 1 when this CPU runs the AVX-512 VNNI variant, else 0 (then the op computes nothing). */
int skippy_q4k_best_route(void) {
#if defined(__x86_64__)
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512vnni");
#else
    return 0;
#endif
}

/* dst (m rows of n) = src[1] (m rows of k) times src[0] (n rows of k, repacked) transposed; src[1] and dst
 * float32 with contiguous rows; userdata: the variant's number (q4k.VARIANTS). This thread takes the 8-row
 * groups [ith * groups / nth, (ith + 1) * groups / nth). */
void skippy_q4k_mul_mat(struct tensor_abi *dst, int ith, int nth, void *userdata) {
    if ((intptr_t)userdata != 1 || !skippy_q4k_best_route()) return;
    const struct tensor_abi *w = dst->src[0];
    const struct tensor_abi *x = dst->src[1];
    const int64_t k = w->ne[0], n = w->ne[1], m = x->ne[1];
    const int64_t groups = n / 8;
    const int64_t first = ith * groups / nth, last = (ith + 1) * groups / nth;
    if (first >= last || m == 0) return;
    const int64_t grouped = m - m % 4; /* rows ggml's GEMM takes; the rest go to its GEMV */
    const int64_t blocks = k / QK, tile = m < ROW_TILE ? m : ROW_TILE;
    /* every thread quantizes the rows it needs: against the products they are little work */
    int8_t *codes = (int8_t *)aligned_alloc(64, (size_t)(tile * k + 64));
    float *scales = (float *)malloc((size_t)(tile * blocks) * sizeof(float));
    int16_t *sums = (int16_t *)malloc((size_t)(tile * blocks * 16) * sizeof(int16_t));
    if (codes == NULL || scales == NULL || sums == NULL) abort(); /* as ggml does when out of memory */
    const size_t stride = dst->nb[1] / sizeof(float);
    for (int64_t r0 = 0; r0 < m; r0 += tile) {
        const qrows a = {blocks, (int)(m - r0 < tile ? m - r0 : tile),
                         (int)(grouped - r0 < 0 ? 0 : grouped - r0 < tile ? grouped - r0 : tile), codes, scales, sums};
        for (int r = 0; r < a.m; r++)
            quantize_row_q8k((const float *)((const char *)x->data + (r0 + r) * x->nb[1]), k, r < a.grouped,
                         codes + r * k, scales + r * blocks, sums + r * blocks * 16);
        for (int64_t group = first; group < last; group++) {
            const block_q4kx8 *wg = (const block_q4kx8 *)((const char *)w->data + group * 8 * w->nb[1]);
#if defined(__x86_64__)
            cols8_vnni(wg, &a, (float *)((char *)dst->data + r0 * dst->nb[1]) + group * 8, stride);
#else
            (void)wg;
#endif
        }
    }
    free(codes);
    free(scales);
    free(sums);
}

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_q4k",
                                    "The Q4_K product as a ggml custom op (skippy_zmq/compute/q4k.py).", -1, NULL};

PyMODINIT_FUNC PyInit__q4k(void) { return PyModule_Create(&module); }
