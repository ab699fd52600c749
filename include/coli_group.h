/* Group-scaled weight rows x Q8 activations (colibrì's group-scaled int4 container, and int8).
 *
 * A weight row w of n elements (int8, or packed int4 as in coli_dot_i4.h) carries one f32 scale
 * per group of gs consecutive inputs: ws[g] for inputs g*gs .. (g+1)*gs - 1, the last group
 * partial when gs does not divide n. gs is a positive multiple of 64 (so every group starts on a
 * byte of a packed int4 row and on a 64-element chunk). The activations are Q8 with one scale per
 * activation block (xs[b], blocks of coli_block_len(n, block), the last partial).
 *
 * (x) below is a float product rounded on its own, (+) a float add, fma(a, b, c) one correctly
 * rounded fused multiply-add (the scalar code calls fmaf, the SIMD code the fma instructions: the
 * same result).
 *
 * One activation block (the engine's default): the LANE FORM. The inputs of the row sit in 16
 * lanes; lane(i) = (i mod 64) / 4 for int8 (4 consecutive inputs per lane of each 64-input
 * chunk: the int32 lanes of vpdpbusd on 64 bytes, of two AVX2 madd vectors) and lane(i) =
 * (i mod 128) / 8 for int4 (8 consecutive inputs per lane of each 128-input block: 64 packed bytes
 * hold 128 weights, their low nibbles meet the block's even activations and their high nibbles
 * its odd ones in the same int32 lane).
 *   D[g][l] = the exact integer dot of the inputs i of group g with lane(i) = l
 *   A[l]    = fma(ws[g], (float)D[g][l], A[l]) over the groups g = 0, 1, ... in order, A = 0 first
 *   out     = xs[0] (x) R16(A)
 * R16: t8[l] = A[l] + A[l+8], t4[l] = t8[l] + t8[l+4], R = (t4[0] + t4[2]) + (t4[1] + t4[3]).
 * A lane a group does not reach (D = 0) is unchanged by its fma (A starts at +0 and never becomes
 * -0, the scales are finite), so code paths may skip those lanes; lanes past the row's end hold
 * D = 0. Each group's scale meets the group's exact integer dot, lane by lane, before any float
 * rounding of the dot itself.
 *
 * Several activation blocks: the SEGMENT FORM (slower; blocks of any multiple of 64):
 *   out = xs[0] (x) in_0  (+)  xs[1] (x) in_1 (+) ...      over the activation blocks b, in order
 *   in_b = ws[g0] (x) (float)dot_0 (+) ws[g1] (x) (float)dot_1 ...  over block b's pieces cut at
 *        the group boundaries, from 0 (coli_block_acc): a block made of whole groups is
 *        coli_rowdot_<kind>(w, q, ws, len, gs) over them.
 *
 * Entry points (per ISA, all bit-identical to the scalar one):
 *   coli_rowdotg_<kind>_<isa>(w, ws, gs, q, xs, n, block)             one weight row, one activation row
 *   coli_rowdotg_<kind>_rows_<isa>(w, ws, gs, q, qstride, xs, sstride, R, n, block, out)
 *       out[r] = coli_rowdotg_<kind>(w, ws, gs, q + r*qstride, xs + r*sstride, n, block), r < R
 *   coli_rowdotg_<kind>_tile_<isa>(w, rb, nw, ws, wstride, gs, q, qstride, xg, gstride, xs, sstride,
 *                                  P, n, out)
 *       lane form (one activation block) for nw (1..4) weight rows (w + r*rb, scales ws + r*wstride)
 *       and P activation rows (q + p*qstride, scale xs[p*sstride]):
 *       out[p*nw + r] = coli_rowdotg_<kind>(w + r*rb, ws + r*wstride, gs, q + p*qstride,
 *                                           xs + p*sstride, n, n)
 *       in one pass over the weights per pair of activation rows (AVX-512 VNNI decodes the
 *       weights once for both and loads the activations once for the four rows). xg (int4, may
 *       be NULL): the activation rows' split forms (coli_split_q8_<isa>, row p at xg + p*gstride),
 *       which AVX-512 reads instead of splitting each 128 activations in every tile.
 *   coli_split_q8_<isa>(q, n, xg): writes the split form and returns 1 where the tile reads it
 *       (AVX-512), else writes nothing and returns 0.
 *
 * Integer ranges: a lane sums at most gs/8 products (|v*x| <= 8*127 for int4, 128*127 for int8),
 * so the lane integers are exact for gs up to 2^20; the AVX-512 code biases the weights (u = v + 8
 * or w + 128, unsigned for vpdpbusd) and subtracts bias * (lane sum of x), exact modulo 2^32.
 */
#ifndef COLI_GROUP_H
#define COLI_GROUP_H

#include <math.h>
#include "coli_dot_i8.h"
#include "coli_dot_i4.h"
#include "coli_axpy.h"  /* coli_mul_pinned */
#include "coli_rows4.h" /* coli_x4_weights_avx512 */
#include "coli_dot_f32.h"

#define COLI_GROUP_OFF_i8(j) (j)
#define COLI_GROUP_OFF_i4(j) ((j) / 2)
#define COLI_LANE_i8(i) (((i) & 63) >> 2)
#define COLI_LANE_i4(i) (((i) & 127) >> 3)

/* R16 of 16 lane floats (the lane form's final sum) */
static inline float coli_lanes_sum16(const float *a)
{
    float t8[8], t4[4];
    for (int l = 0; l < 8; l++)
        t8[l] = a[l] + a[l + 8];
    for (int l = 0; l < 4; l++)
        t4[l] = t8[l] + t8[l + 4];
    return (t4[0] + t4[2]) + (t4[1] + t4[3]);
}

/* ================================ scalar (the definition) ================================ */

