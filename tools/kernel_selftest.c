/* Self-test and micro-benchmark of the colibri kernels (include/coli_*.h).
 *
 *   gcc -O2 -I include tools/kernel_selftest.c -o /tmp/kst -lm && /tmp/kst [--no-bench]
 *
 * For every ISA this CPU supports (selected through the public coli_select_isa, then called
 * through the public dispatching entry points) and every size n in 1..300 plus larger ones:
 *   - integer dots must equal an independent int64 reference exactly;
 *   - row dots and the quantizer must be bit-identical to the scalar variant (and the row dots
 *     close to a double reference);
 *   - float dots must be within REL_TOL * sum|a_i*b_i| of a double reference;
 *   - the multi-activation row dots (coli_rowdot2_*, coli_rowdot_*_rows, R = 1..8, strides larger
 *     than n) must be bit-identical to the equivalent single-row calls, on the active ISA and on
 *     the scalar one, and must not write past out[R-1];
 *   - the per-row-scale tiles (coli_rowdot_*_tile: 1..4 weight rows, plain or interleaved, x 1..7
 *     activation rows, with and without block sums and split activations) must be bit-identical to
 *     the one-row calls;
 *   - the group-scaled row dots (coli_rowdotg_*, groups of 64/128/256 with a partial last group,
 *     any activation block) must be bit-identical to the scalar variant, close to a double
 *     reference of their definition, and their multi-row form (R = 1..8) and their tile form
 *     (1..4 weight rows x 1..5 activation rows) to the one-row calls;
 *   - the float row kernels of attention (coli_dots_f32 over 16-row blocks, with an index, and the
 *     multi-query coli_dots_f32_multi / coli_axpy_rows_f32_multi) must be bit-identical to the
 *     one-row calls.
 * Every input buffer ends right before a PROT_NONE page, so a read past the end crashes (for the
 * strided rows: the last row's activations and scales end at the page).
 * Exit status 0 on success.
 */
#define _DEFAULT_SOURCE /* MAP_ANONYMOUS, clock_gettime under -std=c99 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "coli_kernels.h"

#define REL_TOL 1e-5

static long g_checks, g_fail;

#define CHECK(cond, ...)                                                   \
    do {                                                                   \
        g_checks++;                                                        \
        if (!(cond)) {                                                     \
            if (++g_fail <= 30) {                                          \
                printf("FAIL %s:%d: ", __FILE__, __LINE__);                \
                printf(__VA_ARGS__);                                       \
                printf("\n");                                              \
            }                                                              \
        }                                                                  \
    } while (0)

/* ---------------------------------------- utilities ---------------------------------------- */

#include "coli_tool_util.h"

static float rndf(void) { return (float)((double)rnd() / 4294967296.0 * 2.0 - 1.0); } /* [-1, 1) */

/* Buffer of `bytes` bytes whose end touches an inaccessible page. */
static void *galloc(size_t bytes)
{
    size_t pg = (size_t)sysconf(_SC_PAGESIZE);
    size_t body = (bytes + pg - 1) / pg * pg;
    char *base = mmap(NULL, body + pg, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base == MAP_FAILED || mprotect(base + body, pg, PROT_NONE) != 0) {
        perror("mmap");
        exit(2);
    }
    return base + body - bytes;
}

static void gfree(void *p, size_t bytes)
{
    size_t pg = (size_t)sysconf(_SC_PAGESIZE);
    size_t body = (bytes + pg - 1) / pg * pg;
    munmap((char *)p + bytes - body, body + pg);
}

static int nib(const uint8_t *wp, int i) { return (i & 1) ? (wp[i / 2] >> 4) : (wp[i / 2] & 15); }

static int64_t ref_i8(const int8_t *w, const int8_t *x, int n)
{
    int64_t s = 0;
    for (int i = 0; i < n; i++)
        s += (int64_t)w[i] * x[i];
    return s;
}

static int64_t ref_i4(const uint8_t *wp, const int8_t *x, int n)
{
    int64_t s = 0;
    for (int i = 0; i < n; i++)
        s += (int64_t)(nib(wp, i) - 8) * x[i];
    return s;
}

/* double reference of sum_i a(i)*b[i] and its condition scale sum_i |a(i)*b[i]| */
typedef struct { double val, mag; } fref;

static fref ref_f32(const float *a, const float *b, int n)
{
    fref r = {0, 0};
    for (int i = 0; i < n; i++) {
        r.val += (double)a[i] * b[i];
        r.mag += fabs((double)a[i] * b[i]);
    }
    return r;
}

static fref ref_q8f32(const int8_t *w, const float *x, int n)
{
    fref r = {0, 0};
    for (int i = 0; i < n; i++) {
        r.val += (double)w[i] * x[i];
        r.mag += fabs((double)w[i] * x[i]);
    }
    return r;
}

static fref ref_q4f32(const uint8_t *wp, const float *x, int n)
{
    fref r = {0, 0};
    for (int i = 0; i < n; i++) {
        double v = (double)(nib(wp, i) - 8) * x[i];
        r.val += v;
        r.mag += fabs(v);
    }
    return r;
}

static int close_to(double got, fref r, double tol)
{
    return fabs(got - r.val) <= tol * r.mag + 1e-30;
}

static int same_bits(float a, float b) { return memcmp(&a, &b, sizeof a) == 0; }

/* The quantizer's definition, written out independently. */
static void ref_quant(const float *x, int n, int block, int8_t *q, float *xs)
{
    if (block <= 0 || block > n)
        block = n;
    for (int i0 = 0, b = 0; i0 < n; i0 += block, b++) {
        int end = i0 + block < n ? i0 + block : n;
        float amax = 0.0f;
        for (int i = i0; i < end; i++)
            amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
        float s = amax / 127.0f;
        s = s < 1e-12f ? 1e-12f : s;
        float inv = 1.0f / s;
        for (int i = i0; i < end; i++)
            q[i] = (int8_t)lrintf(x[i] * inv);
        xs[b] = s;
    }
}

/* ------------------------------------------ tests ------------------------------------------ */

enum { FILL_RANDOM, FILL_EXTREME_POS, FILL_EXTREME_NEG, FILL_TIES, FILL_ZERO };

typedef struct {
    int n, nb4;         /* elements, packed int4 bytes */
    int8_t *w8, *x8;
    uint8_t *w4;
    float *xf, *af, *xs;
    int8_t *q;
    float *qs;
} bufs;

static bufs balloc(int n)
{
    bufs b;
    b.n = n;
    b.nb4 = (n + 1) / 2;
    b.w8 = galloc(n);
    b.x8 = galloc(n);
    b.w4 = galloc(b.nb4);
    b.xf = galloc(sizeof(float) * n);
    b.af = galloc(sizeof(float) * n);
    b.xs = galloc(sizeof(float) * n);  /* enough scales for any block >= 1 */
    b.q = galloc(n);
    b.qs = galloc(sizeof(float) * n);
    return b;
}

