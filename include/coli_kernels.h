/* colibri compute kernels: umbrella header with runtime ISA dispatch.
 *
 * Header-only. Each kernel exists as <name>_scalar (the readable definition), and on x86-64 also
 * as <name>_avx2 (AVX2 + FMA) and <name>_avx512 (AVX-512 F/BW/VL + VNNI). The translation unit is
 * compiled for baseline x86-64; the SIMD variants get their ISA from function target attributes,
 * and the entry points below call through a small function-pointer table.
 *
 * Dispatch:
 *   - The table is statically initialized to the scalar kernels, so every entry point is valid at
 *     any time, even before constructors run.
 *   - A load-time constructor (GCC/Clang) switches it to coli_isa_best(), so the default active ISA
 *     is the best one the CPU supports. The Python side may then override it (COLIBRI_ISA) with
 *     coli_select_isa().
 *   - coli_select_isa() rewrites the table; call it at setup time, not while other threads run
 *     kernels. Each entry point costs one indirect call and nothing else.
 *   - The table is static: each translation unit that includes this header has its own copy.
 *
 * Results: the integer dots are exact and identical on every ISA; coli_rowdot_*, coli_rowdot2_*,
 * coli_rowdot_*_rows and coli_quantize_q8 are bit-identical on every ISA (and the multi-activation
 * row dots to the equivalent single-row calls), and so are the group-scaled row dots coli_rowdotg_*
 * (coli_group.h); the float dots agree up to rounding only.
 */
#ifndef COLI_KERNELS_H
#define COLI_KERNELS_H

#include "coli_dot_i8.h"
#include "coli_dot_i4.h"
#include "coli_dot_f32.h"
#include "coli_axpy.h"
#include "coli_split.h"
#include "coli_rows4.h"
#include "coli_quant.h"
#include "coli_group.h"
#include "coli_gemm.h"

enum { COLI_ISA_SCALAR = 0, COLI_ISA_AVX2 = 1, COLI_ISA_AVX512VNNI = 2 };