static inline int coli_wval_i8(const int8_t *w, int i) { return w[i]; }
static inline int coli_wval_i4(const uint8_t *w, int i) { return ((i & 1) ? (w[i >> 1] >> 4) : (w[i >> 1] & 15)) - 8; }

#define COLI_GROUP_LANES_SCALAR(kind, WT)                                                          \
    /* R16(A) of the lane form for one weight row and one activation row (without xs) */          \
    static inline float coli_lanes_##kind##_scalar(const WT *w, const float *ws, int gs,            \
                                                   const int8_t *q, int n)                         \
    {                                                                                              \
        float a[16] = {0.0f};                                                                      \
        for (int g = 0, i0 = 0; i0 < n; g++, i0 += gs) {                                           \
            int32_t d[16] = {0};                                                                   \
            int end = n - i0 < gs ? n : i0 + gs;                                                   \
            for (int i = i0; i < end; i++)                                                         \
                d[COLI_LANE_##kind(i)] += coli_wval_##kind(w, i) * (int32_t)q[i];                  \
            for (int l = 0; l < 16; l++)                                                           \
                a[l] = fmaf(ws[g], (float)d[l], a[l]);                                             \
        }                                                                                          \
        return coli_lanes_sum16(a);                                                                \
    }                                                                                              \
    static inline void coli_rowdotg_##kind##_tile_scalar(const WT *w, long rb, int nw, const float *ws, \
                                                         long wstride, int gs, const int8_t *q,    \
                                                         long qstride, const uint8_t *xg, long gstride, \
                                                         const float *xs, long sstride, int P, int n, \
                                                         float *out)                               \
    {                                                                                              \
        (void)xg; (void)gstride;                                                                   \
        for (int p = 0; p < P; p++)                                                                \
            for (int r = 0; r < nw; r++)                                                           \
                out[p * nw + r] = coli_mul_pinned(xs[(long)p * sstride],                           \
                                                  coli_lanes_##kind##_scalar(w + r * rb, ws + r * wstride, \
                                                                             gs, q + p * qstride, n)); \
    }
COLI_GROUP_LANES_SCALAR(i8, int8_t)
COLI_GROUP_LANES_SCALAR(i4, uint8_t)

#if COLI_X86
/* ========================================= AVX2 ========================================= */

/* R16 of the 16 lanes held as two 8-lane halves (lanes 0..7 = inputs 0..31 of a chunk) */
COLI_AVX2 static inline float coli_lanes_sum16_avx2(__m256 lo, __m256 hi)
{
    __m256 t8 = _mm256_add_ps(lo, hi);
    __m128 t4 = _mm_add_ps(_mm256_castps256_ps128(t8), _mm256_extractf128_ps(t8, 1));
    __m128 t2 = _mm_add_ps(t4, _mm_movehl_ps(t4, t4)); /* t4[0]+t4[2], t4[1]+t4[3] */
    return _mm_cvtss_f32(_mm_add_ss(t2, _mm_shuffle_ps(t2, t2, 1)));
}

/* 32 weights as the operands of the sign trick (coli_i8x32_dot_avx2): *aw = |v|, *sw = v (its
 * sign is moved onto x). int4: v = u - 8 from the unpacked nibbles; int8: the bytes. */
COLI_AVX2 static inline void coli_w32_i4_avx2(const uint8_t *w, int j, __m256i *aw, __m256i *sw)
{
    *sw = _mm256_sub_epi8(coli_i4x32_unpack_avx2(w + j / 2), _mm256_set1_epi8(8));
    *aw = _mm256_abs_epi8(*sw);
}

COLI_AVX2 static inline void coli_w32_i8_avx2(const int8_t *w, int j, __m256i *aw, __m256i *sw)
{
    *sw = _mm256_loadu_si256((const __m256i *)(w + j));
    *aw = _mm256_abs_epi8(*sw);
}

/* the exact lane integers (8 lanes of 4 inputs) of 32 weights given as (aw, sw) against x: the pair
 * sums |w|*(+-x) are <= 2*128*127 = 32512, no saturation */
COLI_AVX2 static inline __m256i coli_lanes32_avx2(__m256i aw, __m256i sw, const int8_t *x)
{
    __m256i xs = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)x), sw);
    return _mm256_madd_epi16(_mm256_maddubs_epi16(aw, xs), _mm256_set1_epi16(1));
}

/* One weight row, P (1 or 2) activation rows: R16(A) per activation row. Whole 32-input halves
 * of a chunk in SIMD (lanes 0..7 for inputs 0..31 of the chunk, 8..15 for 32..63), the weights
 * decoded once for both activation rows. The full groups first, then the row's last group, whose
 * last inputs (< 32, the end of its last chunk) go one by one into their lanes. */
