/* Integer GEMM of the per-row-scale matmuls for batches (prefill): AMX-INT8 tiles.
 *
 * The matmul y[S, O] = x[S, K] · Wᵀ of an int8 or int4 matrix with one scale per row (W.s) and
 * activations quantized with one block per row (Q8 rows q1, scales xs1; with idot=2 also their
 * residual rows q2, scales xs2) is, per output,
 *
 *   idot 1:  y[p, o] = (0 + xs1[p] * (float)d(o, q1_p)) * ws[o]
 *   idot 2:  y[p, o] = ((0 + xs1[p] * (float)d(o, q1_p)) + (0 + xs2[p] * (float)d(o, q2_p))) * ws[o]
 *
 * where d is the exact int32 dot of weight row o (int8, or int4 v = u - 8) with the activation
 * row, and each product goes through coli_block_acc (no FMA contraction). That is what the tile
 * kernels compute (the engine's tile_cols: coli_rowdot_*_tile over one block, then the row
 * scale), so the two paths are bit-identical; the scalar definition below spells it out.
 *
 * The AMX variant: TDPBSSD multiplies a tile A [16 rows, 64 int8] by a tile B [16 rows of 4-byte
 * groups, 16 columns] into C [16, 16] int32, exactly (no saturation). A holds 16 activation rows
 * as they are, B 16 weight rows (int4 decoded to int8 v in [-8, 7]: no bias to correct) in the
 * "VNNI" layout, byte kk*64 + n*4 + i = weight row n's input 4*kk + i of the 64-input chunk, so
 * C [activation row, weight row] comes out in the order of y's rows:
 *
 *   coli_gemm_pack(q, P, K, out, sums)  rows p < P of q (row p at q + p*K) as A tiles: ceil(P/16)
 *       blocks of ceil(K/64) chunks of 16 rows x 64 bytes (block b, chunk c at out + (b*nkc + c)*1024),
 *       zeros past input K-1 and row P-1, so the tiles need no tail code (and, if sums, each row's sum);
 *   coli_gemm_rows_amx(...)  the weight rows o0 .. o0+nw-1 (nw <= 32) against every packed row:
 *       their chunks decoded once into a panel [nkc][2][1024] (two B tiles a chunk), then for
 *       each pair of activation blocks (q1 and q2 of the same 16 rows with idot=2; two consecutive
 *       blocks of q1 without) four TDPBSSD per chunk (2 activation tiles x 2 weight tiles), C
 *       stored, scaled row by row and written to y.
 *
 * The AVX-512 VNNI variant (coli_gemm_rows_vnni, where AMX is off or absent) reads the same
 * packed rows and the same panel with unsigned weights (int4 u, int8 w + 128): one vpdpbusd per
 * 4 inputs, activation row and 16 weight rows, the bias taken off with the rows' sums.
 * coli_gemm_rows picks the variant.
 *
 * AMX needs the CPU (CPUID.7.0:EDX bits 24, 25), the OS saving the tile state (XCR0 bits 17, 18)
 * and, on Linux, the process's permission for the tile data (arch_prctl ARCH_REQ_XCOMP_PERM);
 * coli_amx_select(1) checks all three and turns the path on only when they hold. Each thread
 * loads the tile configuration at the start of a call and releases the tiles at its end.
 */
#ifndef COLI_GEMM_H
#define COLI_GEMM_H

#include <stdlib.h>
#include <string.h>
#include "coli_dot_i8.h"
#include "coli_dot_i4.h"
#include "coli_rows4.h"

#if COLI_X86 && defined(__linux__) && defined(__GNUC__) && (defined(__clang__) || __GNUC__ >= 11)
#define COLI_HAVE_AMX 1
#include <cpuid.h>
#include <unistd.h>
#include <sys/syscall.h>
#define COLI_AMX __attribute__((target("avx2,fma,avx512f,avx512bw,avx512vl,avx512vnni,amx-tile,amx-int8")))
#else
#define COLI_HAVE_AMX 0
#endif

#define COLI_GEMM_COLS 32 /* weight rows per call of coli_gemm_rows_* */

static inline int coli_gemm_nkc(int K) { return (K + 63) / 64; }

