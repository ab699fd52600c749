/* int8 weight x int8 activation dot products.
 *
 *   coli_dot_i8i8_<isa>(w, x, n)            = sum_i w[i] * x[i]              (exact int32)
 *   coli_rowdot_i8_<isa>(w, xq, xs, n, blk) = sum_b xs[b] * (float)dot_b    (float, blocks in order)
 *
 * Several activation rows against one weight row, in one pass over the weights (see the
 * "multi-activation row dots" section at the end):
 *   coli_rowdot2_i8_<isa>(w, q1, xs1, q2, xs2, n, blk)
 *       = coli_rowdot_i8(w, q1, xs1, n, blk) + coli_rowdot_i8(w, q2, xs2, n, blk)   (one float add)
 *   coli_rowdot_i8_rows_<isa>(w, q, qstride, xs, sstride, R, n, blk, out)
 *       out[r] = coli_rowdot_i8(w, q + r*qstride, xs + r*sstride, n, blk),  r = 0..R-1
 *
 * w[i] in [-128, 127], x[i] in [-127, 127]. Every product is <= 128*127 = 16256 in magnitude,
 * so the int32 result is exact for n <= 132104; the engine relies on n <= 65536 per block.
 *
 * The scalar functions are the definition; the AVX2 and AVX-512 VNNI ones must return the
 * same integers, and (through coli_block_acc) bit-identical floats for the row dots.
 */
#ifndef COLI_DOT_I8_H
#define COLI_DOT_I8_H

/* ---- shared prelude, also used by coli_dot_i4.h, coli_dot_f32.h and coli_quant.h ---- */
#include <stdint.h>
#if (defined(__x86_64__) || defined(_M_X64)) && defined(__GNUC__)
#define COLI_X86 1
#include <immintrin.h>
/* Per-function ISA selection: the translation unit itself is built for baseline x86-64. */
#define COLI_AVX2 __attribute__((target("avx2,fma")))
#define COLI_AVX512 __attribute__((target("avx2,fma,avx512f,avx512bw,avx512vl,avx512vnni")))
#else
#define COLI_X86 0
#endif

/* acc + s*d, with the product rounded to float BEFORE the add. The empty asm pins the product in
 * a register so the compiler cannot contract the two operations into one fma (which it would do
 * inside the fma-enabled variants but not in baseline scalar code); this keeps block-scaled row
 * dots bit-identical across ISAs. */
static inline float coli_block_acc(float acc, float s, int32_t d)
{
    float p = s * (float)d;
#if COLI_X86
    __asm__("" : "+x"(p));
#elif defined(__aarch64__) && defined(__GNUC__)
    __asm__("" : "+w"(p));
#endif
    return acc + p;
}

/* Forces inlining; the multi-row kernels are written for a row count G that is a compile-time
 * constant after inlining, so their per-row arrays of vectors live in registers. */
#if defined(__GNUC__)
#define COLI_ALWAYS_INLINE inline __attribute__((always_inline))
#else
#define COLI_ALWAYS_INLINE inline
#endif

/* Length of the block structure used by all row dots and the quantizer: a non-positive block or
 * one that covers the row means "the whole row is a single block". */
static inline int coli_block_len(int n, int block)
{
    return (block <= 0 || block > n) ? n : block;
}

#if COLI_X86
/* Four consecutive blocks at once: acc + xs[0]*d[0] + xs[1]*d[1] + xs[2]*d[2] + xs[3]*d[3], added
 * left to right with each product rounded on its own - the same float operations as four
 * coli_block_acc calls, so the result is bit-identical. Used by the SIMD block-64 fast paths. */
static inline float coli_block_acc4(float acc, const float *xs, __m128i d)
{
    __m128 p = _mm_mul_ps(_mm_loadu_ps(xs), _mm_cvtepi32_ps(d));
    __asm__("" : "+x"(p)); /* no fma contraction, see coli_block_acc */
    acc += _mm_cvtss_f32(p);
    acc += _mm_cvtss_f32(_mm_shuffle_ps(p, p, 1));
    acc += _mm_cvtss_f32(_mm_shuffle_ps(p, p, 2));
    acc += _mm_cvtss_f32(_mm_shuffle_ps(p, p, 3));
    return acc;
}
#endif