static void bfree(bufs *b)
{
    int n = b->n;
    gfree(b->w8, n); gfree(b->x8, n); gfree(b->w4, b->nb4);
    gfree(b->xf, sizeof(float) * n); gfree(b->af, sizeof(float) * n); gfree(b->xs, sizeof(float) * n);
    gfree(b->q, n); gfree(b->qs, sizeof(float) * n);
}

static void fill(bufs *b, int mode)
{
    int n = b->n;
    for (int i = 0; i < n; i++) {
        switch (mode) {
        case FILL_EXTREME_POS: /* largest positive products: (-128)(-127), v=-8 (u=0) vs -127 */
            b->w8[i] = -128; b->x8[i] = -127; break;
        case FILL_EXTREME_NEG:
            b->w8[i] = -128; b->x8[i] = 127; break;
        default:
            b->w8[i] = (int8_t)(rnd() & 0xFF);      /* full range, -128 included */
            b->x8[i] = (int8_t)((int)(rnd() % 255) - 127);
        }
        b->xf[i] = rndf() * 3.0f;
        b->af[i] = rndf();
        b->xs[i] = 1e-3f + (float)(rnd() % 1000) * 1e-4f;
    }
    for (int j = 0; j < b->nb4; j++)
        b->w4[j] = mode == FILL_EXTREME_POS || mode == FILL_EXTREME_NEG ? 0x00 : (uint8_t)(rnd() & 0xFF);
    /* odd n: the padding nibble holds garbage on purpose, it must not matter */
    if (n & 1)
        b->w4[n / 2] = (uint8_t)((b->w4[n / 2] & 0x0F) | ((rnd() & 15) << 4));
    if (mode == FILL_TIES) /* amax 127 per 64-block -> inv = 1: exercises round-half-to-even */
        for (int i = 0; i < n; i++)
            b->xf[i] = (i % 64 == 0) ? 127.0f : (float)((int)(rnd() % 200) - 100) + 0.5f;
    if (mode == FILL_ZERO)
        for (int i = 0; i < n; i++)
            b->xf[i] = 0.0f;
}

static double g_maxrel[3][3]; /* [isa][f32, q8f32, q4f32]: worst |err| / sum|ab| seen */

static void note_rel(int isa, int k, double got, fref r)
{
    double rel = r.mag > 0 ? fabs(got - r.val) / r.mag : 0;
    if (rel > g_maxrel[isa][k])
        g_maxrel[isa][k] = rel;
}

/* Checks the active ISA on one buffer set. */
static void check_all(int isa, bufs *b)
{
    int n = b->n;
    const int blocks[] = {64, 128, 192, 256, 4096, n, n + 1000, 0};

    int64_t r8 = ref_i8(b->w8, b->x8, n), r4 = ref_i4(b->w4, b->x8, n);
    if (n <= 65536) /* the documented exactness limit for int8 */
        CHECK(coli_dot_i8i8(b->w8, b->x8, n) == r8, "dot_i8i8 isa=%d n=%d got %d want %lld", isa, n,
              coli_dot_i8i8(b->w8, b->x8, n), (long long)r8);
    CHECK(coli_dot_i4i8(b->w4, b->x8, n) == r4, "dot_i4i8 isa=%d n=%d got %d want %lld", isa, n,
          coli_dot_i4i8(b->w4, b->x8, n), (long long)r4);

    for (size_t k = 0; k < sizeof blocks / sizeof blocks[0]; k++) {
        int blk = blocks[k];
        if (n > 65536 && (blk <= 0 || blk >= n))
            continue; /* whole-row int8 blocks beyond the exactness limit */
        float g8 = coli_rowdot_i8(b->w8, b->x8, b->xs, n, blk);
        float s8 = coli_rowdot_i8_scalar(b->w8, b->x8, b->xs, n, blk);
        float g4 = coli_rowdot_i4(b->w4, b->x8, b->xs, n, blk);
        float s4 = coli_rowdot_i4_scalar(b->w4, b->x8, b->xs, n, blk);
        CHECK(same_bits(g8, s8), "rowdot_i8 isa=%d n=%d block=%d got %.9g scalar %.9g", isa, n, blk, g8, s8);
        CHECK(same_bits(g4, s4), "rowdot_i4 isa=%d n=%d block=%d got %.9g scalar %.9g", isa, n, blk, g4, s4);

        /* and the scalar definition against a double evaluation of the same formula */
        int bl = coli_block_len(n, blk);
        fref f8 = {0, 0}, f4 = {0, 0};
        for (int i = 0, bi = 0; i < n; i += bl, bi++) {
            int len = n - i < bl ? n - i : bl;
            double d8 = (double)b->xs[bi] * (double)ref_i8(b->w8 + i, b->x8 + i, len);
            double d4 = (double)b->xs[bi] * (double)ref_i4(b->w4 + i / 2, b->x8 + i, len);
            f8.val += d8; f8.mag += fabs(d8);
            f4.val += d4; f4.mag += fabs(d4);
        }
        CHECK(close_to(s8, f8, 1e-5), "rowdot_i8 scalar n=%d block=%d got %.9g want %.9g", n, blk, s8, f8.val);
        CHECK(close_to(s4, f4, 1e-5), "rowdot_i4 scalar n=%d block=%d got %.9g want %.9g", n, blk, s4, f4.val);
    }

    fref rf = ref_f32(b->af, b->xf, n), rq8 = ref_q8f32(b->w8, b->xf, n), rq4 = ref_q4f32(b->w4, b->xf, n);
    float gf = coli_dot_f32(b->af, b->xf, n), gq8 = coli_dot_q8f32(b->w8, b->xf, n);
    float gq4 = coli_dot_q4f32(b->w4, b->xf, n);
    CHECK(close_to(gf, rf, REL_TOL), "dot_f32 isa=%d n=%d got %.9g want %.9g", isa, n, gf, rf.val);
    CHECK(close_to(gq8, rq8, REL_TOL), "dot_q8f32 isa=%d n=%d got %.9g want %.9g", isa, n, gq8, rq8.val);
    CHECK(close_to(gq4, rq4, REL_TOL), "dot_q4f32 isa=%d n=%d got %.9g want %.9g", isa, n, gq4, rq4.val);
    note_rel(isa, 0, gf, rf);
    note_rel(isa, 1, gq8, rq8);
    note_rel(isa, 2, gq4, rq4);

    const int qblocks[] = {64, 128, 192, n, 0};
    for (size_t k = 0; k < sizeof qblocks / sizeof qblocks[0]; k++) {
        int blk = qblocks[k], nbk = (n + coli_block_len(n, blk) - 1) / coli_block_len(n, blk);
        int8_t *qr = malloc((size_t)n);
        float *sr = malloc(sizeof(float) * (size_t)nbk);
        ref_quant(b->xf, n, blk, qr, sr);
        if (nbk < n)
            b->qs[nbk] = -1.0f; /* sentinel: no scale written past the last block */
        coli_quantize_q8(b->xf, n, blk, b->q, b->qs);
        CHECK(nbk == n || b->qs[nbk] == -1.0f, "quantize_q8 wrote past xs[%d] isa=%d n=%d", nbk - 1, isa, n);
        CHECK(memcmp(qr, b->q, (size_t)n) == 0, "quantize_q8 q isa=%d n=%d block=%d", isa, n, blk);
        CHECK(memcmp(sr, b->qs, sizeof(float) * (size_t)nbk) == 0, "quantize_q8 xs isa=%d n=%d block=%d",
              isa, n, blk);
        free(qr);
        free(sr);
    }
}