#define COLI_GROUP_LANES_AVX2(kind, WT)                                                             \
    COLI_AVX2 static COLI_ALWAYS_INLINE void coli_chunk_##kind##_avx2(const WT *w, const int8_t *const *q, int j, \
                                                                      const int P, __m256i *dlo, __m256i *dhi) \
    {                                                                                              \
        __m256i aw, sw;                                                                            \
        coli_w32_##kind##_avx2(w, j, &aw, &sw);                                                    \
        COLI_UNROLL_G                                                                              \
        for (int p = 0; p < P; p++)                                                                \
            dlo[p] = _mm256_add_epi32(dlo[p], coli_lanes32_avx2(aw, sw, q[p] + j));                 \
        coli_w32_##kind##_avx2(w, j + 32, &aw, &sw);                                               \
        COLI_UNROLL_G                                                                              \
        for (int p = 0; p < P; p++)                                                                \
            dhi[p] = _mm256_add_epi32(dhi[p], coli_lanes32_avx2(aw, sw, q[p] + j + 32));            \
    }                                                                                              \
    COLI_AVX2 static COLI_ALWAYS_INLINE void coli_lanes_##kind##_avx2_k(const WT *w, const float *ws, int gs, \
                                                                        const int8_t *const *q, const int P, \
                                                                        int n, float *res)         \
    {                                                                                              \
        __m256 alo[2], ahi[2];                                                                     \
        __m256i dlo[2], dhi[2];                                                                    \
        int g = 0, i0 = 0;                                                                         \
        COLI_UNROLL_G                                                                              \
        for (int p = 0; p < P; p++)                                                                \
            alo[p] = ahi[p] = _mm256_setzero_ps();                                                 \
        for (; i0 + gs <= n; i0 += gs, g++) { /* full groups */                                   \
            COLI_UNROLL_G                                                                          \
            for (int p = 0; p < P; p++)                                                            \
                dlo[p] = dhi[p] = _mm256_setzero_si256();                                          \
            for (int j = i0; j < i0 + gs; j += 64)                                                 \
                coli_chunk_##kind##_avx2(w, q, j, P, dlo, dhi);                                    \
            __m256 s = _mm256_set1_ps(ws[g]);                                                      \
            COLI_UNROLL_G                                                                          \
            for (int p = 0; p < P; p++) {                                                          \
                alo[p] = _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(dlo[p]), alo[p]);                   \
                ahi[p] = _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(dhi[p]), ahi[p]);                   \
            }                                                                                      \
        }                                                                                          \
        if (i0 < n) { /* the last group, partial */                                               \
            int j = i0, tail;                                                                      \
            __m256i aw, sw;                                                                        \
            for (int p = 0; p < P; p++)                                                            \
                dlo[p] = dhi[p] = _mm256_setzero_si256();                                          \
            for (; j + 64 <= n; j += 64)                                                           \
                coli_chunk_##kind##_avx2(w, q, j, P, dlo, dhi);                                    \
            tail = j;                                                                              \
            if (j + 32 <= n) {                                                                     \
                coli_w32_##kind##_avx2(w, j, &aw, &sw);                                            \
                for (int p = 0; p < P; p++)                                                        \
                    dlo[p] = _mm256_add_epi32(dlo[p], coli_lanes32_avx2(aw, sw, q[p] + j));         \
                tail = j + 32;                                                                     \
            }                                                                                      \
            __m256 s = _mm256_set1_ps(ws[g]);                                                      \
            for (int p = 0; p < P; p++) {                                                          \
                int32_t d[16];                                                                     \
                _mm256_storeu_si256((__m256i *)d, dlo[p]);                                         \
                _mm256_storeu_si256((__m256i *)(d + 8), dhi[p]);                                   \
                for (int i = tail; i < n; i++)                                                     \
                    d[COLI_LANE_##kind(i)] += coli_wval_##kind(w, i) * (int32_t)q[p][i];           \
                alo[p] = _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i *)d)), alo[p]); \
                ahi[p] = _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(_mm256_loadu_si256((const __m256i *)(d + 8))), \
                                         ahi[p]);                                                  \
            }                                                                                      \
        }                                                                                          \
        for (int p = 0; p < P; p++)                                                                \
            res[p] = coli_lanes_sum16_avx2(alo[p], ahi[p]);                                        \
    }                                                                                              \
    COLI_AVX2 static inline void coli_rowdotg_##kind##_tile_avx2(const WT *w, long rb, int nw, const float *ws, \
                                                                 long wstride, int gs, const int8_t *q, \
                                                                 long qstride, const uint8_t *xg, long gstride, \
                                                                 const float *xs, long sstride, int P, int n, \
                                                                 float *out)                       \
    {                                                                                              \
        (void)xg; (void)gstride;                                                                   \
        for (int r = 0; r < nw; r++)                                                               \
            for (int p = 0; p < P; p += 2) {                                                       \
                const int8_t *qp[2] = {q + p * qstride, q + (p + 1 < P ? p + 1 : p) * qstride};    \
                float res[2];                                                                      \
                if (p + 1 < P)                                                                     \
                    coli_lanes_##kind##_avx2_k(w + r * rb, ws + r * wstride, gs, qp, 2, n, res);   \
                else                                                                               \
                    coli_lanes_##kind##_avx2_k(w + r * rb, ws + r * wstride, gs, qp, 1, n, res);   \
                for (int k = 0; k < 2 && p + k < P; k++)                                           \
                    out[(p + k) * nw + r] = coli_mul_pinned(xs[(long)(p + k) * sstride], res[k]);  \
            }                                                                                      \
    }
COLI_GROUP_LANES_AVX2(i8, int8_t)

/* int4: lanes of 8 inputs. d[p] += the 8 lanes of the 64-input chunk at j (one half of a 128-input
 * block) for P activation rows, its weights decoded once for all: the two 32-input halves give 8
 * lanes of 4 each (a, b), hadd pairs them into lanes of 8 in the order [a01 a23 b01 b23 | a45 a67
 * b45 b67] = lanes [0 1 4 5 | 2 3 6 7]: d is kept in that order (sums commute with it) and put in
 * input order by vpermq 0xD8 (which swaps qwords 1 and 2, its own inverse) before the fma. */
COLI_AVX2 static COLI_ALWAYS_INLINE void coli_l8_chunk_avx2(const uint8_t *w, const int8_t *const *q, int j,
                                                            const int P, __m256i *d)
{
    __m256i aw0, sw0, aw1, sw1;
    coli_w32_i4_avx2(w, j, &aw0, &sw0);
    coli_w32_i4_avx2(w, j + 32, &aw1, &sw1);
    COLI_UNROLL_G
    for (int p = 0; p < P; p++)
        d[p] = _mm256_add_epi32(d[p], _mm256_hadd_epi32(coli_lanes32_avx2(aw0, sw0, q[p] + j),
                                                        coli_lanes32_avx2(aw1, sw1, q[p] + j + 32)));
}