/* ================================ scalar (the definition) ================================ */

static inline int32_t coli_dot_i8i8_scalar(const int8_t *w, const int8_t *x, int n)
{
    int32_t s = 0;
    for (int i = 0; i < n; i++)
        s += (int32_t)w[i] * (int32_t)x[i];
    return s;
}

static inline float coli_rowdot_i8_scalar(const int8_t *w, const int8_t *xq, const float *xs,
                                          int n, int block)
{
    float acc = 0.0f;
    block = coli_block_len(n, block);
    for (int i = 0, b = 0; i < n; i += block, b++) {
        int len = n - i < block ? n - i : block;
        acc = coli_block_acc(acc, xs[b], coli_dot_i8i8_scalar(w + i, xq + i, len));
    }
    return acc;
}

#if COLI_X86
/* ========================================= AVX2 ========================================= */

COLI_AVX2 static inline int32_t coli_hsum_i32_avx2(__m256i v)
{
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtsi128_si32(s);
}

/* 32 products summed into 8 int32 lanes. Sign trick: maddubs wants u8 x s8, so use |w| (|-128|
 * = 128 still fits u8) and move w's sign onto x (vpsignb; w = 0 zeroes x, harmless). Each pair
 * sum is <= 2*128*127 = 32512, so maddubs never saturates; madd with ones widens to int32. */
COLI_AVX2 static inline __m256i coli_i8x32_dot_avx2(__m256i w, __m256i x)
{
    __m256i pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w));
    return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}

COLI_AVX2 static inline __m128i coli_i8x16_dot_sse(__m128i w, __m128i x)
{
    __m128i pairs = _mm_maddubs_epi16(_mm_abs_epi8(w), _mm_sign_epi8(x, w));
    return _mm_madd_epi16(pairs, _mm_set1_epi16(1));
}

/* the four horizontal sums of a, b, c, d, in that order */
COLI_AVX2 static inline __m128i coli_hsum4_i32_avx2(__m256i a, __m256i b, __m256i c, __m256i d)
{
    __m256i abcd = _mm256_hadd_epi32(_mm256_hadd_epi32(a, b), _mm256_hadd_epi32(c, d));
    return _mm_add_epi32(_mm256_castsi256_si128(abcd), _mm256_extracti128_si256(abcd, 1));
}

/* one full 64-element block, left as 8 int32 partial sums */
COLI_AVX2 static inline __m256i coli_i8_blk64_avx2(const int8_t *w, const int8_t *x)
{
    return _mm256_add_epi32(
        coli_i8x32_dot_avx2(_mm256_loadu_si256((const __m256i *)w), _mm256_loadu_si256((const __m256i *)x)),
        coli_i8x32_dot_avx2(_mm256_loadu_si256((const __m256i *)(w + 32)),
                            _mm256_loadu_si256((const __m256i *)(x + 32))));
}

COLI_AVX2 static inline int32_t coli_dot_i8i8_avx2(const int8_t *w, const int8_t *x, int n)
{
    __m256i acc = _mm256_setzero_si256();
    int i = 0;
    for (; i + 64 <= n; i += 64)
        acc = _mm256_add_epi32(acc, coli_i8_blk64_avx2(w + i, x + i));
    if (i + 32 <= n) {
        acc = _mm256_add_epi32(acc, coli_i8x32_dot_avx2(_mm256_loadu_si256((const __m256i *)(w + i)),
                                                        _mm256_loadu_si256((const __m256i *)(x + i))));
        i += 32;
    }
    if (i + 16 <= n) {
        __m128i d = coli_i8x16_dot_sse(_mm_loadu_si128((const __m128i *)(w + i)),
                                       _mm_loadu_si128((const __m128i *)(x + i)));
        acc = _mm256_add_epi32(acc, _mm256_inserti128_si256(_mm256_setzero_si256(), d, 0));
        i += 16;
    }
    int32_t s = coli_hsum_i32_avx2(acc);
    for (; i < n; i++) /* < 16 left */
        s += (int32_t)w[i] * (int32_t)x[i];
    return s;
}

