/* Four-row decode kernels: four consecutive weight rows (row r at w + r*rb bytes) against the
 * idot=2 activation pair q1/q2 whose per-block sums s1/s2 are known (computed when the
 * activations were quantized):
 *
 *   coli_rowdot2s_i4_x4_<isa>(w, rb, q1, xs1, s1, q2, xs2, s2, n, block, out)
 *       out[r] = coli_rowdot2s_i4_<isa>(w + r*rb, q1, xs1, s1, q2, xs2, s2, n, block)
 *   coli_rowdot2s_i8_x4_<isa>(...)  the same for int8 rows (= coli_rowdot2_i8)
 *
 * bit-identical to the one-row kernels (the same block integers, the same float operations per
 * row), hence to every ISA. The scalar and AVX2 versions are those one-row calls; AVX-512 VNNI
 * loads the activations once for the four rows, reduces the four rows' block sums together and
 * shares the call overhead, which on short rows (an expert's 512-wide down projection) is ~1.5x
 * the one-row kernel.
 */
#ifndef COLI_ROWS4_H
#define COLI_ROWS4_H

#include "coli_dot_i8.h"
#include "coli_dot_i4.h"

#define COLI_ROWDOT2S_X4_BY_ROW(kind, WT, sfx, ATTR)                                               \
    ATTR static inline void coli_rowdot2s_##kind##_x4_##sfx(const WT *w, long rb, const int8_t *q1, \
                                                           const float *xs1, const int32_t *s1,     \
                                                           const int8_t *q2, const float *xs2,      \
                                                           const int32_t *s2, int n, int block,     \
                                                           float *out)                              \
    {                                                                                              \
        for (int r = 0; r < 4; r++)                                                                \
            out[r] = coli_rowdot2s_##kind##_##sfx(w + r * rb, q1, xs1, s1, q2, xs2, s2, n, block); \
    }
#define COLI_ROWDOT2S_X4X2_BY_ROW(kind, WT, sfx, ATTR)                                             \
    ATTR static inline void coli_rowdot2s_##kind##_x4x2_##sfx(const WT *w, long rb, const int8_t *q1, \
                                                             const float *xs1, const int32_t *s1,   \
                                                             const int8_t *q2, const float *xs2,    \
                                                             const int32_t *s2, int n, int block,   \
                                                             long qstep, long sstep, float *out)    \
    {                                                                                              \
        for (int p = 0; p < 2; p++)                                                                \
            coli_rowdot2s_##kind##_x4_##sfx(w, rb, q1 + p * qstep, xs1 + p * sstep, s1 + p * sstep, \
                                            q2 + p * qstep, xs2 + p * sstep, s2 + p * sstep, n,     \
                                            block, out + 4 * p);                                   \
    }
COLI_ROWDOT2S_X4_BY_ROW(i8, int8_t, scalar, )
COLI_ROWDOT2S_X4_BY_ROW(i4, uint8_t, scalar, )
COLI_ROWDOT2S_X4X2_BY_ROW(i8, int8_t, scalar, )
COLI_ROWDOT2S_X4X2_BY_ROW(i4, uint8_t, scalar, )

#if COLI_X86
COLI_ROWDOT2S_X4_BY_ROW(i8, int8_t, avx2, COLI_AVX2)
COLI_ROWDOT2S_X4_BY_ROW(i4, uint8_t, avx2, COLI_AVX2)
COLI_ROWDOT2S_X4X2_BY_ROW(i8, int8_t, avx2, COLI_AVX2)
COLI_ROWDOT2S_X4X2_BY_ROW(i4, uint8_t, avx2, COLI_AVX2)

/* 64 weights of one row from element `at` on as vpdpbusd's unsigned operand: int4 keeps its
 * stored nibble u = v + 8, int8 becomes w ^ 0x80 = w + 128 (the kernel subtracts 8 resp. 128
 * times the activation sum). rem < 64: only that many (masked loads; the lanes past them are
 * 0 for int8, u = 0 for int4, against activations that are 0 there). */
