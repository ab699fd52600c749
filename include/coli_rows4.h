/* Tiles of the per-row-scale integer matmuls: the decode matmuls' unit of work.
 *
 *   coli_rowdot_<kind>_tile_<isa>(w, rb, ilv, r0, nw, q, qstride, xs, s, sstride, xg, gstride, P, n, block, out)
 *       out[p*nw + r] = coli_rowdot_<kind>(weight row r0 + r, q + p*qstride, xs + p*sstride, n, block)
 *   for nw (1..4) weight rows of rb bytes (int8, kind i8, or packed int4, kind i4) and P >= 1 Q8
 *   activation rows: row p at q + p*qstride, its block scales at xs + p*sstride, its block sums
 *   (s[b] = the sum of q over block b, int32; coli_block_sums) at s + p*sstride, its split form
 *   (coli_split.h) at xg + p*gstride. s and xg may be NULL (not known); out must not alias the
 *   inputs. ilv = 0: row k at w + k*rb (the container's layout); ilv = 1: w is a group of four rows
 *   in the interleaved layout below, of which the tile takes rows r0 .. r0 + nw - 1 (r0 + nw <= 4).
 *
 * The interleaved layout ("ilv", made at load time for the matrices only these tiles read):
 * each group of four consecutive rows (4*rb bytes, where the plain rows would be) holds the rows'
 * whole 64-byte chunks in turn - chunk c of row r at c*256 + r*64 - then the rows' last
 * t = rb mod 64 bytes in turn (row r's at 4*(rb - t) + r*t). The rows past the last whole group
 * stay as they are. A tile of four rows then reads one ascending stream of memory, which the
 * hardware prefetcher follows at the full read bandwidth, instead of four streams rb bytes apart
 * that it follows at about half (and that software prefetching recovers only in part); inside a
 * chunk the bytes are the container's, so every kernel decodes them as before.
 *
 * Bit-identical to the one-row kernels per output (the same exact block integers, then per
 * activation row xs[b] * (float)dot_b added block by block in order through coli_block_acc), hence
 * to every ISA. The scalar tile is that definition: plain rows through coli_rowdot_*_scalar, the
 * interleaved ones piece by piece (coli_dot_*_scalar over each contiguous piece of a block, the
 * pieces' exact integers summed). AVX2 takes the multi-activation row dots (coli_rowsg_*: each
 * weight row read once for up to four activation rows) on plain rows, its integer dots piece by
 * piece on interleaved ones.
 *
 * AVX-512 VNNI loads the activations once for the nw weight rows and decodes each weight vector once
 * for the P activation rows. vpdpbusd wants its first operand unsigned: int8 weights become
 * u = w ^ 0x80 = w + 128, int4 weights keep their stored nibble u = v + 8, and the block sums
 * correct the bias: dot_b = sum u*x - bias * s[b] (bias 128 resp. 8), exact modulo 2^32 and so
 * exact (the true dot fits in int32; the int8 lanes may wrap). Per 64 weights and activation row
 * that is one vpdpbusd. int4 with the split activations (coli_split.h; one activation block per row,
 * or blocks of a multiple of 128): 64 packed bytes give the block's even weights (byte & 15) and its
 * odd ones ((byte >> 4) & 15) in two ands and a shift, against the split form's even and odd
 * activations; int4 without it widens the nibbles to bytes (coli_i4x64_unpack_avx512), three
 * instructions per 64 weights including a cross-lane one. Without the block sums the tile takes the
 * multi-activation row dots (plain rows) or the pieces (interleaved).
 */
#ifndef COLI_ROWS4_H
#define COLI_ROWS4_H

#include <string.h>
#include "coli_dot_i8.h"
#include "coli_dot_i4.h"
#include "coli_split.h"

/* ================================== the interleaved layout ================================== */

#define COLI_ILV_CHUNK 64 /* bytes of a row per turn */

/* Where the weight rows of a tile lie: row r's bytes b < full (whole chunks) at
 * w + (b / 64)*cs + b % 64 + r*rs, its bytes b >= full at tw + (b - full) + r*ts. Plain rows:
 * cs = 64, rs = ts = rb (so the bytes of row r are w + r*rb + b); interleaved: cs = 256, rs = 64,
 * ts = rb - full. */
typedef struct {
    const uint8_t *w, *tw;
    long rs, cs, ts, full;
} coli_rows_view;

static inline coli_rows_view coli_rows_at(const uint8_t *w, long rb, int ilv, int r0)
{
    coli_rows_view v;
    v.full = rb / COLI_ILV_CHUNK * COLI_ILV_CHUNK;
    if (ilv) {
        long t = rb - v.full;
        v.rs = COLI_ILV_CHUNK;
        v.cs = 4 * COLI_ILV_CHUNK;
        v.ts = t;
        v.w = w + r0 * v.rs;
        v.tw = w + 4 * v.full + r0 * t;
    } else {
        v.rs = v.ts = rb;
        v.cs = COLI_ILV_CHUNK;
        v.w = w + r0 * rb;
        v.tw = v.w + v.full;
    }
    return v;
}

