/* Group-scaled weight rows x Q8 activations (colibrì's group-scaled int4 container, and int8).
 *
 * A weight row w of n elements (int8, or packed int4 as in coli_dot_i4.h) carries one f32 scale
 * per group of gs consecutive inputs: ws[g] for inputs g*gs .. (g+1)*gs - 1, the last group
 * partial when gs does not divide n. gs is a positive multiple of 64 (so every group starts on a
 * byte of a packed int4 row). The activations are Q8 with one scale per activation block
 * (xs[b], blocks of coli_block_len(n, block), the last partial), as for the per-row kernels.
 *
 *   coli_rowdotg_<i8|i4>_<isa>(w, ws, gs, q, xs, n, block)
 *       = xs[0] (x) in_0  (+)  xs[1] (x) in_1  (+) ...            over the activation blocks b
 *     in_b = ws[g0] (x) (float)dot_0 (+) ws[g1] (x) (float)dot_1 ...  over the segments of block b
 *
 * where the segments of block b are its pieces cut by the weight-group boundaries, in order,
 * dot_k is the exact int32 dot of segment k and g(k) its group; (x) is a float product rounded on
 * its own (never fused with the add: coli_block_acc / coli_mul_pinned), (+) float adds left to
 * right, in_b starting from 0 (coli_block_acc), the outer sum from the first block's product.
 * With one activation block (the engine's default, block >= n) this is
 *
 *       xs[0] (x) coli_rowdot_<kind>(w, q, ws, n, gs)
 *
 * i.e. the per-row kernel with the weight-group scales in the place of the activation-block
 * scales (its SIMD variants are bit-identical to the scalar one), then one product. A block that
 * is a multiple of gs is likewise coli_rowdot over its groups; other blocks are cut into
 * segments, each an exact integer dot of the ISA. So every variant returns the scalar one's
 * float, bit for bit, and the per-row kernels themselves are unchanged.
 *
 *   coli_rowdotg_<kind>_rows_<isa>(w, ws, gs, q, qstride, xs, sstride, R, n, block, out)
 *       out[r] = coli_rowdotg_<kind>(w, ws, gs, q + r*qstride, xs + r*sstride, n, block), r < R,
 *       one pass over the weights (coli_rowdot_<kind>_rows with the weight scales, stride 0),
 *       bit-identical to the one-row call.
 */
#ifndef COLI_GROUP_H
#define COLI_GROUP_H

#include "coli_dot_i8.h"
#include "coli_dot_i4.h"
#include "coli_axpy.h" /* coli_mul_pinned */

#define COLI_GROUP_OFF_i8(j) (j)
#define COLI_GROUP_OFF_i4(j) ((j) / 2)

/* in_b of the activation block [i, end): whole groups (block start and length multiples of gs,
 * or the block is the row's tail) take the row kernel over them; else one integer dot per
 * segment */
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
            coli_rowdot_##kind##_rows_##sfx(w, q, qstride, ws, 0, R, n, gs, out);                  \
            for (int r = 0; r < R; r++)                                                            \
                out[r] = coli_mul_pinned(xs[(long)r * sstride], out[r]);                           \
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

#endif /* COLI_GROUP_H */