/* Bytes coli_gemm_pack writes for P rows of width K (twice that room for q1 and q2). */
static inline long coli_gemm_packed_bytes(int P, int K)
{
    return (long)((P + 15) / 16) * coli_gemm_nkc(K) * 1024;
}

static inline void coli_gemm_pack(const int8_t *q, int P, int K, int8_t *out, int32_t *sums)
{
    int nkc = coli_gemm_nkc(K);
    for (int p = 0; sums && p < P; p++) {         /* the rows' sums (the VNNI kernel's bias term) */
        int32_t t = 0;
        for (int k = 0; k < K; k++)
            t += q[(long)p * K + k];
        sums[p] = t;
    }
    for (int b = 0; b < (P + 15) / 16; b++)
        for (int c = 0; c < nkc; c++) {
            int8_t *t = out + ((long)b * nkc + c) * 1024;
            int kn = K - 64 * c < 64 ? K - 64 * c : 64;
            for (int n = 0; n < 16; n++) {
                int p = 16 * b + n, len = p < P ? kn : 0;
                if (len)
                    memcpy(t + n * 64, q + (long)p * K + 64 * c, (size_t)len);
                if (len < 64)
                    memset(t + n * 64 + len, 0, (size_t)(64 - len));
            }
        }
}

/* A buffer of at least n bytes (64-aligned) owned by the calling thread, grown as needed and kept
 * (slot 0: the packed activations of the caller, slot 1: a worker's weight panel, slot 2: a
 * worker's residual row when activation rows are quantized in parallel). NULL when the memory
 * cannot be had. */
static inline int8_t *coli_gemm_scratch(int slot, long n)
{
    static __thread int8_t *buf[3];
    static __thread long cap[3];
    if (cap[slot] < n) {
        free(buf[slot]);
        long sz = (n + 63) / 64 * 64;
        buf[slot] = (int8_t *)aligned_alloc(64, (size_t)sz);
        cap[slot] = buf[slot] ? sz : 0;
    }
    return buf[slot];
}

/* The weights of row `row` from byte b on (plain rows of rb bytes, or groups of four interleaved
 * rows, coli_rows4.h): the pieces read (32 or 64 bytes from a multiple of their size) never
 * straddle a 64-byte chunk of the interleaved layout. */
static inline const uint8_t *coli_gemm_row_at(const uint8_t *w, long rb, long O, int ilv, long row, long b)
{
    long g0 = row - row % 4;
    if (ilv && g0 + 4 <= O) {
        coli_rows_view v = coli_rows_at(w + g0 * rb, rb, 1, (int)(row - g0));
        return b < v.full ? v.w + (b / COLI_ILV_CHUNK) * v.cs + b % COLI_ILV_CHUNK : v.tw + (b - v.full);
    }
    return w + row * rb + b;
}

/* The 64 inputs of chunk c of a weight row as int8 (int4: v = u - 8), zeros past input K-1. */
static inline void coli_gemm_chunk_scalar(const uint8_t *w, long rb, long O, int ilv, int i4, long row, int c,
                                          int K, int8_t *out)
{
    int k0 = 64 * c, kn = K - k0 < 64 ? K - k0 : 64;
    const uint8_t *p = coli_gemm_row_at(w, rb, O, ilv, row, i4 ? k0 / 2 : k0);
    memset(out, 0, 64);
    for (int k = 0; k < kn; k++)
        out[k] = i4 ? (int8_t)(((k & 1) ? p[k / 2] >> 4 : p[k / 2] & 15) - 8) : (int8_t)p[k];
}

/* ================================ scalar (the definition) ================================ */

static inline void coli_gemm_rows_scalar(const uint8_t *w, long rb, long O, int ilv, int i4, int o0, int nw,
                                         const float *ws, const int8_t *q, int P, int K, const float *xs,
                                         int idot2, float *y, long ldy)
{
    int8_t row[64];
    for (int r = 0; r < nw; r++)
        for (int p = 0; p < P; p++) {
            int32_t d1 = 0, d2 = 0;
            for (int c = 0; c < coli_gemm_nkc(K); c++) {
                coli_gemm_chunk_scalar(w, rb, O, ilv, i4, o0 + r, c, K, row);
                for (int k = 0; k < 64 && 64 * c + k < K; k++) {
                    d1 += (int32_t)row[k] * q[(long)p * K + 64 * c + k];
                    if (idot2)
                        d2 += (int32_t)row[k] * q[((long)P + p) * K + 64 * c + k];
                }
            }
            float t = coli_block_acc(0.0f, xs[p], d1);
            if (idot2)
                t = t + coli_block_acc(0.0f, xs[P + p], d2);
            y[(long)p * ldy + o0 + r] = t * ws[o0 + r];
        }
}