typedef struct coli_kernel_table {
    int isa;
    int32_t (*dot_i8i8)(const int8_t *w, const int8_t *x, int n);
    int32_t (*dot_i4i8)(const uint8_t *w_packed, const int8_t *x, int n);
    float (*rowdot_i8)(const int8_t *w, const int8_t *xq, const float *xs, int n, int block);
    float (*rowdot_i4)(const uint8_t *w_packed, const int8_t *xq, const float *xs, int n, int block);
    float (*dot_f32)(const float *a, const float *b, int n);
    float (*dot_q8f32)(const int8_t *w, const float *x, int n);
    float (*dot_q4f32)(const uint8_t *w_packed, const float *x, int n);
    void (*quantize_q8)(const float *x, int n, int block, int8_t *q, float *xs);
    float (*rowdot2_i8)(const int8_t *w, const int8_t *q1, const float *xs1, const int8_t *q2,
                        const float *xs2, int n, int block);
    float (*rowdot2_i4)(const uint8_t *w_packed, const int8_t *q1, const float *xs1, const int8_t *q2,
                        const float *xs2, int n, int block);
    void (*rowdot_i8_rows)(const int8_t *w, const int8_t *q, long qstride, const float *xs, long sstride,
                           int R, int n, int block, float *out);
    void (*rowdot_i4_rows)(const uint8_t *w_packed, const int8_t *q, long qstride, const float *xs,
                           long sstride, int R, int n, int block, float *out);
    float (*rowdot2s_i4)(const uint8_t *w_packed, const int8_t *q1, const float *xs1, const int32_t *s1,
                         const int8_t *q2, const float *xs2, const int32_t *s2, int n, int block);
    void (*rowdot_i8_tile)(const int8_t *w, long rb, int ilv, int r0, int nw, const int8_t *q, long qstride,
                           const float *xs, const int32_t *s, long sstride, const uint8_t *xg, long gstride, int P,
                           int n, int block, float *out);
    void (*rowdot_i4_tile)(const uint8_t *w_packed, long rb, int ilv, int r0, int nw, const int8_t *q,
                           long qstride, const float *xs, const int32_t *s, long sstride, const uint8_t *xg,
                           long gstride, int P, int n, int block, float *out);
    void (*axpy_f32)(float *y, float c, const float *x, int n);
    void (*axpy_q8f32)(float *y, float c, const int8_t *w, int n);
    void (*axpy_q4f32)(float *y, float c, const uint8_t *w_packed, int n);
    void (*axpy_rows_f32)(float *y, int n, const float *c, const float *x, long stride, const int *idx,
                          int nrows);
    void (*axpy_rows_q8f32)(float *y, int n, const float *c, const int8_t *w, long rb, int nrows);
    void (*axpy_rows_q4f32)(float *y, int n, const float *c, const uint8_t *w_packed, long rb, int nrows);
    void (*dots_f32)(const float *x, int n, const float *base, long stride, const int *idx, int nrows,
                     float *out);
    void (*dots_q8f32)(const float *x, int n, const int8_t *w, long rb, int nrows, float *out);
    void (*dots_q4f32)(const float *x, int n, const uint8_t *w_packed, long rb, int nrows, float *out);
    float (*rowdotg_i8)(const int8_t *w, const float *ws, int gs, const int8_t *q, const float *xs, int n,
                        int block);
    float (*rowdotg_i4)(const uint8_t *w_packed, const float *ws, int gs, const int8_t *q, const float *xs,
                        int n, int block);
    void (*rowdotg_i8_rows)(const int8_t *w, const float *ws, int gs, const int8_t *q, long qstride,
                            const float *xs, long sstride, int R, int n, int block, float *out);
    void (*rowdotg_i4_rows)(const uint8_t *w_packed, const float *ws, int gs, const int8_t *q, long qstride,
                            const float *xs, long sstride, int R, int n, int block, float *out);
    void (*rowdotg_i8_tile)(const int8_t *w, long rb, int nw, const float *ws, long wstride, int gs,
                            const int8_t *q, long qstride, const uint8_t *xg, long gstride, const float *xs,
                            long sstride, int P, int n, float *out);
    void (*rowdotg_i4_tile)(const uint8_t *w_packed, long rb, int nw, const float *ws, long wstride, int gs,
                            const int8_t *q, long qstride, const uint8_t *xg, long gstride, const float *xs,
                            long sstride, int P, int n, float *out);
    int (*split_q8)(const int8_t *q, int n, uint8_t *xg);
    void (*dotsg_q8f32)(const float *x, int n, const int8_t *w, long rb, const float *ws, long wstride, int gs,
                        int nrows, float *out);
    void (*dotsg_q4f32)(const float *x, int n, const uint8_t *w_packed, long rb, const float *ws, long wstride,
                        int gs, int nrows, float *out);
    void (*dots_f32_multi)(const float *x, long xstride, int nq, int n, const float *base, long stride,
                           const int *idx, int nrows, float *out, long ostride);
    void (*axpy_rows_f32_multi)(float *y, long ystride, int nq, int n, const float *c, long cstride,
                                const float *x, long stride, const int *idx, int nrows);
} coli_kernel_table;

#define COLI_KERNEL_TABLE(isa, sfx)                                                       \
    { isa, coli_dot_i8i8_##sfx, coli_dot_i4i8_##sfx, coli_rowdot_i8_##sfx,               \
      coli_rowdot_i4_##sfx, coli_dot_f32_##sfx, coli_dot_q8f32_##sfx, coli_dot_q4f32_##sfx, \
      coli_quantize_q8_##sfx, coli_rowdot2_i8_##sfx, coli_rowdot2_i4_##sfx,                  \
      coli_rowdot_i8_rows_##sfx, coli_rowdot_i4_rows_##sfx, coli_rowdot2s_i4_##sfx,            \
      coli_rowdot_i8_tile_##sfx, coli_rowdot_i4_tile_##sfx, coli_axpy_f32_##sfx,               \
      coli_axpy_q8f32_##sfx, coli_axpy_q4f32_##sfx, coli_axpy_rows_f32_##sfx,                 \
      coli_axpy_rows_q8f32_##sfx, coli_axpy_rows_q4f32_##sfx, coli_dots_f32_##sfx,            \
      coli_dots_q8f32_##sfx, coli_dots_q4f32_##sfx, coli_rowdotg_i8_##sfx, coli_rowdotg_i4_##sfx, \
      coli_rowdotg_i8_rows_##sfx, coli_rowdotg_i4_rows_##sfx, coli_rowdotg_i8_tile_##sfx,          \
      coli_rowdotg_i4_tile_##sfx, coli_split_q8_##sfx, coli_dotsg_q8f32_##sfx, coli_dotsg_q4f32_##sfx, \
      coli_dots_f32_multi_##sfx, coli_axpy_rows_f32_multi_##sfx }

static const coli_kernel_table coli_kernels_by_isa[] = {
    COLI_KERNEL_TABLE(COLI_ISA_SCALAR, scalar),
#if COLI_X86
    COLI_KERNEL_TABLE(COLI_ISA_AVX2, avx2),
    COLI_KERNEL_TABLE(COLI_ISA_AVX512VNNI, avx512),
#endif
};

/* the active table (starts as scalar, see above) */
static coli_kernel_table coli_kt = COLI_KERNEL_TABLE(COLI_ISA_SCALAR, scalar);

/* ------------------------------------ ISA selection ------------------------------------ */

static inline int coli_isa_best(void)
{
#if COLI_X86
    __builtin_cpu_init(); /* required when called from a constructor */
    /* __builtin_cpu_supports also checks that the OS saves the AVX / AVX-512 register state */
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
        if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
            __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni"))
            return COLI_ISA_AVX512VNNI;
        return COLI_ISA_AVX2;
    }
#endif
    return COLI_ISA_SCALAR;
}

