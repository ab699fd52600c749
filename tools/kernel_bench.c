/* Benchmark of the multi-activation row dots (include/coli_dot_i8.h, coli_dot_i4.h):
 *
 *   gcc -O2 -I include tools/kernel_bench.c -o /tmp/kb -lm
 *   nice /tmp/kb [--repeats N] [--quick] [--isa scalar|avx2|avx512vnni] [--prefetch D]
 *
 * A weight matrix of O rows x n = 1024 (int8, or packed int4) is multiplied, row by row through the
 * public dispatching entry points, for every ISA the CPU supports:
 *   (a) two activation vectors (the idot=2 pair q1, q2):
 *         2x rowdot: y[o] = coli_rowdot_*(w_o, q1, xs1) + coli_rowdot_*(w_o, q2, xs2)
 *         rowdot2:   y[o] = coli_rowdot2_*(w_o, q1, xs1, q2, xs2)
 *   (b) four activation rows (a short prefill / verification batch):
 *         4x rowdot: y[4o + r] = coli_rowdot_*(w_o, q + r*n, xs + r*nb), r = 0..3
 *         rows(4):   coli_rowdot_*_rows(w_o, q, n, xs, nb, 4, ..., y + 4o)
 * Matrix sizes: 512 KiB (stays in L2), O = 2048 (2 MiB int8 / 1 MiB int4: L2/L3) and 64 MiB (streams
 * from RAM). Blocks: n (one block per row, the engine's default act_block = 0) and 64.
 *
 * Reported per variant: ns per weight row, and GB/s of weight matrix = matrix bytes / time, i.e.
 * each weight byte counted once per matrix product however often a variant actually reads it.
 * Each figure is the best of --repeats samples (default 9); the variants of one comparison are
 * sampled interleaved, so background load hits them alike. Each sample covers at least ~32 MiB of
 * weights (the small matrices are multiplied several times per sample). The two variants' outputs
 * are also compared bit for bit.
 *
 * --prefetch D: before each weight row o, the driver loop prefetches all cache lines of row o + D
 * (as a matmul loop could do); off by default, so the table measures the kernels alone. When the
 * matrix streams from RAM, this lets the memory traffic overlap the compute.
 */
#define _DEFAULT_SOURCE /* clock_gettime, MAP_ANONYMOUS under -std=c99 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "coli_kernels.h"

enum { N = 1024, NSIZES = 3, MAXR = 4 };

#include "coli_tool_util.h"

typedef struct {
    int is4;            /* 0: int8 weights, 1: packed int4 */
    long O, rowbytes;   /* rows, bytes per weight row */
    const void *w;      /* O * rowbytes */
    const int8_t *q;    /* MAXR activation rows of N, stride N (q1 = row 0, q2 = row 1) */
    const float *xs;    /* MAXR rows of scales, stride nbmax */
    long nbmax;
    int block;
    float *y;           /* O * MAXR outputs */
    int prefetch;       /* rows ahead to prefetch, 0 = none */
} problem;

/* all cache lines of weight row o + p->prefetch, if it exists. always_inline: as a function of its
 * own it has no side effects in GCC's eyes (prefetches only), and its calls get deleted. */
static inline __attribute__((always_inline)) void prefetch_row(const problem *p, long o)
{
    if (p->prefetch && o + p->prefetch < p->O) {
        const char *r = (const char *)p->w + (o + p->prefetch) * p->rowbytes;
        for (long c = 0; c < p->rowbytes; c += 64)
            __builtin_prefetch(r + c);
    }
}

enum { V_TWO_CALLS, V_ROWDOT2, V_FOUR_CALLS, V_ROWS4 };

/* one matrix product with variant v */
static void product(const problem *p, int v)
{
    const int8_t *q = p->q;
    const float *xs = p->xs;
    long nb = p->nbmax;
    int blk = p->block;
    if (!p->is4) {
        const int8_t *w = p->w;
        for (long o = 0; o < p->O; o++, w += p->rowbytes) {
            prefetch_row(p, o);
            switch (v) {
            case V_TWO_CALLS:
                p->y[o] = coli_rowdot_i8(w, q, xs, N, blk) + coli_rowdot_i8(w, q + N, xs + nb, N, blk);
                break;
            case V_ROWDOT2: p->y[o] = coli_rowdot2_i8(w, q, xs, q + N, xs + nb, N, blk); break;
            case V_FOUR_CALLS:
                for (int r = 0; r < 4; r++)
                    p->y[4 * o + r] = coli_rowdot_i8(w, q + r * N, xs + r * nb, N, blk);
                break;
            default: coli_rowdot_i8_rows(w, q, N, xs, nb, 4, N, blk, p->y + 4 * o);
            }
        }
    } else {
        const uint8_t *w = p->w;
        for (long o = 0; o < p->O; o++, w += p->rowbytes) {
            prefetch_row(p, o);
            switch (v) {
            case V_TWO_CALLS:
                p->y[o] = coli_rowdot_i4(w, q, xs, N, blk) + coli_rowdot_i4(w, q + N, xs + nb, N, blk);
                break;
            case V_ROWDOT2: p->y[o] = coli_rowdot2_i4(w, q, xs, q + N, xs + nb, N, blk); break;
            case V_FOUR_CALLS:
                for (int r = 0; r < 4; r++)
                    p->y[4 * o + r] = coli_rowdot_i4(w, q + r * N, xs + r * nb, N, blk);
                break;
            default: coli_rowdot_i4_rows(w, q, N, xs, nb, 4, N, blk, p->y + 4 * o);
            }
        }
    }
}