#if COLI_X86
/* out[kk] = dword kk of every r[n] (a 16 x 16 transpose of 32-bit elements in four rounds of
 * shuffles: after the 32- and 64-bit interleaves, u[4i + j] holds, in each 128-bit lane L, rows
 * 4i .. 4i+3 of column 4L + j; the lane shuffles gather column 4L + j's four lanes). */
COLI_AVX512 static inline void coli_transpose16_epi32(const __m512i r[16], __m512i out[16])
{
    __m512i t[16], u[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    for (int j = 0; j < 4; j++) {
        __m512i a = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x44), b = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x44);
        __m512i c = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xEE), d = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xEE);
        out[j] = _mm512_shuffle_i32x4(a, b, 0x88);
        out[4 + j] = _mm512_shuffle_i32x4(a, b, 0xDD);
        out[8 + j] = _mm512_shuffle_i32x4(c, d, 0x88);
        out[12 + j] = _mm512_shuffle_i32x4(c, d, 0xDD);
    }
}

/* The panel of weight rows o0 .. o0+nw-1 (rows past nw: zeros): for each chunk c, two B tiles
 * (rows o0 .. o0+15, o0+16 .. o0+31) at A + (2c + t)*1024, each its 16 rows' 64 inputs transposed by
 * dwords: as int8 v (unsig = 0, AMX's TDPBSSD), or as the unsigned operand vpdpbusd wants (unsig =
 * 1: int4 u = v + 8, int8 w + 128; zeros past input K-1 either way). */
COLI_AVX512 static inline void coli_gemm_panel(const uint8_t *w, long rb, long O, int ilv, int i4, int o0, int nw,
                                               int K, int unsig, int8_t *A)
{
    int nkc = coli_gemm_nkc(K), full = K / 64;
    const __m512i eight = _mm512_set1_epi8(unsig ? 0 : 8), flip = _mm512_set1_epi8(unsig ? (char)0x80 : 0);
    int8_t tail[64] __attribute__((aligned(64)));
    __m512i r[16], out[16];
    for (int c = 0; c < nkc; c++)
        for (int t = 0; t < 2; t++) {
            int8_t *dst = A + (2L * c + t) * 1024;
            if (16 * t >= nw) {
                memset(dst, 0, 1024);
                continue;
            }
            for (int n = 0; n < 16; n++) {
                int row = 16 * t + n;
                if (row >= nw) {
                    r[n] = _mm512_setzero_si512();
                } else if (c < full) {
                    const uint8_t *p = coli_gemm_row_at(w, rb, O, ilv, o0 + row, i4 ? 32L * c : 64L * c);
                    r[n] = i4 ? _mm512_sub_epi8(coli_i4x64_unpack_avx512(_mm256_loadu_si256((const __m256i *)p)),
                                                eight)
                              : _mm512_xor_si512(_mm512_loadu_si512((const void *)p), flip);
                } else {        /* the last, partial chunk: v, made unsigned where it is a weight */
                    int kn = K - 64 * c;
                    coli_gemm_chunk_scalar(w, rb, O, ilv, i4, o0 + row, c, K, tail);
                    for (int k = 0; unsig && k < kn; k++)
                        tail[k] = (int8_t)(i4 ? tail[k] + 8 : (uint8_t)tail[k] ^ 0x80);
                    r[n] = _mm512_load_si512((const void *)tail);
                }
            }
            coli_transpose16_epi32(r, out);
            for (int kk = 0; kk < 16; kk++)
                _mm512_store_si512((void *)(dst + kk * 64), out[kk]);
        }
}

/* One output row piece: ((0 + s1*(float)d1) [+ (0 + s2*(float)d2)]) * wv for 16 weight rows, stored
 * under mask k: each lane the scalar definition's operations in its order (the asm keeps the
 * products from contracting into FMAs, as coli_block_acc does). two = 0: idot 1 (d2, s2 unused). */
