/* Packed int4 weight x int8 activation dot products.
 *
 * Weight format (byte-exact file format): a row of n elements is ceil(n/2) bytes; byte j holds
 * element 2j in its LOW nibble and element 2j+1 in its HIGH nibble; a nibble u in [0, 15] encodes
 * v = u - 8 in [-8, 7]. For odd n the final high nibble is padding and never contributes.
 *
 *   coli_dot_i4i8_<isa>(wp, x, n)            = sum_i v[i] * x[i]             (exact int32)
 *   coli_rowdot_i4_<isa>(wp, xq, xs, n, blk) = sum_b xs[b] * (float)dot_b   (float, blocks in order)
 *
 * |v*x| <= 8*127 = 1016, so int32 is exact for n up to 2^21 (the SIMD variants additionally keep
 * sum u*x <= 15*127*n, fine up to 2^20 = the engine's maximum row length). For the row dots the
 * block length must be even, so every block starts on a byte boundary (w + i/2).
 */
#ifndef COLI_DOT_I4_H
#define COLI_DOT_I4_H

/* Shared prelude (stdint, COLI_X86, COLI_AVX2/COLI_AVX512 target attributes, coli_block_acc,
 * coli_block_len, horizontal-sum helpers) lives in coli_dot_i8.h. */
#include "coli_dot_i8.h"

/* ================================ scalar (the definition) ================================ */

static inline int32_t coli_dot_i4i8_scalar(const uint8_t *wp, const int8_t *x, int n)
{
    int32_t s = 0;
    int j = 0;
    for (; 2 * j + 1 < n; j++) {
        s += ((int32_t)(wp[j] & 15) - 8) * (int32_t)x[2 * j];
        s += ((int32_t)(wp[j] >> 4) - 8) * (int32_t)x[2 * j + 1];
    }
    if (2 * j < n) /* odd n: low nibble of the last byte only */
        s += ((int32_t)(wp[j] & 15) - 8) * (int32_t)x[2 * j];
    return s;
}

static inline float coli_rowdot_i4_scalar(const uint8_t *wp, const int8_t *xq, const float *xs,
                                          int n, int block)
{
    float acc = 0.0f;
    block = coli_block_len(n, block);
    for (int i = 0, b = 0; i < n; i += block, b++) {
        int len = n - i < block ? n - i : block;
        acc = coli_block_acc(acc, xs[b], coli_dot_i4i8_scalar(wp + i / 2, xq + i, len));
    }
    return acc;
}

#if COLI_X86
/* ========================================= AVX2 ========================================= */

/* 16 packed bytes -> 32 nibbles u in element order, one per byte. Widen each byte b to a 16-bit
 * lane; then (b | b << 4) & 0x0F0F leaves the low nibble in the lane's low byte (element 2j) and
 * the high nibble in its high byte (element 2j+1) - exactly the little-endian element order. */
COLI_AVX2 static inline __m256i coli_i4x32_unpack_avx2(const uint8_t *wp)
{
    __m256i wd = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)wp));
    return _mm256_and_si256(_mm256_or_si256(wd, _mm256_slli_epi16(wd, 4)), _mm256_set1_epi8(0x0F));
}

/* 32 elements: pair sums of (u-8)*x as int16, each within +-2*8*127 = 2032. Computed as
 * maddubs(u, x) - maddubs(8, x), since maddubs needs the unsigned operand first. */
COLI_AVX2 static inline __m256i coli_i4x32_pairs_avx2(const uint8_t *wp, const int8_t *x)
{
    __m256i u = coli_i4x32_unpack_avx2(wp);
    __m256i xv = _mm256_loadu_si256((const __m256i *)x);
    return _mm256_sub_epi16(_mm256_maddubs_epi16(u, xv), _mm256_maddubs_epi16(_mm256_set1_epi8(8), xv));
}

/* one full 64-element block, left as 8 int32 partial sums */
COLI_AVX2 static inline __m256i coli_i4_blk64_avx2(const uint8_t *wp, const int8_t *x)
{
    __m256i p = _mm256_add_epi16(coli_i4x32_pairs_avx2(wp, x), coli_i4x32_pairs_avx2(wp + 16, x + 32));
    return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
}

COLI_AVX2 static inline int32_t coli_dot_i4i8_avx2(const uint8_t *wp, const int8_t *x, int n)
{
    __m256i acc32 = _mm256_setzero_si256();
    int i = 0;
    while (i + 32 <= n) {
        /* up to 16 steps of pair sums (16*2032 = 32512) fit in int16 before widening to int32 */
        __m256i acc16 = _mm256_setzero_si256();
        int stop = (n - i >= 16 * 32) ? i + 16 * 32 : n;
        for (; i + 32 <= stop; i += 32)
            acc16 = _mm256_add_epi16(acc16, coli_i4x32_pairs_avx2(wp + i / 2, x + i));
        acc32 = _mm256_add_epi32(acc32, _mm256_madd_epi16(acc16, _mm256_set1_epi16(1)));
    }
    /* < 32 elements left, i is even */
    return coli_hsum_i32_avx2(acc32) + coli_dot_i4i8_scalar(wp + i / 2, x + i, n - i);
}

