/* Scaled row accumulation, y += c * row, for the float paths of attention (absorbed attention's
 * W_kᵀ q and Σ_t p_t Lc_t, expanded attention's Σ_t p_t v_t) and the embedding lookup.
 *
 *   coli_axpy_f32_<isa>(y, c, x, n)   y[i] += c * x[i]
 *   coli_axpy_q8f32_<isa>(y, c, w, n) y[i] += c * w[i]         w: int8 row
 *   coli_axpy_q4f32_<isa>(y, c, wp, n) y[i] += c * (u[i] - 8)  wp: packed int4 row (coli_dot_i4.h)
 *
 * Each element is on its own: the product c * x[i] is rounded to float, then added (never one
 * fma: the product is pinned in a register first, as in coli_block_acc). So every ISA gives the
 * scalar result bit for bit, and so does any split of the row.
 */
#ifndef COLI_AXPY_H
#define COLI_AXPY_H

#include "coli_dot_i8.h" /* shared prelude */

/* a * b rounded to float, kept from being contracted with a following add */
static inline float coli_mul_pinned(float a, float b)
{
    float p = a * b;
#if COLI_X86
    __asm__("" : "+x"(p));
#elif defined(__aarch64__) && defined(__GNUC__)
    __asm__("" : "+w"(p));
#endif
    return p;
}

/* ================================ scalar (the definition) ================================ */

static inline void coli_axpy_f32_scalar(float *y, float c, const float *x, int n)
{
    for (int i = 0; i < n; i++)
        y[i] += coli_mul_pinned(c, x[i]);
}

static inline void coli_axpy_q8f32_scalar(float *y, float c, const int8_t *w, int n)
{
    for (int i = 0; i < n; i++)
        y[i] += coli_mul_pinned(c, (float)w[i]);
}

static inline void coli_axpy_q4f32_scalar(float *y, float c, const uint8_t *wp, int n)
{
    for (int i = 0; i < n; i++) {
        int u = (i & 1) ? (wp[i >> 1] >> 4) : (wp[i >> 1] & 15);
        y[i] += coli_mul_pinned(c, (float)(u - 8));
    }
}

/* Several rows at once, y += c[0]·row_0 + c[1]·row_1 + ..., each element's terms added in row
 * order: bit-identical to one axpy call per row, in order. Row r of the f32 form is
 * x + (idx ? idx[r] : r) * stride (floats); the int8 / int4 forms take consecutive rows of rb
 * bytes. The generic versions below are exactly those calls; AVX-512 keeps a chunk of y in
 * registers across all the rows. */
#define COLI_AXPY_ROWS_BY_ROW(sfx, ATTR)                                                           \
    ATTR static inline void coli_axpy_rows_f32_##sfx(float *y, int n, const float *c, const float *x, \
                                                     long stride, const int *idx, int nrows)          \
    {                                                                                              \
        for (int r = 0; r < nrows; r++)                                                            \
            coli_axpy_f32_##sfx(y, c[r], x + (idx ? idx[r] : r) * stride, n);                      \
    }                                                                                              \
    ATTR static inline void coli_axpy_rows_q8f32_##sfx(float *y, int n, const float *c, const int8_t *w, \
                                                       long rb, int nrows)                         \
    {                                                                                              \
        for (int r = 0; r < nrows; r++)                                                            \
            coli_axpy_q8f32_##sfx(y, c[r], w + r * rb, n);                                         \
    }                                                                                              \
    ATTR static inline void coli_axpy_rows_q4f32_##sfx(float *y, int n, const float *c, const uint8_t *w, \
                                                       long rb, int nrows)                         \
    {                                                                                              \
        for (int r = 0; r < nrows; r++)                                                            \
            coli_axpy_q4f32_##sfx(y, c[r], w + r * rb, n);                                         \
    }
COLI_AXPY_ROWS_BY_ROW(scalar, )

/* Several outputs over the same rows (attention: a block of query rows of one head, or the heads
 * of one row, over their common values): y_q += sum_r c[q * cstride + r] * row_r for q < nq,
 * y_q = y + q * ystride, row_r = x + (idx ? idx[r] : r) * stride. Each output is the one-output
 * coli_axpy_rows_f32 bit for bit; here it is those calls, the AVX-512 form reads each row once for
 * all outputs. */