/* the address of byte b of row r of a view */
static inline const uint8_t *coli_rows_byte(const coli_rows_view *v, int r, long b)
{
    if (b < v->full)
        return v->w + (b / COLI_ILV_CHUNK) * v->cs + b % COLI_ILV_CHUNK + r * v->rs;
    return v->tw + (b - v->full) + r * v->ts;
}

/* The interleaved copy of O plain rows of rb bytes: src -> dst (not overlapping) */
static inline void coli_ilv_pack(const uint8_t *src, uint8_t *dst, long O, long rb)
{
    long full = rb / COLI_ILV_CHUNK * COLI_ILV_CHUNK, g = 0;
    for (; 4 * g + 4 <= O; g++) {
        coli_rows_view v = coli_rows_at(dst + 4 * g * rb, rb, 1, 0);
        for (int r = 0; r < 4; r++) {
            const uint8_t *row = src + (4 * g + r) * rb;
            for (long b = 0; b < full; b += COLI_ILV_CHUNK)
                memcpy((uint8_t *)coli_rows_byte(&v, r, b), row + b, COLI_ILV_CHUNK);
            if (rb > full)
                memcpy((uint8_t *)coli_rows_byte(&v, r, full), row + full, (size_t)(rb - full));
        }
    }
    memcpy(dst + 4 * g * rb, src + 4 * g * rb, (size_t)((O - 4 * g) * rb));
}

/* ... and back: the plain rows of an interleaved payload */
static inline void coli_ilv_unpack(const uint8_t *src, uint8_t *dst, long O, long rb)
{
    long full = rb / COLI_ILV_CHUNK * COLI_ILV_CHUNK, g = 0;
    for (; 4 * g + 4 <= O; g++) {
        coli_rows_view v = coli_rows_at(src + 4 * g * rb, rb, 1, 0);
        for (int r = 0; r < 4; r++) {
            uint8_t *row = dst + (4 * g + r) * rb;
            for (long b = 0; b < full; b += COLI_ILV_CHUNK)
                memcpy(row + b, coli_rows_byte(&v, r, b), COLI_ILV_CHUNK);
            if (rb > full)
                memcpy(row + full, coli_rows_byte(&v, r, full), (size_t)(rb - full));
        }
    }
    memcpy(dst + 4 * g * rb, src + 4 * g * rb, (size_t)((O - 4 * g) * rb));
}

/* in place, one group at a time through tmp (4*rb bytes) */
static inline void coli_ilv_pack_inplace(uint8_t *w, long O, long rb, uint8_t *tmp)
{
    for (long g = 0; 4 * g + 4 <= O; g++) {
        memcpy(tmp, w + 4 * g * rb, (size_t)(4 * rb));
        coli_ilv_pack(tmp, w + 4 * g * rb, 4, rb);
    }
}

/* The tile piece by piece on any ISA, with its one-row integer dot `dot` (exact): per block and
 * output, the block's integers summed over its pieces (each within a chunk or the rows' tails, so
 * contiguous in memory), then its float term as coli_rowdot_* adds it. WSH: log2 of the inputs per
 * byte (0: int8, 1: int4). */
#define COLI_TILE_PIECES(kind, WT, sfx, ATTR, WSH)                                                 \
    ATTR static inline void coli_rowdot_##kind##_tile_pieces_##sfx(const coli_rows_view *v, int nw, \
                                                                   const int8_t *q, long qstride,  \
                                                                   const float *xs, long sstride,  \
                                                                   int P, int n, int block,        \
                                                                   float *out)                     \
    {                                                                                              \
        block = coli_block_len(n, block);                                                          \
        for (int p = 0; p < P; p++)                                                                \
            for (int r = 0; r < nw; r++) {                                                         \
                const int8_t *x = q + p * qstride;                                                 \
                float acc = 0.0f;                                                                  \
                for (int i = 0, b = 0; i < n; i += block, b++) {                                   \
                    int end = n - i < block ? n : i + block;                                       \
                    int32_t d = 0;                                                                 \
                    for (int e = i; e < end;) {                                                    \
                        long at = (long)e >> (WSH);                                                \
                        /* inputs to the end of this chunk, or of the row */                       \
                        int len = at < v->full ? (int)((COLI_ILV_CHUNK - at % COLI_ILV_CHUNK) << (WSH)) : end - e; \
                        len = len < end - e ? len : end - e;                                       \
                        d += coli_dot_##kind##i8_##sfx((const WT *)coli_rows_byte(v, r, at), x + e, len); \
                        e += len;                                                                  \
                    }                                                                              \
                    acc = coli_block_acc(acc, xs[p * sstride + b], d);                             \
                }                                                                                  \
                out[p * nw + r] = acc;                                                             \
            }                                                                                      \
    }

/* ================================ scalar (the definition) ================================ */

COLI_TILE_PIECES(i8, int8_t, scalar, , 0)
COLI_TILE_PIECES(i4, uint8_t, scalar, , 1)