/* inputs [j, e) of one chunk (the row's last, e - j < 64) one by one into d (hadd order) */
COLI_AVX2 static inline void coli_l8_part_avx2(const uint8_t *w, const int8_t *const *q, int j, int e, int P,
                                               __m256i *d)
{
    for (int p = 0; p < P; p++) {
        int32_t t[8] = {0};
        for (int i = j; i < e; i++)
            t[(i & 63) >> 3] += coli_wval_i4(w, i) * (int32_t)q[p][i];
        d[p] = _mm256_add_epi32(d[p], _mm256_permute4x64_epi64(_mm256_loadu_si256((const __m256i *)t), 0xD8));
    }
}

/* inputs [j, e) of a 64-input chunk (whole, or the row's last) into d */
COLI_AVX2 static COLI_ALWAYS_INLINE void coli_l8_span_avx2(const uint8_t *w, const int8_t *const *q, int j, int e,
                                                           const int P, __m256i *d)
{
    if (e - j == 64)
        coli_l8_chunk_avx2(w, q, j, P, d);
    else if (e > j)
        coli_l8_part_avx2(w, q, j, e, P, d);
}

/* a += ws * d lane-wise, d from hadd order to input order */
COLI_AVX2 static COLI_ALWAYS_INLINE void coli_l8_fma_avx2(float ws, const __m256i *d, const int P, __m256 *a)
{
    __m256 s = _mm256_set1_ps(ws);
    COLI_UNROLL_G
    for (int p = 0; p < P; p++)
        a[p] = _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(_mm256_permute4x64_epi64(d[p], 0xD8)), a[p]);
}

/* One int4 weight row, P (1 or 2) activation rows: R16(A) per activation row. Per 128-input block
 * the low chunk feeds lanes 0..7 (alo), the high chunk lanes 8..15 (ahi). gs = 64: each chunk is a
 * group, fma'd at once; gs >= 128: a group is whole blocks, summed before its two fmas. */
COLI_AVX2 static COLI_ALWAYS_INLINE void coli_lanes_i4_avx2_k(const uint8_t *w, const float *ws, int gs,
                                                              const int8_t *const *q, const int P, int n,
                                                              float *res)
{
    __m256 alo[2], ahi[2];
    __m256i dlo[2], dhi[2];
    for (int p = 0; p < P; p++)
        alo[p] = ahi[p] = _mm256_setzero_ps();
    if (gs == 64) {
        int i = 0, g = 0;
        for (; i + 128 <= n; i += 128, g += 2) {
            COLI_UNROLL_G
            for (int p = 0; p < P; p++)
                dlo[p] = dhi[p] = _mm256_setzero_si256();
            coli_l8_chunk_avx2(w, q, i, P, dlo);
            coli_l8_fma_avx2(ws[g], dlo, P, alo);
            coli_l8_chunk_avx2(w, q, i + 64, P, dhi);
            coli_l8_fma_avx2(ws[g + 1], dhi, P, ahi);
        }
        if (i < n) { /* the row's last block: one or two (partial) groups */
            for (int p = 0; p < P; p++)
                dlo[p] = dhi[p] = _mm256_setzero_si256();
            coli_l8_span_avx2(w, q, i, i + 64 < n ? i + 64 : n, P, dlo);
            coli_l8_fma_avx2(ws[g], dlo, P, alo);
            if (i + 64 < n) {
                coli_l8_span_avx2(w, q, i + 64, n, P, dhi);
                coli_l8_fma_avx2(ws[g + 1], dhi, P, ahi);
            }
        }
    } else {
        for (int g = 0, i0 = 0; i0 < n; g++, i0 += gs) {
            int end = n - i0 < gs ? n : i0 + gs, i = i0;
            for (int p = 0; p < P; p++)
                dlo[p] = dhi[p] = _mm256_setzero_si256();
            for (; i + 128 <= end; i += 128) {
                coli_l8_chunk_avx2(w, q, i, P, dlo);
                coli_l8_chunk_avx2(w, q, i + 64, P, dhi);
            }
            if (i < end) {
                coli_l8_span_avx2(w, q, i, i + 64 < end ? i + 64 : end, P, dlo);
                coli_l8_span_avx2(w, q, i + 64, end, P, dhi);
            }
            coli_l8_fma_avx2(ws[g], dlo, P, alo);
            coli_l8_fma_avx2(ws[g], dhi, P, ahi);
        }
    }
    for (int p = 0; p < P; p++)
        res[p] = coli_lanes_sum16_avx2(alo[p], ahi[p]);
}

COLI_AVX2 static inline void coli_rowdotg_i4_tile_avx2(const uint8_t *w, long rb, int nw, const float *ws,
                                                       long wstride, int gs, const int8_t *q, long qstride,
                                                       const uint8_t *xg, long gstride, const float *xs,
                                                       long sstride, int P, int n, float *out)
{
    (void)xg; (void)gstride;
    for (int r = 0; r < nw; r++)
        for (int p = 0; p < P; p += 2) {
            const int8_t *qp[2] = {q + p * qstride, q + (p + 1 < P ? p + 1 : p) * qstride};
            float res[2];
            if (p + 1 < P)
                coli_lanes_i4_avx2_k(w + r * rb, ws + r * wstride, gs, qp, 2, n, res);
            else
                coli_lanes_i4_avx2_k(w + r * rb, ws + r * wstride, gs, qp, 1, n, res);
            for (int k = 0; k < 2 && p + k < P; k++)
                out[(p + k) * nw + r] = coli_mul_pinned(xs[(long)(p + k) * sstride], res[k]);
        }
}

/* ==================================== AVX-512 VNNI ==================================== */