/* Activates `isa`, clamped to [COLI_ISA_SCALAR, coli_isa_best()]; returns the ISA now active. */
static inline int coli_select_isa(int isa)
{
    int best = coli_isa_best();
    if (isa > best)
        isa = best;
    if (isa < COLI_ISA_SCALAR)
        isa = COLI_ISA_SCALAR;
    coli_kt = coli_kernels_by_isa[isa];
    return coli_kt.isa;
}

static inline int coli_isa_active(void) { return coli_kt.isa; }

static inline const char *coli_isa_name(int isa)
{
    switch (isa) {
    case COLI_ISA_SCALAR: return "scalar";
    case COLI_ISA_AVX2: return "avx2";
    case COLI_ISA_AVX512VNNI: return "avx512vnni";
    default: return "unknown";
    }
}

#if defined(__GNUC__)
__attribute__((constructor)) static void coli_kernels_autoselect(void)
{
    coli_select_isa(coli_isa_best());
}
#endif

/* ------------------------------------- entry points ------------------------------------- */

/* sum_i w[i]*x[i] over one block, exact in int32 (n <= 65536 guaranteed exact) */
static inline int32_t coli_dot_i8i8(const int8_t *w, const int8_t *x, int n)
{
    return coli_kt.dot_i8i8(w, x, n);
}

/* same for packed int4 weights; w_packed starts at element 0 (an even element) */
static inline int32_t coli_dot_i4i8(const uint8_t *w_packed, const int8_t *x, int n)
{
    return coli_kt.dot_i4i8(w_packed, x, n);
}

/* sum_b xs[b] * (float)dot_b over the row's activation blocks, summed in order in float.
 * block: a positive multiple of 64, or >= n (or <= 0) for a single block. */
static inline float coli_rowdot_i8(const int8_t *w, const int8_t *xq, const float *xs, int n, int block)
{
    return coli_kt.rowdot_i8(w, xq, xs, n, block);
}

/* same for packed int4 weights (block must be even so blocks start on a byte) */
static inline float coli_rowdot_i4(const uint8_t *w_packed, const int8_t *xq, const float *xs, int n, int block)
{
    return coli_kt.rowdot_i4(w_packed, xq, xs, n, block);
}

/* Two activation vectors (e.g. a row quantized as q1 and its quantized residual q2) against one
 * weight row in one pass over the weights. Bit-identical to
 *   coli_rowdot_i8(w, q1, xs1, n, block) + coli_rowdot_i8(w, q2, xs2, n, block). */
static inline float coli_rowdot2_i8(const int8_t *w, const int8_t *q1, const float *xs1, const int8_t *q2,
                                    const float *xs2, int n, int block)
{
    return coli_kt.rowdot2_i8(w, q1, xs1, q2, xs2, n, block);
}

static inline float coli_rowdot2_i4(const uint8_t *w_packed, const int8_t *q1, const float *xs1,
                                    const int8_t *q2, const float *xs2, int n, int block)
{
    return coli_kt.rowdot2_i4(w_packed, q1, xs1, q2, xs2, n, block);
}