COLI_AVX2 static inline float coli_rowdot_i8_avx2(const int8_t *w, const int8_t *xq, const float *xs,
                                                  int n, int block)
{
    float acc = 0.0f;
    int i = 0, b = 0;
    block = coli_block_len(n, block);
    if (block == 64) /* fast path: four blocks per step, one joint horizontal reduction */
        for (; i + 256 <= n; i += 256, b += 4)
            acc = coli_block_acc4(acc, xs + b, coli_hsum4_i32_avx2(
                      coli_i8_blk64_avx2(w + i, xq + i), coli_i8_blk64_avx2(w + i + 64, xq + i + 64),
                      coli_i8_blk64_avx2(w + i + 128, xq + i + 128), coli_i8_blk64_avx2(w + i + 192, xq + i + 192)));
    for (; i < n; i += block, b++) {
        int len = n - i < block ? n - i : block;
        acc = coli_block_acc(acc, xs[b], coli_dot_i8i8_avx2(w + i, xq + i, len));
    }
    return acc;
}

/* ==================================== AVX-512 VNNI ==================================== */

/* acc += 64 products via vpdpbusd (u8 x s8, groups of 4 summed into int32, no saturation).
 * Same sign trick as AVX2, but zmm has no vpsignb: negate x under the mask of w's sign bits. */
COLI_AVX512 static inline __m512i coli_i8x64_dpbusd(__m512i acc, __m512i w, __m512i x)
{
    __mmask64 wneg = _mm512_movepi8_mask(w);
    __m512i sx = _mm512_mask_sub_epi8(x, wneg, _mm512_setzero_si512(), x);
    return _mm512_dpbusd_epi32(acc, _mm512_abs_epi8(w), sx);
}

/* the four horizontal sums of a, b, c, d, in that order: interleave-and-add twice gives
 * [a b c d] partial sums in every 128-bit lane, then the four lanes are added */
COLI_AVX512 static inline __m128i coli_hsum4_i32_avx512(__m512i a, __m512i b, __m512i c, __m512i d)
{
    __m512i ab = _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
    __m512i cd = _mm512_add_epi32(_mm512_unpacklo_epi32(c, d), _mm512_unpackhi_epi32(c, d));
    __m512i abcd = _mm512_add_epi32(_mm512_unpacklo_epi64(ab, cd), _mm512_unpackhi_epi64(ab, cd));
    __m256i h = _mm256_add_epi32(_mm512_castsi512_si256(abcd), _mm512_extracti64x4_epi64(abcd, 1));
    return _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
}

COLI_AVX512 static inline __m512i coli_i8_blk64_avx512(const int8_t *w, const int8_t *x)
{
    return coli_i8x64_dpbusd(_mm512_setzero_si512(), _mm512_loadu_si512(w), _mm512_loadu_si512(x));
}

COLI_AVX512 static inline int32_t coli_dot_i8i8_avx512(const int8_t *w, const int8_t *x, int n)
{
    __m512i acc0 = _mm512_setzero_si512(), acc1 = _mm512_setzero_si512();
    int i = 0;
    for (; i + 128 <= n; i += 128) {
        acc0 = coli_i8x64_dpbusd(acc0, _mm512_loadu_si512(w + i), _mm512_loadu_si512(x + i));
        acc1 = coli_i8x64_dpbusd(acc1, _mm512_loadu_si512(w + i + 64), _mm512_loadu_si512(x + i + 64));
    }
    if (i + 64 <= n) {
        acc0 = coli_i8x64_dpbusd(acc0, _mm512_loadu_si512(w + i), _mm512_loadu_si512(x + i));
        i += 64;
    }
    if (i < n) { /* masked loads: lanes past n read as 0 and are never touched in memory */
        __mmask64 m = ~0ULL >> (64 - (n - i));
        acc1 = coli_i8x64_dpbusd(acc1, _mm512_maskz_loadu_epi8(m, w + i), _mm512_maskz_loadu_epi8(m, x + i));
    }
    return _mm512_reduce_add_epi32(_mm512_add_epi32(acc0, acc1));
}

