/* Products of Q4_K matrices, as ggml repacks them, with 2 or more activation rows: a ggml custom op
 * (docs/ARCHITECTURE.md, "The Q4_K product").
 *
 * ggml's CPU backend repacks a Q4_K matrix 8 weight rows at a time (block_q4_Kx8: the 8 rows' scales,
 * then their codes interleaved 8 bytes at a time) and multiplies it with a GEMM kernel in groups of 4
 * activation rows, whose unpacking of the weights is shared by 4 rows only, and with its one-row GEMV
 * kernel for the rows left over (2 and 3 rows: twice and three times the one-row cost). Here each block
 * is unpacked once for all rows, in one of two variants (q4k.VARIANTS): 1, AVX-512 VNNI, where the codes
 * meet the activations in vpdpbusd dot products (cols8_vnni); 2, AVX2 with FMA and F16C, where they meet
 * in vpmaddubsw and vpmaddwd (cols8_avx2), without the shuffles ggml's AVX2 kernels spend per row.
 *
 * A Q4_K value is d * sc[j] * q - dmin * m[j] in sub-block j of 32 (q 0..15, sc and m 6 bits, d and
 * dmin f16); with the activations in q8_K (dx, codes c, sums per 16) the product of a block is
 *     dx * (d * sum_j sc[j] * sum_{i in j} q[i] c[i]  -  dmin * sum_j m[j] * (bsum[2j] + bsum[2j+1]))
 * all integer but the scales. The sums are ggml's: rows in whole groups of 4 as its GEMM adds them (one
 * FMA per 64 values for the codes and one for the minimums, quantized by its 4-row quantizer), the
 * rows after them as its GEMV (one FMA of each per block, quantized as quantize_row_q8_K does), so the
 * products are llama.cpp's bit for bit at every row count this op takes, in either variant.
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

#define ROW_TILE 32     /* activation rows multiplied per pass over a group of weight rows */
#define ROW_BY_ROW 0x100 /* userdata flag: every activation row summed as ggml's one-row GEMV sums it */
#define AVX2_ROW_TILE 8 /* the AVX2 variant's: 16 or 32 a pass were 7-31 % slower at 16 and 32 rows (EPYC) */

/* ggml's block_q4_Kx8 (repack.h): 8 weight rows' superblock of 256 values. */
typedef struct {
    uint16_t d[8];
    uint16_t dmin[8];
    uint8_t scales[96];
    uint8_t qs[1024];
} block_q4kx8;
_Static_assert(sizeof(block_q4kx8) == 1152, "block_q4_Kx8 is 1152 bytes");


/* The activation rows, quantized: codes and sums for the VNNI variant, wide and pairs for the AVX2 one. The VNNI
 * variant's lie block by block, every row's block b side by side: one stream of codes however many rows, where
 * rows K bytes apart were a stream each (4 rows of 5120-input matrices took 0.73-0.75 of ggml's time laid so,
 * 1.19-1.20 laid row after row: docs/BENCHMARKS.md, "The Q4_K product"). */
