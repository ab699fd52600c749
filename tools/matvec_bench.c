/* Decode matvec benchmark: the engine's integer matmul hot path (int_group in colibri/_core.pyx)
 * reproduced in C, to measure the kernels in weight GB/s without Python or the rest of a token.
 *
 *   gcc -O3 -fopenmp -I include tools/matvec_bench.c -o /tmp/mvb -lm
 *   nice /tmp/mvb [--repeats N] [--threads T] [--only SUBSTRING] [--isa scalar|avx2|avx512vnni]
 *                 [--prefetch GROUPS] [--hint 0|1|2|3] [--variants SUBSTRING]
 *
 * One "call" multiplies a set of K weight matrices [O, I] (int4 or int8, one scale per row, one
 * activation block per row: the engine's default act_block = 0) by one activation row, the way a
 * decode matmul does it: work items of four weight rows split statically over the threads of one
 * OpenMP parallel region (matmul_many / ffn_group), each item prefetching its weights --prefetch
 * items ahead (default 4, PREFETCH_GROUPS; coli_prefetch_row) and multiplying them with the public
 * dispatching kernels, then y[o] = dot * scale[o] (--hint 1..3: prefetcht2/t1/t0 instead of the
 * engine's prefetch instruction). Variants:
 *   idot2 / idot1 ilv: the engine's path for resident matrices: coli_rowdot_*_tile on rows
 *       interleaved at load time (coli_ilv_pack; no software prefetch, the rows are one ascending
 *       stream), with the activations' block sums and (int4) split forms: the pair q1 + residual q2
 *       (two activation rows), or q1 alone;
 *   idot2 / idot1: the same tile on the container's layout (experts read from disk), prefetched;
 *   ... unsplit: without the split forms (int4 widens the nibbles, as the four-row kernel before
 *       the tile did);
 *   ... rowwise: the tile one weight row at a time;
 *   idot1 per row: coli_rowdot_* per weight row (the idot=1 path before the tile);
 *   read: the rows loaded and folded with xor, no arithmetic, prefetched as the plain tiles.
 * Every variant's outputs are compared bit for bit with the first variant of its idot.
 *
 * Sets: "L2" (one expert-sized matrix, multiplied again and again: stays in the threads' L2), "L3"
 * (27 matrices = the 9 FFNs of a fixture MoE call, ~7 MiB int4: stays in L3) and "RAM" (384 MiB of
 * matrices: every call streams from memory). GB/s = weight bytes of the set / time of one call, the
 * best of --repeats samples, the variants of one set sampled interleaved (background load hits them
 * alike).
 */
#define _DEFAULT_SOURCE
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#include "coli_kernels.h"
#include "coli_prefetch.h"

enum { GROUP_ROWS = 4, IMAX = 8192 };

#include "coli_tool_util.h"

typedef struct {
    int is4, O, I, K;     /* format, shape, matrices in the set */
    long rb;              /* bytes per row */
    uint8_t *w;           /* K * O * rb */
    uint8_t *wi;          /* the same rows interleaved (coli_ilv_pack, matrix by matrix) */
    float *ws;            /* K * O row scales */
} wset;

/* the activation pair, as the engine lays it out: q1 then q2 (rows I apart), their scales and block
 * sums (one block: one each), their split forms (rows gstride apart) */
typedef struct {
    int8_t q[2 * IMAX];
    float xs[2];
    int32_t s[2];
    uint8_t g[2 * (IMAX / 128) * COLI_SPLIT_BYTES];
    long gstride;
} acts;

typedef enum { V_TILE, V_UNSPLIT, V_PER_ROW, V_READ, V_ROWWISE, V_ILV, V_OLD } how;

typedef struct {
    const char *name;
    int idot;             /* 1 or 2; 0 = no arithmetic */
    how h;
} variant;

#ifdef OLD_KERNELS
void old_x4_i4(const uint8_t *w, long rb, const int8_t *q1, const float *xs1, const int32_t *s1, const int8_t *q2,
               const float *xs2, const int32_t *s2, int n, float *out);
void old_x4_i8(const int8_t *w, long rb, const int8_t *q1, const float *xs1, const int32_t *s1, const int8_t *q2,
               const float *xs2, const int32_t *s2, int n, float *out);