#define COLI_TILE_SCALAR(kind, WT)                                                                 \
    static inline void coli_rowdot_##kind##_tile_scalar(const WT *w, long rb, int ilv, int r0, int nw, \
                                                        const int8_t *q, long qstride,             \
                                                        const float *xs, const int32_t *s,         \
                                                        long sstride, const uint8_t *xg,           \
                                                        long gstride, int P, int n, int block,     \
                                                        float *out)                                \
    {                                                                                              \
        (void)s; (void)xg; (void)gstride;                                                          \
        if (ilv) {                                                                                 \
            coli_rows_view v = coli_rows_at((const uint8_t *)w, rb, ilv, r0);                      \
            coli_rowdot_##kind##_tile_pieces_scalar(&v, nw, q, qstride, xs, sstride, P, n, block, out); \
            return;                                                                                \
        }                                                                                          \
        for (int p = 0; p < P; p++)                                                                \
            for (int r = 0; r < nw; r++)                                                           \
                out[p * nw + r] = coli_rowdot_##kind##_scalar(w + (r0 + r) * rb, q + p * qstride,  \
                                                              xs + p * sstride, n, block);         \
    }
COLI_TILE_SCALAR(i8, int8_t)
COLI_TILE_SCALAR(i4, uint8_t)

#if COLI_X86
/* ============================ AVX2 (and AVX-512 without sums) ============================ */

/* Plain rows through coli_rowsg_<kind>_<sfx> (up to four activation rows per pass over a weight
 * row), interleaved ones piece by piece */
#define COLI_TILE_GENERIC(kind, WT, sfx, ATTR, WSH)                                                \
    COLI_TILE_PIECES(kind, WT, sfx, ATTR, WSH)                                                     \
    ATTR static inline void coli_rowdot_##kind##_tile_rowsg_##sfx(const WT *w, long rb, int ilv,    \
                                                                  int r0, int nw, const int8_t *q, \
                                                                  long qstride, const float *xs,   \
                                                                  long sstride, int P, int n,      \
                                                                  int block, float *out)           \
    {                                                                                              \
        if (ilv) {                                                                                 \
            coli_rows_view v = coli_rows_at((const uint8_t *)w, rb, ilv, r0);                      \
            coli_rowdot_##kind##_tile_pieces_##sfx(&v, nw, q, qstride, xs, sstride, P, n, block, out); \
            return;                                                                                \
        }                                                                                          \
        w += r0 * rb;                                                                              \
        for (int p0 = 0; p0 < P; p0 += COLI_ROWS_G) {                                              \
            int g = P - p0 < COLI_ROWS_G ? P - p0 : COLI_ROWS_G;                                   \
            const int8_t *qp[COLI_ROWS_G];                                                         \
            const float *sp[COLI_ROWS_G];                                                          \
            float o[COLI_ROWS_G];                                                                  \
            for (int p = 0; p < g; p++) {                                                          \
                qp[p] = q + (long)(p0 + p) * qstride;                                              \
                sp[p] = xs + (long)(p0 + p) * sstride;                                             \
            }                                                                                      \
            for (int r = 0; r < nw; r++) {                                                         \
                coli_rowsg_##kind##_##sfx(w + r * rb, qp, sp, g, n, block, o);                     \
                for (int p = 0; p < g; p++)                                                        \
                    out[(p0 + p) * nw + r] = o[p];                                                 \
            }                                                                                      \
        }                                                                                          \
    }
COLI_TILE_GENERIC(i8, int8_t, avx2, COLI_AVX2, 0)
COLI_TILE_GENERIC(i4, uint8_t, avx2, COLI_AVX2, 1)
COLI_TILE_GENERIC(i8, int8_t, avx512, COLI_AVX512, 0)
COLI_TILE_GENERIC(i4, uint8_t, avx512, COLI_AVX512, 1)

#define COLI_TILE_AVX2(kind, WT)                                                                   \
    COLI_AVX2 static inline void coli_rowdot_##kind##_tile_avx2(const WT *w, long rb, int ilv, int r0, \
                                                                int nw, const int8_t *q,           \
                                                                long qstride, const float *xs,     \
                                                                const int32_t *s, long sstride,    \
                                                                const uint8_t *xg, long gstride,   \
                                                                int P, int n, int block,           \
                                                                float *out)                        \
    {                                                                                              \
        (void)s; (void)xg; (void)gstride;                                                          \
        coli_rowdot_##kind##_tile_rowsg_avx2(w, rb, ilv, r0, nw, q, qstride, xs, sstride, P, n, block, out); \
    }
COLI_TILE_AVX2(i8, int8_t)

