/* Float dot products (dequant-on-use paths).
 *
 *   coli_dot_f32_<isa>(a, b, n)    = sum_i a[i] * b[i]
 *   coli_dot_q8f32_<isa>(w, x, n)  = sum_i w[i] * x[i]         w: int8 row
 *   coli_dot_q4f32_<isa>(wp, x, n) = sum_i (u[i] - 8) * x[i]   wp: packed int4 row (see coli_dot_i4.h)
 *
 * The weights are the stored integers (the caller applies the row scale). All accumulation is
 * in float; the SIMD variants use several partial sums, so they agree with the scalar definition
 * only up to rounding (not bit-exactly).
 */
#ifndef COLI_DOT_F32_H
#define COLI_DOT_F32_H

#include "coli_dot_i8.h" /* shared prelude */

/* ================================ scalar (the definition) ================================ */

static inline float coli_dot_f32_scalar(const float *a, const float *b, int n)
{
    float s = 0.0f;
    for (int i = 0; i < n; i++)
        s += a[i] * b[i];
    return s;
}

static inline float coli_dot_q8f32_scalar(const int8_t *w, const float *x, int n)
{
    float s = 0.0f;
    for (int i = 0; i < n; i++)
        s += (float)w[i] * x[i];
    return s;
}

static inline float coli_dot_q4f32_scalar(const uint8_t *wp, const float *x, int n)
{
    float s = 0.0f;
    for (int i = 0; i < n; i++) {
        int u = (i & 1) ? (wp[i >> 1] >> 4) : (wp[i >> 1] & 15);
        s += (float)(u - 8) * x[i];
    }
    return s;
}

/* Many rows against one vector, out[r] = coli_dot_*(row_r, x): each row exactly the one-row
 * kernel of the same ISA (inlined here, so without a dispatch per row). f32 rows are
 * base + (idx ? idx[r] : r) * stride (floats); int8 / int4 rows are consecutive, rb bytes apart.
 * (AVX-512's f32 form, below, sums 16 rows' partial sums at once in the same tree.) */
#define COLI_DOTS_F32_BY_ROW(sfx, ATTR)                                                            \
    ATTR static inline void coli_dots_f32_##sfx(const float *x, int n, const float *base, long stride, \
                                                const int *idx, int nrows, float *out)             \
    {                                                                                              \
        for (int r = 0; r < nrows; r++)                                                            \
            out[r] = coli_dot_f32_##sfx(x, base + (idx ? idx[r] : r) * stride, n);                 \
    }
#define COLI_DOTS_Q_BY_ROW(sfx, ATTR)                                                              \
    ATTR static inline void coli_dots_q8f32_##sfx(const float *x, int n, const int8_t *w, long rb,  \
                                                  int nrows, float *out)                           \
    {                                                                                              \
        for (int r = 0; r < nrows; r++)                                                            \
            out[r] = coli_dot_q8f32_##sfx(w + r * rb, x, n);                                       \
    }                                                                                              \
    ATTR static inline void coli_dots_q4f32_##sfx(const float *x, int n, const uint8_t *w, long rb, \
                                                  int nrows, float *out)                           \
    {                                                                                              \
        for (int r = 0; r < nrows; r++)                                                            \
            out[r] = coli_dot_q4f32_##sfx(w + r * rb, x, n);                                       \
    }
#define COLI_DOTS_BY_ROW(sfx, ATTR) COLI_DOTS_F32_BY_ROW(sfx, ATTR) COLI_DOTS_Q_BY_ROW(sfx, ATTR)
COLI_DOTS_BY_ROW(scalar, )

/* Several query vectors against the same rows (attention: a block of query rows of one head, or
 * the heads of one row, over their common keys): out[q * ostride + r] = coli_dot_f32(x + q *
 * xstride, row_r) for q < nq, r < nrows, row_r = base + (idx ? idx[r] : r) * stride, each the
 * one-vector result bit for bit. Here one coli_dots_f32 per query; the AVX-512 form below keeps
 * 16 rows in L1 for all the queries. */