float old_rowdot_i4(const uint8_t *w, const int8_t *q, const float *xs, int n);
float old_rowdot_i8(const int8_t *w, const int8_t *q, const float *xs, int n);
#endif
static const variant VARS[] = {
#ifdef OLD_KERNELS
    {"idot2 OLD", 2, V_OLD},
    {"idot1 OLD", 1, V_OLD},
#endif
    {"idot2 ilv", 2, V_ILV},
    {"idot2", 2, V_TILE},
    {"idot2 unsplit", 2, V_UNSPLIT},
    {"idot2 rowwise", 2, V_ROWWISE},
    {"idot1 ilv", 1, V_ILV},
    {"idot1", 1, V_TILE},
    {"idot1 unsplit", 1, V_UNSPLIT},
    {"idot1 rowwise", 1, V_ROWWISE},
    {"idot1 per row", 1, V_PER_ROW},
    {"read", 0, V_READ},
};
enum { NV = sizeof VARS / sizeof VARS[0] };

/* xor-fold of four rows (AVX-512 loads when the CPU has them) */
#if COLI_X86
COLI_AVX512 static float read_rows_avx512(const uint8_t *row, long bytes)
{
    __m512i a = _mm512_setzero_si512(), b = _mm512_setzero_si512();
    for (long j = 0; j + 128 <= bytes; j += 128) {
        a = _mm512_xor_si512(a, _mm512_loadu_si512(row + j));
        b = _mm512_xor_si512(b, _mm512_loadu_si512(row + j + 64));
    }
    return (float)_mm512_reduce_add_epi32(_mm512_xor_si512(a, b));
}
#endif

static float read_rows(const uint8_t *row, long bytes)
{
#if COLI_X86
    if (coli_isa_active() == COLI_ISA_AVX512VNNI)
        return read_rows_avx512(row, bytes);
#endif
    uint64_t a = 0;
    for (long j = 0; j + 8 <= bytes; j += 8) {
        uint64_t t;
        memcpy(&t, row + j, 8);
        a ^= t;
    }
    return (float)a;
}

/* prefetch hint of the driver's prefetches: 0 = the engine's (coli_prefetch_row), 1..3 = t2/t1/t0 */
static int g_hint = 0;

static inline __attribute__((always_inline)) void prefetch(const uint8_t *p, long nbytes)
{
    switch (g_hint) {
    case 0: coli_prefetch_row(p, nbytes); break;
    case 1: for (long o = 0; o < nbytes; o += 64) __builtin_prefetch(p + o, 0, 1); break;
    case 2: for (long o = 0; o < nbytes; o += 64) __builtin_prefetch(p + o, 0, 2); break;
    default: for (long o = 0; o < nbytes; o += 64) __builtin_prefetch(p + o, 0, 3); break;
    }
}

/* one work item: rows 4g .. 4g+3 of matrix m, as int_group does it */
static inline __attribute__((always_inline)) void item(const wset *W, const acts *a, const variant *v, int pf,
                                                       long m, int g, float *y)
{
    const long O = W->O, rb = W->rb;
    const uint8_t *mat = (v->h == V_ILV ? W->wi : W->w) + m * O * rb;
    int o0 = g * GROUP_ROWS, ahead = o0 + pf * GROUP_ROWS, I = W->I, P = v->idot;
    if (pf > 0 && ahead < O && v->h != V_ILV) /* as int_group: interleaved rows are one stream */
        prefetch(mat + (long)ahead * rb, (O - ahead > GROUP_ROWS ? GROUP_ROWS : O - ahead) * rb);
    const uint8_t *row = mat + (long)o0 * rb;
    const float *sc = W->ws + m * O + o0;
    float t[2 * GROUP_ROWS], *out = y + m * O + o0;
    switch (v->h) {
    case V_TILE:
    case V_UNSPLIT:
    case V_ILV:
        if (W->is4)
            coli_rowdot_i4_tile(row, rb, v->h == V_ILV, 0, GROUP_ROWS, a->q, I, a->xs, a->s, 1,
                                v->h != V_UNSPLIT ? a->g : NULL, a->gstride, P, I, I, t);
        else
            coli_rowdot_i8_tile((const int8_t *)row, rb, v->h == V_ILV, 0, GROUP_ROWS, a->q, I, a->xs, a->s, 1, NULL,
                                0, P, I, I, t);
        for (int r = 0; r < GROUP_ROWS; r++)
            out[r] = (P == 2 ? t[r] + t[GROUP_ROWS + r] : t[r]) * sc[r];
        break;
    case V_ROWWISE: /* the tile one weight row at a time: one sequential stream */
        for (int r = 0; r < GROUP_ROWS; r++) {
            if (W->is4)
                coli_rowdot_i4_tile(row, rb, 0, r, 1, a->q, I, a->xs, a->s, 1, a->g, a->gstride, P, I, I, t);
            else
                coli_rowdot_i8_tile((const int8_t *)row, rb, 0, r, 1, a->q, I, a->xs, a->s, 1, NULL, 0, P, I, I, t);
            out[r] = (P == 2 ? t[0] + t[1] : t[0]) * sc[r];
        }
        break;
#ifdef OLD_KERNELS
    case V_OLD: /* the kernels before the tiles: four-row x4 for idot 2, one row per call for idot 1 */
        if (P == 2) {
            if (W->is4)
                old_x4_i4(row, rb, a->q, a->xs, a->s, a->q + I, a->xs + 1, a->s + 1, I, t);
            else
                old_x4_i8((const int8_t *)row, rb, a->q, a->xs, a->s, a->q + I, a->xs + 1, a->s + 1, I, t);
            for (int r = 0; r < GROUP_ROWS; r++)
                out[r] = t[r] * sc[r];
        } else {
            for (int r = 0; r < GROUP_ROWS; r++)
                out[r] = (W->is4 ? old_rowdot_i4(row + r * rb, a->q, a->xs, I)
                                 : old_rowdot_i8((const int8_t *)(row + r * rb), a->q, a->xs, I)) * sc[r];
        }
        break;
#endif
    default: /* V_PER_ROW */
        for (int r = 0; r < GROUP_ROWS; r++)
            out[r] = (W->is4 ? coli_rowdot_i4(row + r * rb, a->q, a->xs, I, I)
                             : coli_rowdot_i8((const int8_t *)(row + r * rb), a->q, a->xs, I, I)) * sc[r];
        break;
    case V_READ:
        out[0] = read_rows(row, GROUP_ROWS * rb);
        break;
    }
}

