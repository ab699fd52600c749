/* Decode matvec benchmark: the engine's integer matmul hot path (int_group in colibri/_core.pyx)
 * reproduced in C, to measure the kernels in weight GB/s without Python or the rest of a token.
 *
 *   gcc -O3 -fopenmp -I include tools/matvec_bench.c -o /tmp/mvb -lm
 *   nice /tmp/mvb [--repeats N] [--threads T] [--only SUBSTRING] [--isa scalar|avx2|avx512vnni]
 *
 * One "call" multiplies a set of K weight matrices [O, I] (int4 or int8, one scale per row, one
 * activation block per row: the engine's default act_block = 0) by one activation row, the way a
 * decode matmul does it: work items of four weight rows, split statically over the threads of one
 * OpenMP parallel region (matmul_many / ffn_group), each item prefetching its weights
 * PREFETCH_GROUPS items ahead (coli_prefetch_row) and calling
 *   idot 2: coli_rowdot2s_*_x4 (the activation pair q1 + residual q2, with their block sums)
 *   idot 1: one activation row
 * through the public dispatching entry points, then y[o] = dot * scale[o].
 *
 * Sets: "L2" (one expert-sized matrix, multiplied again and again: stays in the threads' L2),
 * "L3" (27 matrices = the 9 FFNs of a fixture MoE call, ~7 MiB int4: stays in L3) and "RAM"
 * (384 MiB of matrices: every call streams from memory). Layouts: "stored" (the container's byte
 * pairs) and, for int4, "planes" (repacked at load time, see coli_planes.h). GB/s = weight bytes of
 * the set / time of one call (best of --repeats samples, the variants of one row sampled
 * interleaved); every variant's outputs are compared bit for bit with the first variant's.
 */
#define _DEFAULT_SOURCE
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "coli_kernels.h"
#include "coli_prefetch.h"

enum { PREFETCH_GROUPS = 4, GROUP_ROWS = 4 };

static uint64_t g_rng = 0x243F6A8885A308D3ULL;

static uint32_t rnd(void) /* xorshift64* */
{
    g_rng ^= g_rng >> 12;
    g_rng ^= g_rng << 25;
    g_rng ^= g_rng >> 27;
    return (uint32_t)((g_rng * 0x2545F4914F6CDD1DULL) >> 32);
}

static double now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e9 + ts.tv_nsec;
}

typedef struct {
    int is4, O, I;
    long rb;              /* bytes per row */
    int K;                /* matrices in the set */
    uint8_t *w;           /* K * O * rb, stored layout */
    float *ws;            /* K * O row scales */
} wset;

typedef struct {
    const int8_t *q1, *q2;
    const float *xs1, *xs2;
    const int32_t *s1, *s2;
} acts;

typedef enum { K_IDOT2, K_IDOT1 } kind;

typedef struct {
    const char *name;
    kind k;
    int pf;               /* prefetch distance in groups (0 = none) */
} variant;

/* one work item: rows 4g .. 4g+3 of matrix m */
static inline __attribute__((always_inline)) void item(const wset *W, const uint8_t *w, const acts *a,
                                                       const variant *v, long m, int g, float *y)
{
    const long O = W->O, rb = W->rb;
    const uint8_t *mat = w + m * O * rb;
    int o0 = g * GROUP_ROWS, ahead = o0 + v->pf * GROUP_ROWS;
    if (v->pf > 0 && ahead < O)
        coli_prefetch_row(mat + (long)ahead * rb, (O - ahead > GROUP_ROWS ? GROUP_ROWS : O - ahead) * rb);
    const uint8_t *row = mat + (long)o0 * rb;
    const float *sc = W->ws + m * O + o0;
    float r4[GROUP_ROWS];
    float *out = y + m * O + o0;
    if (v->k == K_IDOT2) {
        if (W->is4)
            coli_rowdot2s_i4_x4(row, rb, a->q1, a->xs1, a->s1, a->q2, a->xs2, a->s2, W->I, W->I, r4);
        else
            coli_rowdot2s_i8_x4((const int8_t *)row, rb, a->q1, a->xs1, a->s1, a->q2, a->xs2, a->s2, W->I, W->I,
                                r4);
    } else {
        for (int r = 0; r < GROUP_ROWS; r++)
            r4[r] = W->is4 ? coli_rowdot_i4(row + r * rb, a->q1, a->xs1, W->I, W->I)
                           : coli_rowdot_i8((const int8_t *)(row + r * rb), a->q1, a->xs1, W->I, W->I);
    }
    for (int r = 0; r < GROUP_ROWS; r++)
        out[r] = r4[r] * sc[r];
}

/* one call: every matrix of the set times the activations, nt threads */
static void call(const wset *W, const uint8_t *w, const acts *a, const variant *v, float *y, int nt)
{
    int ng = W->O / GROUP_ROWS;
    long total = (long)W->K * ng;
#pragma omp parallel for schedule(static) num_threads(nt)
    for (long it = 0; it < total; it++)
        item(W, w, a, v, it / ng, (int)(it % ng), y);
}

static void make_set(wset *W, int is4, int O, int I, int K)
{
    W->is4 = is4;
    W->O = O;
    W->I = I;
    W->K = K;
    W->rb = is4 ? (I + 1) / 2 : I;
    size_t bytes = (size_t)K * O * W->rb;
    W->w = aligned_alloc(64, (bytes + 63) / 64 * 64);
    W->ws = malloc(sizeof(float) * (size_t)K * O);
    for (size_t i = 0; i < bytes; i++)
        W->w[i] = (uint8_t)rnd();
    for (long i = 0; i < (long)K * O; i++)
        W->ws[i] = 1e-3f + (float)(rnd() % 1000) * 1e-5f;
}