#define COLI_DOTS_MULTI_BY_QUERY(sfx, ATTR)                                                        \
    ATTR static inline void coli_dots_f32_multi_##sfx(const float *x, long xstride, int nq, int n,  \
                                                      const float *base, long stride,              \
                                                      const int *idx, int nrows, float *out,       \
                                                      long ostride)                                \
    {                                                                                              \
        for (int q = 0; q < nq; q++)                                                               \
            coli_dots_f32_##sfx(x + q * xstride, n, base, stride, idx, nrows, out + q * ostride);  \
    }
COLI_DOTS_MULTI_BY_QUERY(scalar, )

#if COLI_X86
/* ========================================= AVX2 ========================================= */

COLI_AVX2 static inline float coli_hsum_ps_avx2(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Lane mask selecting the first r (0..8) lanes, for vmaskmovps tails (masked-off lanes are not
 * accessed, so reading right up to the end of a buffer is safe). */
COLI_AVX2 static inline __m256i coli_tailmask_avx2(int r)
{
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(r), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

COLI_AVX2 static inline float coli_dot_f32_avx2(const float *a, const float *b, int n)
{
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    __m256 s2 = _mm256_setzero_ps(), s3 = _mm256_setzero_ps();
    int i = 0;
    for (; i + 32 <= n; i += 32) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
        s2 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 16), _mm256_loadu_ps(b + i + 16), s2);
        s3 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 24), _mm256_loadu_ps(b + i + 24), s3);
    }
    for (; i + 8 <= n; i += 8)
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
    if (i < n) {
        __m256i m = coli_tailmask_avx2(n - i);
        s1 = _mm256_fmadd_ps(_mm256_maskload_ps(a + i, m), _mm256_maskload_ps(b + i, m), s1);
    }
    return coli_hsum_ps_avx2(_mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)));
}

/* 8 int8 weights -> 8 floats (the 8-byte load reads exactly the 8 bytes used). */
COLI_AVX2 static inline __m256 coli_i8x8_ps_avx2(const int8_t *w)
{
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)w)));
}

COLI_AVX2 static inline float coli_dot_q8f32_avx2(const int8_t *w, const float *x, int n)
{
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    __m256 s2 = _mm256_setzero_ps(), s3 = _mm256_setzero_ps();
    int i = 0;
    for (; i + 32 <= n; i += 32) {
        s0 = _mm256_fmadd_ps(coli_i8x8_ps_avx2(w + i), _mm256_loadu_ps(x + i), s0);
        s1 = _mm256_fmadd_ps(coli_i8x8_ps_avx2(w + i + 8), _mm256_loadu_ps(x + i + 8), s1);
        s2 = _mm256_fmadd_ps(coli_i8x8_ps_avx2(w + i + 16), _mm256_loadu_ps(x + i + 16), s2);
        s3 = _mm256_fmadd_ps(coli_i8x8_ps_avx2(w + i + 24), _mm256_loadu_ps(x + i + 24), s3);
    }
    for (; i + 8 <= n; i += 8)
        s0 = _mm256_fmadd_ps(coli_i8x8_ps_avx2(w + i), _mm256_loadu_ps(x + i), s0);
    float s = coli_hsum_ps_avx2(_mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)));
    for (; i < n; i++) /* < 8 left */
        s += (float)w[i] * x[i];
    return s;
}

/* 8 packed bytes -> 16 signed weights v = u - 8 as int8, in element order (widen each byte to
 * 16 bits, (b | b << 4) & 0x0F0F splits its nibbles into low/high byte; see coli_dot_i4.h). */
COLI_AVX2 static inline __m128i coli_i4x16_avx2(const uint8_t *wp)
{
    __m128i wd = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)wp));
    __m128i u = _mm_and_si128(_mm_or_si128(wd, _mm_slli_epi16(wd, 4)), _mm_set1_epi8(0x0F));
    return _mm_sub_epi8(u, _mm_set1_epi8(8));
}

COLI_AVX2 static inline __m256 coli_i8lo_ps_avx2(__m128i v) /* bytes 0..7 -> floats */
{
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
}

COLI_AVX2 static inline __m256 coli_i8hi_ps_avx2(__m128i v) /* bytes 8..15 -> floats */
{
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(v, v)));
}