/* int4 on AVX2 with the activations' split forms (coli_split.h) and block sums: 32 packed bytes
 * give 32 even weights (byte & 15) and 32 odd ones ((byte >> 4) & 15), the stored nibbles
 * u = v + 8, which vpmaddubsw multiplies with the split form's even and odd inputs as they come;
 * dot_b = sum u*x - 8 * s[b], exact. Per 64 weights and activation row: two vpmaddubsw and two
 * int16 adds (the unsplit kernel takes four vpmaddubsw, two subtractions and the nibble unpack).
 * The int16 sums of 256 weights stay within +-30720 (|u*x + u'*x'| <= 2*15*128 per pair and step
 * of 64), so they widen to int32 once per 256 weights. One plain weight row against P (1..4)
 * activation rows (split form p at xg + p*gstride, scales and sums at xs / s + p*sstride); blocks
 * cover the row or are multiples of 128 (the split form's unit). The tile takes it for P >= 3
 * activation rows (a verify batch; a 2-row batch's rows and residuals come as P = 4): for P <= 2
 * (decode: one row and its residual) the unsplit rowsg kernel measured faster where the weights
 * stream from RAM (GLM-5 slice, full-width MoE layer, 2 AVX2 threads: 1.28x the time with the
 * split kernel at P = 2, paired in one process). */
COLI_AVX2 static COLI_ALWAYS_INLINE void coli_tile_i4_split_avx2_k(const uint8_t *w, const uint8_t *xg, long gstride,
                                                                   const float *xs, const int32_t *s, long sstride,
                                                                   const int P, int n, int block, float *out)
{
    const __m256i m4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    float acc[COLI_ROWS_G] = {0.0f, 0.0f, 0.0f, 0.0f};
    block = coli_block_len(n, block);
    for (int i = 0, b = 0; i < n; i += block, b++) {
        int end = n - i < block ? n : i + block;
        __m256i a32[COLI_ROWS_G];
        COLI_UNROLL_G
        for (int p = 0; p < P; p++)
            a32[p] = _mm256_setzero_si256();
        for (int c = i; c < end; c += 256) {
            __m256i a16[COLI_ROWS_G];
            COLI_UNROLL_G
            for (int p = 0; p < P; p++)
                a16[p] = _mm256_setzero_si256();
            for (int e = c; e < end && e < c + 256; e += 64) {
                /* weights e .. e+63: bytes e/2 .. e/2 + 31 (fewer at the row's end), inputs k of
                 * the split chunk e/128 from 32*((e/64) & 1) on */
                __m256i wv;
                if (n - e >= 64) {
                    wv = _mm256_loadu_si256((const __m256i *)(w + e / 2));
                } else {
                    uint8_t t[32] = {0};
                    memcpy(t, w + e / 2, (size_t)((n - e + 1) / 2));
                    wv = _mm256_loadu_si256((const __m256i *)t);
                }
                __m256i lo = _mm256_and_si256(wv, m4), hi = _mm256_and_si256(_mm256_srli_epi16(wv, 4), m4);
                const uint8_t *g = xg + (long)(e / 128) * COLI_SPLIT_BYTES + 32 * ((e / 64) & 1);
                COLI_UNROLL_G
                for (int p = 0; p < P; p++) {
                    const uint8_t *gp = g + p * gstride;
                    a16[p] = _mm256_add_epi16(a16[p], _mm256_add_epi16(
                        _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)gp)),
                        _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(gp + 64)))));
                }
            }
            COLI_UNROLL_G
            for (int p = 0; p < P; p++)
                a32[p] = _mm256_add_epi32(a32[p], _mm256_madd_epi16(a16[p], ones));
        }
        int32_t d[COLI_ROWS_G];
        _mm_storeu_si128((__m128i *)d, coli_hsum4_i32_avx2(a32[0], P > 1 ? a32[1] : a32[0],
                                                           P > 2 ? a32[2] : a32[0], P > 3 ? a32[3] : a32[0]));
        COLI_UNROLL_G
        for (int p = 0; p < P; p++)
            acc[p] = coli_block_acc(acc[p], xs[p * sstride + b], d[p] - 8 * s[p * sstride + b]);
    }
    COLI_UNROLL_G
    for (int p = 0; p < P; p++)
        out[p] = acc[p];
}

COLI_AVX2 static inline void coli_rowdot_i4_tile_avx2(const uint8_t *w, long rb, int ilv, int r0, int nw,
                                                      const int8_t *q, long qstride, const float *xs,
                                                      const int32_t *s, long sstride, const uint8_t *xg,
                                                      long gstride, int P, int n, int block, float *out)
{
    int blk = coli_block_len(n, block);
    if (P < 3 || ilv || xg == NULL || s == NULL || (blk != n && blk % 128 != 0)) {
        coli_rowdot_i4_tile_rowsg_avx2(w, rb, ilv, r0, nw, q, qstride, xs, sstride, P, n, block, out);
        return;
    }
    for (int p0 = 0; p0 < P; p0 += COLI_ROWS_G) {
        int g = P - p0 < COLI_ROWS_G ? P - p0 : COLI_ROWS_G;
        const uint8_t *gp = xg + p0 * gstride;
        const float *xsp = xs + p0 * sstride;
        const int32_t *sp = s + p0 * sstride;
        for (int r = 0; r < nw; r++) {
            const uint8_t *row = w + (long)(r0 + r) * rb;
            float o[COLI_ROWS_G];
            switch (g) {
            case 1: coli_tile_i4_split_avx2_k(row, gp, gstride, xsp, sp, sstride, 1, n, block, o); break;
            case 2: coli_tile_i4_split_avx2_k(row, gp, gstride, xsp, sp, sstride, 2, n, block, o); break;
            case 3: coli_tile_i4_split_avx2_k(row, gp, gstride, xsp, sp, sstride, 3, n, block, o); break;
            default: coli_tile_i4_split_avx2_k(row, gp, gstride, xsp, sp, sstride, 4, n, block, o); break;
            }
            for (int p = 0; p < g; p++)
                out[(p0 + p) * nw + r] = o[p];
        }
    }
}

