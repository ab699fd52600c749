/* The split form of a Q8 activation row: its inputs regrouped so that packed int4 weights meet
 * them without being unpacked. 64 packed bytes hold 128 weights, element 2k in the low nibble of
 * byte k and element 2k+1 in its high nibble (coli_dot_i4.h): (byte & 15) is a vector of the
 * block's even weights, (byte >> 4) & 15 one of its odd weights, and vpdpbusd multiplies them with
 * the block's even and odd activations as they come. Splitting the activations once per row of a
 * matmul costs what regrouping the weights' nibbles into planes at load time would save, without
 * touching the weights: every int4 row, resident or streamed, keeps the container's layout.
 *
 * Per 128-input block b, at xg + COLI_SPLIT_BYTES * b: the block's even inputs (64 bytes: byte k =
 * input 2k), its odd inputs (64 bytes), then -8 * the lane sums of the block (16 int32: lane l =
 * inputs 8l .. 8l+7; read by the group-scaled tile, coli_group.h); zeros past n. Made once per
 * activation row (coli_split_q8), read by every tile of the matmul. The AVX-512 and AVX2 int4
 * tiles read it; the scalar ones read the activations as they are (coli_split_q8_scalar returns 0
 * and writes nothing).
 */
#ifndef COLI_SPLIT_H
#define COLI_SPLIT_H

#include <string.h>
#include "coli_dot_i8.h"

#define COLI_SPLIT_BYTES 192

static inline long coli_split_len(int n) { return (long)((n + 127) / 128) * COLI_SPLIT_BYTES; }

static inline void coli_split_q8_ref(const int8_t *q, int n, uint8_t *xg)
{
    for (int b = 0, i0 = 0; i0 < n; b++, i0 += 128) {
        int8_t *xe = (int8_t *)(xg + (long)b * COLI_SPLIT_BYTES), *xo = xe + 64;
        int32_t nc[16] = {0};
        for (int k = 0; k < 64; k++) {
            xe[k] = i0 + 2 * k < n ? q[i0 + 2 * k] : 0;
            xo[k] = i0 + 2 * k + 1 < n ? q[i0 + 2 * k + 1] : 0;
            nc[k >> 2] -= 8 * (xe[k] + xo[k]);
        }
        for (int l = 0; l < 16; l++) /* as bytes: little-endian int32 */
            for (int k = 0; k < 4; k++)
                xg[(long)b * COLI_SPLIT_BYTES + 128 + 4 * l + k] = (uint8_t)((uint32_t)nc[l] >> (8 * k));
    }
}

/* scalar tiles read the activations as they are: no split (returns 0) */
static inline int coli_split_q8_scalar(const int8_t *q, int n, uint8_t *xg)
{
    (void)q; (void)n; (void)xg;
    return 0;
}

#if COLI_X86
/* The split form on AVX2 (the int4 tile of coli_rows4.h reads its even and odd inputs; the lane
 * sums are written too, so the layout is the one every ISA shares): per 16-byte lane, vpshufb
 * gathers the evens into the low and the odds into the high 8 bytes; the 64-bit quarters of the
 * two 32-byte halves of 128 inputs are then collected in order. Returns 1. */