COLI_AVX512 static inline float coli_lanes_sum16_avx512(__m512 a)
{
    __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)); /* AVX-512F only */
    __m256 t8 = _mm256_add_ps(_mm512_castps512_ps256(a), hi);
    __m128 t4 = _mm_add_ps(_mm256_castps256_ps128(t8), _mm256_extractf128_ps(t8, 1));
    __m128 t2 = _mm_add_ps(t4, _mm_movehl_ps(t4, t4));
    return _mm_cvtss_f32(_mm_add_ss(t2, _mm_shuffle_ps(t2, t2, 1)));
}

/* R16 of four accumulators at once, the same adds as coli_lanes_sum16_avx512 on each: with Qk the
 * k-th 128-bit quarter, t8 = [Q0+Q2 | Q1+Q3], t4 = (Q0+Q2) + (Q1+Q3), then within the quarter
 * (t4[0]+t4[2]) + (t4[1]+t4[3]); vshuff32x4 gathers the four accumulators' quarters so that each
 * step is one add for all four. res[0..3] = R16(a), R16(b), R16(c), R16(d). */
COLI_AVX512 static inline void coli_lanes_sum16x4_avx512(__m512 a, __m512 b, __m512 c, __m512 d, float *res)
{
    __m512 ab = _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x44), _mm512_shuffle_f32x4(a, b, 0xEE));
    __m512 cd = _mm512_add_ps(_mm512_shuffle_f32x4(c, d, 0x44), _mm512_shuffle_f32x4(c, d, 0xEE));
    /* ab = [a:Q0+Q2, a:Q1+Q3, b:Q0+Q2, b:Q1+Q3], cd alike */
    __m512 t4 = _mm512_add_ps(_mm512_shuffle_f32x4(ab, cd, 0x88), _mm512_shuffle_f32x4(ab, cd, 0xDD));
    /* t4 = [t4(a) | t4(b) | t4(c) | t4(d)] */
    __m512 t2 = _mm512_add_ps(t4, _mm512_permute_ps(t4, 0x4E));   /* lanes 0, 1: t4[0]+t4[2], t4[1]+t4[3] */
    __m512 r = _mm512_add_ps(t2, _mm512_permute_ps(t2, 0xB1));    /* lane 0: t2[0] + t2[1] */
    _mm_storeu_ps(res, _mm512_castps512_ps128(_mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0,
                                                                                       0, 0, 0, 0, 0, 0), r)));
}

/* res[4p + r] = R16(a[p][r]) for the P x NW accumulators of a tile (four at a time when NW = 4) */
COLI_AVX512 static COLI_ALWAYS_INLINE void coli_tile_sums_avx512(__m512 a[2][4], int P, int NW, float *res)
{
    for (int p = 0; p < P; p++) {
        if (NW == 4) {
            coli_lanes_sum16x4_avx512(a[p][0], a[p][1], a[p][2], a[p][3], res + p * 4);
            continue;
        }
        COLI_UNROLL_G
        for (int r = 0; r < NW; r++)
            res[p * 4 + r] = coli_lanes_sum16_avx512(a[p][r]);
    }
}

/* 64 activations from element j on (rem < 64: masked, zeros past them) */
COLI_AVX512 static inline __m512i coli_x64_avx512(const int8_t *q, int j, int rem)
{
    return rem >= 64 ? _mm512_loadu_si512(q + j) : _mm512_maskz_loadu_epi8(~0ULL >> (64 - rem), q + j);
}

/* int8, lanes of 4 inputs. One 64-input chunk (from element j, rem <= 64 inputs: rem < 64 only
 * for the row's last chunk) of NW weight rows x P activation rows: d[p][r] += the lane dots of
 * u = w + 128 (the unsigned operand, coli_x4_weights_avx512, once per weight row for all P
 * activation rows) and x (loaded once for all NW weight rows). The bias correction: the group's
 * first chunk starts d at -128 * (lane sums of x); later chunks of a group (gs > 64) add their x
 * lane sums into c, subtracted at the group's end. */
COLI_AVX512 static COLI_ALWAYS_INLINE void coli_tile_chunk_avx512(const uint8_t *w, long rb, const int8_t *q,
                                                                  long qstride, int j, const int rem, const int NW,
                                                                  const int P, const int first,
                                                                  __m512i (*d)[4], __m512i *c)
{
    const __m512i one8 = _mm512_set1_epi8(1), z = _mm512_setzero_si512();
    __m512i x[2];
    COLI_UNROLL_G
    for (int p = 0; p < P; p++) {
        x[p] = coli_x64_avx512(q + p * qstride, j, rem);
        if (first) {
            __m512i nc = _mm512_sub_epi32(z, _mm512_slli_epi32(_mm512_dpbusd_epi32(z, one8, x[p]), 7));
            COLI_UNROLL_G
            for (int r = 0; r < NW; r++)
                d[p][r] = nc;
        } else {
            c[p] = _mm512_dpbusd_epi32(c[p], one8, x[p]);
        }
    }
    COLI_UNROLL_G
    for (int r = 0; r < NW; r++) {
        __m512i u = coli_x4_weights_avx512(w + r * rb, j, rem, 0);
        COLI_UNROLL_G
        for (int p = 0; p < P; p++)
            d[p][r] = _mm512_dpbusd_epi32(d[p][r], u, x[p]);
    }
}

/* int8: NW (1..4) weight rows x P (1..2) activation rows, the lane form with lanes of 4 inputs:
 * per group its chunks (coli_tile_chunk_avx512), then A = fma(ws, cvt(D), A) lane-wise;
 * res[p*4 + r] = R16(A). */