/* ===================================== AVX-512 VNNI ===================================== */

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

/* the AVX-512 tile's weight decodings */
enum { COLI_TILE_I8 = 0, COLI_TILE_I4 = 1, COLI_TILE_I4S = 2 };

#define COLI_DPBUSD(acc, u, x) ((acc) = _mm512_dpbusd_epi32((acc), (u), (x)))

/* One step of the tile for NW weight rows (w + r*rs) and P activation rows, into a[p][r]:
 * I8 / I4: 64 inputs (rem < 64: the row's last ones, masked), the activations from q + p*qstride;
 * I4S: 128 inputs (rem < 128: the row's last ones, ceil(rem/2) weight bytes), the activations from
 * their split forms (g + p*gstride: this block's even then odd inputs, zeros past n) - low
 * nibbles . even inputs into a, high nibbles . odd inputs into a too, or into h when P == 1 (two
 * dependency chains per weight row). */
COLI_AVX512 static COLI_ALWAYS_INLINE void coli_tile_step_avx512(const uint8_t *w, long rs, const int8_t *q,
                                                                 long qstride, const uint8_t *g, long gstride,
                                                                 int rem, const int NW, const int P, const int K,
                                                                 __m512i (*a)[4], __m512i (*h)[4])
{
    if (K == COLI_TILE_I4S) {
        const __m512i m4 = _mm512_set1_epi8(0x0F);
        __m512i xe[4], xo[4];
        COLI_UNROLL_G
        for (int p = 0; p < P; p++) {
            xe[p] = _mm512_loadu_si512(g + p * gstride);
            xo[p] = _mm512_loadu_si512(g + p * gstride + 64);
        }
        COLI_UNROLL_G
        for (int r = 0; r < NW; r++) {
            __m512i wv = rem >= 128 ? _mm512_loadu_si512(w + r * rs)
                                    : _mm512_maskz_loadu_epi8(~0ULL >> (64 - (rem + 1) / 2), w + r * rs);
            __m512i lo = _mm512_and_si512(wv, m4), hi = _mm512_and_si512(_mm512_srli_epi16(wv, 4), m4);
            COLI_UNROLL_G
            for (int p = 0; p < P; p++) {
                COLI_DPBUSD(a[p][r], lo, xe[p]);
                if (P == 1)
                    COLI_DPBUSD(h[p][r], hi, xo[p]);
                else
                    COLI_DPBUSD(a[p][r], hi, xo[p]);
            }
        }
    } else {
        __m512i x[4];
        COLI_UNROLL_G
        for (int p = 0; p < P; p++)
            x[p] = rem >= 64 ? _mm512_loadu_si512(q + p * qstride)
                             : _mm512_maskz_loadu_epi8(~0ULL >> (64 - rem), q + p * qstride);
        COLI_UNROLL_G
        for (int r = 0; r < NW; r++) {
            __m512i u = coli_x4_weights_avx512(w + r * rs, 0, rem, K == COLI_TILE_I4);
            COLI_UNROLL_G
            for (int p = 0; p < P; p++)
                COLI_DPBUSD(a[p][r], u, x[p]);
        }
    }
}

/* the eight horizontal sums of a[0..3] and b[0..3], as [a0 a1 a2 a3 b0 b1 b2 b3]: the first two
 * levels as in coli_hsum4_i32_avx512 leave [a0 a1 a2 a3] partial sums in every 128-bit lane of A
 * (resp. B), then the lanes of both are added crosswise */
COLI_AVX512 static COLI_ALWAYS_INLINE __m256i coli_hsum8_i32_avx512(const __m512i *a, const __m512i *b)
{
    __m512i a01 = _mm512_add_epi32(_mm512_unpacklo_epi32(a[0], a[1]), _mm512_unpackhi_epi32(a[0], a[1]));
    __m512i a23 = _mm512_add_epi32(_mm512_unpacklo_epi32(a[2], a[3]), _mm512_unpackhi_epi32(a[2], a[3]));
    __m512i b01 = _mm512_add_epi32(_mm512_unpacklo_epi32(b[0], b[1]), _mm512_unpackhi_epi32(b[0], b[1]));
    __m512i b23 = _mm512_add_epi32(_mm512_unpacklo_epi32(b[2], b[3]), _mm512_unpackhi_epi32(b[2], b[3]));
    __m512i A = _mm512_add_epi32(_mm512_unpacklo_epi64(a01, a23), _mm512_unpackhi_epi64(a01, a23));
    __m512i B = _mm512_add_epi32(_mm512_unpacklo_epi64(b01, b23), _mm512_unpackhi_epi64(b01, b23));
    __m512i t = _mm512_add_epi32(_mm512_shuffle_i64x2(A, B, _MM_SHUFFLE(1, 0, 1, 0)),  /* A0 A1 B0 B1 */
                                 _mm512_shuffle_i64x2(A, B, _MM_SHUFFLE(3, 2, 3, 2))); /* + A2 A3 B2 B3 */
    t = _mm512_shuffle_i64x2(t, t, _MM_SHUFFLE(3, 1, 2, 0));                            /* A02 B02 A13 B13 */
    return _mm256_add_epi32(_mm512_castsi512_si256(t), _mm512_extracti64x4_epi64(t, 1));
}

