/* Packed int4 weight x int8 activation dot products.
 *
 * Weight format (byte-exact file format): a row of n elements is ceil(n/2) bytes; byte j holds
 * element 2j in its LOW nibble and element 2j+1 in its HIGH nibble; a nibble u in [0, 15] encodes
 * v = u - 8 in [-8, 7]. For odd n the final high nibble is padding and never contributes.
 *
 *   coli_dot_i4i8_<isa>(wp, x, n)            = sum_i v[i] * x[i]             (exact int32)
 *   coli_rowdot_i4_<isa>(wp, xq, xs, n, blk) = sum_b xs[b] * (float)dot_b   (float, blocks in order)
 *   coli_rowdot2_i4_<isa>, coli_rowdot_i4_rows_<isa>: several activation rows in one pass over the
 *       weights, bit-identical to the single-row dot per row (see coli_dot_i8.h, "multi-activation
 *       row dots"); the nibbles are decoded once per weight chunk for all rows.
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

/* ============================== multi-activation row dots ==============================
 * (see coli_dot_i8.h for the contract and COLI_ROWS_WRAPPERS) */

/* scalar: two rows per pass over a block, each nibble decoded once for both (as coli_rowsg_i8_scalar) */
static inline void coli_dot2_i4i8_scalar(const uint8_t *wp, const int8_t *x1, const int8_t *x2, int n,
                                         int32_t *d1, int32_t *d2)
{
    int32_t s1 = 0, s2 = 0;
    int j = 0;
    for (; 2 * j + 1 < n; j++) {
        int32_t lo = (int32_t)(wp[j] & 15) - 8, hi = (int32_t)(wp[j] >> 4) - 8;
        s1 += lo * (int32_t)x1[2 * j] + hi * (int32_t)x1[2 * j + 1];
        s2 += lo * (int32_t)x2[2 * j] + hi * (int32_t)x2[2 * j + 1];
    }
    if (2 * j < n) { /* odd n: low nibble of the last byte only */
        int32_t lo = (int32_t)(wp[j] & 15) - 8;
        s1 += lo * (int32_t)x1[2 * j];
        s2 += lo * (int32_t)x2[2 * j];
    }
    *d1 = s1;
    *d2 = s2;
}

static inline void coli_rowsg_i4_scalar(const uint8_t *wp, const int8_t *const *q, const float *const *xs,
                                        int G, int n, int block, float *out)
{
    block = coli_block_len(n, block);
    for (int r = 0; r < G; r++)
        out[r] = 0.0f;
    for (int i = 0, b = 0; i < n; i += block, b++) {
        int len = n - i < block ? n - i : block, r = 0;
        for (; r + 2 <= G; r += 2) {
            int32_t d1, d2;
            coli_dot2_i4i8_scalar(wp + i / 2, q[r] + i, q[r + 1] + i, len, &d1, &d2);
            out[r] = coli_block_acc(out[r], xs[r][b], d1);
            out[r + 1] = coli_block_acc(out[r + 1], xs[r + 1][b], d2);
        }
        if (r < G)
            out[r] = coli_block_acc(out[r], xs[r][b], coli_dot_i4i8_scalar(wp + i / 2, q[r] + i, len));
    }
}
COLI_ROWS_WRAPPERS(i4, uint8_t, scalar, )

static inline float coli_rowdot2s_i4_scalar(const uint8_t *w, const int8_t *q1, const float *xs1,
                                            const int32_t *s1, const int8_t *q2, const float *xs2,
                                            const int32_t *s2, int n, int block)
{
    (void)s1; (void)s2;
    return coli_rowdot2_i4_scalar(w, q1, xs1, q2, xs2, n, block);
}

#if COLI_X86
/* ---------------------------------------- AVX2 ---------------------------------------- */

/* 32 elements of already unpacked nibbles u against x: int16 pair sums of (u-8)*x, as
 * coli_i4x32_pairs_avx2 */
COLI_AVX2 static inline __m256i coli_i4x32_pairs_u_avx2(__m256i u, const int8_t *x)
{
    __m256i xv = _mm256_loadu_si256((const __m256i *)x);
    return _mm256_sub_epi16(_mm256_maddubs_epi16(u, xv), _mm256_maddubs_epi16(_mm256_set1_epi8(8), xv));
}

/* G (1..4) rows; 32 nibbles are unpacked once for all rows. Block-64 fast path as in
 * coli_rowsg_i8_avx2_k (int16 pair sums of a 64-block are <= 2*2032, widened once per block).
 * Other blocks: int16 accumulators per row, widened to int32 every 16 steps of 32 elements
 * (16*2032 = 32512), as coli_dot_i4i8_avx2 does; the < 32 element tail per row. */