COLI_AVX2 static inline float coli_dot_q4f32_avx2(const uint8_t *wp, const float *x, int n)
{
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    __m256 s2 = _mm256_setzero_ps(), s3 = _mm256_setzero_ps();
    int i = 0;
    for (; i + 32 <= n; i += 32) {
        __m128i va = coli_i4x16_avx2(wp + i / 2), vb = coli_i4x16_avx2(wp + i / 2 + 8);
        s0 = _mm256_fmadd_ps(coli_i8lo_ps_avx2(va), _mm256_loadu_ps(x + i), s0);
        s1 = _mm256_fmadd_ps(coli_i8hi_ps_avx2(va), _mm256_loadu_ps(x + i + 8), s1);
        s2 = _mm256_fmadd_ps(coli_i8lo_ps_avx2(vb), _mm256_loadu_ps(x + i + 16), s2);
        s3 = _mm256_fmadd_ps(coli_i8hi_ps_avx2(vb), _mm256_loadu_ps(x + i + 24), s3);
    }
    if (i + 16 <= n) {
        __m128i va = coli_i4x16_avx2(wp + i / 2);
        s0 = _mm256_fmadd_ps(coli_i8lo_ps_avx2(va), _mm256_loadu_ps(x + i), s0);
        s1 = _mm256_fmadd_ps(coli_i8hi_ps_avx2(va), _mm256_loadu_ps(x + i + 8), s1);
        i += 16;
    }
    /* < 16 left, i is even */
    return coli_hsum_ps_avx2(_mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)))
         + coli_dot_q4f32_scalar(wp + i / 2, x + i, n - i);
}

COLI_DOTS_BY_ROW(avx2, COLI_AVX2)
COLI_DOTS_MULTI_BY_QUERY(avx2, COLI_AVX2)

/* ======================================== AVX-512 ======================================== */

/* The horizontal sum of the 16 lanes in a fixed tree (the one GCC's _mm512_reduce_add_ps uses):
 * t[i] = v[i] + v[i+8], u[i] = t[i] + t[i+4], then (u[0] + u[2]) + (u[1] + u[3]). Written out so
 * that coli_hsum16x_avx512 below can take the same pairings for 16 vectors at once. */
COLI_AVX512 static inline float coli_hsum_ps_avx512(__m512 v)
{
    __m256 t = _mm256_add_ps(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)), _mm512_castps512_ps256(v));
    __m128 u = _mm_add_ps(_mm256_extractf128_ps(t, 1), _mm256_castps256_ps128(t));
    __m128 w = _mm_add_ps(u, _mm_shuffle_ps(u, u, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtss_f32(_mm_add_ss(w, _mm_shuffle_ps(w, w, _MM_SHUFFLE(1, 1, 1, 1))));
}

/* Lane r of the result = coli_hsum_ps_avx512(v[r]) bit for bit, for 16 vectors in 4 rounds of
 * 8 / 4 / 2 / 1 adds (transposing as it goes) instead of 16 separate trees. */
COLI_AVX512 static inline __m512 coli_hsum16x_avx512(const __m512 v[16])
{
    __m512 x[8], y[4], z[2];
    for (int k = 0; k < 8; k++)   /* lanes 0-7: v[2k]'s t, lanes 8-15: v[2k+1]'s t */
        x[k] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    for (int m = 0; m < 4; m++)   /* block b: v[4m+b]'s u */
        y[m] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * m], x[2 * m + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(x[2 * m], x[2 * m + 1], _MM_SHUFFLE(3, 1, 3, 1)));
    for (int m = 0; m < 2; m++)   /* block b: u[0]+u[2], u[1]+u[3] of v[8m+b], then of v[8m+4+b] */
        z[m] = _mm512_add_ps(_mm512_shuffle_ps(y[2 * m], y[2 * m + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(y[2 * m], y[2 * m + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    /* lane 4b + k: the sum of v[4k + b]; one permutation puts v[r]'s sum in lane r */
    __m512 s = _mm512_add_ps(_mm512_shuffle_ps(z[0], z[1], _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_ps(z[0], z[1], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), s);
}

/* The 16 partial sums of a . b before the horizontal sum */
COLI_AVX512 static COLI_ALWAYS_INLINE __m512 coli_dot_f32_vec_avx512(const float *a, const float *b, int n)
{
    __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
    __m512 s2 = _mm512_setzero_ps(), s3 = _mm512_setzero_ps();
    int i = 0;
    for (; i + 64 <= n; i += 64) {
        s0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), s0);
        s1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), _mm512_loadu_ps(b + i + 16), s1);
        s2 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 32), _mm512_loadu_ps(b + i + 32), s2);
        s3 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 48), _mm512_loadu_ps(b + i + 48), s3);
    }
    for (; i + 16 <= n; i += 16)
        s0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), s0);
    if (i < n) {
        __mmask16 m = (__mmask16)((1u << (n - i)) - 1);
        s1 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + i), _mm512_maskz_loadu_ps(m, b + i), s1);
    }
    return _mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3));
}