COLI_AVX512 static inline void coli_gemm_out16(__m512i d1, __m512i d2, int two, float s1, float s2, __m512 wv,
                                               __mmask16 k, float *dst)
{
    __m512 p1 = _mm512_mul_ps(_mm512_set1_ps(s1), _mm512_cvtepi32_ps(d1));
    __asm__("" : "+v"(p1));
    __m512 t = _mm512_add_ps(_mm512_setzero_ps(), p1);
    if (two) {
        __m512 p2 = _mm512_mul_ps(_mm512_set1_ps(s2), _mm512_cvtepi32_ps(d2));
        __asm__("" : "+v"(p2));
        t = _mm512_add_ps(t, _mm512_add_ps(_mm512_setzero_ps(), p2));
    }
    _mm512_mask_storeu_ps(dst, k, _mm512_mul_ps(t, wv));
}

/* C tiles [16 activation rows, 16 weight rows] into y: activation rows p0 + m, weight rows o0 + n0 + n;
 * with idot=2, C2 holds the residual rows' dots (scales xs2). A row of C at a time. */
COLI_AVX512 static inline void coli_gemm_store(const int32_t *C1, const int32_t *C2, int n0, int nw, int p0, int P,
                                            const float *xs1, const float *xs2, const float *ws, int o0, float *y,
                                            long ldy)
{
    int nn = nw - n0 < 16 ? nw - n0 : 16;
    __mmask16 k = (__mmask16)((1u << nn) - 1);
    __m512 wv = _mm512_maskz_loadu_ps(k, ws + o0 + n0);
    for (int m = 0; m < 16 && p0 + m < P; m++) {
        int p = p0 + m;
        __m512i d1 = _mm512_load_si512((const void *)(C1 + m * 16));
        __m512i d2 = C2 ? _mm512_load_si512((const void *)(C2 + m * 16)) : d1;
        coli_gemm_out16(d1, d2, C2 != NULL, xs1[p], C2 ? xs2[p] : 0.0f, wv, k, y + (long)p * ldy + o0 + n0);
    }
}


/* ===================================== AVX-512 VNNI ===================================== */

/* The weight rows o0 .. o0+nw-1 (nw <= COLI_GEMM_COLS) against the packed rows (the layout AMX's A
 * tiles read; row p's dword kk of chunk c at packed + (b*nkc + c)*1024 + n*64 + 4*kk, p = 16b + n),
 * sums[p] their sums: per 4 inputs, two weight vectors (32 weight rows x 4 unsigned inputs, the
 * panel of coli_gemm_panel with unsig) and one vpdpbusd per activation row and vector against the
 * row's 4 inputs broadcast; dot = sum u*x - bias * sum x (bias 8 for int4, 128 for int8), exact.
 * Eight activation rows at a time: with idot2 four rows and their four residual rows. y as
 * coli_gemm_rows_scalar; -1 (nothing written) when the panel's memory cannot be had. */