COLI_AVX2 static COLI_ALWAYS_INLINE void coli_rowsg_i4_avx2_k(const uint8_t *wp, const int8_t *const *q,
                                                              const float *const *xs, const int G,
                                                              int n, int block, float *out)
{
    const __m256i ones = _mm256_set1_epi16(1);
    float acc[COLI_ROWS_G] = {0.0f, 0.0f, 0.0f, 0.0f};
    int i = 0, b = 0;
    block = coli_block_len(n, block);
    if (block == 64)
        for (; i + 256 <= n; i += 256, b += 4) {
            __m256i t[COLI_ROWS_G], h01[COLI_ROWS_G], h23[COLI_ROWS_G];
            COLI_UNROLL_G
            for (int k = 0; k < 4; k++) {
                const uint8_t *wk = wp + i / 2 + 32 * k;
                __m256i u0 = coli_i4x32_unpack_avx2(wk), u1 = coli_i4x32_unpack_avx2(wk + 16);
                COLI_UNROLL_G
                for (int r = 0; r < G; r++) {
                    const int8_t *x = q[r] + i + 64 * k;
                    __m256i d = _mm256_madd_epi16(_mm256_add_epi16(coli_i4x32_pairs_u_avx2(u0, x),
                                                                   coli_i4x32_pairs_u_avx2(u1, x + 32)),
                                                  ones);
                    if (k == 0 || k == 2)
                        t[r] = d;
                    else if (k == 1)
                        h01[r] = _mm256_hadd_epi32(t[r], d);
                    else
                        h23[r] = _mm256_hadd_epi32(t[r], d);
                }
            }
            COLI_UNROLL_G
            for (int r = 0; r < G; r++) {
                __m256i s = _mm256_hadd_epi32(h01[r], h23[r]);
                __m128i d4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
                acc[r] = coli_block_acc4(acc[r], xs[r] + b, d4);
            }
        }
    for (; i < n; i += block, b++) {
        int len = n - i < block ? n - i : block, j = 0;
        __m256i a32[COLI_ROWS_G];
        COLI_UNROLL_G
        for (int r = 0; r < COLI_ROWS_G; r++)
            a32[r] = _mm256_setzero_si256();
        while (j + 32 <= len) {
            __m256i a16[COLI_ROWS_G];
            int stop = (len - j >= 16 * 32) ? j + 16 * 32 : len;
            COLI_UNROLL_G
            for (int r = 0; r < G; r++)
                a16[r] = _mm256_setzero_si256();
            for (; j + 32 <= stop; j += 32) {
                __m256i u = coli_i4x32_unpack_avx2(wp + (i + j) / 2);
                COLI_UNROLL_G
                for (int r = 0; r < G; r++)
                    a16[r] = _mm256_add_epi16(a16[r], coli_i4x32_pairs_u_avx2(u, q[r] + i + j));
            }
            COLI_UNROLL_G
            for (int r = 0; r < G; r++)
                a32[r] = _mm256_add_epi32(a32[r], _mm256_madd_epi16(a16[r], ones));
        }
        int32_t d[COLI_ROWS_G];
        _mm_storeu_si128((__m128i *)d, coli_hsum4_i32_avx2(a32[0], a32[1], a32[2], a32[3]));
        COLI_UNROLL_G
        for (int r = 0; r < G; r++) {
            if (j < len) /* i + j is even */
                d[r] += coli_dot_i4i8_scalar(wp + (i + j) / 2, q[r] + i + j, len - j);
            acc[r] = coli_block_acc(acc[r], xs[r][b], d[r]);
        }
    }
    COLI_UNROLL_G
    for (int r = 0; r < G; r++)
        out[r] = acc[r];
}

COLI_AVX2 static inline void coli_rowsg_i4_avx2(const uint8_t *wp, const int8_t *const *q,
                                                const float *const *xs, int G, int n, int block, float *out)
{
    switch (G) {
    case 1: out[0] = coli_rowdot_i4_avx2(wp, q[0], xs[0], n, block); break;
    case 2: coli_rowsg_i4_avx2_k(wp, q, xs, 2, n, block, out); break;
    case 3: coli_rowsg_i4_avx2_k(wp, q, xs, 3, n, block, out); break;
    case 4: coli_rowsg_i4_avx2_k(wp, q, xs, 4, n, block, out); break;
    default: break;
    }
}
COLI_ROWS_WRAPPERS(i4, uint8_t, avx2, COLI_AVX2)

/* rowdot2 with the activations' per-block sums given (see coli_rowdot2s_i4_avx512); AVX2 ignores
 * them (same integers, same floats) */