/* The float row kernels of attention on the active ISA: coli_dots_f32 (16-row transposed sums,
 * with and without an index) and coli_dots_f32_multi must give coli_dot_f32 per (query, row) bit
 * for bit; coli_axpy_rows_f32_multi each output's coli_axpy_rows_f32; none writes past its end. */
static void check_float_rows(int isa)
{
    const int ns[] = {1, 7, 16, 31, 32, 33, 63, 64, 65, 96, 128, 129, 300};
    const int nrs[] = {1, 2, 15, 16, 17, 33, 70};
    enum { NQ = 5, NRMAX = 70, PAD = 8 };
    for (size_t a = 0; a < sizeof ns / sizeof ns[0]; a++)
        for (size_t b = 0; b < sizeof nrs / sizeof nrs[0]; b++) {
            int n = ns[a], nr = nrs[b];
            long stride = n + 5, xstride = n + 3, ostride = nr + PAD, ystride = n + PAD;
            float *rows = malloc(sizeof(float) * (size_t)stride * NRMAX);
            float *x = malloc(sizeof(float) * (size_t)xstride * NQ);
            float *out = malloc(sizeof(float) * (size_t)ostride * NQ);
            float *c = malloc(sizeof(float) * (size_t)ostride * NQ);
            float *y = malloc(sizeof(float) * (size_t)ystride * NQ), *yr = malloc(sizeof(float) * (size_t)n);
            int idx[NRMAX];
            for (long i = 0; i < stride * NRMAX; i++) rows[i] = rndf();
            for (long i = 0; i < xstride * NQ; i++) x[i] = rndf() * 2.0f;
            for (long i = 0; i < ostride * NQ; i++) c[i] = rndf();
            for (int r = 0; r < nr; r++) idx[r] = (int)(rnd() % NRMAX);
            for (int nq = 1; nq <= NQ; nq++)
            for (int use_idx = 0; use_idx < 2; use_idx++) {
                for (long i = 0; i < ostride * NQ; i++) out[i] = -7.0f;
                coli_dots_f32_multi(x, xstride, nq, n, rows, stride, use_idx ? idx : NULL, nr, out, ostride);
                for (int q = 0; q < NQ; q++)
                    for (int r = 0; r < ostride; r++) {
                        float got = out[q * ostride + r];
                        if (q < nq && r < nr)
                            CHECK(same_bits(got, coli_dot_f32(x + q * xstride, rows + (long)(use_idx ? idx[r] : r) * stride, n)),
                                  "dots_f32_multi isa=%d n=%d nr=%d nq=%d q=%d r=%d", isa, n, nr, nq, q, r);
                        else
                            CHECK(got == -7.0f, "dots_f32_multi wrote past isa=%d n=%d nr=%d", isa, n, nr);
                    }
                for (long i = 0; i < ystride * NQ; i++) y[i] = (float)(i % 13) * 0.25f;
                coli_axpy_rows_f32_multi(y, ystride, nq, n, c, ostride, rows, stride, use_idx ? idx : NULL, nr);
                for (int q = 0; q < NQ; q++) {
                    for (int i = 0; i < n; i++) yr[i] = (float)((q * ystride + i) % 13) * 0.25f;
                    if (q < nq)
                        coli_axpy_rows_f32_scalar(yr, n, c + q * ostride, rows, stride, use_idx ? idx : NULL, nr);
                    CHECK(memcmp(yr, y + q * ystride, sizeof(float) * (size_t)n) == 0,
                          "axpy_rows_f32_multi isa=%d n=%d nr=%d nq=%d q=%d", isa, n, nr, nq, q);
                    for (int i = n; i < ystride; i++)
                        CHECK(y[q * ystride + i] == (float)((q * ystride + i) % 13) * 0.25f,
                              "axpy_rows_f32_multi wrote past isa=%d n=%d", isa, n);
                }
            }
            out[nr] = -7.0f;
            coli_dots_f32(x, n, rows, stride, idx, nr, out);
            for (int r = 0; r < nr; r++)
                CHECK(same_bits(out[r], coli_dot_f32(x, rows + (long)idx[r] * stride, n)),
                      "dots_f32 idx isa=%d n=%d nr=%d r=%d", isa, n, nr, r);
            CHECK(out[nr] == -7.0f, "dots_f32 wrote past isa=%d n=%d nr=%d", isa, n, nr);
            free(rows); free(x); free(out); free(c); free(y); free(yr);
        }
}

/* Multi-activation row dots on the active ISA: up to MR strided activation rows. */
enum { MR = 8 };

static void fill_q(int8_t *q, size_t len, int mode)
{
    for (size_t i = 0; i < len; i++)
        q[i] = mode == FILL_EXTREME_POS ? -127 : mode == FILL_EXTREME_NEG ? 127
                                                : (int8_t)((int)(rnd() % 255) - 127);
}