COLI_AVX512 static inline float coli_rowdot_i8_avx512(const int8_t *w, const int8_t *xq, const float *xs,
                                                      int n, int block)
{
    float acc = 0.0f;
    int i = 0, b = 0;
    block = coli_block_len(n, block);
    if (block == 64) /* fast path: four blocks per step, one joint horizontal reduction */
        for (; i + 256 <= n; i += 256, b += 4)
            acc = coli_block_acc4(acc, xs + b, coli_hsum4_i32_avx512(
                      coli_i8_blk64_avx512(w + i, xq + i), coli_i8_blk64_avx512(w + i + 64, xq + i + 64),
                      coli_i8_blk64_avx512(w + i + 128, xq + i + 128),
                      coli_i8_blk64_avx512(w + i + 192, xq + i + 192)));
    for (; i < n; i += block, b++) {
        int len = n - i < block ? n - i : block;
        acc = coli_block_acc(acc, xs[b], coli_dot_i8i8_avx512(w + i, xq + i, len));
    }
    return acc;
}
#endif /* COLI_X86 */

/* ============================== multi-activation row dots ==============================
 *
 * G activation rows against one weight row, reading the weights once: every weight vector is
 * loaded (and, for int4, decoded) once and then used for all G rows, each with its own
 * accumulators. The integer block dots are exact, so the order of the integer work is free; the
 * float side is, per row, exactly the single-row kernel's: xs[b] * (float)dot_b, added block by
 * block in order through coli_block_acc / coli_block_acc4. Hence out[r] is bit-identical to
 * coli_rowdot_*_<isa>(w, q[r], xs[r], n, block), and so to every other ISA.
 *
 * The per-ISA core is coli_rowsg_<i8|i4>_<isa>(w, q[], xs[], G, n, block, out) for G = 1..4
 * rows given as pointer arrays (SIMD: specialized per G so the per-row accumulators stay in
 * registers, and G = 1 is the single-row kernel itself; scalar: rows in pairs, one fused loop per
 * pair). The public entry points wrap it (COLI_ROWS_WRAPPERS):
 *   coli_rowdot2_<i8|i4>_<isa>: two rows (the residual-quantized activation pair), returns
 *       out[0] + out[1], i.e. the same single float add as rowdot(q1) + rowdot(q2);
 *   coli_rowdot_<i8|i4>_rows_<isa>: R strided rows, in groups of up to 4 (the weight row is
 *       streamed from memory once; later groups find it in L1/L2). Any R >= 0 works; the engine
 *       uses R <= 8. out must not alias the inputs.
 */
#define COLI_ROWS_G 4 /* rows per group */

#if defined(__GNUC__)
#define COLI_UNROLL_G _Pragma("GCC unroll 4")
#else
#define COLI_UNROLL_G
#endif

/* rowdot2 and rows for one weight type (kind = i8 / i4, WT = its element type) and one ISA */
#define COLI_ROWS_WRAPPERS(kind, WT, sfx, ATTR)                                                    \
    ATTR static inline float coli_rowdot2_##kind##_##sfx(const WT *w, const int8_t *q1,            \
                                                         const float *xs1, const int8_t *q2,       \
                                                         const float *xs2, int n, int block)       \
    {                                                                                              \
        const int8_t *qp[2] = {q1, q2};                                                            \
        const float *sp[2] = {xs1, xs2};                                                           \
        float o[2];                                                                                \
        coli_rowsg_##kind##_##sfx(w, qp, sp, 2, n, block, o);                                      \
        return o[0] + o[1];                                                                        \
    }                                                                                              \
    ATTR static inline void coli_rowdot_##kind##_rows_##sfx(const WT *w, const int8_t *q,          \
                                                           long qstride, const float *xs,          \
                                                           long sstride, int R, int n, int block,  \
                                                           float *out)                             \
    {                                                                                              \
        for (int r0 = 0; r0 < R; r0 += COLI_ROWS_G) {                                              \
            int g = R - r0 < COLI_ROWS_G ? R - r0 : COLI_ROWS_G;                                   \
            const int8_t *qp[COLI_ROWS_G];                                                         \
            const float *sp[COLI_ROWS_G];                                                          \
            for (int r = 0; r < g; r++) {                                                          \
                qp[r] = q + (long)(r0 + r) * qstride;                                              \
                sp[r] = xs + (long)(r0 + r) * sstride;                                             \
            }                                                                                      \
            coli_rowsg_##kind##_##sfx(w, qp, sp, g, n, block, out + r0);                           \
        }                                                                                          \
    }