#define COLI_AXPY_MULTI_BY_OUTPUT(sfx, ATTR)                                                       \
    ATTR static inline void coli_axpy_rows_f32_multi_##sfx(float *y, long ystride, int nq, int n,   \
                                                           const float *c, long cstride,           \
                                                           const float *x, long stride,            \
                                                           const int *idx, int nrows)              \
    {                                                                                              \
        for (int q = 0; q < nq; q++)                                                               \
            coli_axpy_rows_f32_##sfx(y + q * ystride, n, c + q * cstride, x, stride, idx, nrows);  \
    }
COLI_AXPY_MULTI_BY_OUTPUT(scalar, )

#if COLI_X86
/* ========================================= AVX2 ========================================= */

/* y[0..7] += c * v, the product pinned (no fma) */
COLI_AVX2 static inline void coli_axpy8_avx2(float *y, __m256 c, __m256 v)
{
    __m256 p = _mm256_mul_ps(c, v);
    __asm__("" : "+x"(p));
    _mm256_storeu_ps(y, _mm256_add_ps(_mm256_loadu_ps(y), p));
}

COLI_AVX2 static inline void coli_axpy_f32_avx2(float *y, float c, const float *x, int n)
{
    __m256 cv = _mm256_set1_ps(c);
    int i = 0;
    for (; i + 8 <= n; i += 8)
        coli_axpy8_avx2(y + i, cv, _mm256_loadu_ps(x + i));
    coli_axpy_f32_scalar(y + i, c, x + i, n - i);
}

COLI_AVX2 static inline void coli_axpy_q8f32_avx2(float *y, float c, const int8_t *w, int n)
{
    __m256 cv = _mm256_set1_ps(c);
    int i = 0;
    for (; i + 8 <= n; i += 8)
        coli_axpy8_avx2(y + i, cv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(w + i)))));
    coli_axpy_q8f32_scalar(y + i, c, w + i, n - i);
}

COLI_AVX2 static inline void coli_axpy_q4f32_avx2(float *y, float c, const uint8_t *wp, int n)
{
    __m256 cv = _mm256_set1_ps(c);
    int i = 0;
    for (; i + 16 <= n; i += 16) { /* 8 packed bytes -> 16 weights in element order */
        __m128i wd = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)(wp + i / 2)));
        __m128i v = _mm_sub_epi8(_mm_and_si128(_mm_or_si128(wd, _mm_slli_epi16(wd, 4)), _mm_set1_epi8(0x0F)),
                                 _mm_set1_epi8(8));
        coli_axpy8_avx2(y + i, cv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)));
        coli_axpy8_avx2(y + i + 8, cv, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(v, v))));
    }
    for (; i < n; i++) {
        int u = (i & 1) ? (wp[i >> 1] >> 4) : (wp[i >> 1] & 15);
        y[i] += coli_mul_pinned(c, (float)(u - 8));
    }
}

COLI_AXPY_ROWS_BY_ROW(avx2, COLI_AVX2)
COLI_AXPY_MULTI_BY_OUTPUT(avx2, COLI_AVX2)

/* ===================================== AVX-512 VNNI ===================================== */

/* y[0..15] += c * v under mask m, the product pinned (no fma) */
COLI_AVX512 static inline void coli_axpy16_avx512(float *y, __m512 c, __m512 v, __mmask16 m)
{
    __m512 p = _mm512_mul_ps(c, v);
    __asm__("" : "+v"(p));
    _mm512_mask_storeu_ps(y, m, _mm512_add_ps(_mm512_maskz_loadu_ps(m, y), p));
}

COLI_AVX512 static inline void coli_axpy_f32_avx512(float *y, float c, const float *x, int n)
{
    __m512 cv = _mm512_set1_ps(c);
    int i = 0;
    for (; i + 16 <= n; i += 16)
        coli_axpy16_avx512(y + i, cv, _mm512_loadu_ps(x + i), 0xFFFF);
    if (i < n) {
        __mmask16 m = (__mmask16)((1u << (n - i)) - 1);
        coli_axpy16_avx512(y + i, cv, _mm512_maskz_loadu_ps(m, x + i), m);
    }
}