/* one call: every matrix of the set times the activations, nt threads */
static void call(const wset *W, const acts *a, const variant *v, int pf, float *y, int nt)
{
    int ng = W->O / GROUP_ROWS;
    long total = (long)W->K * ng;
#pragma omp parallel for schedule(static) num_threads(nt)
    for (long it = 0; it < total; it++)
        item(W, a, v, pf, it / ng, (int)(it % ng), y);
}

static void make_set(wset *W, int is4, int O, int I, int K)
{
    W->is4 = is4;
    W->O = O;
    W->I = I;
    W->K = K;
    W->rb = is4 ? (I + 1) / 2 : I;
    size_t bytes = (size_t)K * O * W->rb, alloc = (bytes + (2 << 20) - 1) / (2 << 20) * (2 << 20);
    W->w = aligned_alloc(2 << 20, alloc);
    madvise(W->w, alloc, MADV_HUGEPAGE); /* as numpy does for large arrays */
    W->ws = malloc(sizeof(float) * (size_t)K * O);
    for (size_t i = 0; i < bytes; i++)
        W->w[i] = (uint8_t)rnd();
    for (long i = 0; i < (long)K * O; i++)
        W->ws[i] = 1e-3f + (float)(rnd() % 1000) * 1e-5f;
    W->wi = aligned_alloc(2 << 20, alloc);
    madvise(W->wi, alloc, MADV_HUGEPAGE);
    for (long m = 0; m < K; m++)
        coli_ilv_pack(W->w + m * O * W->rb, W->wi + m * O * W->rb, O, W->rb);
}