/* rowdot2 given the activations' block sums, for a kind whose kernels do not use them */
#define COLI_ROWDOT2S_IGNORING_SUMS(kind, WT, sfx, ATTR)                                           \
    ATTR static inline float coli_rowdot2s_##kind##_##sfx(const WT *w, const int8_t *q1,           \
                                                          const float *xs1, const int32_t *s1,     \
                                                          const int8_t *q2, const float *xs2,      \
                                                          const int32_t *s2, int n, int block)     \
    {                                                                                              \
        (void)s1; (void)s2;                                                                        \
        return coli_rowdot2_##kind##_##sfx(w, q1, xs1, q2, xs2, n, block);                         \
    }

/* scalar: two rows per pass over a block, each weight loaded once for both (two exact int32 sums,
 * the same integers as coli_dot_i8i8_scalar); an odd last row on its own */
static inline void coli_dot2_i8i8_scalar(const int8_t *w, const int8_t *x1, const int8_t *x2, int n,
                                         int32_t *d1, int32_t *d2)
{
    int32_t s1 = 0, s2 = 0;
    for (int i = 0; i < n; i++) {
        int32_t wi = w[i];
        s1 += wi * (int32_t)x1[i];
        s2 += wi * (int32_t)x2[i];
    }
    *d1 = s1;
    *d2 = s2;
}

static inline void coli_rowsg_i8_scalar(const int8_t *w, const int8_t *const *q, const float *const *xs,
                                        int G, int n, int block, float *out)
{
    block = coli_block_len(n, block);
    for (int r = 0; r < G; r++)
        out[r] = 0.0f;
    for (int i = 0, b = 0; i < n; i += block, b++) {
        int len = n - i < block ? n - i : block, r = 0;
        for (; r + 2 <= G; r += 2) {
            int32_t d1, d2;
            coli_dot2_i8i8_scalar(w + i, q[r] + i, q[r + 1] + i, len, &d1, &d2);
            out[r] = coli_block_acc(out[r], xs[r][b], d1);
            out[r + 1] = coli_block_acc(out[r + 1], xs[r + 1][b], d2);
        }
        if (r < G)
            out[r] = coli_block_acc(out[r], xs[r][b], coli_dot_i8i8_scalar(w + i, q[r] + i, len));
    }
}
COLI_ROWS_WRAPPERS(i8, int8_t, scalar, )
COLI_ROWDOT2S_IGNORING_SUMS(i8, int8_t, scalar, )

#if COLI_X86
/* ---------------------------------------- AVX2 ---------------------------------------- */

/* The sign trick of coli_i8x32_dot_avx2 with |w| computed once: 32 products of w (given as w and
 * aw = |w|) and x, summed into 8 int32 lanes. */
COLI_AVX2 static inline __m256i coli_i8x32_dot_aw_avx2(__m256i aw, __m256i w, const int8_t *x)
{
    __m256i pairs = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)x), w));
    return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}

/* G (1..4, a constant after inlining) rows. Block-64 fast path: per 4 blocks, each row's four
 * block vectors are folded pairwise with hadd as they are produced (hadd(hadd(a,b), hadd(c,d)) is
 * coli_hsum4_i32_avx2), which keeps the live registers at about 3 per row. Other blocks: one
 * int32 accumulator per row, reduced for all rows at once with coli_hsum4_i32_avx2; the < 32
 * element tail of a block is done per row by coli_dot_i8i8_avx2 (the bytes are in L1 by then). */