typedef struct {
    int64_t blocks; /* per row */
    int m;
    int grouped; /* rows [0, grouped) sum as ggml's GEMM, the rest as its GEMV */
    int64_t block_rows; /* the VNNI variant's: rows a block holds (its allocation), row r's block b at b * block_rows + r */
    float *scales;  /* VNNI: (blocks, block_rows); AVX2: (m, blocks) */
    int8_t *codes;  /* (blocks, block_rows, 256) */
    int16_t *sums;  /* (blocks, block_rows, 16) */
    int8_t *wide;   /* row r's codes from wide + r * wide_stride on, every 8 repeated 4 times */
    int64_t wide_stride;
    int32_t *pairs; /* (m, blocks * 4): per 64 values, the sums of its two halves' codes as an int16 pair */
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
                const int8_t *c = a->codes + (b * a->block_rows + r) * QK + 64 * g;
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
                const int16_t *bs = a->sums + (b * a->block_rows + r) * 16 + 4 * g;
                const uint32_t pair = (uint16_t)(bs[0] + bs[1]) | ((uint32_t)(uint16_t)(bs[2] + bs[3]) << 16);
                const __m256i imin = _mm256_madd_epi16(mins, _mm256_set1_epi32((int32_t)pair));
                const __m512i sums = _mm512_permutex2var_epi32(both, gather, _mm512_castsi256_si512(imin));
                if (r < a->grouped) {
                    const __m512 dd = _mm512_mul_ps(dcol, _mm512_set1_ps(a->scales[b * a->block_rows + r]));
                    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), dd, acc[r]);
                } else {
                    iacc[r] = _mm512_add_epi32(iacc[r], sums);
                }
            }
        }
        for (int r = a->grouped; r < a->m; r++) {
            const __m512 dd = _mm512_mul_ps(dcol, _mm512_set1_ps(a->scales[b * a->block_rows + r]));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(iacc[r]), dd, acc[r]);
        }
    }
    for (int r = 0; r < a->m; r++)
        _mm256_storeu_ps(out + r * stride, _mm256_sub_ps(_mm512_castps512_ps256(acc[r]),
                                                         _mm512_extractf32x8_ps(acc[r], 1)));
}

/* Int32 lane i of the AVX2 variant's part sums holds weight row HADD_ORDER[i]: the order vphaddd leaves
 * when it adds the pairs of weight rows 0..3 and of 4..7 (it works within 128-bit lanes). It is its own
 * inverse, so the same permutation puts the sums back in order. */
static const int32_t HADD_ORDER[8] = {0, 1, 4, 5, 2, 3, 6, 7};
/* vpshufb indices taking the 4 bytes of a broadcast int32 (one sub-block's scales of 4 weight rows) to
 * int16 lanes, 4 for each weight row, as the codes' pair sums lie after vpmaddubsw */
static const int8_t SPREAD_SCALES[32] = {0, -1, 0, -1, 0, -1, 0, -1, 1, -1, 1, -1, 1, -1, 1, -1,
                                         2, -1, 2, -1, 2, -1, 2, -1, 3, -1, 3, -1, 3, -1, 3, -1};

/* quantize_row_q8k's codes and scales in AVX2, bit for bit, written as cols8_avx2 reads them: the codes
 * widened (every 8 repeated 4 times: vpmaddubsw's operand for 4 weight rows) and, per 64 values, the sums of
 * its two halves as an int16 pair (wrapping as vpmaddwd's lanes do; they fit). */