COLI_AVX512 static inline int coli_gemm_rows_vnni(const uint8_t *w, long rb, long O, int ilv, int i4, int o0, int nw,
                                                  const float *ws, const int8_t *packed, const int32_t *sums, int P,
                                                  int K, const float *xs, int idot2, float *y, long ldy)
{
    int nkc = coli_gemm_nkc(K), nblk = (P + 15) / 16, R = idot2 ? 4 : 8;
    long bs = (long)nkc * 1024, half = (long)nblk * bs;
    int8_t *B = coli_gemm_scratch(1, 2L * nkc * 1024);
    if (B == NULL)
        return -1;
    coli_gemm_panel(w, rb, O, ilv, i4, o0, nw, K, 1, B);
    const __m512i bias = _mm512_set1_epi32(i4 ? 8 : 128);
    __mmask16 k0 = (__mmask16)(nw >= 16 ? 0xFFFF : (1u << nw) - 1);
    __mmask16 k1 = (__mmask16)(nw <= 16 ? 0 : nw >= 32 ? 0xFFFF : (1u << (nw - 16)) - 1);
    __m512 w0 = _mm512_maskz_loadu_ps(k0, ws + o0), w1 = _mm512_maskz_loadu_ps(k1, ws + o0 + 16);
    for (int p0 = 0; p0 < P; p0 += R) {
        __m512i acc[8][2];
        const int8_t *row[8];
        for (int r = 0; r < 8; r++)
            acc[r][0] = acc[r][1] = _mm512_setzero_si512();
        for (int c = 0; c < nkc; c++) {
            for (int r = 0; r < 8; r++) {    /* row r: p0 + r (idot1), or p0 + r % 4 of q1 / q2 (idot2) */
                int p = idot2 ? p0 + r % 4 : p0 + r;
                row[r] = packed + (idot2 && r >= 4 ? half : 0) + ((long)(p / 16) * nkc + c) * 1024 + (p % 16) * 64;
            }
            const int8_t *bt = B + 2L * c * 1024;
            for (int kk = 0; kk < 16; kk++) {
                __m512i b0 = _mm512_load_si512((const void *)(bt + kk * 64));
                __m512i b1 = _mm512_load_si512((const void *)(bt + 1024 + kk * 64));
                for (int r = 0; r < 8; r++) {
                    int32_t x4;
                    memcpy(&x4, row[r] + 4 * kk, 4);
                    __m512i xv = _mm512_set1_epi32(x4);
                    acc[r][0] = _mm512_dpbusd_epi32(acc[r][0], b0, xv);
                    acc[r][1] = _mm512_dpbusd_epi32(acc[r][1], b1, xv);
                }
            }
        }
        for (int i = 0; i < R && p0 + i < P; i++) {
            int p = p0 + i;
            for (int t = 0; t < 2; t++) {
                __mmask16 k = t ? k1 : k0;
                if (!k)
                    continue;
                __m512i d1 = _mm512_sub_epi32(acc[i][t], _mm512_mullo_epi32(bias, _mm512_set1_epi32(sums[p])));
                __m512i d2 = idot2 ? _mm512_sub_epi32(acc[4 + i][t],
                                                      _mm512_mullo_epi32(bias, _mm512_set1_epi32(sums[P + p])))
                                   : d1;
                coli_gemm_out16(d1, d2, idot2, xs[p], idot2 ? xs[P + p] : 0.0f, t ? w1 : w0, k,
                                y + (long)p * ldy + o0 + 16 * t);
            }
        }
    }
    return 0;
}
#endif

#if COLI_HAVE_AMX
/* ========================================== AMX ========================================== */

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} coli_tilecfg;

static int coli_amx_on = 0;

/* Whether the CPU and the OS let this process use AMX-INT8 tiles (asks the permission once). */
static inline int coli_amx_supported(void)
{
    static int known = -1;
    if (known >= 0)
        return known;
    unsigned a, b, c, d;
    known = 0;
    if (__get_cpuid_max(0, 0) < 7)
        return known;
    __cpuid_count(7, 0, a, b, c, d);
    if (!((d >> 24) & 1) || !((d >> 25) & 1))          /* AMX-TILE, AMX-INT8 */
        return known;
    __cpuid(1, a, b, c, d);
    if (!((c >> 27) & 1))                                /* OSXSAVE: xgetbv allowed */
        return known;
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if (((lo >> 17) & 3) != 3)                           /* XTILECFG, XTILEDATA saved by the OS */
        return known;
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) != 0)
        return known;
    known = 1;
    return known;
}

/* The weight rows o0 .. o0+nw-1 (nw <= COLI_GEMM_COLS) against the packed activation rows (P rows,
 * then with idot2 their P residual rows from packed + coli_gemm_packed_bytes(P, K)): y as
 * coli_gemm_rows_scalar. Returns -1 (nothing written) when the panel's memory cannot be had. */