/* coli_rowdot2_i4 given the activations' per-block sums (s[b] = sum of q over block b, int32):
 * bit-identical, faster where the ISA uses them (AVX-512 VNNI). */
static inline float coli_rowdot2s_i4(const uint8_t *w_packed, const int8_t *q1, const float *xs1,
                                     const int32_t *s1, const int8_t *q2, const float *xs2,
                                     const int32_t *s2, int n, int block)
{
    return coli_kt.rowdot2s_i4(w_packed, q1, xs1, s1, q2, xs2, s2, n, block);
}

/* The tile of the per-row-scale integer matmuls (coli_rows4.h), the decode matmuls' unit of work:
 * nw (1..4) weight rows - rows r0 .. r0 + nw - 1 of the plain rows at w (ilv = 0: row k at w + k*rb)
 * or of the group of four interleaved rows at w (ilv = 1, coli_ilv_pack) - against P >= 1 Q8
 * activation rows (row p at q + p*qstride; its block scales and block sums at xs / s + p*sstride,
 * its split form at xg + p*gstride; s and xg may be NULL):
 *   out[p*nw + r] = coli_rowdot_i8 / coli_rowdot_i4(row r0 + r, q + p*qstride, xs + p*sstride, n, block)
 * bit-identical. The idot=2 pair (q1, its residual q2) is two activation rows; with the block sums
 * (and, for int4, the split forms) the AVX-512 tile needs one vpdpbusd per 64 weights and row. */
static inline void coli_rowdot_i8_tile(const int8_t *w, long rb, int ilv, int r0, int nw, const int8_t *q,
                                       long qstride, const float *xs, const int32_t *s, long sstride,
                                       const uint8_t *xg, long gstride, int P, int n, int block, float *out)
{
    coli_kt.rowdot_i8_tile(w, rb, ilv, r0, nw, q, qstride, xs, s, sstride, xg, gstride, P, n, block, out);
}

static inline void coli_rowdot_i4_tile(const uint8_t *w_packed, long rb, int ilv, int r0, int nw, const int8_t *q,
                                       long qstride, const float *xs, const int32_t *s, long sstride,
                                       const uint8_t *xg, long gstride, int P, int n, int block, float *out)
{
    coli_kt.rowdot_i4_tile(w_packed, rb, ilv, r0, nw, q, qstride, xs, s, sstride, xg, gstride, P, n, block, out);
}

/* y[i] += c * x[i] (x float / int8 / packed int4 - 8), element by element, bit-identical across
 * ISAs (coli_axpy.h) */
static inline void coli_axpy_f32(float *y, float c, const float *x, int n)
{
    coli_kt.axpy_f32(y, c, x, n);
}

static inline void coli_axpy_q8f32(float *y, float c, const int8_t *w, int n)
{
    coli_kt.axpy_q8f32(y, c, w, n);
}

static inline void coli_axpy_q4f32(float *y, float c, const uint8_t *w_packed, int n)
{
    coli_kt.axpy_q4f32(y, c, w_packed, n);
}

/* y += sum_r c[r] * row_r, each element's terms in row order: bit-identical to one coli_axpy_*
 * call per row (coli_axpy.h). f32 rows: x + (idx ? idx[r] : r) * stride; int8 / int4: rows of rb
 * bytes from w. */
static inline void coli_axpy_rows_f32(float *y, int n, const float *c, const float *x, long stride,
                                      const int *idx, int nrows)
{
    coli_kt.axpy_rows_f32(y, n, c, x, stride, idx, nrows);
}

static inline void coli_axpy_rows_q8f32(float *y, int n, const float *c, const int8_t *w, long rb, int nrows)
{
    coli_kt.axpy_rows_q8f32(y, n, c, w, rb, nrows);
}

static inline void coli_axpy_rows_q4f32(float *y, int n, const float *c, const uint8_t *w_packed, long rb,
                                        int nrows)
{
    coli_kt.axpy_rows_q4f32(y, n, c, w_packed, rb, nrows);
}

/* out[r] = coli_dot_f32(x, row_r) / coli_dot_q8f32 / coli_dot_q4f32 for many rows in one call
 * (coli_dot_f32.h): the same floats as one call per row */