__attribute__((target("avx2")))
static void quantize_row_avx2(const float *x, int64_t k, int positive_ties, int8_t *wide, float *scales, int32_t *pairs) {
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m256i top = _mm256_set1_epi32(127), invalid = _mm256_set1_epi32(INT32_MIN);
    const __m256i unpack = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7); /* undoes vpack*'s 128-bit lanes */
    const __m256i bias = _mm256_set1_epi8(-128);
    for (int64_t b = 0; b < k / QK; b++) {
        const float *xb = x + b * QK;
        int8_t *qb = wide + 4 * b * QK;
        __m256 big = _mm256_setzero_ps();
        for (int i = 0; i < QK; i += 8) /* a NaN, the first operand, loses: as the scalar code passes it over */
            big = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(xb + i), magnitude), big);
        __m128 h = _mm_max_ps(_mm256_castps256_ps128(big), _mm256_extractf128_ps(big, 1));
        h = _mm_max_ps(h, _mm_movehl_ps(h, h));
        const float amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
        if (amax == 0.0f) {
            scales[b] = 0.0f;
            memset(qb, 0, 4 * QK);
            memset(pairs + 4 * b, 0, 4 * sizeof(int32_t));
            continue;
        }
        float max = -amax; /* which of +amax and -amax: the first to come, or + where both do (positive_ties) */
        const __m256 target = _mm256_set1_ps(amax);
        for (int i = 0; i < QK; i += 8) {
            const __m256 v = _mm256_loadu_ps(xb + i);
            const int hit = _mm256_movemask_ps(_mm256_cmp_ps(positive_ties ? v : _mm256_and_ps(v, magnitude), target, _CMP_EQ_OQ));
            if (hit) {
                max = positive_ties ? amax : xb[i + __builtin_ctz((unsigned)hit)];
                break;
            }
        }
        const float iscale = -127.0f / max;
        const __m256 vs = _mm256_set1_ps(iscale);
        int32_t halves[8]; /* the sums of the block's 32-value halves */
        for (int i = 0; i < QK; i += 32) {
            __m256i c[4];
            for (int j = 0; j < 4; j++) { /* rounded to nearest even as lrintf; a NaN's code is 0, as lrintf's LONG_MIN cast */
                const __m256i v = _mm256_cvtps_epi32(_mm256_mul_ps(vs, _mm256_loadu_ps(xb + i + 8 * j)));
                c[j] = _mm256_min_epi32(_mm256_andnot_si256(_mm256_cmpeq_epi32(v, invalid), v), top);
            }
            const __m256i codes = _mm256_permutevar8x32_epi32(
                _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3])), unpack);
            __m256i *out = (__m256i *)(qb + 4 * i);
            _mm256_store_si256(out, _mm256_permute4x64_epi64(codes, 0x00));
            _mm256_store_si256(out + 1, _mm256_permute4x64_epi64(codes, 0x55));
            _mm256_store_si256(out + 2, _mm256_permute4x64_epi64(codes, 0xAA));
            _mm256_store_si256(out + 3, _mm256_permute4x64_epi64(codes, 0xFF));
            const __m256i eights = _mm256_sad_epu8(_mm256_xor_si256(codes, bias), _mm256_setzero_si256()); /* each + 8 * 128 */
            const __m128i fours = _mm_add_epi64(_mm256_castsi256_si128(eights), _mm256_extracti128_si256(eights, 1));
            halves[i / 32] = (int32_t)(_mm_cvtsi128_si64(fours) + _mm_extract_epi64(fours, 1)) - 32 * 128;
        }
        for (int g = 0; g < 4; g++)
            pairs[4 * b + g] = (int32_t)((uint32_t)(uint16_t)halves[2 * g] | ((uint32_t)(uint16_t)halves[2 * g + 1] << 16));
        scales[b] = 1.0f / iscale;
    }
}

/* One activation row's integer sums for 4 weight rows over 64 values (two sub-blocks): q[0..3] the low
 * sub-block's codes (each a 32-byte load: 8 codes of each of the 4 weight rows), q[4..7] the high one's, `c`
 * the row's 64 codes widened. vpmaddubsw multiplies 8 codes of each weight row with the 8 activation codes
 * they meet, 4 such add up a sub-block in int16 lanes (at most 8 products of 15 x 127 each: no overflow),
 * and vpmaddwd applies the sub-block's scales: int32 lanes 2w and 2w + 1 hold weight row w's two halves. */
__attribute__((target("avx2"), always_inline))
static inline __m256i avx2_quarter(const __m256i *q, const int8_t *c, __m256i scale_low, __m256i scale_high) {
    __m256i low = _mm256_maddubs_epi16(q[0], _mm256_load_si256((const __m256i *)c));
    __m256i high = _mm256_maddubs_epi16(q[4], _mm256_load_si256((const __m256i *)(c + 128)));
    for (int t = 1; t < 4; t++) {
        low = _mm256_add_epi16(low, _mm256_maddubs_epi16(q[t], _mm256_load_si256((const __m256i *)(c + 32 * t))));
        high = _mm256_add_epi16(high, _mm256_maddubs_epi16(q[4 + t], _mm256_load_si256((const __m256i *)(c + 128 + 32 * t))));
    }
    return _mm256_add_epi32(_mm256_madd_epi16(low, scale_low), _mm256_madd_epi16(high, scale_high));
}

