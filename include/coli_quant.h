/* Per-block symmetric int8 quantization of activations.
 *
 * For each block of `block` elements (the last may be shorter; block <= 0 or >= n means one
 * block for the whole row):
 *     amax = max |x|,  s = max(amax / 127, 1e-12),  inv = 1 / s,
 *     q[i] = rint(x[i] * inv)   (round half to even, as lrintf in the default rounding mode),
 *     xs[b] = s.
 * |x * inv| <= 127 up to rounding, so q lands in [-127, 127] without clamping.
 *
 * The SIMD variants perform exactly the same float operations (max, one divide, one reciprocal,
 * one multiply, convert with the current rounding mode), so for finite inputs their output is
 * bit-identical.
 */
#ifndef COLI_QUANT_H
#define COLI_QUANT_H

#include <math.h>
#include "coli_dot_i8.h" /* shared prelude */

/* scale and inverse scale of one block from its amax (shared by all variants) */
static inline float coli_q8_scale(float amax, float *inv)
{
    float s = amax / 127.0f;
    if (s < 1e-12f)
        s = 1e-12f;
    *inv = 1.0f / s;
    return s;
}

/* ================================ scalar (the definition) ================================ */

static inline void coli_quantize_q8_scalar(const float *x, int n, int block, int8_t *q, float *xs)
{
    block = coli_block_len(n, block);
    for (int i0 = 0, b = 0; i0 < n; i0 += block, b++) {
        int end = n - i0 < block ? n : i0 + block;
        float amax = 0.0f, inv;
        for (int i = i0; i < end; i++) {
            float a = fabsf(x[i]);
            if (a > amax)
                amax = a;
        }
        xs[b] = coli_q8_scale(amax, &inv);
        for (int i = i0; i < end; i++)
            q[i] = (int8_t)lrintf(x[i] * inv);
    }
}

/* The residual of a Q8 row (the input of idot=2's second quantization): xr[i] = x[i] - xs[b] * q[i]
 * for the elements i of block b, the product rounded to float before the subtraction. Plain C for
 * every ISA: the compiler vectorizes it for the baseline ISA (SSE2, which has no fma to contract
 * the two into), and a vector lane computes what one scalar operation does. */
static inline void coli_q8_residual(const float *x, const int8_t *q, const float *xs, int n, int block, float *xr)
{
    block = coli_block_len(n, block);
    for (int i0 = 0, b = 0; i0 < n; i0 += block, b++) {
        int end = n - i0 < block ? n : i0 + block;
        const float s = xs[b];
        for (int i = i0; i < end; i++)
            xr[i] = x[i] - s * (float)q[i];
    }
}

#if COLI_X86
/* ========================================= AVX2 ========================================= */

COLI_AVX2 static inline float coli_absmax_avx2(const float *x, int n)
{
    const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 m = _mm256_setzero_ps();
    int i = 0;
    for (; i + 8 <= n; i += 8)
        m = _mm256_max_ps(m, _mm256_and_ps(_mm256_loadu_ps(x + i), absmask));
    if (i < n) { /* masked tail: missing lanes load as 0, which cannot raise the max */
        __m256i tm = _mm256_cmpgt_epi32(_mm256_set1_epi32(n - i), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        m = _mm256_max_ps(m, _mm256_and_ps(_mm256_maskload_ps(x + i, tm), absmask));
    }
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}

/* q[0..31] = rint(x[0..31] * inv). vcvtps2dq rounds with the current mode (= lrintf). The two
 * saturating packs interleave the 128-bit lanes; a dword permute restores element order. */
COLI_AVX2 static inline void coli_q8x32_avx2(const float *x, __m256 inv, int8_t *q)
{
    __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x), inv));
    __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 8), inv));
    __m256i c = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 16), inv));
    __m256i d = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 24), inv));
    __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(a, b), _mm256_packs_epi32(c, d));
    p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256((__m256i *)q, p);
}

COLI_AVX2 static inline void coli_quantize_q8_avx2(const float *x, int n, int block, int8_t *q, float *xs)
{
    block = coli_block_len(n, block);
    for (int i0 = 0, b = 0; i0 < n; i0 += block, b++) {
        int len = n - i0 < block ? n - i0 : block;
        float inv;
        xs[b] = coli_q8_scale(coli_absmax_avx2(x + i0, len), &inv);
        __m256 vinv = _mm256_set1_ps(inv);
        int i = 0;
        for (; i + 32 <= len; i += 32)
            coli_q8x32_avx2(x + i0 + i, vinv, q + i0 + i);
        for (; i < len; i++)
            q[i0 + i] = (int8_t)lrintf(x[i0 + i] * inv);
    }
}

/* ======================================== AVX-512 ======================================== */

COLI_AVX512 static inline float coli_absmax_avx512(const float *x, int n)
{
    __m512 m = _mm512_setzero_ps();
    int i = 0;
    for (; i + 16 <= n; i += 16)
        m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(x + i)));
    if (i < n)
        m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_maskz_loadu_ps((__mmask16)((1u << (n - i)) - 1), x + i)));
    return _mm512_reduce_max_ps(m);
}

COLI_AVX512 static inline void coli_quantize_q8_avx512(const float *x, int n, int block, int8_t *q, float *xs)
{
    block = coli_block_len(n, block);
    for (int i0 = 0, b = 0; i0 < n; i0 += block, b++) {
        int len = n - i0 < block ? n - i0 : block;
        float inv;
        xs[b] = coli_q8_scale(coli_absmax_avx512(x + i0, len), &inv);
        __m512 vinv = _mm512_set1_ps(inv);
        const float *xb = x + i0;
        int8_t *qb = q + i0;
        int i = 0;
        for (; i + 16 <= len; i += 16) /* vpmovdb truncates; values are already within int8 */
            _mm_storeu_si128((__m128i *)(qb + i),
                             _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xb + i), vinv))));
        if (i < len) {
            __mmask16 m = (__mmask16)((1u << (len - i)) - 1);
            __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, xb + i), vinv));
            _mm512_mask_cvtepi32_storeu_epi8(qb + i, m, v);
        }
    }
}
#endif /* COLI_X86 */

#endif /* COLI_QUANT_H */