COLI_AVX2 static COLI_ALWAYS_INLINE void coli_rowsg_i8_avx2_k(const int8_t *w, const int8_t *const *q,
                                                              const float *const *xs, const int G,
                                                              int n, int block, float *out)
{
    float acc[COLI_ROWS_G] = {0.0f, 0.0f, 0.0f, 0.0f};
    int i = 0, b = 0;
    block = coli_block_len(n, block);
    if (block == 64)
        for (; i + 256 <= n; i += 256, b += 4) {
            __m256i t[COLI_ROWS_G], h01[COLI_ROWS_G], h23[COLI_ROWS_G];
            COLI_UNROLL_G
            for (int k = 0; k < 4; k++) {
                const int8_t *wk = w + i + 64 * k;
                __m256i w0 = _mm256_loadu_si256((const __m256i *)wk);
                __m256i w1 = _mm256_loadu_si256((const __m256i *)(wk + 32));
                __m256i a0 = _mm256_abs_epi8(w0), a1 = _mm256_abs_epi8(w1);
                COLI_UNROLL_G
                for (int r = 0; r < G; r++) {
                    const int8_t *x = q[r] + i + 64 * k;
                    __m256i d = _mm256_add_epi32(coli_i8x32_dot_aw_avx2(a0, w0, x),
                                                 coli_i8x32_dot_aw_avx2(a1, w1, x + 32));
                    if (k == 0 || k == 2)
                        t[r] = d;
                    else if (k == 1)
                        h01[r] = _mm256_hadd_epi32(t[r], d);
                    else
                        h23[r] = _mm256_hadd_epi32(t[r], d);
                }
            }
            COLI_UNROLL_G
            for (int r = 0; r < G; r++) {
                __m256i s = _mm256_hadd_epi32(h01[r], h23[r]);
                __m128i d4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
                acc[r] = coli_block_acc4(acc[r], xs[r] + b, d4);
            }
        }
    for (; i < n; i += block, b++) {
        int len = n - i < block ? n - i : block, j = 0;
        __m256i a[COLI_ROWS_G];
        COLI_UNROLL_G
        for (int r = 0; r < COLI_ROWS_G; r++)
            a[r] = _mm256_setzero_si256();
        for (; j + 32 <= len; j += 32) {
            __m256i wv = _mm256_loadu_si256((const __m256i *)(w + i + j)), aw = _mm256_abs_epi8(wv);
            COLI_UNROLL_G
            for (int r = 0; r < G; r++)
                a[r] = _mm256_add_epi32(a[r], coli_i8x32_dot_aw_avx2(aw, wv, q[r] + i + j));
        }
        int32_t d[COLI_ROWS_G];
        _mm_storeu_si128((__m128i *)d, coli_hsum4_i32_avx2(a[0], a[1], a[2], a[3]));
        COLI_UNROLL_G
        for (int r = 0; r < G; r++) {
            if (j < len)
                d[r] += coli_dot_i8i8_avx2(w + i + j, q[r] + i + j, len - j);
            acc[r] = coli_block_acc(acc[r], xs[r][b], d[r]);
        }
    }
    COLI_UNROLL_G
    for (int r = 0; r < G; r++)
        out[r] = acc[r];
}

COLI_AVX2 static inline void coli_rowsg_i8_avx2(const int8_t *w, const int8_t *const *q, const float *const *xs,
                                                int G, int n, int block, float *out)
{
    switch (G) {
    case 1: out[0] = coli_rowdot_i8_avx2(w, q[0], xs[0], n, block); break;
    case 2: coli_rowsg_i8_avx2_k(w, q, xs, 2, n, block, out); break;
    case 3: coli_rowsg_i8_avx2_k(w, q, xs, 3, n, block, out); break;
    case 4: coli_rowsg_i8_avx2_k(w, q, xs, 4, n, block, out); break;
    default: break;
    }
}
COLI_ROWS_WRAPPERS(i8, int8_t, avx2, COLI_AVX2)
COLI_ROWDOT2S_IGNORING_SUMS(i8, int8_t, avx2, COLI_AVX2)

/* ------------------------------------- AVX-512 VNNI ------------------------------------- */

/* G (1..4) rows. Per 64 weights: one load, the sign mask and |w| once, then per row a masked
 * negate of x and one vpdpbusd. Block-64 fast path: 4 blocks x G rows of accumulators (16 zmm
 * at most), reduced per row with coli_hsum4_i32_avx512. Other blocks: one accumulator per row,
 * reduced for all rows at once; the block tail uses masked loads (weights once, x per row). */