/* Block b of one 8-row group (`blk`) against every row of `a`, added to acc and acc_min (lanes as in
 * cols8_avx2). Each 64-value part is unpacked once per half (4 weight rows, in 8 registers) and met by every
 * activation row; one vphaddd then adds a row's pairs of int32 lanes from both halves. */
__attribute__((target("avx2,f16c,fma")))
static void avx2_block(const block_q4kx8 *blk, const qrows *a, int64_t b, __m256 *acc, __m256 *acc_min) {
    __m256 dd[AVX2_ROW_TILE], dd_min[AVX2_ROW_TILE];  /* the block's d and dmin times the row's scale */
    __m256i isum[AVX2_ROW_TILE], imin[AVX2_ROW_TILE]; /* GEMV rows: the block's integer sums, as acc, acc_min */
    __m256i high[AVX2_ROW_TILE];                      /* a row's sums of weight rows 4..7, waiting for 0..3's */
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    const __m256i order = _mm256_loadu_si256((const __m256i *)HADD_ORDER);
    const __m256i spread = _mm256_loadu_si256((const __m256i *)SPREAD_SCALES);
    const __m256 d = _mm256_permutevar8x32_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk->d)), order);
    const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk->dmin));
    uint32_t sm[8][4]; /* sub-block s: scales of weight rows 0..3, 4..7, then minimums of 0..3, 4..7 */
    for (int s = 0; s < 8; s++) unpack_scales(blk->scales + 12 * s, (uint8_t *)sm[s]);
    for (int r = 0; r < a->m; r++) {
        const __m256 dx = _mm256_set1_ps(a->scales[r * a->blocks + b]);
        dd[r] = _mm256_mul_ps(d, dx);
        dd_min[r] = _mm256_mul_ps(dmin, dx);
        isum[r] = imin[r] = _mm256_setzero_si256();
    }
    for (int g = 0; g < 4; g++) {
        /* int32 lane w: the minimums of weight row w's two sub-blocks, an int16 pair */
        const __m256i mins = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(_mm_loadl_epi64((const __m128i *)&sm[2 * g][2]),
                                                                    _mm_loadl_epi64((const __m128i *)&sm[2 * g + 1][2])));
        const int8_t *c = a->wide + 4 * (b * QK + 64 * g);
        for (int h = 1; h >= 0; h--) {
            const __m256i scale_low = _mm256_shuffle_epi8(_mm256_set1_epi32((int32_t)sm[2 * g][h]), spread);
            const __m256i scale_high = _mm256_shuffle_epi8(_mm256_set1_epi32((int32_t)sm[2 * g + 1][h]), spread);
            __m256i q[8];
            for (int t = 0; t < 4; t++) {
                const __m256i raw = _mm256_loadu_si256((const __m256i *)(blk->qs + 256 * g + 64 * t + 32 * h));
                q[t] = _mm256_and_si256(raw, low4);
                q[4 + t] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
            }
            if (h == 1) {
                for (int r = 0; r < a->m; r++) high[r] = avx2_quarter(q, c + r * a->wide_stride, scale_low, scale_high);
                continue;
            }
            for (int r = 0; r < a->m; r++) {
                const __m256i part = _mm256_hadd_epi32(avx2_quarter(q, c + r * a->wide_stride, scale_low, scale_high), high[r]);
                const __m256i imins = _mm256_madd_epi16(mins, _mm256_set1_epi32(a->pairs[r * a->blocks * 4 + 4 * b + g]));
                if (r < a->grouped) { /* ggml's GEMM: floats every 64 values */
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(part), dd[r], acc[r]);
                    acc_min[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(imins), dd_min[r], acc_min[r]);
                } else {
                    isum[r] = _mm256_add_epi32(isum[r], part);
                    imin[r] = _mm256_add_epi32(imin[r], imins);
                }
            }
        }
    }
    for (int r = a->grouped; r < a->m; r++) { /* ggml's GEMV: floats once a block */
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), dd[r], acc[r]);
        acc_min[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(imin[r]), dd_min[r], acc_min[r]);
    }
}