/* acc + xs * (float)(d - c), lane by lane: coli_block_acc for 8 outputs (xs, c per lane) */
COLI_AVX512 static COLI_ALWAYS_INLINE __m256 coli_block_acc8(__m256 acc, __m256 xs, __m256i d, __m256i c)
{
    __m256 p = _mm256_mul_ps(xs, _mm256_cvtepi32_ps(_mm256_sub_epi32(d, c)));
    __asm__("" : "+v"(p)); /* no fma contraction, see coli_block_acc */
    return _mm256_add_ps(acc, p);
}

/* The integer dots of one activation block [i, i + len) for NW (1 or 4) weight rows (view v) x P
 * (1, 2 or 4) activation rows, left in a[p][r] as 16 int32 lanes each (without the bias
 * correction). First the whole steps in the rows' whole chunks (I8 / I4S: a chunk a step; I4: half
 * a chunk; I8 with P == 1 alternates two accumulator sets, I4S keeps the high nibbles' products
 * apart), then the rest: the rows' tails, or the last chunk of an odd int4 row (the row's last
 * step masked). I4S: the block is whole
 * 128-input chunks but for the row's last. */
COLI_AVX512 static COLI_ALWAYS_INLINE void coli_tile_block_avx512(const coli_rows_view *v, const int8_t *q,
                                                                  long qstride, const uint8_t *xg, long gstride,
                                                                  int i, int len, const int NW, const int P,
                                                                  const int K, __m512i (*a)[4])
{
    const int wsh = K == COLI_TILE_I8 ? 0 : 1;                       /* bytes = inputs >> wsh */
    const int step = K == COLI_TILE_I4S ? 128 : 64;                  /* inputs per step */
    const long cs = v->cs, full_in = v->full << wsh;                 /* inputs in whole chunks */
    const int end = i + len;
    __m512i h[4][4];
    int e = i;
    COLI_UNROLL_G
    for (int p = 0; p < P; p++)
        COLI_UNROLL_G
        for (int r = 0; r < 4; r++)
            a[p][r] = h[p][r] = _mm512_setzero_si512();
    if (K == COLI_TILE_I4S) {
        const uint8_t *wp = v->w + (long)(e >> 7) * cs, *gp = xg + (long)(e >> 7) * COLI_SPLIT_BYTES;
        for (; e + 128 <= end && e + 128 <= full_in; e += 128, wp += cs, gp += COLI_SPLIT_BYTES)
            coli_tile_step_avx512(wp, v->rs, q, qstride, gp, gstride, 128, NW, P, K, a, h);
    } else if (K == COLI_TILE_I8) {
        const uint8_t *wp = v->w + (long)(e >> 6) * cs;
        if (P == 1)
            for (; e + 128 <= end && e + 128 <= full_in; e += 128, wp += 2 * cs) {
                coli_tile_step_avx512(wp, v->rs, q + e, qstride, NULL, 0, 64, NW, P, K, a, h);
                coli_tile_step_avx512(wp + cs, v->rs, q + e + 64, qstride, NULL, 0, 64, NW, P, K, h, h);
            }
        for (; e + 64 <= end && e + 64 <= full_in; e += 64, wp += cs)
            coli_tile_step_avx512(wp, v->rs, q + e, qstride, NULL, 0, 64, NW, P, K, a, h);
    } else {
        for (; e + 64 <= end && e + 64 <= full_in; e += 64)
            coli_tile_step_avx512(coli_rows_byte(v, 0, e >> 1), v->rs, q + e, qstride, NULL, 0, 64, NW, P, K, a, h);
    }
    for (; e < end; e += step) { /* the rows' tails, and an odd int4 row's last chunk (masked) */
        long b = (long)e >> wsh;
        coli_tile_step_avx512(coli_rows_byte(v, 0, b), b < v->full ? v->rs : v->ts, q + e, qstride,
                              K == COLI_TILE_I4S ? xg + (long)(e >> 7) * COLI_SPLIT_BYTES : NULL, gstride,
                              end - e < step ? end - e : step, NW, P, K, a, h);
    }
    /* An empty asm per accumulator: without it GCC (12) ties the loop's accumulators to the
     * registers the reduction below wants and copies them around every vpdpbusd in the loop. */
    COLI_UNROLL_G
    for (int p = 0; p < P; p++)
        COLI_UNROLL_G
        for (int r = 0; r < NW; r++) {
            __asm__("" : "+v"(a[p][r]));
            if (P == 1)
                __asm__("" : "+v"(h[p][r]));
        }
    if (P == 1)
        COLI_UNROLL_G
        for (int r = 0; r < NW; r++)
            a[0][r] = _mm512_add_epi32(a[0][r], h[0][r]);
}