int main(int argc, char **argv)
{
    int repeats = 7, only_isa = -1, threads[2] = {1, 2}, nthr = 2;
    const char *only = NULL;
    for (int a = 1; a < argc; a++) {
        if (!strcmp(argv[a], "--repeats") && a + 1 < argc)
            repeats = atoi(argv[++a]);
        else if (!strcmp(argv[a], "--threads") && a + 1 < argc) {
            threads[0] = atoi(argv[++a]);
            nthr = 1;
        } else if (!strcmp(argv[a], "--only") && a + 1 < argc)
            only = argv[++a];
        else if (!strcmp(argv[a], "--isa") && a + 1 < argc) {
            a++;
            for (int k = COLI_ISA_SCALAR; k <= COLI_ISA_AVX512VNNI; k++)
                if (!strcmp(argv[a], coli_isa_name(k)))
                    only_isa = k;
            if (only_isa < 0 || only_isa > coli_isa_best()) {
                fprintf(stderr, "ISA %s unknown or not supported here\n", argv[a]);
                return 2;
            }
        } else {
            fprintf(stderr, "usage: %s [--repeats N] [--threads T] [--only SUBSTRING] [--isa NAME]\n", argv[0]);
            return 2;
        }
    }
    coli_select_isa(only_isa >= 0 ? only_isa : coli_isa_best());
    printf("isa %s, best of %d; GB/s = weight bytes of the set / time of one call\n",
           coli_isa_name(coli_isa_active()), repeats);

    /* activations: q1 = Q8(x), q2 = Q8(residual), one block per row */
    enum { IMAX = 2048 };
    int8_t q1[IMAX], q2[IMAX];
    float xs1 = 0.01f, xs2 = 4e-5f;
    for (int i = 0; i < IMAX; i++) {
        q1[i] = (int8_t)((int)(rnd() % 255) - 127);
        q2[i] = (int8_t)((int)(rnd() % 255) - 127);
    }

    variant vars[] = {
        {"idot2 stored", K_IDOT2, PREFETCH_GROUPS},
        {"idot2 stored nopf", K_IDOT2, 0},
        {"idot1 stored", K_IDOT1, PREFETCH_GROUPS},
    };
    int nv = sizeof vars / sizeof vars[0];

    struct { const char *name; int O, I; long bytes4; } shapes[] = {
        {"L2  512x1024 x1", 512, 1024, 0},
        {"L2 1024x512  x1", 1024, 512, 0},
        {"L3  512x1024 x27", 512, 1024, 27},
        {"RAM 512x1024", 512, 1024, -1},
        {"RAM 2048x1024", 2048, 1024, -1},
    };
    for (int is4 = 1; is4 >= 0; is4--)
        for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
            char label[128];
            snprintf(label, sizeof label, "%s %s", is4 ? "int4" : "int8", shapes[si].name);
            if (only && !strstr(label, only))
                continue;
            int O = shapes[si].O, I = shapes[si].I;
            long rb = is4 ? I / 2 : I;
            int K = shapes[si].bytes4 > 0 ? (int)shapes[si].bytes4 : 1;
            if (shapes[si].bytes4 < 0)
                K = (int)((384L << 20) / ((long)O * rb));
            wset W;
            make_set(&W, is4, O, I, K);
            int32_t s1 = 0, s2 = 0;
            for (int i = 0; i < I; i++) {
                s1 += q1[i];
                s2 += q2[i];
            }
            acts a = {q1, q2, &xs1, &xs2, &s1, &s2};
            long bytes = (long)K * O * rb;
            float *y = malloc(sizeof(float) * (size_t)K * O), *yref = malloc(sizeof(float) * (size_t)K * O);
            /* calls per sample: >= ~64 MiB of weights */
            int calls = (int)((64L << 20) / bytes);
            if (calls < 1)
                calls = 1;
            printf("\n%s: %d matrices, %.2f MiB\n", label, K, bytes / 1048576.0);
            for (int ti = 0; ti < nthr; ti++) {
                int nt = threads[ti];
                double best[16];
                int same[16];
                for (int v = 0; v < nv; v++) {
                    best[v] = 1e300;
                    call(&W, W.w, &a, &vars[v], y, nt);
                    if (v == 0)
                        memcpy(yref, y, sizeof(float) * (size_t)K * O);
                    /* idot 1 has its own reference: the first idot-1 variant */
                    same[v] = 1;
                }
                for (int rep = 0; rep < repeats; rep++)
                    for (int v = 0; v < nv; v++) {
                        double t0 = now_ns();
                        for (int c = 0; c < calls; c++)
                            call(&W, W.w, &a, &vars[v], y, nt);
                        double t = (now_ns() - t0) / calls;
                        if (t < best[v])
                            best[v] = t;
                    }
                for (int v = 0; v < nv; v++)
                    printf("  %d thr  %-22s %8.1f us  %6.1f GB/s%s\n", nt, vars[v].name, best[v] / 1e3,
                           bytes / best[v], same[v] ? "" : "  OUTPUT MISMATCH");
            }
            free(y);
            free(yref);
            free(W.w);
            free(W.ws);
        }
    return 0;
}