/* As cols8_vnni, in AVX2 (avx2_block), rows widened by quantize_row_avx2. */
__attribute__((target("avx2,f16c,fma")))
static void cols8_avx2(const block_q4kx8 *w, const qrows *a, float *out, size_t stride) {
    __m256 acc[AVX2_ROW_TILE], acc_min[AVX2_ROW_TILE]; /* acc: lane i weight row HADD_ORDER[i]; acc_min: w row w */
    for (int r = 0; r < a->m; r++) acc[r] = acc_min[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < a->blocks; b++) avx2_block(w + b, a, b, acc, acc_min);
    const __m256i order = _mm256_loadu_si256((const __m256i *)HADD_ORDER);
    for (int r = 0; r < a->m; r++)
        _mm256_storeu_ps(out + r * stride, _mm256_sub_ps(_mm256_permutevar8x32_ps(acc[r], order), acc_min[r]));
}
#endif

/* The variant this CPU runs best: 1 AVX-512 VNNI, 2 AVX2 (with FMA and F16C), else 0 (then the op computes
 * nothing). */
int skippy_q4k_best_route(void) {
    const int sets = cpu_sets();
    return sets & CPU_VNNI ? 1 : sets & CPU_AVX2 ? 2 : 0;
}

/* Room for m activation rows of k values, quantized in `variant`'s layout (1: codes and sums, 2: wide codes
 * and pairs); aborts when out of memory, as ggml does. */
static void qrows_alloc(qrows *a, int variant, int64_t m, int64_t k) {
    const int64_t blocks = k / QK;
    *a = (qrows){blocks, 0, 0, m, NULL, NULL, NULL, NULL, 0, NULL};
    a->scales = (float *)malloc((size_t)(m * blocks) * sizeof(float));
    if (variant == 1) {
        a->codes = (int8_t *)aligned_alloc(64, (size_t)(m * k + 64));
        a->sums = (int16_t *)malloc((size_t)(m * blocks * 16) * sizeof(int16_t));
    } else {
        /* rows 4k + 256 bytes apart: a part of each (256 bytes) falls in cache sets of its own */
        a->wide_stride = 4 * k + 256;
        a->wide = (int8_t *)aligned_alloc(64, (size_t)(m * a->wide_stride));
        a->pairs = (int32_t *)malloc((size_t)(m * blocks * 4) * sizeof(int32_t));
    }
    if (a->scales == NULL || (variant == 1 ? a->codes == NULL || a->sums == NULL : a->wide == NULL || a->pairs == NULL))
        abort();
}

static void qrows_free(qrows *a) {
    free(a->codes);
    free(a->scales);
    free(a->sums);
    free(a->pairs);
    free(a->wide);
}

/* Row r of `a` := the k values at `row`, quantized as ggml's GEMM (positive_ties) or its GEMV quantizes them. */
static void qrows_quantize(qrows *a, int variant, int64_t r, const float *row, int positive_ties) {
    const int64_t blocks = a->blocks, k = blocks * QK;
#if defined(__x86_64__)
    if (variant == 2) {
        quantize_row_avx2(row, k, positive_ties, a->wide + r * a->wide_stride, a->scales + r * blocks, a->pairs + r * blocks * 4);
        return;
    }
#endif
    (void)variant;
    quantize_row_q8k_strided(row, k, positive_ties, a->codes + r * QK, a->block_rows * QK, a->scales + r, a->block_rows,
                             a->sums + r * 16, a->block_rows * 16);
}