COLI_AVX512 static COLI_ALWAYS_INLINE void coli_lanes_tile_k_avx512(const uint8_t *w, long rb, const float *ws,
                                                                    long wstride, int gs, const int8_t *q,
                                                                    long qstride, int n, const int NW,
                                                                    const int P, float *res)
{
    __m512 a[2][4];
    for (int p = 0; p < P; p++)
        COLI_UNROLL_G
        for (int r = 0; r < NW; r++)
            a[p][r] = _mm512_setzero_ps();
    for (int g = 0, i0 = 0; i0 < n; g++, i0 += gs) {
        int end = n - i0 < gs ? n : i0 + gs;
        __m512i d[2][4], c[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
        if (end - i0 == 64) { /* a group of one full chunk (gs = 64: every group but maybe the last) */
            coli_tile_chunk_avx512(w, rb, q, qstride, i0, 64, NW, P, 1, d, c);
        } else {
            if (i0 + 64 <= end)
                coli_tile_chunk_avx512(w, rb, q, qstride, i0, 64, NW, P, 1, d, c);
            else
                coli_tile_chunk_avx512(w, rb, q, qstride, i0, end - i0, NW, P, 1, d, c);
            int j = i0 + 64;
            for (; j + 64 <= end; j += 64)
                coli_tile_chunk_avx512(w, rb, q, qstride, j, 64, NW, P, 0, d, c);
            if (j < end)
                coli_tile_chunk_avx512(w, rb, q, qstride, j, end - j, NW, P, 0, d, c);
            COLI_UNROLL_G
            for (int p = 0; p < P; p++) {
                __m512i cs = _mm512_slli_epi32(c[p], 7);
                COLI_UNROLL_G
                for (int r = 0; r < NW; r++)
                    d[p][r] = _mm512_sub_epi32(d[p][r], cs);
            }
        }
        COLI_UNROLL_G
        for (int r = 0; r < NW; r++) {
            __m512 sc = _mm512_set1_ps(ws[r * wstride + g]);
            COLI_UNROLL_G
            for (int p = 0; p < P; p++)
                a[p][r] = _mm512_fmadd_ps(sc, _mm512_cvtepi32_ps(d[p][r]), a[p][r]);
        }
    }
    coli_tile_sums_avx512(a, P, NW, res);
}

/* one 128-input block of NW int4 weight rows (row r's block at w + r*rb, 64 packed bytes; rem < 128:
 * ceil(rem/2) bytes) against P split activation rows: d[p][r] (+)= low nibbles . even inputs +
 * high nibbles . odd inputs (the stored u = v + 8), corrected by nc = -8 * the lane sums of the
 * block's activations: the group's first block starts d at nc, later blocks add nc into c for the
 * group's end. SPLIT: the activations come split (coli_split_q8: xg + p*gstride, this block's
 * 192 bytes), else they are split here. */
COLI_AVX512 static COLI_ALWAYS_INLINE void coli_l8_block_avx512(const uint8_t *w, long rb, const int8_t *q,
                                                                long qstride, const uint8_t *xg, long gstride,
                                                                int rem, const int NW, const int P,
                                                                const int SPLIT, const int first,
                                                                __m512i (*d)[4], __m512i *c)
{
    const __m512i one8 = _mm512_set1_epi8(1), z = _mm512_setzero_si512(), m4 = _mm512_set1_epi8(0x0F);
    __m512i xe[2], xo[2];
    COLI_UNROLL_G
    for (int p = 0; p < P; p++) {
        __m512i nc;
        if (SPLIT) {
            xe[p] = _mm512_loadu_si512(xg + p * gstride);
            xo[p] = _mm512_loadu_si512(xg + p * gstride + 64);
            nc = _mm512_loadu_si512(xg + p * gstride + 128);
        } else {
            coli_x128_split_avx512(q + p * qstride, rem, &xe[p], &xo[p]);
            nc = _mm512_sub_epi32(z, _mm512_slli_epi32(
                _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(z, one8, xe[p]), one8, xo[p]), 3));
        }
        if (first) {
            COLI_UNROLL_G
            for (int r = 0; r < NW; r++)
                d[p][r] = nc;
        } else {
            c[p] = _mm512_add_epi32(c[p], nc);
        }
    }
    COLI_UNROLL_G
    for (int r = 0; r < NW; r++) {
        __m512i wv = rem >= 128 ? _mm512_loadu_si512(w + r * rb)
                                : _mm512_maskz_loadu_epi8(~0ULL >> (64 - (rem + 1) / 2), w + r * rb);
        __m512i lo = _mm512_and_si512(wv, m4), hi = _mm512_and_si512(_mm512_srli_epi16(wv, 4), m4);
        COLI_UNROLL_G
        for (int p = 0; p < P; p++)
            d[p][r] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(d[p][r], lo, xe[p]), hi, xo[p]);
    }
}

/* The int4 lane form for NW (1..4) weight rows x P (1..2) activation rows. gs = 64: each 128-input
 * block holds two groups, lanes 0..7 and 8..15, scaled by [ws[2b] x 8 | ws[2b+1] x 8] in one fma;
 * gs >= 128: a group is whole blocks (the row's last one partial), its lane integers summed over
 * them before its fma. res[p*4 + r] = R16(A). */