COLI_AVX2 static inline float coli_rowdot2s_i4_avx2(const uint8_t *w, const int8_t *q1, const float *xs1,
                                                    const int32_t *s1, const int8_t *q2, const float *xs2,
                                                    const int32_t *s2, int n, int block)
{
    (void)s1; (void)s2;
    return coli_rowdot2_i4_avx2(w, q1, xs1, q2, xs2, n, block);
}

/* ------------------------------------- AVX-512 VNNI ------------------------------------- */

/* Signed weights v = u - 8 for all rows: 64 nibbles from 32 packed bytes (lanes past the masked
 * load are u = 0, v = -8; see coli_rowsg_i4_avx512_k for why they do not matter). */
COLI_AVX512 static inline __m512i coli_i4x64_v_avx512(__m256i packed)
{
    return _mm512_sub_epi8(coli_i4x64_unpack_avx512(packed), _mm512_set1_epi8(8));
}

/* G (1..4) rows. The single-row kernel makes the weight the unsigned vpdpbusd operand (u = v + 8)
 * and corrects by 8 * sum x, which costs a second vpdpbusd per row. Here the roles are swapped so
 * the correction depends on the weights only and is shared by all rows:
 *   sum v*x = sum v*(x + 128) - 128 * sum v,   x + 128 = x ^ 0x80 as an unsigned byte,
 * so per 64 elements: the nibbles are decoded once, sum v is one vpdpbusd against ones, and each
 * row costs one xor and one vpdpbusd. The int32 lanes may wrap for long blocks, but the
 * arithmetic is exact modulo 2^32 and the true block dot fits in int32, so the result is exact.
 * Masked tails: the lanes past the block end hold x = 0 and (padding or zeroed) weights, and
 * contribute 128*v - 128*v = 0. Fast path for block 64 as in coli_rowsg_i8_avx512_k, with the
 * correction as the accumulators' starting value. */
COLI_AVX512 static COLI_ALWAYS_INLINE void coli_rowsg_i4_avx512_k(const uint8_t *wp, const int8_t *const *q,
                                                                  const float *const *xs, const int G,
                                                                  int n, int block, float *out)
{
    const __m512i z = _mm512_setzero_si512(), one8 = _mm512_set1_epi8(1), bias = _mm512_set1_epi8((char)0x80);
    float acc[COLI_ROWS_G] = {0.0f, 0.0f, 0.0f, 0.0f};
    int i = 0, b = 0;
    block = coli_block_len(n, block);
    if (block == 64)
        for (; i + 256 <= n; i += 256, b += 4) {
            __m512i d[COLI_ROWS_G][4];
            COLI_UNROLL_G
            for (int k = 0; k < 4; k++) {
                __m512i v = coli_i4x64_v_avx512(_mm256_loadu_si256((const __m256i *)(wp + i / 2 + 32 * k)));
                __m512i corr = _mm512_sub_epi32(z, _mm512_slli_epi32(_mm512_dpbusd_epi32(z, one8, v), 7));
                COLI_UNROLL_G
                for (int r = 0; r < G; r++) {
                    __m512i x = _mm512_loadu_si512(q[r] + i + 64 * k);
                    d[r][k] = _mm512_dpbusd_epi32(corr, _mm512_xor_si512(x, bias), v);
                }
            }
            COLI_UNROLL_G
            for (int r = 0; r < G; r++)
                acc[r] = coli_block_acc4(acc[r], xs[r] + b,
                                         coli_hsum4_i32_avx512(d[r][0], d[r][1], d[r][2], d[r][3]));
        }
    for (; i < n; i += block, b++) {
        int len = n - i < block ? n - i : block, j = 0;
        __m512i a[COLI_ROWS_G], sv = z;
        COLI_UNROLL_G
        for (int r = 0; r < COLI_ROWS_G; r++)
            a[r] = z;
        for (; j + 64 <= len; j += 64) {
            __m512i v = coli_i4x64_v_avx512(_mm256_loadu_si256((const __m256i *)(wp + (i + j) / 2)));
            sv = _mm512_dpbusd_epi32(sv, one8, v);
            COLI_UNROLL_G
            for (int r = 0; r < G; r++)
                a[r] = _mm512_dpbusd_epi32(a[r], _mm512_xor_si512(_mm512_loadu_si512(q[r] + i + j), bias), v);
        }
        if (j < len) { /* ceil(rem/2) weight bytes, rem activations */
            int rem = len - j;
            __mmask32 mb = (__mmask32)((1ULL << ((rem + 1) / 2)) - 1);
            __mmask64 mx = ~0ULL >> (64 - rem);
            __m512i v = coli_i4x64_v_avx512(_mm256_maskz_loadu_epi8(mb, wp + (i + j) / 2));
            sv = _mm512_dpbusd_epi32(sv, one8, v);
            COLI_UNROLL_G
            for (int r = 0; r < G; r++)
                a[r] = _mm512_dpbusd_epi32(a[r], _mm512_xor_si512(_mm512_maskz_loadu_epi8(mx, q[r] + i + j), bias), v);
        }
        sv = _mm512_slli_epi32(sv, 7);
        COLI_UNROLL_G
        for (int r = 0; r < COLI_ROWS_G; r++)
            a[r] = r < G ? _mm512_sub_epi32(a[r], sv) : z;
        int32_t d[COLI_ROWS_G];
        _mm_storeu_si128((__m128i *)d, coli_hsum4_i32_avx512(a[0], a[1], a[2], a[3]));
        COLI_UNROLL_G
        for (int r = 0; r < G; r++)
            acc[r] = coli_block_acc(acc[r], xs[r][b], d[r]);
    }
    COLI_UNROLL_G
    for (int r = 0; r < G; r++)
        out[r] = acc[r];
}