/* Row j of `to` := row r of `from` (one layout, one k). */
static void qrows_copy(qrows *to, int64_t j, const qrows *from, int64_t r, int variant) {
    const int64_t blocks = from->blocks, k = blocks * QK;
    if (variant == 1) {
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t there = b * from->block_rows + r, here = b * to->block_rows + j;
            to->scales[here] = from->scales[there];
            memcpy(to->codes + here * QK, from->codes + there * QK, QK);
            memcpy(to->sums + here * 16, from->sums + there * 16, 16 * sizeof(int16_t));
        }
    } else {
        memcpy(to->scales + j * blocks, from->scales + r * blocks, (size_t)blocks * sizeof(float));
        memcpy(to->wide + j * to->wide_stride, from->wide + r * from->wide_stride, (size_t)(4 * k));
        memcpy(to->pairs + j * blocks * 4, from->pairs + r * blocks * 4, (size_t)blocks * 4 * sizeof(int32_t));
    }
}

/* out[r * stride + c] for one 8-row group of repacked weights and the rows of `a`, in `variant`. */
static void cols8(int variant, const block_q4kx8 *w, const qrows *a, float *out, size_t stride) {
#if defined(__x86_64__)
    if (variant == 1) cols8_vnni(w, a, out, stride);
    else cols8_avx2(w, a, out, stride);
#else
    (void)variant, (void)w, (void)a, (void)out, (void)stride;
#endif
}

/* dst (m rows of n) = src[1] (m rows of k) times src[0] (n rows of k, repacked) transposed; src[1] and dst
 * float32 with contiguous rows; userdata: the variant's number (q4k.VARIANTS), with ROW_BY_ROW for the
 * batch-invariant mode. This thread takes the 8-row
 * groups [ith * groups / nth, (ith + 1) * groups / nth). */
void skippy_q4k_mul_mat(struct tensor_abi *dst, int ith, int nth, void *userdata) {
    const int flags = (int)(intptr_t)userdata, best = skippy_q4k_best_route();
    const int variant = flags & 0xff;
    if (best == 0 || variant < best || variant > 2) return; /* a variant this CPU runs, or none */
    const struct tensor_abi *w = dst->src[0];
    const struct tensor_abi *x = dst->src[1];
    const int64_t k = w->ne[0], n = w->ne[1], m = x->ne[1];
    const int64_t groups = n / 8;
    const int64_t first = ith * groups / nth, last = (ith + 1) * groups / nth;
    if (first >= last || m == 0) return;
    /* rows ggml's GEMM takes; the rest go to its GEMV. With ROW_BY_ROW every row is a GEMV row: one order
     * whatever the row count (the batch-invariant mode), ggml's one-row bits */
    const int64_t grouped = flags & ROW_BY_ROW ? 0 : m - m % 4;
    const int64_t limit = variant == 1 ? ROW_TILE : AVX2_ROW_TILE;
    const int64_t tile = m < limit ? m : limit;
    /* every thread quantizes the rows it needs: against the products they are little work */
    qrows a;
    qrows_alloc(&a, variant, tile, k);
    const size_t stride = dst->nb[1] / sizeof(float);
    for (int64_t r0 = 0; r0 < m; r0 += tile) {
        a.m = (int)(m - r0 < tile ? m - r0 : tile);
        a.grouped = (int)(grouped - r0 < 0 ? 0 : grouped - r0 < tile ? grouped - r0 : tile);
        for (int r = 0; r < a.m; r++)
            qrows_quantize(&a, variant, r, (const float *)((const char *)x->data + (r0 + r) * x->nb[1]), r < a.grouped);
        for (int64_t group = first; group < last; group++) {
            const block_q4kx8 *wg = (const block_q4kx8 *)((const char *)w->data + group * 8 * w->nb[1]);
            cols8(variant, wg, &a, (float *)((char *)dst->data + r0 * dst->nb[1]) + group * 8, stride);
        }
    }
    qrows_free(&a);
}