static void check_multi(int isa, bufs *b, int mode, int rmask)
{
    int n = b->n;
    const int blocks[] = {64, 128, 192, n, n + 1000, 0};
    for (size_t k = 0; k < sizeof blocks / sizeof blocks[0]; k++) {
        int blk = blocks[k];
        if (n > 65536 && (blk <= 0 || blk >= n))
            continue;
        int bl = coli_block_len(n, blk), nbk = (n + bl - 1) / bl;
        /* two stride settings, both larger than the row: odd (misaligned rows) and padded */
        for (int st = 0; st < 2; st++) {
            long qstride = st ? n + 64 : n + 13, sstride = st ? nbk + 16 : nbk + 3;
            size_t qlen = (size_t)(MR - 1) * qstride + n, slen = (size_t)(MR - 1) * sstride + nbk;
            int8_t *qbuf = galloc(qlen);
            float *sbuf = galloc(sizeof(float) * slen);
            float *out = malloc(sizeof(float) * (MR + 1));
            fill_q(qbuf, qlen, mode);
            for (size_t i = 0; i < slen; i++)
                sbuf[i] = 1e-3f + (float)(rnd() % 1000) * 1e-4f;

            /* rowdot2: q1/xs1 = the bufs row, q2/xs2 = the last row of qbuf/sbuf (guard-ended) */
            const int8_t *q2 = qbuf + qlen - n;
            const float *s2 = sbuf + slen - nbk;
            float w8a = coli_rowdot_i8(b->w8, b->x8, b->xs, n, blk), w8b = coli_rowdot_i8(b->w8, q2, s2, n, blk);
            float w4a = coli_rowdot_i4(b->w4, b->x8, b->xs, n, blk), w4b = coli_rowdot_i4(b->w4, q2, s2, n, blk);
            float e8 = w8a + w8b, e4 = w4a + w4b;
            float sc8 = coli_rowdot_i8_scalar(b->w8, b->x8, b->xs, n, blk) + coli_rowdot_i8_scalar(b->w8, q2, s2, n, blk);
            float sc4 = coli_rowdot_i4_scalar(b->w4, b->x8, b->xs, n, blk) + coli_rowdot_i4_scalar(b->w4, q2, s2, n, blk);
            float g8 = coli_rowdot2_i8(b->w8, b->x8, b->xs, q2, s2, n, blk);
            float g4 = coli_rowdot2_i4(b->w4, b->x8, b->xs, q2, s2, n, blk);
            CHECK(same_bits(g8, e8) && same_bits(g8, sc8), "rowdot2_i8 isa=%d n=%d block=%d got %.9g want %.9g (scalar %.9g)",
                  isa, n, blk, g8, e8, sc8);
            CHECK(same_bits(g4, e4) && same_bits(g4, sc4), "rowdot2_i4 isa=%d n=%d block=%d got %.9g want %.9g (scalar %.9g)",
                  isa, n, blk, g4, e4, sc4);
            /* swapped operands, and q1 == q2 */
            g8 = coli_rowdot2_i8(b->w8, q2, s2, b->x8, b->xs, n, blk);
            g4 = coli_rowdot2_i4(b->w4, q2, s2, b->x8, b->xs, n, blk);
            CHECK(same_bits(g8, w8b + w8a), "rowdot2_i8 swapped isa=%d n=%d block=%d", isa, n, blk);
            CHECK(same_bits(g4, w4b + w4a), "rowdot2_i4 swapped isa=%d n=%d block=%d", isa, n, blk);
            g8 = coli_rowdot2_i8(b->w8, q2, s2, q2, s2, n, blk);
            g4 = coli_rowdot2_i4(b->w4, q2, s2, q2, s2, n, blk);
            CHECK(same_bits(g8, w8b + w8b), "rowdot2_i8 same isa=%d n=%d block=%d", isa, n, blk);
            CHECK(same_bits(g4, w4b + w4b), "rowdot2_i4 same isa=%d n=%d block=%d", isa, n, blk);

            /* rows: R rows placed so that the last one ends at the guard page */
            for (int R = 1; R <= MR; R++) {
                if (!(rmask >> R & 1))
                    continue;
                const int8_t *q = qbuf + qlen - ((size_t)(R - 1) * qstride + n);
                const float *xs = sbuf + slen - ((size_t)(R - 1) * sstride + nbk);
                for (int t = 0; t < 2; t++) { /* t = 0: int8 weights, 1: int4 */
                    for (int r = 0; r <= MR; r++)
                        out[r] = -12345.0f;
                    if (t == 0)
                        coli_rowdot_i8_rows(b->w8, q, qstride, xs, sstride, R, n, blk, out);
                    else
                        coli_rowdot_i4_rows(b->w4, q, qstride, xs, sstride, R, n, blk, out);
                    for (int r = 0; r < R; r++) {
                        const int8_t *qr = q + (size_t)r * qstride;
                        const float *sr = xs + (size_t)r * sstride;
                        float want = t ? coli_rowdot_i4(b->w4, qr, sr, n, blk) : coli_rowdot_i8(b->w8, qr, sr, n, blk);
                        float sc = t ? coli_rowdot_i4_scalar(b->w4, qr, sr, n, blk)
                                     : coli_rowdot_i8_scalar(b->w8, qr, sr, n, blk);
                        CHECK(same_bits(out[r], want) && same_bits(out[r], sc),
                              "rowdot_%s_rows isa=%d n=%d block=%d R=%d r=%d qstride=%ld got %.9g want %.9g (scalar %.9g)",
                              t ? "i4" : "i8", isa, n, blk, R, r, qstride, out[r], want, sc);
                    }
                    CHECK(out[R] == -12345.0f, "rowdot_%s_rows wrote out[%d] isa=%d n=%d R=%d", t ? "i4" : "i8", R,
                          isa, n, R);
                }
            }
            free(out);
            gfree(sbuf, sizeof(float) * slen);
            gfree(qbuf, qlen);
        }
    }
}

/* Group-scaled row dots: weight-group scales ws (one per gs inputs, guard-ended) against the bufs'
 * activations with several activation blocks; the rows form against strided activation rows. */