COLI_AVX512 static inline void coli_rowsg_i4_avx512(const uint8_t *wp, const int8_t *const *q,
                                                    const float *const *xs, int G, int n, int block,
                                                    float *out)
{
    switch (G) {
    case 1: out[0] = coli_rowdot_i4_avx512(wp, q[0], xs[0], n, block); break;
    case 2: coli_rowsg_i4_avx512_k(wp, q, xs, 2, n, block, out); break;
    case 3: coli_rowsg_i4_avx512_k(wp, q, xs, 3, n, block, out); break;
    case 4: coli_rowsg_i4_avx512_k(wp, q, xs, 4, n, block, out); break;
    default: break;
    }
}
COLI_ROWS_WRAPPERS(i4, uint8_t, avx512, COLI_AVX512)

/* rowdot2 (two activation rows: q1 and its quantized residual q2) with each activation block's sum
 * s[b] = sum of q over block b given by the caller (computed once per activation row, when it is
 * quantized, instead of once per weight row): the stored nibble u = v + 8 is vpdpbusd's unsigned
 * operand as it is, sum v*x = sum u*x - 8 * s[b], so 64 weights cost one decode and one vpdpbusd
 * per activation row. The block integers are exact, so the floats (coli_block_acc in block order,
 * then o1 + o2) are bit-identical to coli_rowdot2_i4_avx512. Masked tails: lanes past the end hold
 * u = 0 and x = 0. */
COLI_AVX512 static inline float coli_rowdot2s_i4_avx512(const uint8_t *wp, const int8_t *q1, const float *xs1,
                                                        const int32_t *s1, const int8_t *q2, const float *xs2,
                                                        const int32_t *s2, int n, int block)
{
    float acc1 = 0.0f, acc2 = 0.0f;
    int i = 0, b = 0;
    block = coli_block_len(n, block);
    for (; i < n; i += block, b++) {
        int len = n - i < block ? n - i : block, j = 0;
        __m512i a1 = _mm512_setzero_si512(), a2 = _mm512_setzero_si512();
        for (; j + 64 <= len; j += 64) {
            __m512i u = coli_i4x64_unpack_avx512(_mm256_loadu_si256((const __m256i *)(wp + (i + j) / 2)));
            a1 = _mm512_dpbusd_epi32(a1, u, _mm512_loadu_si512(q1 + i + j));
            a2 = _mm512_dpbusd_epi32(a2, u, _mm512_loadu_si512(q2 + i + j));
        }
        if (j < len) {
            int rem = len - j;
            __mmask32 mb = (__mmask32)((1ULL << ((rem + 1) / 2)) - 1);
            __mmask64 mx = ~0ULL >> (64 - rem);
            __m512i u = coli_i4x64_unpack_avx512(_mm256_maskz_loadu_epi8(mb, wp + (i + j) / 2));
            a1 = _mm512_dpbusd_epi32(a1, u, _mm512_maskz_loadu_epi8(mx, q1 + i + j));
            a2 = _mm512_dpbusd_epi32(a2, u, _mm512_maskz_loadu_epi8(mx, q2 + i + j));
        }
        acc1 = coli_block_acc(acc1, xs1[b], _mm512_reduce_add_epi32(a1) - 8 * s1[b]);
        acc2 = coli_block_acc(acc2, xs2[b], _mm512_reduce_add_epi32(a2) - 8 * s2[b]);
    }
    return acc1 + acc2;
}
#endif /* COLI_X86 */

#endif /* COLI_DOT_I4_H */
