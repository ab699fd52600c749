/* int8 weight x int8 activation dot products.
 *
 *   coli_dot_i8i8_<isa>(w, x, n)            = sum_i w[i] * x[i]              (exact int32)
 *   coli_rowdot_i8_<isa>(w, xq, xs, n, blk) = sum_b xs[b] * (float)dot_b    (float, blocks in order)
 *
 * w[i] in [-128, 127], x[i] in [-127, 127]. Every product is <= 128*127 = 16256 in magnitude,
 * so the int32 result is exact for n <= 132104; the engine relies on n <= 65536 per block.
 *
 * The scalar functions are the definition; the AVX2 and AVX-512 VNNI ones must return the
 * same integers, and (through coli_block_acc) bit-identical floats for the row dots.
 */
#ifndef COLI_DOT_I8_H
#define COLI_DOT_I8_H

/* ---- shared prelude, also used by coli_dot_i4.h, coli_dot_f32.h and coli_quant.h ---- */
#include <stdint.h>
#if (defined(__x86_64__) || defined(_M_X64)) && defined(__GNUC__)
#define COLI_X86 1
#include <immintrin.h>
/* Per-function ISA selection: the translation unit itself is built for baseline x86-64. */
#define COLI_AVX2 __attribute__((target("avx2,fma")))
#define COLI_AVX512 __attribute__((target("avx2,fma,avx512f,avx512bw,avx512vl,avx512vnni")))
#else
#define COLI_X86 0
#endif

/* acc + s*d, with the product rounded to float BEFORE the add. The empty asm pins the product in
 * a register so the compiler cannot contract the two operations into one fma (which it would do
 * inside the fma-enabled variants but not in baseline scalar code); this keeps block-scaled row
 * dots bit-identical across ISAs. */
static inline float coli_block_acc(float acc, float s, int32_t d)
{
    float p = s * (float)d;
#if COLI_X86
    __asm__("" : "+x"(p));
#elif defined(__aarch64__) && defined(__GNUC__)
    __asm__("" : "+w"(p));
#endif
    return acc + p;
}

/* Length of the block structure used by all row dots and the quantizer: a non-positive block or
 * one that covers the row means "the whole row is a single block". */
static inline int coli_block_len(int n, int block)
{
    return (block <= 0 || block > n) ? n : block;
}

#if COLI_X86
/* Four consecutive blocks at once: acc + xs[0]*d[0] + xs[1]*d[1] + xs[2]*d[2] + xs[3]*d[3], added
 * left to right with each product rounded on its own - the same float operations as four
 * coli_block_acc calls, so the result is bit-identical. Used by the SIMD block-64 fast paths. */
static inline float coli_block_acc4(float acc, const float *xs, __m128i d)
{
    __m128 p = _mm_mul_ps(_mm_loadu_ps(xs), _mm_cvtepi32_ps(d));
    __asm__("" : "+x"(p)); /* no fma contraction, see coli_block_acc */
    acc += _mm_cvtss_f32(p);
    acc += _mm_cvtss_f32(_mm_shuffle_ps(p, p, 1));
    acc += _mm_cvtss_f32(_mm_shuffle_ps(p, p, 2));
    acc += _mm_cvtss_f32(_mm_shuffle_ps(p, p, 3));
    return acc;
}
#endif

/* ================================ scalar (the definition) ================================ */

static inline int32_t coli_dot_i8i8_scalar(const int8_t *w, const int8_t *x, int n)
{
    int32_t s = 0;
    for (int i = 0; i < n; i++)
        s += (int32_t)w[i] * (int32_t)x[i];
    return s;
}

static inline float coli_rowdot_i8_scalar(const int8_t *w, const int8_t *xq, const float *xs,
                                          int n, int block)
{
    float acc = 0.0f;
    block = coli_block_len(n, block);
    for (int i = 0, b = 0; i < n; i += block, b++) {
        int len = n - i < block ? n - i : block;
        acc = coli_block_acc(acc, xs[b], coli_dot_i8i8_scalar(w + i, xq + i, len));
    }
    return acc;
}

#if COLI_X86
/* ========================================= AVX2 ========================================= */