static void check_grouped(int isa, bufs *b, int mode)
{
    int n = b->n;
    const int sizes[] = {64, 128, 256};
    const int blocks[] = {0, 64, 128, 192, 256, 384};
    for (size_t gi = 0; gi < sizeof sizes / sizeof sizes[0]; gi++) {
        int gs = sizes[gi], G = (n + gs - 1) / gs;
        float *ws = galloc(sizeof(float) * (size_t)G);
        for (int g = 0; g < G; g++)
            ws[g] = 1e-3f + (float)(rnd() % 1000) * 1e-4f;
        for (size_t k = 0; k < sizeof blocks / sizeof blocks[0]; k++) {
            int blk = blocks[k], bl = coli_block_len(n, blk), nbk = (n + bl - 1) / bl;
            if (n > 65536 && bl >= n)
                continue; /* int8 exactness limit per block */
            float g8 = coli_rowdotg_i8(b->w8, ws, gs, b->x8, b->xs, n, blk);
            float s8 = coli_rowdotg_i8_scalar(b->w8, ws, gs, b->x8, b->xs, n, blk);
            float g4 = coli_rowdotg_i4(b->w4, ws, gs, b->x8, b->xs, n, blk);
            float s4 = coli_rowdotg_i4_scalar(b->w4, ws, gs, b->x8, b->xs, n, blk);
            CHECK(same_bits(g8, s8), "rowdotg_i8 isa=%d n=%d gs=%d block=%d got %.9g scalar %.9g", isa, n, gs,
                  blk, g8, s8);
            CHECK(same_bits(g4, s4), "rowdotg_i4 isa=%d n=%d gs=%d block=%d got %.9g scalar %.9g", isa, n, gs,
                  blk, g4, s4);
            /* the definition in double: sum over blocks and their group pieces */
            fref f8 = {0, 0}, f4 = {0, 0};
            for (int i = 0; i < n; i++) {
                int bi = i / bl, g = i / gs;
                double d8 = (double)b->xs[bi] * ws[g] * b->w8[i] * b->x8[i];
                double d4 = (double)b->xs[bi] * ws[g] * (nib(b->w4, i) - 8) * b->x8[i];
                f8.val += d8; f8.mag += fabs(d8);
                f4.val += d4; f4.mag += fabs(d4);
            }
            CHECK(close_to(s8, f8, 1e-5), "rowdotg_i8 scalar n=%d gs=%d block=%d got %.9g want %.9g", n, gs, blk,
                  s8, f8.val);
            if (k == 0) { /* the float path: group dots times their scales */
                fref d8 = {0, 0}, d4 = {0, 0};
                for (int i = 0; i < n; i++) {
                    double a8 = (double)ws[i / gs] * b->w8[i] * b->xf[i], a4 = (double)ws[i / gs] * (nib(b->w4, i) - 8) * b->xf[i];
                    d8.val += a8; d8.mag += fabs(a8);
                    d4.val += a4; d4.mag += fabs(a4);
                }
                float o8, o4;
                coli_dotsg_q8f32(b->xf, n, b->w8, 0, ws, 0, gs, 1, &o8);
                coli_dotsg_q4f32(b->xf, n, b->w4, 0, ws, 0, gs, 1, &o4);
                CHECK(close_to(o8, d8, REL_TOL), "dotsg_q8f32 isa=%d n=%d gs=%d got %.9g want %.9g", isa, n, gs, o8, d8.val);
                CHECK(close_to(o4, d4, REL_TOL), "dotsg_q4f32 isa=%d n=%d gs=%d got %.9g want %.9g", isa, n, gs, o4, d4.val);
            }
            CHECK(close_to(s4, f4, 1e-5), "rowdotg_i4 scalar n=%d gs=%d block=%d got %.9g want %.9g", n, gs, blk,
                  s4, f4.val);
            /* rows: R strided activation rows, the last one ending at the guard page */
            long qstride = n + 13, sstride = nbk + 3;
            size_t qlen = (size_t)(MR - 1) * qstride + n, slen = (size_t)(MR - 1) * sstride + nbk;
            int8_t *qbuf = galloc(qlen);
            float *sbuf = galloc(sizeof(float) * slen);
            float out[MR + 1];
            fill_q(qbuf, qlen, mode);
            for (size_t i = 0; i < slen; i++)
                sbuf[i] = 1e-3f + (float)(rnd() % 1000) * 1e-4f;
            for (int R = 1; R <= MR; R++) {
                const int8_t *q = qbuf + qlen - ((size_t)(R - 1) * qstride + n);
                const float *xs = sbuf + slen - ((size_t)(R - 1) * sstride + nbk);
                if (R == 6 || R == 7)
                    continue; /* 1..5 and 8 cover one to two groups of four rows */
                for (int t = 0; t < 2; t++) {
                    for (int r = 0; r <= MR; r++)
                        out[r] = -12345.0f;
                    if (t == 0)
                        coli_rowdotg_i8_rows(b->w8, ws, gs, q, qstride, xs, sstride, R, n, blk, out);
                    else
                        coli_rowdotg_i4_rows(b->w4, ws, gs, q, qstride, xs, sstride, R, n, blk, out);
                    for (int r = 0; r < R; r++) {
                        const int8_t *qr = q + (size_t)r * qstride;
                        const float *sr = xs + (size_t)r * sstride;
                        float want = t ? coli_rowdotg_i4_scalar(b->w4, ws, gs, qr, sr, n, blk)
                                       : coli_rowdotg_i8_scalar(b->w8, ws, gs, qr, sr, n, blk);
                        CHECK(same_bits(out[r], want), "rowdotg_%s_rows isa=%d n=%d gs=%d block=%d R=%d r=%d "
                              "got %.9g want %.9g", t ? "i4" : "i8", isa, n, gs, blk, R, r, out[r], want);
                    }
                    CHECK(out[R] == -12345.0f, "rowdotg_%s_rows wrote out[%d] isa=%d n=%d", t ? "i4" : "i8", R,
                          isa, n);
                }
            }
            gfree(sbuf, sizeof(float) * slen);
            gfree(qbuf, qlen);
        }
        gfree(ws, sizeof(float) * (size_t)G);
    }
}

/* The lane-form tile: nw = 1..4 weight rows (rows rb apart, the last ending at a guard page) and
 * P = 1..5 activation rows, each output bit-identical to the scalar one-row call. */
static void check_tile(int isa, int n, int mode)
{
    const int sizes[] = {64, 128};
    for (size_t gi = 0; gi < sizeof sizes / sizeof sizes[0]; gi++) {
        int gs = sizes[gi], G = (n + gs - 1) / gs;
        long rb8 = n + 5, rb4 = (n + 1) / 2 + 3, wstride = G + 2, qstride = n + 7, sstride = 3;
        size_t len8 = 3 * rb8 + n, len4 = 3 * rb4 + (n + 1) / 2, wlen = 3 * wstride + G;
        size_t qlen = 4 * qstride + n, slen = 4 * sstride + 1;
        int8_t *w8 = galloc(len8), *q = galloc(qlen);
        uint8_t *w4 = galloc(len4);
        float *ws = galloc(sizeof(float) * wlen), *xs = galloc(sizeof(float) * slen), out[4 * 5 + 1];
        fill_q(w8, len8, mode);
        fill_q(q, qlen, mode);
        for (size_t i = 0; i < len4; i++)
            w4[i] = mode == FILL_EXTREME_POS ? 0x00 : (uint8_t)(rnd() & 0xFF);
        for (size_t i = 0; i < wlen; i++)
            ws[i] = 1e-3f + (float)(rnd() % 1000) * 1e-4f;
        for (size_t i = 0; i < slen; i++)
            xs[i] = 1e-3f + (float)(rnd() % 1000) * 1e-4f;
        /* the activation rows' split forms (the reference splitter), rows gstride bytes apart */
        long gstride = coli_split_len(n) + 64;
        uint8_t *xg = galloc((size_t)(4 * gstride + coli_split_len(n)));
        for (int p = 0; p < 5; p++)
            coli_split_q8_ref(q + p * qstride, n, xg + p * gstride);
        for (int nw = 1; nw <= 4; nw++)
            for (int P = 1; P <= 5; P++)
                for (int t = 0; t < 3; t++) { /* int8, int4, int4 with the split activations */
                    /* the tile placed so that its last weight row ends at the guard page */
                    const int8_t *a8 = w8 + (3 - (nw - 1)) * rb8;
                    const uint8_t *a4 = w4 + (3 - (nw - 1)) * rb4;
                    const float *aws = ws + (3 - (nw - 1)) * wstride;
                    const int8_t *aq = q + (4 - (P - 1)) * qstride;
                    const float *axs = xs + (4 - (P - 1)) * sstride;
                    for (int k = 0; k <= 4 * 5; k++)
                        out[k] = -12345.0f;
                    const uint8_t *axg = xg + (4 - (P - 1)) * gstride;
                    if (t == 0)
                        coli_rowdotg_i8_tile(a8, rb8, nw, aws, wstride, gs, aq, qstride, NULL, 0, axs, sstride, P, n,
                                             out);
                    else
                        coli_rowdotg_i4_tile(a4, rb4, nw, aws, wstride, gs, aq, qstride, t == 2 ? axg : NULL, gstride,
                                             axs, sstride, P, n, out);
                    for (int p = 0; p < P; p++)
                        for (int r = 0; r < nw; r++) {
                            float want = t ? coli_rowdotg_i4_scalar(a4 + r * rb4, aws + r * wstride, gs,
                                                                    aq + p * qstride, axs + p * sstride, n, n)
                                           : coli_rowdotg_i8_scalar(a8 + r * rb8, aws + r * wstride, gs,
                                                                    aq + p * qstride, axs + p * sstride, n, n);
                            CHECK(same_bits(out[p * nw + r], want), "rowdotg_%s_tile isa=%d n=%d gs=%d nw=%d P=%d "
                                  "r=%d p=%d got %.9g want %.9g", t == 2 ? "i4 split" : t ? "i4" : "i8", isa, n, gs,
                                  nw, P, r, p, out[p * nw + r], want);
                        }
                    CHECK(out[P * nw] == -12345.0f, "rowdotg_tile wrote past out isa=%d n=%d", isa, n);
                }
        /* the dispatched splitter writes the reference's bytes, or nothing */
        if (coli_split_q8(q, n, xg + 4 * gstride)) {
            uint8_t *want = malloc((size_t)coli_split_len(n));
            coli_split_q8_ref(q, n, want);
            CHECK(memcmp(want, xg + 4 * gstride, (size_t)coli_split_len(n)) == 0, "split_q8 isa=%d n=%d", isa, n);
            free(want);
        }
        gfree(xg, (size_t)(4 * gstride + coli_split_len(n)));
        gfree(w8, len8); gfree(q, qlen); gfree(w4, len4);
        gfree(ws, sizeof(float) * wlen); gfree(xs, sizeof(float) * slen);
    }
}