static inline void coli_dots_f32(const float *x, int n, const float *base, long stride, const int *idx,
                                 int nrows, float *out)
{
    coli_kt.dots_f32(x, n, base, stride, idx, nrows, out);
}

/* out[q * ostride + r] = coli_dot_f32(x + q * xstride, row_r), row_r = base + (idx ? idx[r] : r) *
 * stride: several queries over the same rows, each bit-identical to its own coli_dots_f32 */
static inline void coli_dots_f32_multi(const float *x, long xstride, int nq, int n, const float *base, long stride,
                                       const int *idx, int nrows, float *out, long ostride)
{
    coli_kt.dots_f32_multi(x, xstride, nq, n, base, stride, idx, nrows, out, ostride);
}

/* y_q += sum_r c[q * cstride + r] * row_r, y_q = y + q * ystride, for q < nq (rows as above): each
 * output bit-identical to its own coli_axpy_rows_f32 */
static inline void coli_axpy_rows_f32_multi(float *y, long ystride, int nq, int n, const float *c, long cstride,
                                            const float *x, long stride, const int *idx, int nrows)
{
    coli_kt.axpy_rows_f32_multi(y, ystride, nq, n, c, cstride, x, stride, idx, nrows);
}

static inline void coli_dots_q8f32(const float *x, int n, const int8_t *w, long rb, int nrows, float *out)
{
    coli_kt.dots_q8f32(x, n, w, rb, nrows, out);
}

static inline void coli_dots_q4f32(const float *x, int n, const uint8_t *w_packed, long rb, int nrows,
                                   float *out)
{
    coli_kt.dots_q4f32(x, n, w_packed, rb, nrows, out);
}

/* s[b] = sum of the int8 activations of each block (the input of coli_rowdot2s_i4) */
static inline void coli_block_sums(const int8_t *q, int n, int block, int32_t *s)
{
    int b = 0;
    block = coli_block_len(n, block);
    for (int i = 0; i < n; i += block, b++) {
        int len = n - i < block ? n - i : block, acc = 0;
        for (int j = 0; j < len; j++)
            acc += q[i + j];
        s[b] = acc;
    }
}

/* R activation rows (meant for R <= 8; any R >= 0 works) against one weight row in one pass over
 * the weights: out[r] = coli_rowdot_i8(w, q + r*qstride, xs + r*sstride, n, block), bit-identical.
 * qstride is in int8 elements, sstride in floats; out must not alias the inputs. */
static inline void coli_rowdot_i8_rows(const int8_t *w, const int8_t *q, long qstride, const float *xs,
                                       long sstride, int R, int n, int block, float *out)
{
    coli_kt.rowdot_i8_rows(w, q, qstride, xs, sstride, R, n, block, out);
}

static inline void coli_rowdot_i4_rows(const uint8_t *w_packed, const int8_t *q, long qstride,
                                       const float *xs, long sstride, int R, int n, int block, float *out)
{
    coli_kt.rowdot_i4_rows(w_packed, q, qstride, xs, sstride, R, n, block, out);
}

static inline float coli_dot_f32(const float *a, const float *b, int n)
{
    return coli_kt.dot_f32(a, b, n);
}

static inline float coli_dot_q8f32(const int8_t *w, const float *x, int n)
{
    return coli_kt.dot_q8f32(w, x, n);
}

static inline float coli_dot_q4f32(const uint8_t *w_packed, const float *x, int n)
{
    return coli_kt.dot_q4f32(w_packed, x, n);
}

/* Group-scaled weight rows (coli_group.h): ws[g] scales inputs g*gs .. (g+1)*gs-1 of the row (gs a
 * multiple of 64, the last group partial), against Q8 activations q with block scales xs. One
 * activation block: the lane form, xs[0] * R16(A) with A[l] = fma(ws[g], (float)D[g][l], A[l])
 * over the groups (D: the exact integer dot of the group's inputs in lane l = (i mod 64) / 4);
 * several blocks: the segment form, sum over blocks b of xs[b] * (sum over the block's pieces k,
 * cut at the group boundaries, of ws[g(k)] * (float)dot_k). Bit-identical on every ISA. */
static inline float coli_rowdotg_i8(const int8_t *w, const float *ws, int gs, const int8_t *q, const float *xs,
                                    int n, int block)
{
    return coli_kt.rowdotg_i8(w, ws, gs, q, xs, n, block);
}