COLI_AVX2 static inline int32_t coli_hsum_i32_avx2(__m256i v)
{
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtsi128_si32(s);
}

/* 32 products summed into 8 int32 lanes. Sign trick: maddubs wants u8 x s8, so use |w| (|-128|
 * = 128 still fits u8) and move w's sign onto x (vpsignb; w = 0 zeroes x, harmless). Each pair
 * sum is <= 2*128*127 = 32512, so maddubs never saturates; madd with ones widens to int32. */
COLI_AVX2 static inline __m256i coli_i8x32_dot_avx2(__m256i w, __m256i x)
{
    __m256i pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w));
    return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}

COLI_AVX2 static inline __m128i coli_i8x16_dot_sse(__m128i w, __m128i x)
{
    __m128i pairs = _mm_maddubs_epi16(_mm_abs_epi8(w), _mm_sign_epi8(x, w));
    return _mm_madd_epi16(pairs, _mm_set1_epi16(1));
}

/* the four horizontal sums of a, b, c, d, in that order */
COLI_AVX2 static inline __m128i coli_hsum4_i32_avx2(__m256i a, __m256i b, __m256i c, __m256i d)
{
    __m256i abcd = _mm256_hadd_epi32(_mm256_hadd_epi32(a, b), _mm256_hadd_epi32(c, d));
    return _mm_add_epi32(_mm256_castsi256_si128(abcd), _mm256_extracti128_si256(abcd, 1));
}

/* one full 64-element block, left as 8 int32 partial sums */
COLI_AVX2 static inline __m256i coli_i8_blk64_avx2(const int8_t *w, const int8_t *x)
{
    return _mm256_add_epi32(
        coli_i8x32_dot_avx2(_mm256_loadu_si256((const __m256i *)w), _mm256_loadu_si256((const __m256i *)x)),
        coli_i8x32_dot_avx2(_mm256_loadu_si256((const __m256i *)(w + 32)),
                            _mm256_loadu_si256((const __m256i *)(x + 32))));
}

COLI_AVX2 static inline int32_t coli_dot_i8i8_avx2(const int8_t *w, const int8_t *x, int n)
{
    __m256i acc = _mm256_setzero_si256();
    int i = 0;
    for (; i + 64 <= n; i += 64)
        acc = _mm256_add_epi32(acc, coli_i8_blk64_avx2(w + i, x + i));
    if (i + 32 <= n) {
        acc = _mm256_add_epi32(acc, coli_i8x32_dot_avx2(_mm256_loadu_si256((const __m256i *)(w + i)),
                                                        _mm256_loadu_si256((const __m256i *)(x + i))));
        i += 32;
    }
    if (i + 16 <= n) {
        __m128i d = coli_i8x16_dot_sse(_mm_loadu_si128((const __m128i *)(w + i)),
                                       _mm_loadu_si128((const __m128i *)(x + i)));
        acc = _mm256_add_epi32(acc, _mm256_inserti128_si256(_mm256_setzero_si256(), d, 0));
        i += 16;
    }
    int32_t s = coli_hsum_i32_avx2(acc);
    for (; i < n; i++) /* < 16 left */
        s += (int32_t)w[i] * (int32_t)x[i];
    return s;
}

COLI_AVX2 static inline float coli_rowdot_i8_avx2(const int8_t *w, const int8_t *xq, const float *xs,
                                                  int n, int block)
{
    float acc = 0.0f;
    int i = 0, b = 0;
    block = coli_block_len(n, block);
    if (block == 64) /* fast path: four blocks per step, one joint horizontal reduction */
        for (; i + 256 <= n; i += 256, b += 4)
            acc = coli_block_acc4(acc, xs + b, coli_hsum4_i32_avx2(
                      coli_i8_blk64_avx2(w + i, xq + i), coli_i8_blk64_avx2(w + i + 64, xq + i + 64),
                      coli_i8_blk64_avx2(w + i + 128, xq + i + 128), coli_i8_blk64_avx2(w + i + 192, xq + i + 192)));
    for (; i < n; i += block, b++) {
        int len = n - i < block ? n - i : block;
        acc = coli_block_acc(acc, xs[b], coli_dot_i8i8_avx2(w + i, xq + i, len));
    }
    return acc;
}