COLI_AVX2 static inline float coli_rowdot_i4_avx2(const uint8_t *wp, const int8_t *xq, const float *xs,
                                                  int n, int block)
{
    float acc = 0.0f;
    int i = 0, b = 0;
    block = coli_block_len(n, block);
    if (block == 64) /* fast path: four blocks per step, one joint horizontal reduction */
        for (; i + 256 <= n; i += 256, b += 4)
            acc = coli_block_acc4(acc, xs + b, coli_hsum4_i32_avx2(
                      coli_i4_blk64_avx2(wp + i / 2, xq + i), coli_i4_blk64_avx2(wp + i / 2 + 32, xq + i + 64),
                      coli_i4_blk64_avx2(wp + i / 2 + 64, xq + i + 128),
                      coli_i4_blk64_avx2(wp + i / 2 + 96, xq + i + 192)));
    for (; i < n; i += block, b++) {
        int len = n - i < block ? n - i : block;
        acc = coli_block_acc(acc, xs[b], coli_dot_i4i8_avx2(wp + i / 2, xq + i, len));
    }
    return acc;
}

/* ==================================== AVX-512 VNNI ==================================== */

/* 32 packed bytes -> 64 nibbles in element order (same widening trick as AVX2; vpternlogd does
 * the (a | b) & c in one instruction: imm 0xA8 = (0xF0 | 0xCC) & 0xAA). */
COLI_AVX512 static inline __m512i coli_i4x64_unpack_avx512(__m256i packed)
{
    __m512i wd = _mm512_cvtepu8_epi16(packed);
    return _mm512_ternarylogic_epi32(wd, _mm512_slli_epi16(wd, 4), _mm512_set1_epi8(0x0F), 0xA8);
}

/* The stored nibble u = v + 8 is already the unsigned operand vpdpbusd wants:
 *   sum v*x = sum u*x - 8 * sum x,
 * and sum x is one more vpdpbusd against a vector of ones. ux += u.x and sx += 1.x for 64
 * elements (32 packed bytes); the caller combines ux - 8*sx. */
COLI_AVX512 static inline void coli_i4x64_dp_avx512(__m512i *ux, __m512i *sx, __m256i packed, __m512i xv)
{
    *ux = _mm512_dpbusd_epi32(*ux, coli_i4x64_unpack_avx512(packed), xv);
    *sx = _mm512_dpbusd_epi32(*sx, _mm512_set1_epi8(1), xv);
}

/* one full 64-element block, left as 16 int32 partial sums */
COLI_AVX512 static inline __m512i coli_i4_blk64_avx512(const uint8_t *wp, const int8_t *x)
{
    __m512i ux = _mm512_setzero_si512(), sx = _mm512_setzero_si512();
    coli_i4x64_dp_avx512(&ux, &sx, _mm256_loadu_si256((const __m256i *)wp), _mm512_loadu_si512(x));
    return _mm512_sub_epi32(ux, _mm512_slli_epi32(sx, 3));
}

COLI_AVX512 static inline int32_t coli_dot_i4i8_avx512(const uint8_t *wp, const int8_t *x, int n)
{
    /* two independent accumulator pairs hide the vpdpbusd latency */
    __m512i ux0 = _mm512_setzero_si512(), sx0 = _mm512_setzero_si512();
    __m512i ux1 = _mm512_setzero_si512(), sx1 = _mm512_setzero_si512();
    int i = 0;
    for (; i + 128 <= n; i += 128) {
        coli_i4x64_dp_avx512(&ux0, &sx0, _mm256_loadu_si256((const __m256i *)(wp + i / 2)),
                             _mm512_loadu_si512(x + i));
        coli_i4x64_dp_avx512(&ux1, &sx1, _mm256_loadu_si256((const __m256i *)(wp + i / 2 + 32)),
                             _mm512_loadu_si512(x + i + 64));
    }
    if (i + 64 <= n) {
        coli_i4x64_dp_avx512(&ux0, &sx0, _mm256_loadu_si256((const __m256i *)(wp + i / 2)),
                             _mm512_loadu_si512(x + i));
        i += 64;
    }
    if (i < n) {
        /* Masked tail: ceil(r/2) bytes of weights, r activations. An odd tail's padding nibble
         * meets a zeroed activation lane, so it never contributes. */
        int r = n - i;
        __mmask32 mb = (__mmask32)((1ULL << ((r + 1) / 2)) - 1);
        __mmask64 mx = ~0ULL >> (64 - r);
        coli_i4x64_dp_avx512(&ux1, &sx1, _mm256_maskz_loadu_epi8(mb, wp + i / 2), _mm512_maskz_loadu_epi8(mx, x + i));
    }
    __m512i ux = _mm512_add_epi32(ux0, ux1), sx = _mm512_add_epi32(sx0, sx1);
    return _mm512_reduce_add_epi32(_mm512_sub_epi32(ux, _mm512_slli_epi32(sx, 3)));
}

COLI_AVX512 static inline float coli_rowdot_i4_avx512(const uint8_t *wp, const int8_t *xq, const float *xs,
                                                      int n, int block)
{
    float acc = 0.0f;
    int i = 0, b = 0;
    block = coli_block_len(n, block);
    if (block == 64) /* fast path: four blocks per step, one joint horizontal reduction */
        for (; i + 256 <= n; i += 256, b += 4)
            acc = coli_block_acc4(acc, xs + b, coli_hsum4_i32_avx512(
                      coli_i4_blk64_avx512(wp + i / 2, xq + i), coli_i4_blk64_avx512(wp + i / 2 + 32, xq + i + 64),
                      coli_i4_blk64_avx512(wp + i / 2 + 64, xq + i + 128),
                      coli_i4_blk64_avx512(wp + i / 2 + 96, xq + i + 192)));
    for (; i < n; i += block, b++) {
        int len = n - i < block ? n - i : block;
        acc = coli_block_acc(acc, xs[b], coli_dot_i4i8_avx512(wp + i / 2, xq + i, len));
    }
    return acc;
}
#endif /* COLI_X86 */

#endif /* COLI_DOT_I4_H */