/* acc[p][r] (+)= the block's float terms xs[p][b] (x) (float)(dot - bias * s[p][b]) of its dots a:
 * NW = 4: 8 lanes [p][r] per pair of activation rows (an odd last row: its lanes repeat in the upper
 * 4); NW = 1: acc1[p] */
COLI_AVX512 static COLI_ALWAYS_INLINE void coli_tile_terms_avx512(__m512i (*a)[4], const float *xs, const int32_t *s,
                                                                  long sstride, int b, const int NW, const int P,
                                                                  const int K, __m256 *acc8, float *acc1)
{
    const int32_t bias = K == COLI_TILE_I8 ? 128 : 8;
    if (NW == 4) {
        COLI_UNROLL_G
        for (int p = 0; p < P; p += 2) {
            const int p2 = p + 1 < P ? p + 1 : p;                  /* an odd last row: repeated */
            __m256i d = coli_hsum8_i32_avx512(a[p], a[p2]);
            __m256 sc = _mm256_set_m128(_mm_set1_ps(xs[p2 * sstride + b]), _mm_set1_ps(xs[p * sstride + b]));
            __m256i c = _mm256_set_m128i(_mm_set1_epi32(bias * s[p2 * sstride + b]),
                                         _mm_set1_epi32(bias * s[p * sstride + b]));
            acc8[p / 2] = coli_block_acc8(acc8[p / 2], sc, d, c);
        }
    } else {
        COLI_UNROLL_G
        for (int p = 0; p < P; p++)
            acc1[p] = coli_block_acc(acc1[p], xs[p * sstride + b],
                                     _mm512_reduce_add_epi32(a[p][0]) - bias * s[p * sstride + b]);
    }
}

/* The tile for NW (1 or 4) weight rows x P (1, 2 or 4) activation rows with their block sums, one
 * decoding K: per activation block its dots, the rows' lanes reduced together, then per output the
 * block's float term, in block order; out[p * ostride + r]. One block (the engine's default) has a
 * path of its own: no loop around the dots' loop keeps GCC's accumulators in place. */