COLI_AVX512 static inline void coli_axpy_q8f32_avx512(float *y, float c, const int8_t *w, int n)
{
    __m512 cv = _mm512_set1_ps(c);
    int i = 0;
    for (; i + 16 <= n; i += 16)
        coli_axpy16_avx512(y + i, cv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(w + i)))),
                           0xFFFF);
    if (i < n) {
        __mmask16 m = (__mmask16)((1u << (n - i)) - 1);
        coli_axpy16_avx512(y + i, cv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, w + i))), m);
    }
}

COLI_AVX512 static inline void coli_axpy_q4f32_avx512(float *y, float c, const uint8_t *wp, int n)
{
    __m512 cv = _mm512_set1_ps(c);
    int i = 0;
    for (; i < n; i += 32) { /* 16 packed bytes -> 32 weights in element order; masked tail */
        int r = n - i < 32 ? n - i : 32;
        __mmask16 mb = (__mmask16)((1u << ((r + 1) / 2)) - 1);
        __mmask32 my = (__mmask32)(r == 32 ? 0xFFFFFFFFu : (1u << r) - 1);
        __m256i wd = _mm256_cvtepu8_epi16(_mm_maskz_loadu_epi8(mb, wp + i / 2));
        __m256i u = _mm256_ternarylogic_epi32(wd, _mm256_slli_epi16(wd, 4), _mm256_set1_epi8(0x0F), 0xA8);
        __m256i v = _mm256_sub_epi8(u, _mm256_set1_epi8(8));
        coli_axpy16_avx512(y + i, cv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(v))),
                           (__mmask16)my);
        coli_axpy16_avx512(y + i + 16, cv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(v, 1))),
                           (__mmask16)(my >> 16));
    }
}

/* acc += c * v with the product pinned (no fma) */
COLI_AVX512 static inline __m512 coli_acc_pinned_avx512(__m512 acc, __m512 c, __m512 v)
{
    __m512 p = _mm512_mul_ps(c, v);
    __asm__("" : "+v"(p));
    return _mm512_add_ps(acc, p);
}

/* Chunks of 64 elements of y (four registers, masked at the end) stay in registers while every
 * row is added; one row term per element in row order, as the one-row calls. kind (a constant
 * after inlining): 0 = f32 rows x + (idx ? idx[r] : r) * stride floats, 1 = int8 rows, 2 = packed
 * int4 rows, stride bytes apart. */
COLI_AVX512 static COLI_ALWAYS_INLINE void coli_axpy_rows_k_avx512(float *y, int n, const float *c, const void *w,
                                                                  long stride, const int *idx, int nrows,
                                                                  const int kind)
{
    for (int i = 0; i < n; i += 64) {
        int left = n - i < 64 ? n - i : 64;
        __mmask16 m[4];
        __m512 a[4];
        for (int k = 0; k < 4; k++) {
            int l = left - 16 * k;
            m[k] = l >= 16 ? (__mmask16)0xFFFF : l <= 0 ? (__mmask16)0 : (__mmask16)((1u << l) - 1);
            a[k] = _mm512_maskz_loadu_ps(m[k], y + i + 16 * k);
        }
        for (int r = 0; r < nrows; r++) {
            __m512 cv = _mm512_set1_ps(c[r]);
            if (kind == 2) { /* 32 packed bytes -> 64 weights v = u - 8 in element order */
                __mmask32 mb = (__mmask32)((1ULL << ((left + 1) / 2)) - 1);
                __m512i wd = _mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8(mb, (const uint8_t *)w + r * stride + i / 2));
                __m512i v = _mm512_sub_epi8(_mm512_ternarylogic_epi32(wd, _mm512_slli_epi16(wd, 4),
                                                                      _mm512_set1_epi8(0x0F), 0xA8),
                                            _mm512_set1_epi8(8));
                const __m128i part[4] = {_mm512_castsi512_si128(v), _mm512_extracti32x4_epi32(v, 1),
                                         _mm512_extracti32x4_epi32(v, 2), _mm512_extracti32x4_epi32(v, 3)};
                for (int k = 0; k < 4; k++)
                    a[k] = coli_acc_pinned_avx512(a[k], cv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(part[k])));
            } else if (kind == 1) {
                const int8_t *row = (const int8_t *)w + r * stride + i;
                for (int k = 0; k < 4; k++)
                    a[k] = coli_acc_pinned_avx512(a[k], cv,
                               _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m[k], row + 16 * k))));
            } else {
                const float *row = (const float *)w + (idx ? idx[r] : r) * stride + i;
                for (int k = 0; k < 4; k++)
                    a[k] = coli_acc_pinned_avx512(a[k], cv, _mm512_maskz_loadu_ps(m[k], row + 16 * k));
            }
        }
        for (int k = 0; k < 4; k++)
            _mm512_mask_storeu_ps(y + i + 16 * k, m[k], a[k]);
    }
}