static inline float coli_rowdotg_i4(const uint8_t *w_packed, const float *ws, int gs, const int8_t *q,
                                    const float *xs, int n, int block)
{
    return coli_kt.rowdotg_i4(w_packed, ws, gs, q, xs, n, block);
}

/* R activation rows (q + r*qstride, xs + r*sstride) against one group-scaled weight row in one
 * pass: out[r] = coli_rowdotg_*(w, ws, gs, q + r*qstride, xs + r*sstride, n, block), bit-identical */
static inline void coli_rowdotg_i8_rows(const int8_t *w, const float *ws, int gs, const int8_t *q, long qstride,
                                        const float *xs, long sstride, int R, int n, int block, float *out)
{
    coli_kt.rowdotg_i8_rows(w, ws, gs, q, qstride, xs, sstride, R, n, block, out);
}

static inline void coli_rowdotg_i4_rows(const uint8_t *w_packed, const float *ws, int gs, const int8_t *q,
                                        long qstride, const float *xs, long sstride, int R, int n, int block,
                                        float *out)
{
    coli_kt.rowdotg_i4_rows(w_packed, ws, gs, q, qstride, xs, sstride, R, n, block, out);
}

/* Lane form for a tile of nw (1..4) weight rows (w + r*rb, scales ws + r*wstride) and P activation
 * rows (q + p*qstride, one scale xs[p*sstride] each): out[p*nw + r] = coli_rowdotg_*(w + r*rb,
 * ws + r*wstride, gs, q + p*qstride, xs + p*sstride, n, n), bit-identical; the decode matmuls'
 * unit of work for group-scaled matrices. xg (int4; NULL = none): the activation rows' split
 * forms, row p at xg + p*gstride, as coli_split_q8 wrote them (when it returned 1). */
static inline void coli_rowdotg_i8_tile(const int8_t *w, long rb, int nw, const float *ws, long wstride, int gs,
                                        const int8_t *q, long qstride, const uint8_t *xg, long gstride,
                                        const float *xs, long sstride, int P, int n, float *out)
{
    coli_kt.rowdotg_i8_tile(w, rb, nw, ws, wstride, gs, q, qstride, xg, gstride, xs, sstride, P, n, out);
}

static inline void coli_rowdotg_i4_tile(const uint8_t *w_packed, long rb, int nw, const float *ws, long wstride,
                                        int gs, const int8_t *q, long qstride, const uint8_t *xg, long gstride,
                                        const float *xs, long sstride, int P, int n, float *out)
{
    coli_kt.rowdotg_i4_tile(w_packed, rb, nw, ws, wstride, gs, q, qstride, xg, gstride, xs, sstride, P, n, out);
}

/* The split form of one Q8 activation row (coli_split_len(n) bytes at xg) for the active ISA's int4
 * tile; returns 0 (nothing written) when the tile reads the activations as they are. */
static inline int coli_split_q8(const int8_t *q, int n, uint8_t *xg)
{
    return coli_kt.split_q8(q, n, xg);
}

/* whether the active ISA's int4 tile reads split activations (coli_split_q8 writes them) */
static inline int coli_split_active(void)
{
    return coli_kt.split_q8(NULL, 0, NULL);
}

/* float path of group-scaled rows: out[r] = sum_g coli_dot_*f32(group g of row r, x) * ws[r*wstride + g]
 * (coli_group.h; equal across ISAs up to rounding, as the float dots) */
static inline void coli_dotsg_q8f32(const float *x, int n, const int8_t *w, long rb, const float *ws, long wstride,
                                    int gs, int nrows, float *out)
{
    coli_kt.dotsg_q8f32(x, n, w, rb, ws, wstride, gs, nrows, out);
}

static inline void coli_dotsg_q4f32(const float *x, int n, const uint8_t *w_packed, long rb, const float *ws,
                                    long wstride, int gs, int nrows, float *out)
{
    coli_kt.dotsg_q4f32(x, n, w_packed, rb, ws, wstride, gs, nrows, out);
}

/* per-block int8 quantization; q gets n values, xs gets one scale per block */
static inline void coli_quantize_q8(const float *x, int n, int block, int8_t *q, float *xs)
{
    coli_kt.quantize_q8(x, n, block, q, xs);
}

#endif /* COLI_KERNELS_H */