/* ==================================== AVX-512 VNNI ==================================== */

/* acc += 64 products via vpdpbusd (u8 x s8, groups of 4 summed into int32, no saturation).
 * Same sign trick as AVX2, but zmm has no vpsignb: negate x under the mask of w's sign bits. */
COLI_AVX512 static inline __m512i coli_i8x64_dpbusd(__m512i acc, __m512i w, __m512i x)
{
    __mmask64 wneg = _mm512_movepi8_mask(w);
    __m512i sx = _mm512_mask_sub_epi8(x, wneg, _mm512_setzero_si512(), x);
    return _mm512_dpbusd_epi32(acc, _mm512_abs_epi8(w), sx);
}

/* the four horizontal sums of a, b, c, d, in that order: interleave-and-add twice gives
 * [a b c d] partial sums in every 128-bit lane, then the four lanes are added */
COLI_AVX512 static inline __m128i coli_hsum4_i32_avx512(__m512i a, __m512i b, __m512i c, __m512i d)
{
    __m512i ab = _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
    __m512i cd = _mm512_add_epi32(_mm512_unpacklo_epi32(c, d), _mm512_unpackhi_epi32(c, d));
    __m512i abcd = _mm512_add_epi32(_mm512_unpacklo_epi64(ab, cd), _mm512_unpackhi_epi64(ab, cd));
    __m256i h = _mm256_add_epi32(_mm512_castsi512_si256(abcd), _mm512_extracti64x4_epi64(abcd, 1));
    return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

COLI_AVX512 static inline __m512i coli_i8_blk64_avx512(const int8_t *w, const int8_t *x)
{
    return coli_i8x64_dpbusd(_mm512_setzero_si512(), _mm512_loadu_si512(w), _mm512_loadu_si512(x));
}

COLI_AVX512 static inline int32_t coli_dot_i8i8_avx512(const int8_t *w, const int8_t *x, int n)
{
    __m512i acc0 = _mm512_setzero_si512(), acc1 = _mm512_setzero_si512();
    int i = 0;
    for (; i + 128 <= n; i += 128) {
        acc0 = coli_i8x64_dpbusd(acc0, _mm512_loadu_si512(w + i), _mm512_loadu_si512(x + i));
        acc1 = coli_i8x64_dpbusd(acc1, _mm512_loadu_si512(w + i + 64), _mm512_loadu_si512(x + i + 64));
    }
    if (i + 64 <= n) {
        acc0 = coli_i8x64_dpbusd(acc0, _mm512_loadu_si512(w + i), _mm512_loadu_si512(x + i));
        i += 64;
    }
    if (i < n) { /* masked loads: lanes past n read as 0 and are never touched in memory */
        __mmask64 m = ~0ULL >> (64 - (n - i));
        acc1 = coli_i8x64_dpbusd(acc1, _mm512_maskz_loadu_epi8(m, w + i), _mm512_maskz_loadu_epi8(m, x + i));
    }
    return _mm512_reduce_add_epi32(_mm512_add_epi32(acc0, acc1));
}

COLI_AVX512 static inline float coli_rowdot_i8_avx512(const int8_t *w, const int8_t *xq, const float *xs,
                                                      int n, int block)
{
    float acc = 0.0f;
    int i = 0, b = 0;
    block = coli_block_len(n, block);
    if (block == 64) /* fast path: four blocks per step, one joint horizontal reduction */
        for (; i + 256 <= n; i += 256, b += 4)
            acc = coli_block_acc4(acc, xs + b, coli_hsum4_i32_avx512(
                      coli_i8_blk64_avx512(w + i, xq + i), coli_i8_blk64_avx512(w + i + 64, xq + i + 64),
                      coli_i8_blk64_avx512(w + i + 128, xq + i + 128),
                      coli_i8_blk64_avx512(w + i + 192, xq + i + 192)));
    for (; i < n; i += block, b++) {
        int len = n - i < block ? n - i : block;
        acc = coli_block_acc(acc, xs[b], coli_dot_i8i8_avx512(w + i, xq + i, len));
    }
    return acc;
}
#endif /* COLI_X86 */

#endif /* COLI_DOT_I8_H */