int main(int argc, char **argv)
{
    int repeats = 7, only_isa = -1, threads[2] = {1, 2}, nthr = 2, pf = 4;
    const char *only = NULL, *vonly = NULL;
    for (int a = 1; a < argc; a++) {
        if (!strcmp(argv[a], "--repeats") && a + 1 < argc)
            repeats = atoi(argv[++a]);
        else if (!strcmp(argv[a], "--threads") && a + 1 < argc) {
            threads[0] = atoi(argv[++a]);
            nthr = 1;
        } else if (!strcmp(argv[a], "--prefetch") && a + 1 < argc)
            pf = atoi(argv[++a]);
        else if (!strcmp(argv[a], "--hint") && a + 1 < argc)
            g_hint = atoi(argv[++a]);
        else if (!strcmp(argv[a], "--only") && a + 1 < argc)
            only = argv[++a];
        else if (!strcmp(argv[a], "--variants") && a + 1 < argc)
            vonly = argv[++a];
        else if (!strcmp(argv[a], "--isa") && a + 1 < argc) {
            if ((only_isa = tool_isa(argv[++a])) < 0)
                return 2;
        } else {
            fprintf(stderr, "usage: %s [--repeats N] [--threads T] [--only SUBSTRING] [--isa NAME] "
                            "[--prefetch GROUPS] [--hint 0..3] [--variants SUBSTRING]\n", argv[0]);
            return 2;
        }
    }
    coli_select_isa(only_isa >= 0 ? only_isa : coli_isa_best());
    printf("isa %s, best of %d, prefetch %d groups ahead (hint %d); GB/s = weight bytes of the set / time of one "
           "call\n", coli_isa_name(coli_isa_active()), repeats, pf, g_hint);

    static acts a;
    a.xs[0] = 0.01f;
    a.xs[1] = 4e-5f;
    struct { const char *name; int O, I, K; } shapes[] = {
        {"L2  512x1024 x1", 512, 1024, 1},
        {"L2 1024x512  x1", 1024, 512, 1},
        {"L3  512x1024 x27", 512, 1024, 27},   /* int8: x13 (the same ~7 MiB) */
        {"L2  128x4096 x1", 128, 4096, 1},
        {"L3  1024x4096 x4", 1024, 4096, 4},   /* int8: x2 */
        {"RAM 512x1024", 512, 1024, -1},
        {"RAM 2048x1024", 2048, 1024, -1},
        {"RAM 1024x4096", 1024, 4096, -1},
        {"RAM 1024x6144", 1024, 6144, -1},
    };
    int mismatches = 0;
    for (int is4 = 1; is4 >= 0; is4--)
        for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
            char label[128];
            snprintf(label, sizeof label, "%s %s", is4 ? "int4" : "int8", shapes[si].name);
            if (!is4 && shapes[si].K > 1)
                snprintf(label, sizeof label, "int8 %.*s x%d", (int)(strchr(shapes[si].name, 'x') ?
                         strrchr(shapes[si].name, ' ') - shapes[si].name : 0), shapes[si].name, shapes[si].K / 2);
            if (only && !strstr(label, only))
                continue;
            int O = shapes[si].O, I = shapes[si].I, K = shapes[si].K;
            long rb = is4 ? I / 2 : I;
            if (K < 0)
                K = (int)((384L << 20) / ((long)O * rb));
            else if (K > 1 && !is4) /* the L3 sets: as many bytes as int4's (two copies must stay in L3) */
                K /= 2;
            /* q1 = Q8(x), q2 = Q8(residual): random int8, their block sums and split forms */
            for (int i = 0; i < 2 * I; i++)
                a.q[i] = (int8_t)((int)(rnd() % 255) - 127);
            a.gstride = coli_split_len(I);
            for (int p = 0; p < 2; p++) {
                coli_block_sums(a.q + p * I, I, 0, a.s + p);
                coli_split_q8_ref(a.q + p * I, I, a.g + p * a.gstride);
            }
            wset W;
            make_set(&W, is4, O, I, K);
            long bytes = (long)K * O * rb;
            size_t ny = (size_t)K * O;
            float *y = malloc(sizeof(float) * ny), *yref = malloc(sizeof(float) * ny * 3);
            int calls = (int)((64L << 20) / bytes); /* per sample: >= ~64 MiB of weights */
            if (calls < 1)
                calls = 1;
            printf("\n%s: %d matrices, %.2f MiB\n", label, K, bytes / 1048576.0);
            for (int ti = 0; ti < nthr; ti++) {
                int nt = threads[ti], have[3] = {0, 0, 0}, same[NV];
                double best[NV];
                for (int v = 0; v < NV; v++) {
                    best[v] = 1e300;
                    same[v] = 1;
                    if (vonly && !strstr(VARS[v].name, vonly) && strcmp(VARS[v].name, "read"))
                        continue;
                    call(&W, &a, &VARS[v], pf, y, nt);
                    int k = VARS[v].idot;
                    if (!have[k])
                        memcpy(yref + ny * k, y, sizeof(float) * ny);
                    have[k] = 1;
                    same[v] = k == 0 || memcmp(yref + ny * k, y, sizeof(float) * ny) == 0;
                    mismatches += !same[v];
                }
                for (int rep = 0; rep < repeats; rep++)
                    for (int v = 0; v < NV; v++) {
                        if (vonly && !strstr(VARS[v].name, vonly) && strcmp(VARS[v].name, "read"))
                            continue;
                        if (bytes < (64L << 20)) /* a cached set: in cache before the clock starts (the variants
                                                  * read two copies of it, plain and interleaved) */
                            call(&W, &a, &VARS[v], pf, y, nt);
                        double t0 = now_ns();
                        for (int c = 0; c < calls; c++)
                            call(&W, &a, &VARS[v], pf, y, nt);
                        double t = (now_ns() - t0) / calls;
                        if (t < best[v])
                            best[v] = t;
                    }
                for (int v = 0; v < NV; v++)
                    if (best[v] < 1e300)
                        printf("  %d thr  %-15s %9.1f us  %6.1f GB/s%s\n", nt, VARS[v].name, best[v] / 1e3,
                           bytes / best[v], same[v] ? "" : "  OUTPUT MISMATCH");
                fflush(stdout);
            }
            free(y);
            free(yref);
            free(W.w);
            free(W.wi);
            free(W.ws);
        }
    if (mismatches)
        printf("\n%d output mismatches\n", mismatches);
    return mismatches ? 1 : 0;
}