/* The per-row-scale tile (coli_rowdot_*_tile): nw = 1..4 weight rows (rows rb apart, the last
 * ending at a guard page; and rows r0 .. r0 + nw - 1 of the four interleaved) x P = 1..7 activation rows (their last row, scales, block sums and split
 * form ending at guard pages), with and without the block sums and the split forms, for blocks
 * covering the row, of 64, 128 and 192 inputs: each output bit-identical to the scalar one-row call. */
static void check_rowtile(int isa, int n, int mode)
{
    enum { TP = 7 };
    const int blocks[] = {0, 64, 128, 192};
    long rb8 = n + 3, rb4 = (n + 1) / 2 + 5, qstride = n + 9, gstride = coli_split_len(n) + 64;
    size_t len8 = 3 * rb8 + n, len4 = 3 * rb4 + (n + 1) / 2, qlen = (TP - 1) * qstride + n;
    size_t glen = (TP - 1) * gstride + coli_split_len(n);
    int8_t *w8 = galloc(len8), *q = galloc(qlen);
    uint8_t *w4 = galloc(len4), *xg = galloc(glen);
    fill_q(w8, len8, mode);
    fill_q(q, qlen, mode);
    if (mode == FILL_EXTREME_POS || mode == FILL_EXTREME_NEG)
        for (size_t i = 0; i < len8; i++)
            w8[i] = -128;
    for (size_t i = 0; i < len4; i++)
        w4[i] = mode == FILL_EXTREME_POS || mode == FILL_EXTREME_NEG ? 0x00 : (uint8_t)(rnd() & 0xFF);
    for (int p = 0; p < TP; p++)
        coli_split_q8_ref(q + p * qstride, n, xg + p * gstride);
    /* the four rows interleaved (coli_ilv_pack of their contiguous copy), ending at a guard page */
    long gb8 = 4L * n, gb4 = 4L * ((n + 1) / 2);
    uint8_t *c8 = malloc((size_t)gb8), *c4 = malloc((size_t)gb4), *g8 = galloc((size_t)gb8), *g4 = galloc((size_t)gb4);
    for (int r = 0; r < 4; r++) {
        memcpy(c8 + (long)r * n, w8 + r * rb8, (size_t)n);
        memcpy(c4 + (long)r * ((n + 1) / 2), w4 + r * rb4, (size_t)((n + 1) / 2));
    }
    coli_ilv_pack(c8, g8, 4, n);
    coli_ilv_pack(c4, g4, 4, (n + 1) / 2);
    coli_ilv_unpack(g4, c8, 4, (n + 1) / 2); /* and back */
    CHECK(memcmp(c8, c4, (size_t)gb4) == 0, "ilv_unpack(ilv_pack) n=%d", n);
    free(c8);
    free(c4);
    for (size_t bi = 0; bi < sizeof blocks / sizeof blocks[0]; bi++) {
        int blk = blocks[bi], bl = coli_block_len(n, blk), nbk = (n + bl - 1) / bl;
        if (blk > 0 && blk >= n && bi > 0)
            continue; /* the same as one block */
        long sstride = nbk + 2;
        size_t slen = (TP - 1) * sstride + nbk;
        float *xs = galloc(sizeof(float) * slen), out[4 * TP + 1];
        int32_t *sums = galloc(sizeof(int32_t) * slen);
        for (size_t i = 0; i < slen; i++)
            xs[i] = 1e-3f + (float)(rnd() % 1000) * 1e-4f;
        for (int p = 0; p < TP; p++)
            coli_block_sums(q + p * qstride, n, blk, sums + p * sstride);
        for (int nw = 1; nw <= 4; nw++)
            for (int P = 1; P <= TP; P++)
                for (int t = 0; t < 5; t++) { /* int8, int8 with sums, int4, with sums, with sums + split */
                    const int8_t *a8 = w8 + (3 - (nw - 1)) * rb8;
                    const uint8_t *a4 = w4 + (3 - (nw - 1)) * rb4;
                    const int8_t *aq = q + (TP - P) * qstride;
                    const float *axs = xs + (TP - P) * sstride;
                    const int32_t *as = (t == 1 || t >= 3) ? sums + (TP - P) * sstride : NULL;
                    const uint8_t *ag = t == 4 ? xg + (TP - P) * gstride : NULL;
                    for (int il = 0; il < 2; il++) /* plain rows, then rows r0 .. of the interleaved group */
                        for (int r0 = 0; r0 + nw <= (il ? 4 : nw); r0++) {
                            for (int k = 0; k <= 4 * TP; k++)
                                out[k] = -12345.0f;
                            if (t < 2)
                                coli_rowdot_i8_tile(il ? (const int8_t *)g8 : a8, il ? n : rb8, il, r0, nw, aq,
                                                    qstride, axs, as, sstride, NULL, 0, P, n, blk, out);
                            else
                                coli_rowdot_i4_tile(il ? g4 : a4, il ? (n + 1) / 2 : rb4, il, r0, nw, aq, qstride,
                                                    axs, as, sstride, ag, gstride, P, n, blk, out);
                            for (int p = 0; p < P; p++)
                                for (int r = 0; r < nw; r++) {
                                    float want = t >= 2 ? coli_rowdot_i4_scalar(il ? w4 + (r0 + r) * rb4 : a4 + r * rb4,
                                                                                aq + p * qstride, axs + p * sstride, n, blk)
                                                        : coli_rowdot_i8_scalar(il ? w8 + (r0 + r) * rb8 : a8 + r * rb8,
                                                                                aq + p * qstride, axs + p * sstride, n, blk);
                                    CHECK(same_bits(out[p * nw + r], want), "rowdot_tile t=%d ilv=%d r0=%d isa=%d n=%d "
                                          "block=%d nw=%d P=%d r=%d p=%d got %.9g want %.9g", t, il, r0, isa, n, blk, nw,
                                          P, r, p, out[p * nw + r], want);
                                }
                            CHECK(out[P * nw] == -12345.0f, "rowdot_tile wrote past out t=%d isa=%d n=%d", t, isa, n);
                        }
                }
        gfree(xs, sizeof(float) * slen);
        gfree(sums, sizeof(int32_t) * slen);
    }
    gfree(w8, len8); gfree(q, qlen); gfree(w4, len4); gfree(xg, glen);
    gfree(g8, (size_t)gb8); gfree(g4, (size_t)gb4);
}