COLI_AVX512 static COLI_ALWAYS_INLINE __m512i coli_x4_weights_avx512(const uint8_t *row, int at, int rem,
                                                                     const int is4)
{
    if (is4) {
        __m256i p = rem >= 64 ? _mm256_loadu_si256((const __m256i *)(row + at / 2))
                              : _mm256_maskz_loadu_epi8((__mmask32)((1ULL << ((rem + 1) / 2)) - 1), row + at / 2);
        return coli_i4x64_unpack_avx512(p);
    }
    __m512i v = rem >= 64 ? _mm512_loadu_si512(row + at) : _mm512_maskz_loadu_epi8(~0ULL >> (64 - rem), row + at);
    return _mm512_xor_si512(v, _mm512_set1_epi8((char)0x80));
}

/* For activation rows p < P: a1[p][r] += u_r · x1[p], a2[p][r] += u_r · x2[p] for the four weight
 * rows' 64 weights from element `at` (each weight vector decoded once for all P rows) */
COLI_AVX512 static COLI_ALWAYS_INLINE void coli_x4_step_avx512(const uint8_t *w, long rb, int at, int rem,
                                                               const __m512i *x1, const __m512i *x2,
                                                               __m512i (*a1)[4], __m512i (*a2)[4],
                                                               const int P, const int is4)
{
    COLI_UNROLL_G
    for (int r = 0; r < 4; r++) {
        __m512i u = coli_x4_weights_avx512(w + r * rb, at, rem, is4);
        for (int p = 0; p < P; p++) {
            a1[p][r] = _mm512_dpbusd_epi32(a1[p][r], u, x1[p]);
            a2[p][r] = _mm512_dpbusd_epi32(a2[p][r], u, x2[p]);
        }
    }
}

/* The four-row kernel for int4 (is4) or int8 rows and P (1 or 2) activation rows; row p's q1 /
 * q2 at + p * qstep, its scales and block sums at + p * sstep; out[4 * p + r]. Per block: the
 * activations are loaded once, each (activation row, weight row) adds u·x1 and u·x2 into its own
 * int32 lanes, then the four weight rows' sums are reduced together and each accumulates
 * xs * (sum - bias * s) in block order (coli_block_acc): per output, the one-row kernels' float
 * operations. The lanes may wrap for int8 (255 * 127 per product), but the arithmetic is exact
 * modulo 2^32 and the true block dot fits in int32. */