COLI_AVX2 static inline int coli_split_q8_avx2(const int8_t *q, int n, uint8_t *xg)
{
    if (q == NULL)
        return 1; /* coli_split_active asks */
    const __m256i sh = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
                                        0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    const __m256i one8 = _mm256_set1_epi8(1), one16 = _mm256_set1_epi16(1);
    for (int i = 0; i < n; i += 128, xg += COLI_SPLIT_BYTES) {
        int8_t buf[128];
        const int8_t *x = q + i;
        if (n - i < 128) {
            memset(buf, 0, sizeof buf);
            memcpy(buf, x, (size_t)(n - i));
            x = buf;
        }
        __m256i v[4]; /* 32 inputs each: their 16 evens in the low half, their 16 odds in the high */
        for (int k = 0; k < 4; k++) {
            /* vpshufb: evens in quarters 0 and 2, odds in 1 and 3; then quarters 0 2 1 3 */
            v[k] = _mm256_permute4x64_epi64(
                _mm256_shuffle_epi8(_mm256_loadu_si256((const __m256i *)(x + 32 * k)), sh), 0xD8);
        }
        /* evens of inputs 0..127: the low halves of v[0..3] in order; odds: the high halves */
        __m256i xe0 = _mm256_permute2x128_si256(v[0], v[1], 0x20), xe1 = _mm256_permute2x128_si256(v[2], v[3], 0x20);
        __m256i xo0 = _mm256_permute2x128_si256(v[0], v[1], 0x31), xo1 = _mm256_permute2x128_si256(v[2], v[3], 0x31);
        _mm256_storeu_si256((__m256i *)xg, xe0);
        _mm256_storeu_si256((__m256i *)(xg + 32), xe1);
        _mm256_storeu_si256((__m256i *)(xg + 64), xo0);
        _mm256_storeu_si256((__m256i *)(xg + 96), xo1);
        /* lane l (inputs 8l .. 8l+7) = evens 4l..4l+3 + odds 4l..4l+3: int32 sums of 4 bytes each */
        for (int h = 0; h < 2; h++) {
            __m256i se = _mm256_madd_epi16(_mm256_maddubs_epi16(one8, h ? xe1 : xe0), one16);
            __m256i so = _mm256_madd_epi16(_mm256_maddubs_epi16(one8, h ? xo1 : xo0), one16);
            __m256i lanes = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(_mm256_add_epi32(se, so), 3));
            _mm256_storeu_si256((__m256i *)(xg + 128 + 32 * h), lanes);
        }
    }
    return 1;
}

/* int4, lanes of 8 inputs: 128 activations from x (rem < 128: zeros past rem) split into their
 * even inputs *xe and their odd inputs *xo (byte k = input 2k resp. 2k + 1): vpshufb gathers each
 * 16-byte lane's evens into its low and odds into its high 8 bytes, vpermt2q collects them. */
COLI_AVX512 static COLI_ALWAYS_INLINE void coli_x128_split_avx512(const int8_t *x, int rem, __m512i *xe, __m512i *xo)
{
    static const int8_t evens_odds[64] = {0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
                                          0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
                                          0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
                                          0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15};
    __m512i a, b;
    if (rem >= 128) {
        a = _mm512_loadu_si512(x);
        b = _mm512_loadu_si512(x + 64);
    } else {
        a = rem >= 64 ? _mm512_loadu_si512(x) : _mm512_maskz_loadu_epi8(~0ULL >> (64 - rem), x);
        b = rem > 64 ? _mm512_maskz_loadu_epi8(~0ULL >> (128 - rem), x + 64) : _mm512_setzero_si512();
    }
    const __m512i sh = _mm512_loadu_si512(evens_odds);
    a = _mm512_shuffle_epi8(a, sh);
    b = _mm512_shuffle_epi8(b, sh);
    *xe = _mm512_permutex2var_epi64(a, _mm512_set_epi64(14, 12, 10, 8, 6, 4, 2, 0), b);
    *xo = _mm512_permutex2var_epi64(a, _mm512_set_epi64(15, 13, 11, 9, 7, 5, 3, 1), b);
}

/* the split form (COLI_SPLIT_BYTES) of a Q8 row for the tiles below; returns 1 */
COLI_AVX512 static inline int coli_split_q8_avx512(const int8_t *q, int n, uint8_t *xg)
{
    const __m512i one8 = _mm512_set1_epi8(1), z = _mm512_setzero_si512();
    for (int i = 0; i < n; i += 128, xg += COLI_SPLIT_BYTES) {
        __m512i xe, xo;
        coli_x128_split_avx512(q + i, n - i, &xe, &xo);
        _mm512_storeu_si512(xg, xe);
        _mm512_storeu_si512(xg + 64, xo);
        _mm512_storeu_si512(xg + 128, _mm512_sub_epi32(z, _mm512_slli_epi32(
            _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(z, one8, xe), one8, xo), 3)));
    }
    return 1;
}

#endif /* COLI_X86 */

#endif /* COLI_SPLIT_H */