COLI_AVX512 static inline void coli_axpy_rows_f32_avx512(float *y, int n, const float *c, const float *x,
                                                         long stride, const int *idx, int nrows)
{
    coli_axpy_rows_k_avx512(y, n, c, x, stride, idx, nrows, 0);
}

COLI_AVX512 static inline void coli_axpy_rows_q8f32_avx512(float *y, int n, const float *c, const int8_t *w,
                                                           long rb, int nrows)
{
    coli_axpy_rows_k_avx512(y, n, c, w, rb, NULL, nrows, 1);
}

COLI_AVX512 static inline void coli_axpy_rows_q4f32_avx512(float *y, int n, const float *c, const uint8_t *w,
                                                           long rb, int nrows)
{
    coli_axpy_rows_k_avx512(y, n, c, w, rb, NULL, nrows, 2);
}

/* coli_axpy_rows_f32_multi for NQ (a constant after inlining, 1..4) outputs: chunks of 32
 * elements of every output in registers while each row is loaded once */
COLI_AVX512 static COLI_ALWAYS_INLINE void coli_axpy_multi_k_avx512(float *y, long ystride, int n, const float *c,
                                                                   long cstride, const float *x, long stride,
                                                                   const int *idx, int nrows, const int NQ)
{
    for (int i = 0; i < n; i += 32) {
        int left = n - i < 32 ? n - i : 32;
        __mmask16 m0 = left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1);
        __mmask16 m1 = left >= 32 ? (__mmask16)0xFFFF : left <= 16 ? (__mmask16)0 : (__mmask16)((1u << (left - 16)) - 1);
        __m512 a[4][2];
        for (int q = 0; q < NQ; q++) {
            a[q][0] = _mm512_maskz_loadu_ps(m0, y + q * ystride + i);
            a[q][1] = _mm512_maskz_loadu_ps(m1, y + q * ystride + i + 16);
        }
        for (int r = 0; r < nrows; r++) {
            const float *row = x + (idx ? idx[r] : r) * stride + i;
            __m512 v0 = _mm512_maskz_loadu_ps(m0, row);
            __m512 v1 = _mm512_maskz_loadu_ps(m1, row + 16);
            for (int q = 0; q < NQ; q++) {
                __m512 cv = _mm512_set1_ps(c[q * cstride + r]);
                a[q][0] = coli_acc_pinned_avx512(a[q][0], cv, v0);
                a[q][1] = coli_acc_pinned_avx512(a[q][1], cv, v1);
            }
        }
        for (int q = 0; q < NQ; q++) {
            _mm512_mask_storeu_ps(y + q * ystride + i, m0, a[q][0]);
            _mm512_mask_storeu_ps(y + q * ystride + i + 16, m1, a[q][1]);
        }
    }
}

COLI_AVX512 static inline void coli_axpy_rows_f32_multi_avx512(float *y, long ystride, int nq, int n,
                                                               const float *c, long cstride, const float *x,
                                                               long stride, const int *idx, int nrows)
{
    for (; nq >= 4; nq -= 4, y += 4 * ystride, c += 4 * cstride)
        coli_axpy_multi_k_avx512(y, ystride, n, c, cstride, x, stride, idx, nrows, 4);
    if (nq == 3)
        coli_axpy_multi_k_avx512(y, ystride, n, c, cstride, x, stride, idx, nrows, 3);
    else if (nq == 2)
        coli_axpy_multi_k_avx512(y, ystride, n, c, cstride, x, stride, idx, nrows, 2);
    else if (nq == 1)
        coli_axpy_multi_k_avx512(y, ystride, n, c, cstride, x, stride, idx, nrows, 1);
}
#endif /* COLI_X86 */

#endif /* COLI_AXPY_H */