COLI_AVX512 static COLI_ALWAYS_INLINE void coli_l8_tile_k_avx512(const uint8_t *w, long rb, const float *ws,
                                                                 long wstride, int gs, const int8_t *q,
                                                                 long qstride, const uint8_t *xg, long gstride,
                                                                 int n, const int NW, const int P, const int SPLIT,
                                                                 float *res)
{
    __m512 a[2][4];
    __m512i d[2][4], c[2];
    for (int p = 0; p < P; p++)
        COLI_UNROLL_G
        for (int r = 0; r < NW; r++) {
            a[p][r] = _mm512_setzero_ps();
            d[p][r] = _mm512_setzero_si512(); /* (set by each group's first block) */
        }
    if (gs == 64) {
        int i = 0, g = 0;
        for (; i + 128 <= n; i += 128, g += 2) { /* whole blocks: two groups each */
            coli_l8_block_avx512(w + i / 2, rb, q + i, qstride, xg + i / 128 * COLI_SPLIT_BYTES, gstride, 128, NW, P,
                                 SPLIT, 1, d, c);
            COLI_UNROLL_G
            for (int r = 0; r < NW; r++) {
                __m512 sv = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(ws[r * wstride + g]),
                                                 _mm512_set1_ps(ws[r * wstride + g + 1]));
                COLI_UNROLL_G
                for (int p = 0; p < P; p++)
                    a[p][r] = _mm512_fmadd_ps(sv, _mm512_cvtepi32_ps(d[p][r]), a[p][r]);
            }
        }
        if (i < n) { /* the row's last block, partial: one group, or two with the second partial */
            coli_l8_block_avx512(w + i / 2, rb, q + i, qstride, xg + i / 128 * COLI_SPLIT_BYTES, gstride, n - i, NW,
                                 P, SPLIT, 1, d, c);
            int g1 = i + 64 < n ? g + 1 : g; /* one group: its high lanes hold D = 0 */
            for (int r = 0; r < NW; r++) {
                __m512 sv = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(ws[r * wstride + g]),
                                                 _mm512_set1_ps(ws[r * wstride + g1]));
                for (int p = 0; p < P; p++)
                    a[p][r] = _mm512_fmadd_ps(sv, _mm512_cvtepi32_ps(d[p][r]), a[p][r]);
            }
        }
    } else {
        for (int g = 0, i0 = 0; i0 < n; g++, i0 += gs) {
            int end = n - i0 < gs ? n : i0 + gs;
            for (int p = 0; p < P; p++)
                c[p] = _mm512_setzero_si512();
            for (int i = i0; i < end; i += 128) {
                if (i + 128 <= end)
                    coli_l8_block_avx512(w + i / 2, rb, q + i, qstride, xg + i / 128 * COLI_SPLIT_BYTES, gstride, 128,
                                         NW, P, SPLIT, i == i0, d, c);
                else
                    coli_l8_block_avx512(w + i / 2, rb, q + i, qstride, xg + i / 128 * COLI_SPLIT_BYTES, gstride,
                                         end - i, NW, P, SPLIT, i == i0, d, c);
            }
            COLI_UNROLL_G
            for (int r = 0; r < NW; r++) {
                __m512 sv = _mm512_set1_ps(ws[r * wstride + g]);
                COLI_UNROLL_G
                for (int p = 0; p < P; p++)
                    a[p][r] = _mm512_fmadd_ps(sv, _mm512_cvtepi32_ps(_mm512_add_epi32(d[p][r], c[p])), a[p][r]);
            }
        }
    }
    coli_tile_sums_avx512(a, P, NW, res);
}

#define COLI_TILE_CASE(NW_, P_)                                                                    \
    (!is4 ? coli_lanes_tile_k_avx512(wb, rb, ws, wstride, gs, qp, qstride, n, NW_, P_, res)          \
     : xg ? coli_l8_tile_k_avx512(wb, rb, ws, wstride, gs, qp, qstride, xg + p0 * gstride, gstride, n, NW_, P_, 1, res) \
          : coli_l8_tile_k_avx512(wb, rb, ws, wstride, gs, qp, qstride, xg, gstride, n, NW_, P_, 0, res))

COLI_AVX512 static inline void coli_rowdotg_tile_avx512(const uint8_t *wb, long rb, int nw, const float *ws,
                                                        long wstride, int gs, const int8_t *q, long qstride,
                                                        const uint8_t *xg, long gstride, const float *xs,
                                                        long sstride, int P, int n, float *out, const int is4)
{
    for (int p0 = 0; p0 < P; p0 += 2) {
        const int8_t *qp = q + p0 * qstride;
        float res[8];
        int pc = P - p0 < 2 ? 1 : 2;
        switch (nw * 2 + pc - 1) {
        case 2: COLI_TILE_CASE(1, 1); break;
        case 3: COLI_TILE_CASE(1, 2); break;
        case 4: COLI_TILE_CASE(2, 1); break;
        case 5: COLI_TILE_CASE(2, 2); break;
        case 6: COLI_TILE_CASE(3, 1); break;
        case 7: COLI_TILE_CASE(3, 2); break;
        case 8: COLI_TILE_CASE(4, 1); break;
        case 9: COLI_TILE_CASE(4, 2); break;
        default: return;
        }
        for (int p = 0; p < pc; p++)
            for (int r = 0; r < nw; r++)
                out[(p0 + p) * nw + r] = coli_mul_pinned(xs[(long)(p0 + p) * sstride], res[p * 4 + r]);
    }
}
#undef COLI_TILE_CASE

COLI_AVX512 static inline void coli_rowdotg_i4_tile_avx512(const uint8_t *w, long rb, int nw, const float *ws,
                                                           long wstride, int gs, const int8_t *q, long qstride,
                                                           const uint8_t *xg, long gstride, const float *xs,
                                                           long sstride, int P, int n, float *out)
{
    coli_rowdotg_tile_avx512(w, rb, nw, ws, wstride, gs, q, qstride, xg, gstride, xs, sstride, P, n, out, 1);
}

COLI_AVX512 static inline void coli_rowdotg_i8_tile_avx512(const int8_t *w, long rb, int nw, const float *ws,
                                                           long wstride, int gs, const int8_t *q, long qstride,
                                                           const uint8_t *xg, long gstride, const float *xs,
                                                           long sstride, int P, int n, float *out)
{
    coli_rowdotg_tile_avx512((const uint8_t *)w, rb, nw, ws, wstride, gs, q, qstride, NULL, gstride, xs, sstride,
                             P, n, out, 0);
}
#endif /* COLI_X86 */