COLI_AVX512 static inline float coli_dot_f32_avx512(const float *a, const float *b, int n)
{
    return coli_hsum_ps_avx512(coli_dot_f32_vec_avx512(a, b, n));
}

COLI_AVX512 static inline __m512 coli_i8x16_ps_avx512(__m128i v)
{
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v));
}

COLI_AVX512 static inline float coli_dot_q8f32_avx512(const int8_t *w, const float *x, int n)
{
    __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
    __m512 s2 = _mm512_setzero_ps(), s3 = _mm512_setzero_ps();
    int i = 0;
    for (; i + 64 <= n; i += 64) {
        __m512i w64 = _mm512_loadu_si512(w + i);
        s0 = _mm512_fmadd_ps(coli_i8x16_ps_avx512(_mm512_extracti32x4_epi32(w64, 0)), _mm512_loadu_ps(x + i), s0);
        s1 = _mm512_fmadd_ps(coli_i8x16_ps_avx512(_mm512_extracti32x4_epi32(w64, 1)), _mm512_loadu_ps(x + i + 16), s1);
        s2 = _mm512_fmadd_ps(coli_i8x16_ps_avx512(_mm512_extracti32x4_epi32(w64, 2)), _mm512_loadu_ps(x + i + 32), s2);
        s3 = _mm512_fmadd_ps(coli_i8x16_ps_avx512(_mm512_extracti32x4_epi32(w64, 3)), _mm512_loadu_ps(x + i + 48), s3);
    }
    for (; i + 16 <= n; i += 16)
        s0 = _mm512_fmadd_ps(coli_i8x16_ps_avx512(_mm_loadu_si128((const __m128i *)(w + i))),
                             _mm512_loadu_ps(x + i), s0);
    if (i < n) {
        __mmask16 m = (__mmask16)((1u << (n - i)) - 1);
        s1 = _mm512_fmadd_ps(coli_i8x16_ps_avx512(_mm_maskz_loadu_epi8(m, w + i)),
                             _mm512_maskz_loadu_ps(m, x + i), s1);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3)));
}

/* 16 packed bytes -> 32 signed weights v = u - 8 as int8 in element order (the nibble split of
 * coli_dot_i4.h; vpternlogd imm 0xA8 computes (a | b) & c). */
COLI_AVX512 static inline __m256i coli_i4x32_avx512(__m128i packed)
{
    __m256i wd = _mm256_cvtepu8_epi16(packed);
    __m256i u = _mm256_ternarylogic_epi32(wd, _mm256_slli_epi16(wd, 4), _mm256_set1_epi8(0x0F), 0xA8);
    return _mm256_sub_epi8(u, _mm256_set1_epi8(8));
}