/* best ns per matrix product of variants va and vb, sampled interleaved; 1 if their outputs match */
static int time_pair(const problem *p, int va, int vb, int repeats, double *ta, double *tb)
{
    long bytes = p->O * p->rowbytes;
    int iters = (int)((32L << 20) / bytes);
    if (iters < 1)
        iters = 1;
    size_t ylen = (size_t)p->O * MAXR;
    float *ya = malloc(sizeof(float) * ylen);
    product(p, va); /* warm-up, and the outputs to compare */
    memcpy(ya, p->y, sizeof(float) * ylen);
    product(p, vb);
    int same = memcmp(ya, p->y, sizeof(float) * (size_t)p->O * (va == V_TWO_CALLS ? 1 : 4)) == 0;
    free(ya);
    *ta = *tb = 1e300;
    for (int rep = 0; rep < repeats; rep++)
        for (int k = 0; k < 2; k++) {
            int v = k ? vb : va;
            double t0 = now_ns();
            for (int it = 0; it < iters; it++)
                product(p, v);
            double t = (now_ns() - t0) / iters;
            double *best = k ? tb : ta;
            if (t < *best)
                *best = t;
        }
    return same;
}

int main(int argc, char **argv)
{
    int repeats = 9, quick = 0, only = -1, prefetch = 0;
    for (int a = 1; a < argc; a++) {
        if (!strcmp(argv[a], "--repeats") && a + 1 < argc)
            repeats = atoi(argv[++a]);
        else if (!strcmp(argv[a], "--prefetch") && a + 1 < argc)
            prefetch = atoi(argv[++a]);
        else if (!strcmp(argv[a], "--quick"))
            quick = 1; /* SIMD ISAs only, block = n only */
        else if (!strcmp(argv[a], "--isa") && a + 1 < argc) {
            if ((only = tool_isa(argv[++a])) < 0)
                return 2;
        } else {
            fprintf(stderr, "usage: %s [--repeats N] [--quick] [--isa scalar|avx2|avx512vnni] [--prefetch D]\n",
                    argv[0]);
            return 2;
        }
    }
    int best = coli_isa_best(), mismatches = 0;
    printf("n = %d, best ISA %s, best of %d samples; GB/s = weight matrix bytes / time\n", N,
           coli_isa_name(best), repeats);
    if (prefetch)
        printf("driver loop prefetches weight row o + %d\n", prefetch);

    /* activations: 4 rows, scales for the finest block structure (64) */
    long nbmax = N / 64;
    int8_t *q = malloc((size_t)MAXR * N);
    float *xs = malloc(sizeof(float) * (size_t)MAXR * nbmax);
    for (long i = 0; i < (long)MAXR * N; i++)
        q[i] = (int8_t)((int)(rnd() % 255) - 127);
    for (long i = 0; i < MAXR * nbmax; i++)
        xs[i] = 1e-3f + (float)(rnd() % 1000) * 1e-4f;

    for (int is4 = 0; is4 <= 1; is4++) {
        long rowbytes = is4 ? N / 2 : N;
        const long sizes[NSIZES] = {(512L << 10) / rowbytes, 2048, (64L << 20) / rowbytes};
        const char *where[NSIZES] = {"L2-resident", "O = 2048", "streams from RAM"};
        for (int si = 0; si < NSIZES; si++) {
            long O = sizes[si], bytes = O * rowbytes;
            uint8_t *w = malloc((size_t)bytes);
            float *y = malloc(sizeof(float) * (size_t)O * MAXR);
            for (long i = 0; i < bytes; i++)
                w[i] = (uint8_t)rnd();
            for (int bi = 0; bi < (quick ? 1 : 2); bi++) {
                problem p = {is4, O, rowbytes, w, q, xs, nbmax, bi ? 64 : 0, y, prefetch};
                printf("\n%s weights, %ld x %d = %.1f MiB (%s), block = %s\n", is4 ? "int4" : "int8", O, N,
                       bytes / 1048576.0, where[si], bi ? "64" : "n");
                printf("%-11s | %-27s %-8s | %-27s %-8s\n", "", "(a) 2x rowdot -> rowdot2", "",
                       "(b) 4x rowdot -> rows(R=4)", "");
                printf("%-11s | %6s %6s   %6s %6s  %7s | %6s %6s   %6s %6s  %7s\n", "isa", "ns/row", "GB/s",
                       "ns/row", "GB/s", "speedup", "ns/row", "GB/s", "ns/row", "GB/s", "speedup");
                for (int isa = quick ? COLI_ISA_AVX2 : 0; isa <= best; isa++) {
                    double t[4];
                    if (only >= 0 && isa != only)
                        continue;
                    coli_select_isa(isa);
                    int ok = time_pair(&p, V_TWO_CALLS, V_ROWDOT2, repeats, &t[0], &t[1]);
                    ok &= time_pair(&p, V_FOUR_CALLS, V_ROWS4, repeats, &t[2], &t[3]);
                    mismatches += !ok;
                    printf("%-11s |", coli_isa_name(isa));
                    for (int k = 0; k < 4; k++) {
                        printf(" %6.1f %6.1f ", t[k] / O, bytes / t[k]);
                        if (k & 1)
                            printf(" %6.2fx |", t[k - 1] / t[k]);
                    }
                    printf("%s\n", ok ? "" : "  OUTPUT MISMATCH");
                    fflush(stdout);
                }
            }
            free(w);
            free(y);
        }
    }
    coli_select_isa(best);
    free(q);
    free(xs);
    if (mismatches)
        printf("\n%d output mismatches between variants\n", mismatches);
    return mismatches ? 1 : 0;
}