/* ====================== one-row forms (lane form or segment form) ====================== */

/* in_b of the segment form for the activation block [i, end): whole groups take the row kernel
 * over them; else one integer dot per piece */
#define COLI_GROUP_KERNELS(kind, WT, sfx, ATTR)                                                    \
    ATTR static inline float coli_groupblk_##kind##_##sfx(const WT *w, const float *ws, int gs,     \
                                                          const int8_t *q, int i, int end, int n)   \
    {                                                                                              \
        if (i % gs == 0 && ((end - i) % gs == 0 || end == n))                                      \
            return coli_rowdot_##kind##_##sfx(w + COLI_GROUP_OFF_##kind(i), q + i, ws + i / gs,     \
                                              end - i, gs);                                        \
        float in = 0.0f;                                                                           \
        for (int j = i; j < end;) {                                                                \
            int g = j / gs, stop = (g + 1) * gs < end ? (g + 1) * gs : end;                        \
            in = coli_block_acc(in, ws[g],                                                         \
                                coli_dot_##kind##i8_##sfx(w + COLI_GROUP_OFF_##kind(j), q + j, stop - j)); \
            j = stop;                                                                              \
        }                                                                                          \
        return in;                                                                                 \
    }                                                                                              \
    ATTR static inline float coli_rowdotg_##kind##_##sfx(const WT *w, const float *ws, int gs,      \
                                                         const int8_t *q, const float *xs, int n,   \
                                                         int block)                                \
    {                                                                                              \
        int bl = coli_block_len(n, block);                                                         \
        float acc = 0.0f;                                                                          \
        if (bl == n) { /* one activation block: the lane form */                                  \
            coli_rowdotg_##kind##_tile_##sfx(w, 0, 1, ws, 0, gs, q, 0, NULL, 0, xs, 0, 1, n, &acc); \
            return acc;                                                                            \
        }                                                                                          \
        for (int i = 0, b = 0; i < n; i += bl, b++) {                                              \
            int end = n - i < bl ? n : i + bl;                                                     \
            float p = coli_mul_pinned(xs[b], coli_groupblk_##kind##_##sfx(w, ws, gs, q, i, end, n)); \
            acc = b ? acc + p : p;                                                                 \
        }                                                                                          \
        return acc;                                                                                \
    }                                                                                              \
    ATTR static inline void coli_rowdotg_##kind##_rows_##sfx(const WT *w, const float *ws, int gs,  \
                                                             const int8_t *q, long qstride,         \
                                                             const float *xs, long sstride, int R,  \
                                                             int n, int block, float *out)          \
    {                                                                                              \
        if (coli_block_len(n, block) == n) {                                                       \
            coli_rowdotg_##kind##_tile_##sfx(w, 0, 1, ws, 0, gs, q, qstride, NULL, 0, xs, sstride, R, n, out); \
            return;                                                                                \
        }                                                                                          \
        for (int r = 0; r < R; r++)                                                                \
            out[r] = coli_rowdotg_##kind##_##sfx(w, ws, gs, q + (long)r * qstride,                 \
                                                 xs + (long)r * sstride, n, block);                \
    }

COLI_GROUP_KERNELS(i8, int8_t, scalar, )
COLI_GROUP_KERNELS(i4, uint8_t, scalar, )
#if COLI_X86
COLI_GROUP_KERNELS(i8, int8_t, avx2, COLI_AVX2)
COLI_GROUP_KERNELS(i4, uint8_t, avx2, COLI_AVX2)
COLI_GROUP_KERNELS(i8, int8_t, avx512, COLI_AVX512)
COLI_GROUP_KERNELS(i4, uint8_t, avx512, COLI_AVX512)
#endif

/* ================================ the float (idot=0) path ================================
 * out[r] = sum over the groups g of row r, in order, of coli_dot_<q8|q4>f32(group g, x) * ws[g]
 * (the group's float dot times its scale, added to the row's sum): the dequant-on-use dots of
 * group-scaled rows, in one call for nrows consecutive rows (rows rb bytes apart, scales wstride
 * floats apart). Like the float dots themselves, equal across ISAs up to rounding only. */
#define COLI_DOTSG(sfx, ATTR)                                                                      \
    ATTR static inline void coli_dotsg_q8f32_##sfx(const float *x, int n, const int8_t *w, long rb,  \
                                                   const float *ws, long wstride, int gs, int nrows, \
                                                   float *out)                                     \
    {                                                                                              \
        for (int r = 0; r < nrows; r++) {                                                          \
            float acc = 0.0f;                                                                      \
            for (int g = 0, i = 0; i < n; g++, i += gs)                                            \
                acc += coli_dot_q8f32_##sfx(w + r * rb + i, x + i, n - i < gs ? n - i : gs) * ws[r * wstride + g]; \
            out[r] = acc;                                                                          \
        }                                                                                          \
    }                                                                                              \
    ATTR static inline void coli_dotsg_q4f32_##sfx(const float *x, int n, const uint8_t *w, long rb, \
                                                   const float *ws, long wstride, int gs, int nrows, \
                                                   float *out)                                     \
    {                                                                                              \
        for (int r = 0; r < nrows; r++) {                                                          \
            float acc = 0.0f;                                                                      \
            for (int g = 0, i = 0; i < n; g++, i += gs)                                            \
                acc += coli_dot_q4f32_##sfx(w + r * rb + i / 2, x + i, n - i < gs ? n - i : gs) *   \
                       ws[r * wstride + g];                                                        \
            out[r] = acc;                                                                          \
        }                                                                                          \
    }
COLI_DOTSG(scalar, )
#if COLI_X86
COLI_DOTSG(avx2, COLI_AVX2)
COLI_DOTSG(avx512, COLI_AVX512)
#endif

#endif /* COLI_GROUP_H */