/* ggml_mul_mat_id's products over repacked Q4_K experts (docs/ARCHITECTURE.md, "The expert layer"): dst
 * (n, used, R) holds, for row r of the pass and its slot s, expert ids[s, r]'s matrix times activation row
 * (s % ne11, r); src[0] the experts' matrices (k, n, experts) as ggml repacks them, src[1] the activations
 * (k, ne11, R; ne11 is 1 or `used`), src[2] the I32 ids (used, R). ggml's repacked op multiplies every pair
 * with its one-row GEMV, the activations quantized as quantize_row_q8_K does; here the pairs are grouped by
 * expert and each expert's are multiplied in tiles (every row summed as the GEMV sums it), so a selected
 * expert's blocks are read once per tile where ggml reads them once per pair, with its bits. userdata: the
 * variant's number. This thread takes the 8-row groups [ith * groups / nth, (ith + 1) * groups / nth) of
 * every selected expert. */
void skippy_q4k_mul_mat_id(struct tensor_abi *dst, int ith, int nth, void *userdata) {
    const int variant = (int)(intptr_t)userdata & 0xff, best = skippy_q4k_best_route();
    if (best == 0 || variant < best || variant > 2) return;
    const struct tensor_abi *w = dst->src[0], *x = dst->src[1], *ids = dst->src[2];
    const int64_t k = w->ne[0], n = w->ne[1], experts = w->ne[2];
    const int64_t used = ids->ne[0], passes = ids->ne[1], inputs = x->ne[1];
    const int64_t first = ith * (n / 8) / nth, last = (ith + 1) * (n / 8) / nth, width = 8 * (last - first);
    if (width <= 0 || passes == 0 || used == 0) return;
    const int64_t rows = inputs * passes, pairs = used * passes, limit = variant == 1 ? ROW_TILE : AVX2_ROW_TILE;
    qrows all, tile;
    qrows_alloc(&all, variant, rows, k);
    qrows_alloc(&tile, variant, limit, k);
    for (int64_t r = 0; r < passes; r++)
        for (int64_t i = 0; i < inputs; i++)
            qrows_quantize(&all, variant, i + inputs * r, (const float *)((const char *)x->data + i * x->nb[1] + r * x->nb[2]), 0);
    int64_t *count = (int64_t *)calloc((size_t)experts + 1, sizeof(int64_t));
    int64_t *next = (int64_t *)malloc((size_t)experts * sizeof(int64_t));
    int64_t *order = (int64_t *)malloc((size_t)pairs * sizeof(int64_t));
    float *out = (float *)malloc((size_t)(limit * width) * sizeof(float));
    if (!count || !next || !order || !out) abort();
    group_pairs(ids, experts, count, next, order);
    for (int64_t e = 0; e < experts; e++) {
        const char *matrix = (const char *)w->data + e * w->nb[2];
        for (int64_t t0 = count[e]; t0 < count[e + 1]; t0 += limit) {
            tile.m = (int)(count[e + 1] - t0 < limit ? count[e + 1] - t0 : limit);
            tile.grouped = 0;
            for (int j = 0; j < tile.m; j++) {
                const int64_t p = order[t0 + j];
                qrows_copy(&tile, j, &all, (p % used) % inputs + inputs * (p / used), variant);
            }
            for (int64_t group = first; group < last; group++)
                cols8(variant, (const block_q4kx8 *)(matrix + group * 8 * w->nb[1]), &tile,
                      out + 8 * (group - first), (size_t)width);
            for (int j = 0; j < tile.m; j++) {
                const int64_t p = order[t0 + j];
                float *o = (float *)((char *)dst->data + (p % used) * dst->nb[1] + (p / used) * dst->nb[2]);
                memcpy(o + 8 * first, out + j * width, (size_t)width * sizeof(float));
            }
        }
    }
    free(out);
    free(order);
    free(next);
    free(count);
    qrows_free(&tile);
    qrows_free(&all);
}

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_q4k",
                                    "The Q4_K product as a ggml custom op (skippy_zmq/compute/q4k.py).", -1, NULL};

PyMODINIT_FUNC PyInit__q4k(void) { return PyModule_Create(&module); }