COLI_AVX512 static inline float coli_dot_q4f32_avx512(const uint8_t *wp, const float *x, int n)
{
    __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
    __m512 s2 = _mm512_setzero_ps(), s3 = _mm512_setzero_ps();
    int i = 0;
    for (; i + 64 <= n; i += 64) {
        __m256i va = coli_i4x32_avx512(_mm_loadu_si128((const __m128i *)(wp + i / 2)));
        __m256i vb = coli_i4x32_avx512(_mm_loadu_si128((const __m128i *)(wp + i / 2 + 16)));
        s0 = _mm512_fmadd_ps(coli_i8x16_ps_avx512(_mm256_castsi256_si128(va)), _mm512_loadu_ps(x + i), s0);
        s1 = _mm512_fmadd_ps(coli_i8x16_ps_avx512(_mm256_extracti128_si256(va, 1)), _mm512_loadu_ps(x + i + 16), s1);
        s2 = _mm512_fmadd_ps(coli_i8x16_ps_avx512(_mm256_castsi256_si128(vb)), _mm512_loadu_ps(x + i + 32), s2);
        s3 = _mm512_fmadd_ps(coli_i8x16_ps_avx512(_mm256_extracti128_si256(vb, 1)), _mm512_loadu_ps(x + i + 48), s3);
    }
    for (; i + 32 <= n; i += 32) {
        __m256i va = coli_i4x32_avx512(_mm_loadu_si128((const __m128i *)(wp + i / 2)));
        s0 = _mm512_fmadd_ps(coli_i8x16_ps_avx512(_mm256_castsi256_si128(va)), _mm512_loadu_ps(x + i), s0);
        s1 = _mm512_fmadd_ps(coli_i8x16_ps_avx512(_mm256_extracti128_si256(va, 1)), _mm512_loadu_ps(x + i + 16), s1);
    }
    if (i < n) {
        /* masked tail: ceil(r/2) weight bytes, r activations; an odd tail's padding nibble is
         * multiplied by a zeroed activation lane */
        int r = n - i;
        __mmask16 mb = (__mmask16)((1u << ((r + 1) / 2)) - 1);
        __mmask32 mx = (__mmask32)((1u << r) - 1);
        __m256i va = coli_i4x32_avx512(_mm_maskz_loadu_epi8(mb, wp + i / 2));
        s2 = _mm512_fmadd_ps(coli_i8x16_ps_avx512(_mm256_castsi256_si128(va)),
                             _mm512_maskz_loadu_ps((__mmask16)mx, x + i), s2);
        s3 = _mm512_fmadd_ps(coli_i8x16_ps_avx512(_mm256_extracti128_si256(va, 1)),
                             _mm512_maskz_loadu_ps((__mmask16)(mx >> 16), x + i + 16), s3);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3)));
}
COLI_DOTS_Q_BY_ROW(avx512, COLI_AVX512)

/* out[r] = coli_dot_f32_avx512(x, row_r): 16 rows' partial sums summed by one transposed tree */
COLI_AVX512 static inline void coli_dots_f32_avx512(const float *x, int n, const float *base, long stride,
                                                    const int *idx, int nrows, float *out)
{
    for (int r0 = 0; r0 < nrows; r0 += 16) {
        int nr = nrows - r0 < 16 ? nrows - r0 : 16;
        __m512 v[16];
        for (int r = 0; r < 16; r++)
            v[r] = r < nr ? coli_dot_f32_vec_avx512(x, base + (idx ? idx[r0 + r] : r0 + r) * stride, n)
                          : _mm512_setzero_ps();
        _mm512_mask_storeu_ps(out + r0, (__mmask16)((1u << nr) - 1), coli_hsum16x_avx512(v));
    }
}

/* coli_dots_f32_multi: for each block of 16 rows, every query's 16 dots (the rows stay in L1) */
COLI_AVX512 static inline void coli_dots_f32_multi_avx512(const float *x, long xstride, int nq, int n,
                                                          const float *base, long stride, const int *idx,
                                                          int nrows, float *out, long ostride)
{
    for (int r0 = 0; r0 < nrows; r0 += 16) {
        int nr = nrows - r0 < 16 ? nrows - r0 : 16;
        for (int q = 0; q < nq; q++) {
            __m512 v[16];
            for (int r = 0; r < 16; r++)
                v[r] = r < nr ? coli_dot_f32_vec_avx512(x + q * xstride,
                                                        base + (idx ? idx[r0 + r] : r0 + r) * stride, n)
                              : _mm512_setzero_ps();
            _mm512_mask_storeu_ps(out + q * ostride + r0, (__mmask16)((1u << nr) - 1), coli_hsum16x_avx512(v));
        }
    }
}
#endif /* COLI_X86 */

#endif /* COLI_DOT_F32_H */
