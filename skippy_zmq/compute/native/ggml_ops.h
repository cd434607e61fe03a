/* What the package's ggml custom ops share (q6k.c, q4k.c): the part of ggml's tensor they read, and the
 * activations quantized to q8_K as ggml quantizes them for the K-quants' dot products. */
#ifndef SKIPPY_GGML_OPS_H
#define SKIPPY_GGML_OPS_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#define QK 256

/* ggml 0.25's struct ggml_tensor, the fields the ops read (the layout ggml.h declares). */
struct tensor_abi {
    int type;
    void *buffer;
    int64_t ne[4];
    size_t nb[4];
    int op;
    int32_t op_params[16];
    int32_t flags;
    struct tensor_abi *src[10];
    struct tensor_abi *view_src;
    size_t view_offs;
    void *data;
    char name[64];
    void *extra;
    char padding[8];
};

/* One row of k values to q8_K, block b's codes at codes + b * code_stride, its scale at scales[b * scale_stride]
 * and its 16 sums at sums + b * sum_stride: per 256 values the value of largest magnitude maps to -127, codes round to
 * nearest (ties to even) and clip at 127. Where +a and -a both have the largest magnitude a, ggml's 4-row
 * quantizer picks +a (`positive_ties`), quantize_row_q8_K the first of them. */
static inline void quantize_row_q8k_strided(const float *x, int64_t k, int positive_ties, int8_t *codes,
                                            int64_t code_stride, float *scales, int64_t scale_stride, int16_t *sums,
                                            int64_t sum_stride) {
    for (int64_t b = 0; b < k / QK; b++) {
        const float *xb = x + b * QK;
        int8_t *qb = codes + b * code_stride;
        int16_t *sb = sums + b * sum_stride;
        float amax = 0.0f, max = 0.0f;
        for (int i = 0; i < QK; i++) {
            const float ax = fabsf(xb[i]);
            if (ax > amax) {
                amax = ax;
                max = xb[i];
            }
        }
        if (positive_ties) {
            int has_positive = 0;
            for (int i = 0; i < QK; i++) has_positive |= xb[i] == amax;
            max = has_positive ? amax : -amax;
        }
        if (amax == 0.0f) {
            scales[b * scale_stride] = 0.0f;
            memset(qb, 0, QK);
            memset(sb, 0, 16 * sizeof(int16_t));
            continue;
        }
        const float iscale = -127.0f / max;
        for (int i = 0; i < QK; i++) {
            const long v = lrintf(iscale * xb[i]);
            qb[i] = (int8_t)(v > 127 ? 127 : v);
        }
        for (int j = 0; j < 16; j++) {
            int s = 0;
            for (int i = 0; i < 16; i++) s += qb[16 * j + i];
            sb[j] = (int16_t)s;
        }
        scales[b * scale_stride] = 1.0f / iscale;
    }
}

/* quantize_row_q8k_strided with a row's blocks side by side. */
static inline void quantize_row_q8k(const float *x, int64_t k, int positive_ties, int8_t *codes, float *scales, int16_t *sums) {
    quantize_row_q8k_strided(x, k, positive_ties, codes, QK, scales, 1, sums, 16);
}

#define CPU_AVX2 1   /* AVX2 with FMA and F16C */
#define CPU_AVX512 2 /* AVX-512 F, BW, VL and DQ */
#define CPU_VNNI 4   /* AVX-512 VNNI, besides CPU_AVX512 */

/* The instruction sets the ops' variants need that this CPU has (CPU_* bits; none off x86-64). */
static inline int cpu_sets(void) {
    int sets = 0;
#if defined(__x86_64__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
        sets |= CPU_AVX2;
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx512dq"))
        sets |= CPU_AVX512;
    if ((sets & CPU_AVX512) && __builtin_cpu_supports("avx512vnni")) sets |= CPU_VNNI;
#endif
    return sets;
}

/* The (slot, pass row) pairs of an expert op's I32 ids (used, R), pair p = s + used * r, sorted by the expert
 * they select: expert e's are order[count[e] .. count[e + 1]) (count: experts + 1 zeroed entries, next:
 * experts). An id out of range selects none (ggml would abort the process). */
static inline void group_pairs(const struct tensor_abi *ids, int64_t experts, int64_t *count, int64_t *next,
                               int64_t *order) {
    const int64_t used = ids->ne[0], pairs = ids->ne[0] * ids->ne[1];
    for (int64_t p = 0; p < pairs; p++) {
        const int32_t e = *(const int32_t *)((const char *)ids->data + (p % used) * ids->nb[0] + (p / used) * ids->nb[1]);
        if (e >= 0 && e < experts) count[e + 1]++;
    }
    for (int64_t e = 0; e < experts; e++) count[e + 1] += count[e];
    memcpy(next, count, (size_t)experts * sizeof(int64_t));
    for (int64_t p = 0; p < pairs; p++) {
        const int32_t e = *(const int32_t *)((const char *)ids->data + (p % used) * ids->nb[0] + (p / used) * ids->nb[1]);
        if (e >= 0 && e < experts) order[next[e]++] = p;
    }
}

#endif