#define ALL_R 0x1FE /* R = 1..8 */

static void run_size(int isa, int n, int modes)
{
    bufs b = balloc(n);
    /* every R up to 16385 elements; beyond that R = 1, 2, 4, 5, 8 */
    int rmask = n <= 16385 ? ALL_R : (1 << 1 | 1 << 2 | 1 << 4 | 1 << 5 | 1 << 8);
    for (int mode = 0; mode < modes; mode++) {
        fill(&b, mode);
        check_all(isa, &b);
        check_multi(isa, &b, mode, rmask);
        /* a subset of sizes and fills: whole and partial groups and blocks, short rows, long rows */
        if (mode <= FILL_EXTREME_POS && (n % 64 == 0 || n % 64 == 36 || n % 64 == 1 || n % 64 == 63 || n < 8 || n > 300)) {
            check_grouped(isa, &b, mode);
            if (n <= 16385) {
                check_tile(isa, n, mode);
                check_rowtile(isa, n, mode);
            }
        }
    }
    bfree(&b);
}

/* n = 2^20 int4 row: the whole-row int32 accumulation at its documented limit */
static void run_i4_limit(int isa)
{
    int n = 1 << 20;
    bufs b = balloc(n);
    for (int mode = FILL_EXTREME_POS; mode <= FILL_EXTREME_NEG; mode++) {
        fill(&b, mode);
        int64_t r = ref_i4(b.w4, b.x8, n);
        CHECK(coli_dot_i4i8(b.w4, b.x8, n) == r, "dot_i4i8 limit isa=%d got %d want %lld", isa,
              coli_dot_i4i8(b.w4, b.x8, n), (long long)r);
        memset(b.w4, 0xFF, (size_t)b.nb4); /* v = +7 */
        r = ref_i4(b.w4, b.x8, n);
        CHECK(coli_dot_i4i8(b.w4, b.x8, n) == r, "dot_i4i8 limit(+7) isa=%d got %d want %lld", isa,
              coli_dot_i4i8(b.w4, b.x8, n), (long long)r);
        /* the multi-activation int4 dots at the limit, one whole-row block and 64-blocks; stride 0
         * (R copies of the same row) also covers aliased rows */
        for (int w = 0; w < 2; w++) {
            if (w)
                memset(b.w4, 0x00, (size_t)b.nb4); /* back to v = -8 */
            for (int blk = 0; blk <= 64; blk += 64) {
                float one = coli_rowdot_i4(b.w4, b.x8, b.xs, n, blk), out[MR + 1];
                float sc = coli_rowdot_i4_scalar(b.w4, b.x8, b.xs, n, blk);
                CHECK(same_bits(one, sc), "rowdot_i4 limit isa=%d block=%d", isa, blk);
                CHECK(same_bits(coli_rowdot2_i4(b.w4, b.x8, b.xs, b.x8, b.xs, n, blk), one + one),
                      "rowdot2_i4 limit isa=%d block=%d", isa, blk);
                coli_rowdot_i4_rows(b.w4, b.x8, 0, b.xs, 0, MR, n, blk, out);
                for (int k = 0; k < MR; k++)
                    CHECK(same_bits(out[k], one), "rowdot_i4_rows limit isa=%d block=%d r=%d", isa, blk, k);
            }
        }
    }
    fill(&b, FILL_RANDOM);
    check_all(isa, &b);
    bfree(&b);
}

/* ---------------------------------------- benchmark ---------------------------------------- */


static volatile float g_sink;

/* best of 5 runs of `reps` calls, ns per call */
#define BENCH(result, reps, call)                                                   \
    do {                                                                            \
        double best_ = 1e300;                                                       \
        for (int r_ = 0; r_ < 5; r_++) {                                            \
            double t0_ = now_ns();                                                  \
            float acc_ = 0;                                                         \
            for (int i_ = 0; i_ < (reps); i_++)                                     \
                acc_ += (float)(call);                                              \
            double t_ = (now_ns() - t0_) / (reps);                                  \
            g_sink = acc_;                                                          \
            if (t_ < best_)                                                         \
                best_ = t_;                                                         \
        }                                                                           \
        result = best_;                                                             \
    } while (0)

static void bench(int best)
{
    const int n = 1024, reps = 20000;
    bufs b = balloc(n);
    fill(&b, FILL_RANDOM);
    printf("\ntiming, n = %d, ns per call (best of 5 x %d calls, data in L1):\n", n, reps);
    printf("%-11s %9s %9s %9s %9s %9s %9s %9s %9s\n", "isa", "i8 b=64", "i8 b=n", "i4 b=64", "i4 b=n",
           "f32", "q8f32", "q4f32", "quant64");
    for (int isa = 0; isa <= best; isa++) {
        double t[8];
        coli_select_isa(isa);
        BENCH(t[0], reps, coli_rowdot_i8(b.w8, b.x8, b.xs, n, 64));
        BENCH(t[1], reps, coli_rowdot_i8(b.w8, b.x8, b.xs, n, n));
        BENCH(t[2], reps, coli_rowdot_i4(b.w4, b.x8, b.xs, n, 64));
        BENCH(t[3], reps, coli_rowdot_i4(b.w4, b.x8, b.xs, n, n));
        BENCH(t[4], reps, coli_dot_f32(b.af, b.xf, n));
        BENCH(t[5], reps, coli_dot_q8f32(b.w8, b.xf, n));
        BENCH(t[6], reps, coli_dot_q4f32(b.w4, b.xf, n));
        BENCH(t[7], reps, (coli_quantize_q8(b.xf, n, 64, b.q, b.qs), b.q[0]));
        printf("%-11s", coli_isa_name(isa));
        for (int k = 0; k < 8; k++)
            printf(" %9.1f", t[k]);
        printf("\n");
    }
    bfree(&b);
}

/* ------------------------------------------ main ------------------------------------------ */

/* The batch GEMM (coli_gemm.h): its scalar definition against the one-row scalar dots (int8 and
 * int4 rows, plain and interleaved, idot 1 and 2), and the AMX variant (when the CPU has it)
 * bit-identical to the definition; weights, activations and scales end at guard pages. */