COLI_AVX512 static COLI_ALWAYS_INLINE void coli_rowsg_i8_avx512_k(const int8_t *w, const int8_t *const *q,
                                                                  const float *const *xs, const int G,
                                                                  int n, int block, float *out)
{
    const __m512i z = _mm512_setzero_si512();
    float acc[COLI_ROWS_G] = {0.0f, 0.0f, 0.0f, 0.0f};
    int i = 0, b = 0;
    block = coli_block_len(n, block);
    if (block == 64)
        for (; i + 256 <= n; i += 256, b += 4) {
            __m512i d[COLI_ROWS_G][4];
            COLI_UNROLL_G
            for (int k = 0; k < 4; k++) {
                __m512i wv = _mm512_loadu_si512(w + i + 64 * k);
                __mmask64 wneg = _mm512_movepi8_mask(wv);
                __m512i aw = _mm512_abs_epi8(wv);
                COLI_UNROLL_G
                for (int r = 0; r < G; r++) {
                    __m512i x = _mm512_loadu_si512(q[r] + i + 64 * k);
                    d[r][k] = _mm512_dpbusd_epi32(z, aw, _mm512_mask_sub_epi8(x, wneg, z, x));
                }
            }
            COLI_UNROLL_G
            for (int r = 0; r < G; r++)
                acc[r] = coli_block_acc4(acc[r], xs[r] + b,
                                         coli_hsum4_i32_avx512(d[r][0], d[r][1], d[r][2], d[r][3]));
        }
    for (; i < n; i += block, b++) {
        int len = n - i < block ? n - i : block, j = 0;
        __m512i a[COLI_ROWS_G];
        COLI_UNROLL_G
        for (int r = 0; r < COLI_ROWS_G; r++)
            a[r] = z;
        for (; j + 64 <= len; j += 64) {
            __m512i wv = _mm512_loadu_si512(w + i + j);
            __mmask64 wneg = _mm512_movepi8_mask(wv);
            __m512i aw = _mm512_abs_epi8(wv);
            COLI_UNROLL_G
            for (int r = 0; r < G; r++) {
                __m512i x = _mm512_loadu_si512(q[r] + i + j);
                a[r] = _mm512_dpbusd_epi32(a[r], aw, _mm512_mask_sub_epi8(x, wneg, z, x));
            }
        }
        if (j < len) { /* masked: lanes past the block end read as 0 and are never touched */
            __mmask64 m = ~0ULL >> (64 - (len - j));
            __m512i wv = _mm512_maskz_loadu_epi8(m, w + i + j);
            __mmask64 wneg = _mm512_movepi8_mask(wv);
            __m512i aw = _mm512_abs_epi8(wv);
            COLI_UNROLL_G
            for (int r = 0; r < G; r++) {
                __m512i x = _mm512_maskz_loadu_epi8(m, q[r] + i + j);
                a[r] = _mm512_dpbusd_epi32(a[r], aw, _mm512_mask_sub_epi8(x, wneg, z, x));
            }
        }
        int32_t d[COLI_ROWS_G];
        _mm_storeu_si128((__m128i *)d, coli_hsum4_i32_avx512(a[0], a[1], a[2], a[3]));
        COLI_UNROLL_G
        for (int r = 0; r < G; r++)
            acc[r] = coli_block_acc(acc[r], xs[r][b], d[r]);
    }
    COLI_UNROLL_G
    for (int r = 0; r < G; r++)
        out[r] = acc[r];
}

COLI_AVX512 static inline void coli_rowsg_i8_avx512(const int8_t *w, const int8_t *const *q,
                                                    const float *const *xs, int G, int n, int block,
                                                    float *out)
{
    switch (G) {
    case 1: out[0] = coli_rowdot_i8_avx512(w, q[0], xs[0], n, block); break;
    case 2: coli_rowsg_i8_avx512_k(w, q, xs, 2, n, block, out); break;
    case 3: coli_rowsg_i8_avx512_k(w, q, xs, 3, n, block, out); break;
    case 4: coli_rowsg_i8_avx512_k(w, q, xs, 4, n, block, out); break;
    default: break;
    }
}
COLI_ROWS_WRAPPERS(i8, int8_t, avx512, COLI_AVX512)
COLI_ROWDOT2S_IGNORING_SUMS(i8, int8_t, avx512, COLI_AVX512)

#endif /* COLI_X86 */

#endif /* COLI_DOT_I8_H */