COLI_AVX512 static COLI_ALWAYS_INLINE void coli_tile_k_avx512(const coli_rows_view *v, const int8_t *q, long qstride,
                                                              const float *xs, const int32_t *s, long sstride,
                                                              const uint8_t *xg, long gstride, int n, int block,
                                                              float *out, long ostride, const int NW, const int P,
                                                              const int K)
{
    __m256 acc8[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    float acc1[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    __m512i a[4][4];
    block = coli_block_len(n, block);
    if (block == n) {
        coli_tile_block_avx512(v, q, qstride, xg, gstride, 0, n, NW, P, K, a);
        coli_tile_terms_avx512(a, xs, s, sstride, 0, NW, P, K, acc8, acc1);
    } else {
        for (int i = 0, b = 0; i < n; i += block, b++) {
            coli_tile_block_avx512(v, q, qstride, xg, gstride, i, n - i < block ? n - i : block, NW, P, K, a);
            coli_tile_terms_avx512(a, xs, s, sstride, b, NW, P, K, acc8, acc1);
        }
    }
    if (NW == 4) {
        COLI_UNROLL_G
        for (int p = 0; p < P; p += 2) {
            _mm_storeu_ps(out + p * ostride, _mm256_castps256_ps128(acc8[p / 2]));
            if (p + 1 < P)
                _mm_storeu_ps(out + (p + 1) * ostride, _mm256_extractf128_ps(acc8[p / 2], 1));
        }
    } else {
        COLI_UNROLL_G
        for (int p = 0; p < P; p++)
            out[p * ostride] = acc1[p];
    }
}

/* nw rows x pc (1, 2 or 4) activation rows from p0: NW = 4 for four rows, else row by row */
#define COLI_TILE_ROWS(K_, P_)                                                                     \
    do {                                                                                           \
        if (nw == 4) {                                                                             \
            coli_tile_k_avx512(&v, qp, qstride, xsp, sp, sstride, gp, gstride, n, block, o, nw, 4, P_, K_); \
        } else {                                                                                   \
            for (int r = 0; r < nw; r++) {                                                         \
                coli_rows_view vr = coli_rows_at(w, rb, ilv, r0 + r);                              \
                coli_tile_k_avx512(&vr, qp, qstride, xsp, sp, sstride, gp, gstride, n, block, o + r, nw, 1, P_, K_); \
            }                                                                                      \
        }                                                                                          \
    } while (0)
#define COLI_TILE_PC(K_)                                                                           \
    do {                                                                                           \
        if (pc == 4)                                                                               \
            COLI_TILE_ROWS(K_, 4);                                                                 \
        else if (pc == 2)                                                                          \
            COLI_TILE_ROWS(K_, 2);                                                                 \
        else                                                                                       \
            COLI_TILE_ROWS(K_, 1);                                                                 \
    } while (0)

COLI_AVX512 static inline void coli_rowdot_tile_avx512(const uint8_t *w, long rb, int ilv, int r0, int nw,
                                                       const int8_t *q, long qstride, const float *xs,
                                                       const int32_t *s, long sstride, const uint8_t *xg,
                                                       long gstride, int P, int n, int block, float *out,
                                                       const int is4)
{
    int blk = coli_block_len(n, block);
    int K = !is4 ? COLI_TILE_I8 : (xg != NULL && (blk == n || blk % 128 == 0)) ? COLI_TILE_I4S : COLI_TILE_I4;
    coli_rows_view v = coli_rows_at(w, rb, ilv, r0);
    for (int p0 = 0; p0 < P;) {
        int pc = P - p0 >= 4 ? 4 : P - p0 >= 2 ? 2 : 1;
        const int8_t *qp = q + p0 * qstride;
        const float *xsp = xs + p0 * sstride;
        const int32_t *sp = s + p0 * sstride;
        const uint8_t *gp = xg ? xg + p0 * gstride : NULL;
        float *o = out + p0 * nw;
        if (K == COLI_TILE_I4S)
            COLI_TILE_PC(COLI_TILE_I4S);
        else if (K == COLI_TILE_I4)
            COLI_TILE_PC(COLI_TILE_I4);
        else
            COLI_TILE_PC(COLI_TILE_I8);
        p0 += pc;
    }
}
#undef COLI_TILE_PC
#undef COLI_TILE_ROWS

/* the decode and verify cases - four weight rows, one to four activation rows (idot 1, 2; a verify
 * batch of up to four), one activation block - directly, without the general dispatch: each P its
 * own copy of the tile (measured on a Zen 4 core, int4, n = 64..384: four rows through the general
 * dispatch cost 2.6-3.2x one row, through their own copy 1.8-2.1x) */
#define COLI_TILE_DECODE(K_)                                                                       \
    do {                                                                                           \
        coli_rows_view v = coli_rows_at((const uint8_t *)w, rb, ilv, r0);                          \
        if (P == 4)                                                                                \
            coli_tile_k_avx512(&v, q, qstride, xs, s, sstride, xg, gstride, n, n, out, 4, 4, 4, K_); \
        else if (P == 3)                                                                           \
            coli_tile_k_avx512(&v, q, qstride, xs, s, sstride, xg, gstride, n, n, out, 4, 4, 3, K_); \
        else if (P == 2)                                                                           \
            coli_tile_k_avx512(&v, q, qstride, xs, s, sstride, xg, gstride, n, n, out, 4, 4, 2, K_); \
        else                                                                                       \
            coli_tile_k_avx512(&v, q, qstride, xs, s, sstride, xg, gstride, n, n, out, 4, 4, 1, K_); \
        return;                                                                                    \
    } while (0)

COLI_AVX512 static inline void coli_rowdot_i8_tile_avx512(const int8_t *w, long rb, int ilv, int r0, int nw,
                                                          const int8_t *q, long qstride, const float *xs,
                                                          const int32_t *s, long sstride, const uint8_t *xg,
                                                          long gstride, int P, int n, int block, float *out)
{
    if (s != NULL && nw == 4 && P <= 4 && coli_block_len(n, block) == n)
        COLI_TILE_DECODE(COLI_TILE_I8);
    if (s == NULL)
        coli_rowdot_i8_tile_rowsg_avx512(w, rb, ilv, r0, nw, q, qstride, xs, sstride, P, n, block, out);
    else
        coli_rowdot_tile_avx512((const uint8_t *)w, rb, ilv, r0, nw, q, qstride, xs, s, sstride, xg, gstride, P, n,
                                block, out, 0);
}

COLI_AVX512 static inline void coli_rowdot_i4_tile_avx512(const uint8_t *w, long rb, int ilv, int r0, int nw,
                                                          const int8_t *q, long qstride, const float *xs,
                                                          const int32_t *s, long sstride, const uint8_t *xg,
                                                          long gstride, int P, int n, int block, float *out)
{
    if (s != NULL && xg != NULL && nw == 4 && P <= 4 && coli_block_len(n, block) == n)
        COLI_TILE_DECODE(COLI_TILE_I4S);
    if (s == NULL)
        coli_rowdot_i4_tile_rowsg_avx512(w, rb, ilv, r0, nw, q, qstride, xs, sstride, P, n, block, out);
    else
        coli_rowdot_tile_avx512(w, rb, ilv, r0, nw, q, qstride, xs, s, sstride, xg, gstride, P, n, block, out, 1);
}
#undef COLI_TILE_DECODE
#endif /* COLI_X86 */

#endif /* COLI_ROWS4_H */