COLI_AMX static inline int coli_gemm_rows_amx(const uint8_t *w, long rb, long O, int ilv, int i4, int o0, int nw,
                                              const float *ws, const int8_t *packed, int P, int K,
                                              const float *xs, int idot2, float *y, long ldy)
{
    int nkc = coli_gemm_nkc(K), nblk = (P + 15) / 16;
    long bs = (long)nkc * 1024;                         /* bytes of one block of 16 packed rows */
    int8_t *B = coli_gemm_scratch(1, 2L * nkc * 1024);
    if (B == NULL)
        return -1;
    coli_gemm_panel(w, rb, O, ilv, i4, o0, nw, K, 0, B);
    coli_tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
    int32_t C[4][256] __attribute__((aligned(64)));
    int two_w = nw > 16;
    for (int b = 0; b < nblk; b += idot2 ? 1 : 2) {
        /* tiles: 0 = A0·B0, 1 = A0·B1, 2 = A1·B0, 3 = A1·B1; 4, 5 = A0, A1 (activations); 6, 7 = B0, B1 */
        const int8_t *A0 = packed + b * bs;
        const int8_t *A1 = idot2 ? packed + (nblk + b) * bs : (b + 1 < nblk ? packed + (b + 1) * bs : NULL);
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int c = 0; c < nkc; c++) {
            const int8_t *bt = B + 2L * c * 1024;
            _tile_loadd(4, A0 + 1024L * c, 64);
            _tile_loadd(6, bt, 64);
            _tile_dpbssd(0, 4, 6);
            if (two_w) {
                _tile_loadd(7, bt + 1024, 64);
                _tile_dpbssd(1, 4, 7);
            }
            if (A1) {
                _tile_loadd(5, A1 + 1024L * c, 64);
                _tile_dpbssd(2, 5, 6);
                if (two_w)
                    _tile_dpbssd(3, 5, 7);
            }
        }
        _tile_stored(0, C[0], 64);
        _tile_stored(1, C[1], 64);
        _tile_stored(2, C[2], 64);
        _tile_stored(3, C[3], 64);
        if (idot2) {
            coli_gemm_store(C[0], C[2], 0, nw, 16 * b, P, xs, xs + P, ws, o0, y, ldy);
            if (two_w)
                coli_gemm_store(C[1], C[3], 16, nw, 16 * b, P, xs, xs + P, ws, o0, y, ldy);
        } else {
            coli_gemm_store(C[0], NULL, 0, nw, 16 * b, P, xs, NULL, ws, o0, y, ldy);
            if (two_w)
                coli_gemm_store(C[1], NULL, 16, nw, 16 * b, P, xs, NULL, ws, o0, y, ldy);
            if (A1) {
                coli_gemm_store(C[2], NULL, 0, nw, 16 * (b + 1), P, xs, NULL, ws, o0, y, ldy);
                if (two_w)
                    coli_gemm_store(C[3], NULL, 16, nw, 16 * (b + 1), P, xs, NULL, ws, o0, y, ldy);
            }
        }
    }
    _tile_release();
    return 0;
}

static inline int coli_amx_select(int on)
{
    coli_amx_on = on && coli_amx_supported();
    return coli_amx_on;
}

static inline int coli_amx_active(void) { return coli_amx_on; }

#else /* no AMX: the path stays off */

static inline int coli_amx_supported(void) { return 0; }
static inline int coli_amx_select(int on) { (void)on; return 0; }
static inline int coli_amx_active(void) { return 0; }
#endif

/* The weight rows o0 .. o0+nw-1 against the packed rows: on AMX tiles when they are on, else with
 * AVX-512 VNNI (the caller checks that ISA is active); -1 where neither exists (or no memory). */
static inline int coli_gemm_rows(const uint8_t *w, long rb, long O, int ilv, int i4, int o0, int nw, const float *ws,
                                 const int8_t *packed, const int32_t *sums, int P, int K, const float *xs, int idot2,
                                 float *y, long ldy)
{
#if COLI_HAVE_AMX
    if (coli_amx_active())
        return coli_gemm_rows_amx(w, rb, O, ilv, i4, o0, nw, ws, packed, P, K, xs, idot2, y, ldy);
#endif
#if COLI_X86
    return coli_gemm_rows_vnni(w, rb, O, ilv, i4, o0, nw, ws, packed, sums, P, K, xs, idot2, y, ldy);
#else
    (void)w; (void)rb; (void)O; (void)ilv; (void)i4; (void)o0; (void)nw; (void)ws; (void)packed; (void)sums;
    (void)P; (void)K; (void)xs; (void)idot2; (void)y; (void)ldy;
    return -1;
#endif
}

#endif /* COLI_GEMM_H */