COLI_AVX512 static COLI_ALWAYS_INLINE void coli_rowdot2s_x4_k_avx512(const uint8_t *w, long rb, const int8_t *q1,
                                                                     const float *xs1, const int32_t *s1,
                                                                     const int8_t *q2, const float *xs2,
                                                                     const int32_t *s2, int n, int block,
                                                                     long qstep, long sstep, float *out,
                                                                     const int P, const int is4)
{
    const int32_t bias = is4 ? 8 : 128;
    float acc1[2][4] = {{0.0f}}, acc2[2][4] = {{0.0f}};
    int i = 0, b = 0;
    block = coli_block_len(n, block);
    for (; i < n; i += block, b++) {
        int len = n - i < block ? n - i : block;
        __m512i a1[2][4], a2[2][4], x1[2], x2[2];
        for (int p = 0; p < P; p++)
            COLI_UNROLL_G
            for (int r = 0; r < 4; r++)
                a1[p][r] = a2[p][r] = _mm512_setzero_si512();
        int j = 0;
        for (; j + 64 <= len; j += 64) {
            for (int p = 0; p < P; p++) {
                x1[p] = _mm512_loadu_si512(q1 + p * qstep + i + j);
                x2[p] = _mm512_loadu_si512(q2 + p * qstep + i + j);
            }
            coli_x4_step_avx512(w, rb, i + j, 64, x1, x2, a1, a2, P, is4);
        }
        if (j < len) {
            __mmask64 mx = ~0ULL >> (64 - (len - j));
            for (int p = 0; p < P; p++) {
                x1[p] = _mm512_maskz_loadu_epi8(mx, q1 + p * qstep + i + j);
                x2[p] = _mm512_maskz_loadu_epi8(mx, q2 + p * qstep + i + j);
            }
            coli_x4_step_avx512(w, rb, i + j, len - j, x1, x2, a1, a2, P, is4);
        }
        for (int p = 0; p < P; p++) {
            int32_t d1[4], d2[4];
            _mm_storeu_si128((__m128i *)d1, coli_hsum4_i32_avx512(a1[p][0], a1[p][1], a1[p][2], a1[p][3]));
            _mm_storeu_si128((__m128i *)d2, coli_hsum4_i32_avx512(a2[p][0], a2[p][1], a2[p][2], a2[p][3]));
            float sc1 = xs1[p * sstep + b], sc2 = xs2[p * sstep + b];
            int32_t c1 = bias * s1[p * sstep + b], c2 = bias * s2[p * sstep + b];
            COLI_UNROLL_G
            for (int r = 0; r < 4; r++) {
                acc1[p][r] = coli_block_acc(acc1[p][r], sc1, d1[r] - c1);
                acc2[p][r] = coli_block_acc(acc2[p][r], sc2, d2[r] - c2);
            }
        }
    }
    for (int p = 0; p < P; p++)
        COLI_UNROLL_G
        for (int r = 0; r < 4; r++)
            out[4 * p + r] = acc1[p][r] + acc2[p][r];
}

COLI_AVX512 static inline void coli_rowdot2s_i4_x4_avx512(const uint8_t *w, long rb, const int8_t *q1,
                                                          const float *xs1, const int32_t *s1,
                                                          const int8_t *q2, const float *xs2,
                                                          const int32_t *s2, int n, int block, float *out)
{
    coli_rowdot2s_x4_k_avx512(w, rb, q1, xs1, s1, q2, xs2, s2, n, block, 0, 0, out, 1, 1);
}

COLI_AVX512 static inline void coli_rowdot2s_i8_x4_avx512(const int8_t *w, long rb, const int8_t *q1,
                                                          const float *xs1, const int32_t *s1,
                                                          const int8_t *q2, const float *xs2,
                                                          const int32_t *s2, int n, int block, float *out)
{
    coli_rowdot2s_x4_k_avx512((const uint8_t *)w, rb, q1, xs1, s1, q2, xs2, s2, n, block, 0, 0, out, 1, 0);
}

/* The same for two activation rows at once (a verify batch): row p's q1 / q2 at + p * qstep, its
 * xs / s at + p * sstep; out[4 * p + r] */
COLI_AVX512 static inline void coli_rowdot2s_i4_x4x2_avx512(const uint8_t *w, long rb, const int8_t *q1,
                                                            const float *xs1, const int32_t *s1,
                                                            const int8_t *q2, const float *xs2,
                                                            const int32_t *s2, int n, int block,
                                                            long qstep, long sstep, float *out)
{
    coli_rowdot2s_x4_k_avx512(w, rb, q1, xs1, s1, q2, xs2, s2, n, block, qstep, sstep, out, 2, 1);
}

COLI_AVX512 static inline void coli_rowdot2s_i8_x4x2_avx512(const int8_t *w, long rb, const int8_t *q1,
                                                            const float *xs1, const int32_t *s1,
                                                            const int8_t *q2, const float *xs2,
                                                            const int32_t *s2, int n, int block,
                                                            long qstep, long sstep, float *out)
{
    coli_rowdot2s_x4_k_avx512((const uint8_t *)w, rb, q1, xs1, s1, q2, xs2, s2, n, block, qstep, sstep, out, 2, 0);
}
#endif /* COLI_X86 */

#endif /* COLI_ROWS4_H */
