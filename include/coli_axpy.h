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
#endif /* COLI_X86 */

#endif /* COLI_AXPY_H */