static void check_gemm(void)
{
    const int Ks[] = {1, 2, 63, 64, 65, 127, 130, 301, 1024}, Os[] = {1, 5, 16, 17, 32, 37}, Ps[] = {1, 8, 17, 33};
    int amx = coli_amx_select(1), vnni = coli_isa_best() == COLI_ISA_AVX512VNNI;
    printf("gemm: AMX-INT8 %s, AVX-512 VNNI %s\n", amx ? "checked" : "not available",
           vnni ? "checked" : "not available");
    for (size_t ki = 0; ki < sizeof Ks / sizeof Ks[0]; ki++)
        for (size_t oi = 0; oi < sizeof Os / sizeof Os[0]; oi++)
            for (size_t pi = 0; pi < sizeof Ps / sizeof Ps[0]; pi++)
                for (int i4 = 0; i4 < 2; i4++) {
                    int K = Ks[ki], O = Os[oi], P = Ps[pi];
                    long rb = i4 ? (K + 1) / 2 : K;
                    size_t wl = (size_t)(O * rb), ql = (size_t)2 * P * K;
                    uint8_t *w = galloc(wl), *wi = galloc(wl), *tmp = malloc(4 * (size_t)rb + 1);
                    int8_t *q = galloc(ql);
                    float *ws = galloc(sizeof(float) * O), *xs = galloc(sizeof(float) * 2 * P);
                    float *y = malloc(sizeof(float) * P * O), *ya = malloc(sizeof(float) * P * O);
                    int8_t *packed = malloc((size_t)2 * coli_gemm_packed_bytes(P, K));
                    int32_t *sums = malloc(sizeof(int32_t) * 2 * P);
                    for (size_t i = 0; i < wl; i++)
                        w[i] = (uint8_t)(rnd() & 0xFF);
                    fill_q(q, ql, FILL_RANDOM);
                    for (int i = 0; i < O; i++)
                        ws[i] = 1e-3f + (float)(rnd() % 1000) * 1e-4f;
                    for (int i = 0; i < 2 * P; i++)
                        xs[i] = 1e-3f + (float)(rnd() % 1000) * 1e-4f;
                    memcpy(wi, w, wl);
                    coli_ilv_pack_inplace(wi, O, rb, tmp);
                    coli_gemm_pack(q, P, K, packed, sums);
                    coli_gemm_pack(q + (long)P * K, P, K, packed + coli_gemm_packed_bytes(P, K), sums + P);
                    for (int ilv = 0; ilv < 2; ilv++)
                        for (int idot2 = 0; idot2 < 2; idot2++) {
                            const uint8_t *wv = ilv ? wi : w;
                            coli_gemm_rows_scalar(wv, rb, O, ilv, i4, 0, O, ws, q, P, K, xs, idot2, y, O);
                            for (int p = 0; p < P; p++)
                                for (int r = 0; r < O; r++) {
                                    const int8_t *q1 = q + (long)p * K, *q2 = q + (long)(P + p) * K;
                                    float t = i4 ? coli_rowdot_i4_scalar(w + r * rb, q1, xs + p, K, K)
                                                 : coli_rowdot_i8_scalar((const int8_t *)w + r * rb, q1, xs + p, K, K);
                                    if (idot2)
                                        t = t + (i4 ? coli_rowdot_i4_scalar(w + r * rb, q2, xs + P + p, K, K)
                                                    : coli_rowdot_i8_scalar((const int8_t *)w + r * rb, q2,
                                                                            xs + P + p, K, K));
                                    CHECK(same_bits(y[p * O + r], t * ws[r]), "gemm scalar %s K=%d O=%d P=%d ilv=%d "
                                          "idot2=%d p=%d r=%d", i4 ? "i4" : "i8", K, O, P, ilv, idot2, p, r);
                                }
                            for (int use_amx = 0; use_amx < 2; use_amx++) {
                                if (!(use_amx ? amx : vnni))
                                    continue;
                                coli_amx_select(use_amx);
                                for (int o0 = 0; o0 < O; o0 += COLI_GEMM_COLS) {
                                    int nw = O - o0 < COLI_GEMM_COLS ? O - o0 : COLI_GEMM_COLS;
                                    CHECK(coli_gemm_rows(wv, rb, O, ilv, i4, o0, nw, ws, packed, sums, P, K, xs, idot2,
                                                         ya, O) == 0, "gemm failed K=%d O=%d", K, O);
                                }
                                CHECK(memcmp(y, ya, sizeof(float) * P * O) == 0,
                                      "gemm %s %s K=%d O=%d P=%d ilv=%d idot2=%d", use_amx ? "amx" : "vnni",
                                      i4 ? "i4" : "i8", K, O, P, ilv, idot2);
                            }
                        }
                    gfree(w, wl); gfree(wi, wl); gfree(q, ql); gfree(ws, sizeof(float) * O);
                    gfree(xs, sizeof(float) * 2 * P);
                    free(tmp); free(y); free(ya); free(packed); free(sums);
                }
}

int main(int argc, char **argv)
{
    g_rng = 0x9E3779B97F4A7C15ULL; /* this selftest's own stream */
    int do_bench = !(argc > 1 && strcmp(argv[1], "--no-bench") == 0);
    int best = coli_isa_best();
    printf("best ISA: %s, active at startup: %s\n", coli_isa_name(best), coli_isa_name(coli_isa_active()));
    CHECK(coli_isa_active() == best, "constructor did not select the best ISA");
    CHECK(coli_select_isa(99) == best, "select clamps high");
    CHECK(coli_select_isa(-5) == COLI_ISA_SCALAR, "select clamps low");

    const int big[] = {383, 384, 385, 511, 512, 513, 1000, 1023, 1024, 1025, 4095, 4096, 4097,
                       6144, 6180, 16383, 16384, 16385, 65536};
    for (int isa = 0; isa <= best; isa++) {
        long before = g_fail, checks0 = g_checks;
        CHECK(coli_select_isa(isa) == isa && coli_isa_active() == isa, "select %d", isa);
        for (int n = 1; n <= 300; n++)
            run_size(isa, n, 5);
        for (size_t k = 0; k < sizeof big / sizeof big[0]; k++)
            run_size(isa, big[k], big[k] == 65536 ? 3 : 5);
        run_i4_limit(isa);
        check_float_rows(isa);
        printf("%-11s %s  (%ld checks; n = 1..300 + %d larger sizes up to 65536, int4 also 2^20;\n"
               "                  rowdot2, rows with R = 1..8 and group-scaled rows included)\n",
               coli_isa_name(isa), g_fail == before ? "ok  " : "FAIL", g_checks - checks0,
               (int)(sizeof big / sizeof big[0]));
        printf("            float dots, worst |err|/sum|ab|: f32 %.2e  q8f32 %.2e  q4f32 %.2e\n",
               g_maxrel[isa][0], g_maxrel[isa][1], g_maxrel[isa][2]);
    }

    check_gemm();
    if (do_bench)
        bench(best);
    coli_select_isa(best);
    printf("\n%s: %ld checks, %ld failures\n", g_fail ? "FAILED" : "PASSED", g_checks, g_fail);
    return g_fail ? 1 : 0;
}
