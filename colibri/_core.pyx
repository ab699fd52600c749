# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False
"""colibri engine core: the glm_moe_dsa forward pass, mirroring colibrì's glm.c by name.

Python orchestrates (per layer, per expert); every loop over elements runs here without the GIL,
on raw pointers into preallocated numpy buffers, calling the SIMD dot kernels of ``include/``.

Shapes in comments: S = rows of a forward batch, D = hidden, H = heads, T = keys in the cache.
HF transformers' ``glm_moe_dsa`` is the definition of the model; where glm.c deviates from it we
follow transformers and say so (see ``NOTE(HF)`` comments).
"""
# Contents, bottom-up (each part builds on the ones above it), with the glm.c functions each mirrors:
#
#  1. Kernel externs: the SIMD dot / axpy / GEMM kernels of include/ (glm.c's dot_i8i8, dot_i4i8,
#     qrow_i8 and the inner loops of matmul_q / matmul_i4), OpenMP thread control, the ISA selection.
#  2. Quantized tensors and matmul: QT (glm.c's QT, qt_bytes), the float and integer row kernels,
#     the tiles and the batch GEMM glue behind matmul_qt / matmul_many (glm.c's matmul, matmul_q,
#     matmul_i4, matmul_i2, matmul_q_idot, matmul_i4_idot, the dispatcher matmul_qt; qrow_i8 is
#     quant_row), the absorption helpers qt_addrow / qt_addrows (glm.c's qt_addrow,
#     qt_matvec_rows); numpy front-ends for tests.
#  3. Primitives: rmsnorm_row, layernorm_row, rope_interleave, silu, softmax_inplace (glm.c's
#     rmsnorm, layernorm, rope_interleave, siluf, softmax).
#  4. nogil attention / routing kernels: the cores of glm.c's attention (expanded and absorbed
#     paths), its DSA selection (dsa_topk, dsa_pick), moe's router and expert union (route_row,
#     batch_union), and attend_step: layer_forward's attention half with the routing, in one
#     parallel region.
#  5. Fused FFN group: the expert FFNs of glm.c's moe (routed experts + shared expert) and dense_mlp
#     in one parallel region (ffn_group, FfnScratch).
#  6. Engine state: Layer (glm.c's Layer), Expert (ESlot), Work (the forward's scratch), KVState
#     (the KV snapshot colibri.kvstore saves), and layers_step / mlp_step: glm.c's layers_forward / layer_forward (attention, then
#     moe or dense_mlp) for decode and verify batches without returning to Python.
#  7. Model (glm.c's Model) and its per-call paths, named as in glm.c: expert_load, embed_row,
#     kv_alloc, attention, dense_mlp, moe, pilot_prefetch (the PILOT router lookahead of
#     layer_forward), layer_forward, layers_forward, step, step_all, forward_all, generate,
#     mtp_draft, mtp_absorb, spec_decode (carry_ban, the hlast rewind).
#  8. model_init and its loading helpers: glm.c's model_init (its qt_load / qt_from_disk / ld are
#     Model._load_qt / _load_vec), expert_bytes_probe (_expert_disk_bytes), the container
#     mapping, the huge-page buffers.
#  9. Drafts: ngram_draft (glm.c's ngram_draft), the exponential race (race_pick) that draws a
#     position's token and its sampled draft from one key, and mtp_chain, the steps of glm.c's
#     mtp_draft without Python between them.
# 10. Sampler: glm.c's rndu, dist_build, dist_sample, pick_tok (with the ban that spec_decode's
#     carry_ban passes) and the verify's acceptance test (accepts).

import os
import time

import numpy as np

from libc.stdint cimport int8_t, uint8_t, int32_t, uintptr_t
from libc.math cimport expf, sqrtf, sqrt, cosf, sinf, isnan, log, INFINITY
from libc.string cimport memcpy, memset
from libc.stdlib cimport qsort, malloc, calloc, free
from posix.time cimport clock_gettime, timespec, CLOCK_MONOTONIC
from cython.parallel cimport prange, threadid, parallel

import threading

from .cache import ExpertCache, IoClock, SlabPool
from .config import Config, indexer_missing, load_config
from .lookahead import PrefetchPolicy, parse_prefetch
from .budget import EXTRA_CALL_EXPERTS
from .options import switch
from . import st as _st
from . import quant as _quant


# ---------------------------------------------------------------------------------------------
# 1. Kernel externs: the SIMD kernels of include/ (coli_*.h)
# ---------------------------------------------------------------------------------------------

cdef extern from "coli_kernels.h" nogil:
    int COLI_ISA_SCALAR, COLI_ISA_AVX2, COLI_ISA_AVX512VNNI
    int coli_isa_best()
    int coli_select_isa(int isa)
    int coli_isa_active()
    const char *coli_isa_name(int isa)
    int32_t coli_dot_i8i8(const int8_t *w, const int8_t *x, int n)
    int32_t coli_dot_i4i8(const uint8_t *w, const int8_t *x, int n)
    float coli_rowdot_i8(const int8_t *w, const int8_t *xq, const float *xs, int n, int block)
    float coli_rowdot_i4(const uint8_t *w, const int8_t *xq, const float *xs, int n, int block)
    float coli_dot_f32(const float *a, const float *b, int n)
    float coli_dot_q8f32(const int8_t *w, const float *x, int n)
    float coli_dot_q4f32(const uint8_t *w, const float *x, int n)
    void coli_quantize_q8(const float *x, int n, int block, int8_t *q, float *xs)
    float coli_rowdot2_i8(const int8_t *w, const int8_t *q1, const float *xs1, const int8_t *q2,
                          const float *xs2, int n, int block)
    float coli_rowdot2_i4(const uint8_t *w, const int8_t *q1, const float *xs1, const int8_t *q2,
                          const float *xs2, int n, int block)
    void coli_rowdot_i8_rows(const int8_t *w, const int8_t *q, long qstride, const float *xs, long sstride,
                             int R, int n, int block, float *out)
    void coli_rowdot_i4_rows(const uint8_t *w, const int8_t *q, long qstride, const float *xs, long sstride,
                             int R, int n, int block, float *out)
    float coli_rowdot2s_i4(const uint8_t *w, const int8_t *q1, const float *xs1, const int32_t *s1,
                           const int8_t *q2, const float *xs2, const int32_t *s2, int n, int block)
    void coli_block_sums(const int8_t *q, int n, int block, int32_t *s)
    void coli_q8_residual(const float *x, const int8_t *q, const float *xs, int n, int block, float *xr)
    void coli_axpy_f32(float *y, float c, const float *x, int n)
    void coli_axpy_q8f32(float *y, float c, const int8_t *w, int n)
    void coli_axpy_q4f32(float *y, float c, const uint8_t *w, int n)
    void coli_axpy_rows_f32(float *y, int n, const float *c, const float *x, long stride, const int *idx,
                            int nrows)
    void coli_dots_f32(const float *x, int n, const float *base, long stride, const int *idx, int nrows,
                       float *out)
    void coli_dots_f32_multi(const float *x, long xstride, int nq, int n, const float *base, long stride,
                             const int *idx, int nrows, float *out, long ostride)
    void coli_axpy_rows_f32_multi(float *y, long ystride, int nq, int n, const float *c, long cstride,
                                  const float *x, long stride, const int *idx, int nrows)
    void coli_dots_q8f32(const float *x, int n, const int8_t *w, long rb, int nrows, float *out)
    void coli_dots_q4f32(const float *x, int n, const uint8_t *w, long rb, int nrows, float *out)
    void coli_axpy_rows_q8f32(float *y, int n, const float *c, const int8_t *w, long rb, int nrows)
    void coli_axpy_rows_q4f32(float *y, int n, const float *c, const uint8_t *w, long rb, int nrows)
    void coli_rowdot_i8_tile(const int8_t *w, long rb, int ilv, int r0, int nw, const int8_t *q, long qstride,
                             const float *xs, const int32_t *s, long sstride, const uint8_t *xg, long gstride,
                             int P, int n, int block, float *out)
    void coli_rowdot_i4_tile(const uint8_t *w, long rb, int ilv, int r0, int nw, const int8_t *q, long qstride,
                             const float *xs, const int32_t *s, long sstride, const uint8_t *xg, long gstride,
                             int P, int n, int block, float *out)
    void coli_ilv_pack_inplace(uint8_t *w, long O, long rb, uint8_t *tmp)
    void coli_ilv_unpack(const uint8_t *src, uint8_t *dst, long O, long rb)
    float coli_rowdotg_i8(const int8_t *w, const float *ws, int gs, const int8_t *q, const float *xs, int n,
                          int block)
    float coli_rowdotg_i4(const uint8_t *w, const float *ws, int gs, const int8_t *q, const float *xs, int n,
                          int block)
    void coli_rowdotg_i8_rows(const int8_t *w, const float *ws, int gs, const int8_t *q, long qstride,
                              const float *xs, long sstride, int R, int n, int block, float *out)
    void coli_rowdotg_i4_rows(const uint8_t *w, const float *ws, int gs, const int8_t *q, long qstride,
                              const float *xs, long sstride, int R, int n, int block, float *out)
    void coli_rowdotg_i8_tile(const int8_t *w, long rb, int nw, const float *ws, long wstride, int gs,
                              const int8_t *q, long qstride, const uint8_t *xg, long gstride, const float *xs,
                              long sstride, int P, int n, float *out)
    void coli_rowdotg_i4_tile(const uint8_t *w, long rb, int nw, const float *ws, long wstride, int gs,
                              const int8_t *q, long qstride, const uint8_t *xg, long gstride, const float *xs,
                              long sstride, int P, int n, float *out)
    long coli_split_len(int n)
    int coli_split_q8(const int8_t *q, int n, uint8_t *xg)
    int coli_split_active()
    void coli_dotsg_q8f32(const float *x, int n, const int8_t *w, long rb, const float *ws, long wstride, int gs,
                          int nrows, float *out)
    void coli_dotsg_q4f32(const float *x, int n, const uint8_t *w, long rb, const float *ws, long wstride, int gs,
                          int nrows, float *out)

cdef extern from "coli_gemm.h" nogil:
    int COLI_GEMM_COLS
    int coli_amx_supported()
    int coli_amx_select(int on)
    int coli_amx_active()
    long coli_gemm_packed_bytes(int P, int K)
    void coli_gemm_pack(const int8_t *q, int P, int K, int8_t *out, int32_t *sums)
    int8_t *coli_gemm_scratch(int slot, long n)
    int coli_gemm_rows(const uint8_t *w, long rb, long O, int ilv, int i4, int o0, int nw, const float *ws,
                       const int8_t *packed, const int32_t *sums, int P, int K, const float *xs, int idot2, float *y,
                       long ldy)

cdef extern from "coli_prefetch.h" nogil:
    void coli_prefetch_row(const void *p, Py_ssize_t nbytes)

cdef extern from "coli_threads.h" nogil:
    int coli_max_threads()
    void coli_set_threads(int n)
    int coli_has_openmp()


# -- ISA and thread selection -----------------------------------------------------------------

ISA_NAMES = {"scalar": 0, "avx2": 1, "avx512vnni": 2}


def isa_best():
    return coli_isa_name(coli_isa_best()).decode()


def isa_active():
    return coli_isa_name(coli_isa_active()).decode()


def select_isa(name):
    """Force a kernel variant ("scalar", "avx2", "avx512vnni"); clamped to what the CPU has."""
    if name not in ISA_NAMES:
        raise ValueError(f"unknown ISA {name!r}; choose one of {sorted(ISA_NAMES)}")
    return coli_isa_name(coli_select_isa(ISA_NAMES[name])).decode()


def has_openmp():
    return bool(coli_has_openmp())


def max_threads():
    return coli_max_threads()


def set_threads(int n):
    coli_set_threads(n)


# ---------------------------------------------------------------------------------------------
# 2. Quantized tensors and matmul: QT, the row kernels, the integer tiles, the batch GEMM glue,
#    matmul_qt / matmul_many
# ---------------------------------------------------------------------------------------------

cdef enum:
    FMT_F32 = 0
    FMT_I8 = 1
    FMT_I4 = 2
    FMT_I2 = 3
FORMAT_NAMES = {FMT_F32: "f32", FMT_I8: "int8", FMT_I4: "int4", FMT_I2: "int2"}

cdef struct QTc:
    int fmt            # FMT_*
    int O              # output rows
    int I              # inputs per row
    Py_ssize_t rb      # bytes per packed row (quantized formats)
    const float *f     # [O, I] f32 weights (FMT_F32)
    const uint8_t *q   # [O, rb] packed payload
    const float *s     # [O, G] scales: one per row (G = 1), or one per group of gs inputs
    int gs             # group size of the scales: 0 = one scale per row (int8 / int4 only when > 0)
    int G              # scales per row: 1, or ceil(I / gs)
    int ilv            # 1: the rows' groups of four interleaved (coli_ilv_pack; only the tiles read them)


def fmt_from_nbytes(Py_ssize_t nbytes, int O, int I):
    """Container format from the payload size (as glm.c's qt_from_disk infers it), or -1 if it matches none."""
    if nbytes == <Py_ssize_t>O * I:
        return FMT_I8
    if nbytes == <Py_ssize_t>O * ((I + 1) // 2):
        return FMT_I4
    if nbytes == <Py_ssize_t>O * ((I + 3) // 4):
        return FMT_I2
    return -1


cdef class QT:
    """A 2-D weight [O, I]: f32, or int8/int4/int2 packed rows with one f32 scale per row, or
    (int8/int4) one f32 scale per group of gs inputs of each row (colibrì's group-scaled
    container; the last group of a row partial)."""
    cdef QTc c
    cdef readonly object data      # numpy array keeping the payload (or f32 weights) alive
    cdef readonly object scale     # numpy f32 [O·G] (G = 1: per row) or None
    cdef object __weakref__

    @staticmethod
    def from_f32(w):
        cdef QT t = QT()
        w = np.ascontiguousarray(w, dtype=np.float32)
        cdef float[:, ::1] v = w
        t.data = w
        t.scale = None
        t.c.fmt = FMT_F32
        t.c.O = w.shape[0]
        t.c.I = w.shape[1]
        t.c.rb = t.c.I * 4
        t.c.f = &v[0, 0]
        t.c.q = NULL
        t.c.s = NULL
        t.c.gs = 0
        t.c.G = 1
        t.c.ilv = 0
        return t

    @staticmethod
    def from_packed(payload, scale, int O, int I, str name="tensor"):
        cdef QT t = QT()
        payload = np.ascontiguousarray(payload, dtype=np.uint8).reshape(-1)
        scale = np.ascontiguousarray(scale, dtype=np.float32)
        fmt = fmt_from_nbytes(payload.shape[0], O, I)
        if fmt < 0:
            raise ValueError(f"{name}: payload of {payload.shape[0]} bytes matches no int8/int4/int2 "
                             f"packing of a [{O}, {I}] matrix")
        # [O] per-row scales, or [O, G] / [O·G] group scales (the size inferred from the count)
        cdef int gs = _quant.scale_group_size(scale.shape, FORMAT_NAMES[fmt], O, I, name)
        scale = scale.reshape(-1)
        if not np.all(np.isfinite(scale)):
            raise ValueError(f"{name}.qs: non-finite scale")
        cdef const uint8_t[::1] pv = payload       # const: may be a view of a read-only mapping
        cdef const float[::1] sv = scale
        t.data = payload
        t.scale = scale
        t.c.fmt = fmt
        t.c.O = O
        t.c.I = I
        t.c.rb = payload.shape[0] // O
        t.c.f = NULL
        t.c.q = &pv[0]
        t.c.s = &sv[0]
        t.c.gs = gs
        t.c.G = _quant.n_groups(I, gs)
        t.c.ilv = 0
        return t

    def interleave(self):
        """Lay the rows out for the integer matmul tiles, in place: each group of four rows
        interleaved in 64-byte chunks (coli_rows4.h), so a tile reads one ascending stream. Only for
        a matrix that nothing but the integer matmuls reads (not an embedding, not kv_b of the
        absorbed attention); int8 / int4 with one scale per row, else nothing changes. Returns
        whether the layout changed."""
        if self.c.ilv or self.c.gs > 0 or self.c.fmt not in (FMT_I8, FMT_I4) or self.c.O < 4:
            return False
        cdef uint8_t[::1] tmp = np.empty(4 * self.c.rb, np.uint8)
        cdef uint8_t[::1] pv = self.data
        with nogil:                 # the I/O threads lay out experts they read while the matmuls run
            coli_ilv_pack_inplace(&pv[0], self.c.O, self.c.rb, &tmp[0])
        self.c.ilv = 1
        return True

    @property
    def interleaved(self):
        """Whether the rows are laid out for the tiles (interleave)."""
        return bool(self.c.ilv)

    def payload(self):
        """The packed rows in the container's layout (a copy when interleaved)."""
        if not self.c.ilv:
            return self.data
        out = np.empty_like(self.data)
        cdef uint8_t[::1] src = self.data
        cdef uint8_t[::1] dst = out
        coli_ilv_unpack(&src[0], &dst[0], self.c.O, self.c.rb)
        return out

    def _plain(self, what):
        if self.c.ilv:
            raise ValueError(f"{what}: the rows are interleaved for the integer matmul tiles (interleave)")

    @property
    def fmt(self):
        return FORMAT_NAMES[self.c.fmt]

    @property
    def shape(self):
        return (self.c.O, self.c.I)

    @property
    def group_size(self):
        """Inputs per scale: 0 when there is one scale per row."""
        return self.c.gs

    @property
    def nbytes(self):
        """Bytes held in RAM (glm.c's qt_bytes): payload + f32 scales (O, or O·G for groups)."""
        if self.c.fmt == FMT_F32:
            return 4 * self.c.O * self.c.I
        return self.c.O * self.c.rb + 4 * self.c.O * self.c.G

    def dequantize(self):
        """f32 copy of the weights [O, I] (tests, tools)."""
        if self.c.fmt == FMT_F32:
            return np.array(self.data, copy=True)
        return _quant.dequantize(self.payload(), self.scale, self.c.O, self.c.I)

    def _rows(self, int row0, int nrows):
        if nrows < 1 or row0 < 0 or row0 + nrows > self.c.O:
            raise ValueError(f"rows {row0}..{row0 + nrows - 1} outside [0, {self.c.O})")

    def addrows(self, int row0, c, acc, bint one_by_one=False):
        """acc + Σ_r c[r] · W[row0 + r, :] (dequantized) through the attention helpers (tests):
        qt_addrows, or qt_addrow per row (one_by_one)."""
        cdef float[::1] cv = np.ascontiguousarray(c, dtype=np.float32)
        cdef float[::1] av = np.array(acc, dtype=np.float32)
        cdef int r, n = cv.shape[0]
        self._plain("addrows")
        self._rows(row0, n)
        if av.shape[0] != self.c.I:
            raise ValueError(f"acc has {av.shape[0]} values, W has {self.c.I} inputs")
        cdef float[::1] cs = np.empty(n, np.float32)
        if one_by_one:
            for r in range(n):
                qt_addrow(&self.c, row0 + r, cv[r], &av[0])
        else:
            qt_addrows(&self.c, row0, n, &cv[0], &cs[0], &av[0])
        return np.asarray(av)

    def rowdots(self, int row0, int nrows, x):
        """[W[row0 + r, :] · x for r < nrows] through qt_rowdots_f (float path, tests)."""
        cdef float[::1] xv = np.ascontiguousarray(x, dtype=np.float32)
        self._plain("rowdots")
        self._rows(row0, nrows)
        if xv.shape[0] != self.c.I:
            raise ValueError(f"x has {xv.shape[0]} values, W has {self.c.I} inputs")
        out = np.empty(nrows, np.float32)
        cdef float[::1] ov = out
        qt_rowdots_f(&self.c, row0, nrows, &xv[0], &ov[0])
        return out


cdef inline int group_len(const QTc *W, int g) noexcept nogil:
    """Inputs of weight group g of a row (the last group may be partial)."""
    return W.I - g * W.gs if W.I - g * W.gs < W.gs else W.gs


cdef inline void qt_rowdots_fg(const QTc *W, int row0, int nrows, const float *x, float *out) noexcept nogil:
    """Float path of group-scaled int8/int4 rows: out[r] = Σ_g (Σ_{i in g} v_i·x_i) · ws[g] for the
    rows row0 .. row0+nrows-1, groups in order (coli_dotsg_*)."""
    if W.fmt == FMT_I8:
        coli_dotsg_q8f32(x, W.I, <const int8_t *>(W.q + <Py_ssize_t>row0 * W.rb), W.rb,
                         W.s + <Py_ssize_t>row0 * W.G, W.G, W.gs, nrows, out)
    else:
        coli_dotsg_q4f32(x, W.I, W.q + <Py_ssize_t>row0 * W.rb, W.rb, W.s + <Py_ssize_t>row0 * W.G, W.G, W.gs,
                         nrows, out)


cdef inline float qt_rowdot_f(const QTc *W, int row, const float *x) noexcept nogil:
    """Float path (dequant-on-use): W[row, :] · x."""
    cdef const uint8_t *p
    cdef int i, I = W.I
    cdef float acc = 0.0
    if W.fmt == FMT_F32:
        return coli_dot_f32(W.f + <Py_ssize_t>row * I, x, I)
    if W.gs > 0:
        qt_rowdots_fg(W, row, 1, x, &acc)
        return acc
    p = W.q + <Py_ssize_t>row * W.rb
    if W.fmt == FMT_I8:
        return coli_dot_q8f32(<const int8_t *>p, x, I) * W.s[row]
    if W.fmt == FMT_I4:
        return coli_dot_q4f32(p, x, I) * W.s[row]
    for i in range(I):   # int2: element 4j+k in bits 2k..2k+1, stored v+2
        acc = acc + (<float>(((p[i >> 2] >> (2 * (i & 3))) & 3) - 2)) * x[i]
    return acc * W.s[row]


cdef inline void qt_addrow(const QTc *W, int row, float c, float *acc) noexcept nogil:
    """acc[:] += c · W[row, :] (dequantized)."""
    cdef const uint8_t *p
    cdef int i, I = W.I
    cdef float cs
    if W.fmt == FMT_F32:
        coli_axpy_f32(acc, c, W.f + <Py_ssize_t>row * I, I)
        return
    p = W.q + <Py_ssize_t>row * W.rb
    if W.gs > 0:
        qt_addrow_g(W, p, W.s + <Py_ssize_t>row * W.G, c, acc)
        return
    cs = c * W.s[row]
    if W.fmt == FMT_I8:
        coli_axpy_q8f32(acc, cs, <const int8_t *>p, I)
    elif W.fmt == FMT_I4:
        coli_axpy_q4f32(acc, cs, p, I)
    else:
        for i in range(I):
            acc[i] += cs * <float>(((p[i >> 2] >> (2 * (i & 3))) & 3) - 2)


cdef inline void qt_addrow_g(const QTc *W, const uint8_t *p, const float *ws, float c, float *acc) noexcept nogil:
    """qt_addrow of a group-scaled int8/int4 row p: acc[i] += (c · ws[g]) · v_i for the inputs i
    of each group g (the group scale folded into the coefficient, as the row scale is)."""
    cdef int g, i0
    for g in range(W.G):
        i0 = g * W.gs
        if W.fmt == FMT_I8:
            coli_axpy_q8f32(acc + i0, c * ws[g], <const int8_t *>p + i0, group_len(W, g))
        else:
            coli_axpy_q4f32(acc + i0, c * ws[g], p + i0 // 2, group_len(W, g))


cdef inline void qt_rowdots_f(const QTc *W, int row0, int nrows, const float *x, float *out) noexcept nogil:
    """out[r] = W[row0 + r, :] · x for nrows rows: qt_rowdot_f per row, in one kernel call."""
    cdef int r
    if W.gs > 0:
        qt_rowdots_fg(W, row0, nrows, x, out)
        return
    if W.fmt == FMT_F32:
        coli_dots_f32(x, W.I, W.f + <Py_ssize_t>row0 * W.I, W.I, NULL, nrows, out)
        return
    if W.fmt == FMT_I8:
        coli_dots_q8f32(x, W.I, <const int8_t *>(W.q + <Py_ssize_t>row0 * W.rb), W.rb, nrows, out)
    elif W.fmt == FMT_I4:
        coli_dots_q4f32(x, W.I, W.q + <Py_ssize_t>row0 * W.rb, W.rb, nrows, out)
    else:
        for r in range(nrows):
            out[r] = qt_rowdot_f(W, row0 + r, x)
        return
    for r in range(nrows):
        out[r] = out[r] * W.s[row0 + r]


cdef inline void qt_addrows(const QTc *W, int row0, int nrows, const float *c, float *cs,
                            float *acc) noexcept nogil:
    """acc[:] += Σ_r c[r] · W[row0 + r, :] (dequantized), each element's terms in row order: the
    same floats as qt_addrow per row. cs: scratch of nrows floats."""
    cdef int r
    if W.fmt == FMT_F32:
        coli_axpy_rows_f32(acc, W.I, c, W.f + <Py_ssize_t>row0 * W.I, W.I, NULL, nrows)
        return
    if W.fmt != FMT_I8 and W.fmt != FMT_I4:
        for r in range(nrows):
            qt_addrow(W, row0 + r, c[r], acc)
        return
    if W.gs > 0:
        qt_addrows_g(W, row0, nrows, c, cs, acc)
        return
    for r in range(nrows):
        cs[r] = c[r] * W.s[row0 + r]        # as qt_addrow: the row scale folded into the coefficient
    if W.fmt == FMT_I8:
        coli_axpy_rows_q8f32(acc, W.I, cs, <const int8_t *>(W.q + <Py_ssize_t>row0 * W.rb), W.rb, nrows)
    else:
        coli_axpy_rows_q4f32(acc, W.I, cs, W.q + <Py_ssize_t>row0 * W.rb, W.rb, nrows)


cdef inline void qt_addrows_g(const QTc *W, int row0, int nrows, const float *c, float *cs,
                              float *acc) noexcept nogil:
    """qt_addrows of group-scaled rows, group by group: for the inputs of group g, acc += Σ_r
    (c[r] · ws_r[g]) · row_r in row order - per element the floats of qt_addrow per row."""
    cdef int r, g, i0
    cdef const uint8_t *p = W.q + <Py_ssize_t>row0 * W.rb
    for g in range(W.G):
        i0 = g * W.gs
        for r in range(nrows):
            cs[r] = c[r] * W.s[<Py_ssize_t>(row0 + r) * W.G + g]
        if W.fmt == FMT_I8:
            coli_axpy_rows_q8f32(acc + i0, group_len(W, g), cs, <const int8_t *>p + i0, W.rb, nrows)
        else:
            coli_axpy_rows_q4f32(acc + i0, group_len(W, g), cs, p + i0 // 2, W.rb, nrows)


cdef inline int act_nblocks(int I, int block) noexcept nogil:
    if block <= 0 or block >= I:
        return 1
    return (I + block - 1) // block


# Multiply-adds below which a matmul (or an attention call) stays on one thread. With sleeping
# OpenMP threads (passive waits, ~50 µs to wake a team here) only large products pay; with the
# bounded spin colibri/__init__.py chooses on an idle machine a team costs a few µs and even the
# small products of single-token attention gain (attention of the bench fixture: 190 -> 105 µs a
# layer at 64K). COLIBRI_PARALLEL_MIN_MACS overrides.
_PASSIVE = os.environ.get("OMP_WAIT_POLICY", "").strip().lower() == "passive"
cdef double PARALLEL_MIN_MACS = float(switch("PARALLEL_MIN_MACS") or ((4 << 20) if _PASSIVE else (1 << 15)))

cdef enum:
    IDOT_FLOAT = 0      # dequant-on-use float dots (exact up to f32 summation order)
    IDOT_Q8 = 1         # integer dots, activations quantized to int8 (colibrì's IDOT)
    IDOT_Q8X2 = 2       # integer dots on int8 activations + their int8-quantized residual


# The integer matmuls pass each activation block's sum to the tiles, which then need one vpdpbusd
# per 64 weights and activation row (bit-identical; COLIBRI_BLOCK_SUMS=0 turns it off, for A/B
# measurements).
cdef bint BLOCK_SUMS = switch("BLOCK_SUMS") != "0"
# Decode matmuls take four weight rows per kernel call (int_group: the tiles); COLIBRI_GROUP_KERNELS=0
# makes them one row per call, for A/B measurements (bit-identical either way).
cdef bint GROUP_KERNELS = switch("GROUP_KERNELS") != "0"
cdef int PREFETCH_GROUPS = int(switch("PREFETCH_GROUPS"))


# Batches of at least GEMM_MIN_ROWS rows take the AMX-INT8 GEMM (coli_gemm.h) where the CPU has it
# (COLIBRI_AMX=0 or select_amx(False) turns it off), else batches of GEMM_VNNI_MIN_ROWS rows or more
# the AVX-512 VNNI GEMM (0: never); both bit-identical to the tiles. set_kernel_flags(gemm=False)
# keeps every batch on the tiles (A/B runs, tests).
cdef int GEMM_MIN_ROWS = int(switch("GEMM_MIN_ROWS"))
cdef int GEMM_VNNI_MIN_ROWS = int(switch("GEMM_VNNI_MIN_ROWS"))
cdef bint GEMM = switch("GEMM") != "0"
coli_amx_select(switch("AMX") != "0")


def gemm_scratch_bytes(int S, int K, int nt):
    """Bytes the batch GEMMs hold for a matmul of S rows of width K on nt threads: the packed rows
    (q1 and q2) and their sums for the calling thread, a weight panel and a residual row (quant_rows
    on all threads) per thread (coli_gemm.h's thread-local scratch, grown to the largest matmul and
    kept)."""
    return int(2 * coli_gemm_packed_bytes(S, K) + 8 * <long>S + nt * (2 * 1024 * ((K + 63) // 64) + 4 * K))


def amx_supported():
    """Whether this CPU and OS let colibri use AMX-INT8 tiles."""
    return bool(coli_amx_supported())


def amx_active():
    return bool(coli_amx_active())


def select_amx(bint on):
    """Turn the AMX-INT8 prefill GEMM on or off (on only where supported); returns whether it is on."""
    return bool(coli_amx_select(on))


def set_kernel_flags(block_sums=None, group_kernels=None, prefetch_groups=None, gemm=None):
    """Switch the bit-identical kernel variants at run time (for A/B benchmarks in one process);
    returns the flags now in force."""
    global BLOCK_SUMS, GROUP_KERNELS, PREFETCH_GROUPS, GEMM
    if gemm is not None:
        GEMM = bool(gemm)
    if block_sums is not None:
        BLOCK_SUMS = bool(block_sums)
    if group_kernels is not None:
        GROUP_KERNELS = bool(group_kernels)
    if prefetch_groups is not None:
        PREFETCH_GROUPS = max(int(prefetch_groups), 0)
    return {"block_sums": bool(BLOCK_SUMS), "group_kernels": bool(GROUP_KERNELS),
            "prefetch_groups": PREFETCH_GROUPS, "gemm": bool(GEMM)}

cdef enum:
    GROUP_ROWS = 4      # weight rows per work item of the integer matmuls (see int_group)
    GUIDED_MIN = 8      # smallest chunk of work items a thread takes under schedule='guided'
# The integer matmuls' group loops run schedule='guided': a static split gives each thread half the
# weight bytes, but the halves take different times (some experts still sit in L3, the other core
# is interrupted), and the faster thread waited at the barrier; guided chunks shrink towards the end
# so both threads finish together (decode of the bench fixture 1.10-1.14x, int4 and int8, in-process
# A/B on AMD EPYC). Each work item is still computed whole by one thread: bit-identical.


cdef inline void rowdotg_rows(const QTc *W, const uint8_t *row, const float *ws, const int8_t *q, Py_ssize_t qstride,
                              const float *xs, Py_ssize_t sstride, int R, int blk, float *out) noexcept nogil:
    if W.fmt == FMT_I8:
        coli_rowdotg_i8_rows(<const int8_t *>row, ws, W.gs, q, qstride, xs, sstride, R, W.I, blk, out)
    else:
        coli_rowdotg_i4_rows(row, ws, W.gs, q, qstride, xs, sstride, R, W.I, blk, out)


cdef inline void int_row_g(const QTc *W, int o, int S, const int8_t *xq, const float *xs, int nb, int blk,
                           int idot, float *y) noexcept nogil:
    """int_row of a group-scaled matrix: y[s, o] = rowdotg(q1_s) (+ rowdotg(q2_s), the residual
    row, with idot=2). Each group's exact integer dot is scaled by its weight scale inside the
    kernel, the activation scales come after (coli_rowdotg_*, bit-identical on every ISA and for
    every R: the lane form with one activation block, the segment form with several). Decode
    (S = 1) takes q1 and q2 in one pass over the weight row."""
    cdef float r1[8]
    cdef float r2[8]
    cdef int s0, R, r, I = W.I, O = W.O
    cdef const uint8_t *row = W.q + <Py_ssize_t>o * W.rb
    cdef const float *ws = W.s + <Py_ssize_t>o * W.G
    cdef Py_ssize_t off2 = <Py_ssize_t>S * I, soff2 = <Py_ssize_t>S * nb
    if S == 1:
        rowdotg_rows(W, row, ws, xq, off2, xs, soff2, 2 if idot == IDOT_Q8X2 else 1, blk, r1)
        y[o] = (r1[0] + r1[1]) if idot == IDOT_Q8X2 else r1[0]
        return
    for s0 in range(0, S, 8):
        R = S - s0 if S - s0 < 8 else 8
        rowdotg_rows(W, row, ws, xq + <Py_ssize_t>s0 * I, I, xs + <Py_ssize_t>s0 * nb, nb, R, blk, r1)
        if idot == IDOT_Q8X2:
            rowdotg_rows(W, row, ws, xq + off2 + <Py_ssize_t>s0 * I, I, xs + soff2 + <Py_ssize_t>s0 * nb, nb, R,
                         blk, r2)
        for r in range(R):
            y[<Py_ssize_t>(s0 + r) * O + o] = (r1[r] + r2[r]) if idot == IDOT_Q8X2 else r1[r]


cdef inline void tile_g(const QTc *W, int o0, int nw, const int8_t *q, Py_ssize_t qstride, const uint8_t *xg,
                        Py_ssize_t gstride, const float *xs, Py_ssize_t sstride, int P, float *out) noexcept nogil:
    """out[p·nw + r] = the lane-form row dot of weight row o0 + r and activation row p (scale
    xs[p·sstride]), for nw <= 4 weight rows and P activation rows (coli_rowdotg_*_tile); xg: the
    activation rows' split forms (int4, NULL: none), row p at xg + p·gstride."""
    cdef const uint8_t *row = W.q + <Py_ssize_t>o0 * W.rb
    cdef const float *ws = W.s + <Py_ssize_t>o0 * W.G
    if W.fmt == FMT_I8:
        coli_rowdotg_i8_tile(<const int8_t *>row, W.rb, nw, ws, W.G, W.gs, q, qstride, NULL, 0, xs, sstride, P, W.I,
                             out)
    else:
        coli_rowdotg_i4_tile(row, W.rb, nw, ws, W.G, W.gs, q, qstride, xg, gstride, xs, sstride, P, W.I, out)


cdef inline bint wants_split(const QTc *W, int nb) noexcept nogil:
    """Whether W's integer matmul reads its activations' split forms (int4 on the tile kernels,
    when the active ISA's tiles use them; group-scaled int4 with one activation block)."""
    return W.fmt == FMT_I4 and (W.gs == 0 or nb == 1) and GROUP_KERNELS and coli_split_active()


cdef inline void split_rows(const int8_t *xq, int rows, int I, uint8_t *xg, Py_ssize_t gstride) noexcept nogil:
    """The split forms (coli_split_q8) of Q8 rows xq + p·I into xg + p·gstride, p < rows."""
    cdef int p
    for p in range(rows):
        coli_split_q8(xq + <Py_ssize_t>p * I, I, xg + <Py_ssize_t>p * gstride)


cdef inline void int_group_g(const QTc *W, int o0, int n, int S, const int8_t *xq, const float *xs, int nb,
                             int blk, int idot, float *y, const uint8_t *xg, Py_ssize_t gstride) noexcept nogil:
    """Output columns o0 .. o0+n-1 (n <= GROUP_ROWS) of a group-scaled integer matmul for all S
    activation rows. One activation block (the default): the lane-form tile kernel on the n weight
    rows and up to 8 activation rows per call (decode: q1 and its residual q2 in one call, one pass
    over the weights), reading the activations' split forms xg (row p of xq at xg + p·gstride) when
    given; several blocks: int_row_g per column. Each output is the same float as int_row_g's,
    whatever S and n (the kernels are bit-identical per output, split or not)."""
    cdef float t1[GROUP_ROWS * 8]
    cdef float t2[GROUP_ROWS * 8]
    cdef int s0, R, r, p, I = W.I, O = W.O
    cdef Py_ssize_t off2 = <Py_ssize_t>S * I, soff2 = <Py_ssize_t>S * nb, goff2 = <Py_ssize_t>S * gstride
    if nb > 1:
        for r in range(n):
            int_row_g(W, o0 + r, S, xq, xs, nb, blk, idot, y)
        return
    if S == 1 and idot == IDOT_Q8X2:
        tile_g(W, o0, n, xq, off2, xg, goff2, xs, soff2, 2, t1)         # activation rows: q1, then q2
        for r in range(n):
            y[o0 + r] = t1[r] + t1[n + r]
        return
    for s0 in range(0, S, 8):
        R = S - s0 if S - s0 < 8 else 8
        tile_g(W, o0, n, xq + <Py_ssize_t>s0 * I, I, (xg + s0 * gstride) if xg != NULL else NULL, gstride,
               xs + <Py_ssize_t>s0 * nb, nb, R, t1)
        if idot == IDOT_Q8X2:
            tile_g(W, o0, n, xq + off2 + <Py_ssize_t>s0 * I, I, (xg + goff2 + s0 * gstride) if xg != NULL else NULL,
                   gstride, xs + soff2 + <Py_ssize_t>s0 * nb, nb, R, t2)
        for p in range(R):
            for r in range(n):
                y[<Py_ssize_t>(s0 + p) * O + o0 + r] = (t1[p * n + r] + t2[p * n + r]) if idot == IDOT_Q8X2 \
                    else t1[p * n + r]


cdef inline void int_row(const QTc *W, int o, int S, const int8_t *xq, const float *xs, int nb, int blk,
                         int idot, float *y, const int32_t *xsum=NULL) noexcept nogil:
    """Output column o of an integer-path matmul for all S activation rows: y[s, o].
    Several activation rows share each pass over the weight row (coli_rowdot_*_rows); every row's
    value is bit-identical to a single-row call, so results never depend on S. A row of an
    interleaved group is read by the tile, one row a call."""
    cdef float r1[8]
    cdef float r2[8]
    cdef int s0, R, r, I = W.I, O = W.O
    cdef const uint8_t *row = W.q + <Py_ssize_t>o * W.rb
    cdef Py_ssize_t off2 = <Py_ssize_t>S * I, soff2 = <Py_ssize_t>S * nb
    if W.gs > 0:
        int_row_g(W, o, S, xq, xs, nb, blk, idot, y)
        return
    if ilv_group(W, o - o % GROUP_ROWS):       # a row of an interleaved group: the tile on it alone
        tile_cols(W, o - o % GROUP_ROWS, 1, o % GROUP_ROWS, 1, S, xq, xs, nb, blk, idot, y, xsum, NULL, 0)
        return
    if S == 1:
        if W.fmt == FMT_I8:
            r1[0] = (coli_rowdot2_i8(<const int8_t *>row, xq, xs, xq + off2, xs + soff2, I, blk)
                     if idot == IDOT_Q8X2 else coli_rowdot_i8(<const int8_t *>row, xq, xs, I, blk))
        elif idot == IDOT_Q8X2 and xsum != NULL:
            # the activations' block sums are known: the faster, bit-identical two-row kernel
            r1[0] = coli_rowdot2s_i4(row, xq, xs, xsum, xq + off2, xs + soff2, xsum + soff2, I, blk)
        else:
            r1[0] = (coli_rowdot2_i4(row, xq, xs, xq + off2, xs + soff2, I, blk)
                     if idot == IDOT_Q8X2 else coli_rowdot_i4(row, xq, xs, I, blk))
        y[o] = r1[0] * W.s[o]
        return
    for s0 in range(0, S, 8):
        R = S - s0 if S - s0 < 8 else 8
        if W.fmt == FMT_I8:
            coli_rowdot_i8_rows(<const int8_t *>row, xq + <Py_ssize_t>s0 * I, I, xs + <Py_ssize_t>s0 * nb, nb,
                                R, I, blk, r1)
            if idot == IDOT_Q8X2:
                coli_rowdot_i8_rows(<const int8_t *>row, xq + off2 + <Py_ssize_t>s0 * I, I,
                                    xs + soff2 + <Py_ssize_t>s0 * nb, nb, R, I, blk, r2)
        else:
            coli_rowdot_i4_rows(row, xq + <Py_ssize_t>s0 * I, I, xs + <Py_ssize_t>s0 * nb, nb, R, I, blk, r1)
            if idot == IDOT_Q8X2:
                coli_rowdot_i4_rows(row, xq + off2 + <Py_ssize_t>s0 * I, I, xs + soff2 + <Py_ssize_t>s0 * nb,
                                    nb, R, I, blk, r2)
        for r in range(R):
            y[<Py_ssize_t>(s0 + r) * O + o] = ((r1[r] + r2[r]) if idot == IDOT_Q8X2 else r1[r]) * W.s[o]


cdef inline int n_groups(int O) noexcept nogil:
    """Work items of an integer matmul with O output rows (GROUP_ROWS rows each, the last partial)."""
    return (O + GROUP_ROWS - 1) // GROUP_ROWS


cdef inline void row_tile(const QTc *W, const uint8_t *rows, int ilv, int r0, int nw, const int8_t *q,
                          Py_ssize_t qstride, const float *xs, const int32_t *m, Py_ssize_t sstride,
                          const uint8_t *xg, Py_ssize_t gstride, int P, int blk, float *out) noexcept nogil:
    """out[p·nw + r] = the row dot (without W's row scale) of weight row r0 + r of the rows at rows
    (plain, or a group of four interleaved: ilv) and activation row p < P (q + p·qstride; scales,
    block sums m at + p·sstride; split form xg + p·gstride): coli_rowdot_*_tile, bit-identical to
    coli_rowdot_* per output."""
    if W.fmt == FMT_I8:
        coli_rowdot_i8_tile(<const int8_t *>rows, W.rb, ilv, r0, nw, q, qstride, xs, m, sstride, NULL, 0, P, W.I,
                            blk, out)
    else:
        coli_rowdot_i4_tile(rows, W.rb, ilv, r0, nw, q, qstride, xs, m, sstride, xg, gstride, P, W.I, blk, out)


cdef inline void tile_cols(const QTc *W, int o0, int ilv, int r0, int nw, int S, const int8_t *xq,
                           const float *xs, int nb, int blk, int idot, float *y, const int32_t *xsum,
                           const uint8_t *xg, Py_ssize_t gstride) noexcept nogil:
    """Output columns o0 + r0 .. o0 + r0 + nw - 1 of an integer-path matmul for all S activation
    rows, through the tiles: rows o0 + r0 .. of the plain rows from o0, or of the interleaved group
    at o0 (ilv). Up to four activation rows a call; with idot=2 and S <= 2 (decode, a depth-1
    verify) the S rows q1 and their residuals q2 in one call (one pass over the weights): xq holds
    them as 2·S rows I apart, their scales, sums and split forms likewise."""
    cdef float t1[GROUP_ROWS * 4]
    cdef float t2[GROUP_ROWS * 4]
    cdef int r, s0, p, P, I = W.I, O = W.O, o = o0 + r0
    cdef Py_ssize_t off2 = <Py_ssize_t>S * I, soff2 = <Py_ssize_t>S * nb, goff2 = <Py_ssize_t>S * gstride
    cdef const uint8_t *rows = W.q + <Py_ssize_t>o0 * W.rb
    if S <= 2 and idot == IDOT_Q8X2:
        row_tile(W, rows, ilv, r0, nw, xq, I, xs, xsum, nb, xg, gstride, 2 * S, blk, t1)
        for p in range(S):
            for r in range(nw):
                y[<Py_ssize_t>p * O + o + r] = (t1[p * nw + r] + t1[(S + p) * nw + r]) * W.s[o + r]
        return
    for s0 in range(0, S, 4):
        P = S - s0 if S - s0 < 4 else 4
        row_tile(W, rows, ilv, r0, nw, xq + <Py_ssize_t>s0 * I, I, xs + <Py_ssize_t>s0 * nb,
                 (xsum + <Py_ssize_t>s0 * nb) if xsum != NULL else NULL, nb,
                 (xg + s0 * gstride) if xg != NULL else NULL, gstride, P, blk, t1)
        if idot == IDOT_Q8X2:       # the residual rows
            row_tile(W, rows, ilv, r0, nw, xq + off2 + <Py_ssize_t>s0 * I, I, xs + soff2 + <Py_ssize_t>s0 * nb,
                     (xsum + soff2 + <Py_ssize_t>s0 * nb) if xsum != NULL else NULL, nb,
                     (xg + goff2 + s0 * gstride) if xg != NULL else NULL, gstride, P, blk, t2)
        for p in range(P):
            for r in range(nw):
                y[<Py_ssize_t>(s0 + p) * O + o + r] = ((t1[p * nw + r] + t2[p * nw + r]) if idot == IDOT_Q8X2
                                                       else t1[p * nw + r]) * W.s[o + r]


cdef inline bint ilv_group(const QTc *W, int o0) noexcept nogil:
    """Whether the group of rows from o0 is interleaved (a whole group of an interleaved W)."""
    return W.ilv and o0 + GROUP_ROWS <= W.O


cdef inline void int_group(const QTc *W, int grp, int S, const int8_t *xq, const float *xs, int nb, int blk,
                           int idot, float *y, const int32_t *xsum=NULL, const uint8_t *xg=NULL,
                           Py_ssize_t gstride=0) noexcept nogil:
    """Output columns GROUP_ROWS·grp .. (the group's rows < W.O) of an integer-path matmul for all
    S activation rows: the tiles (tile_cols) on the group's weight rows, with the activations'
    block sums xsum and split forms xg when given (row p of xq at xg + p·gstride); bit-identical to
    int_row per column, which GROUP_KERNELS=0 takes. The rows PREFETCH_GROUPS groups ahead are
    prefetched into L2, plain or interleaved (a group's rows are the same bytes either way; with
    the prefetch the interleaved experts and resident matrices of the bench fixture decode 1.17×
    (int4) and 1.25× (int8) faster than on the hardware prefetcher alone). Group-scaled matrices
    take int_group_g."""
    cdef int o0 = grp * GROUP_ROWS, r, ahead = o0 + PREFETCH_GROUPS * GROUP_ROWS, O = W.O
    cdef int n = O - o0 if O - o0 < GROUP_ROWS else GROUP_ROWS
    if PREFETCH_GROUPS > 0 and ahead < O:
        coli_prefetch_row(W.q + <Py_ssize_t>ahead * W.rb,
                          (GROUP_ROWS if O - ahead > GROUP_ROWS else O - ahead) * W.rb)
        if W.gs > 0:        # and the group scales of those rows
            coli_prefetch_row(W.s + <Py_ssize_t>ahead * W.G,
                              (GROUP_ROWS if O - ahead > GROUP_ROWS else O - ahead) * W.G * 4)
    if W.gs > 0 and GROUP_KERNELS:
        int_group_g(W, o0, n, S, xq, xs, nb, blk, idot, y, xg if wants_split(W, nb) else NULL, gstride)
        return
    if not GROUP_KERNELS:
        for r in range(n):
            int_row(W, o0 + r, S, xq, xs, nb, blk, idot, y, xsum)
        return
    tile_cols(W, o0, ilv_group(W, o0), 0, n, S, xq, xs, nb, blk, idot, y, xsum,
              xg if xg != NULL and wants_split(W, nb) else NULL, gstride)


cdef inline void quant_row(const float *x, int n, int blk, int idot, int8_t *q1, float *s1,
                           int8_t *q2, float *s2, float *xr, int32_t *m1=NULL, int32_t *m2=NULL) noexcept nogil:
    """Q8 activations of one row for the integer paths: q1/s1 = Q8(x); with IDOT_Q8X2 also
    q2/s2 = Q8(x − s1·q1), the residual (xr [n] is scratch). m1/m2 (optional): the per-block sums
    of q1/q2, which the tile kernels take."""
    coli_quantize_q8(x, n, blk, q1, s1)
    if m1 != NULL:
        coli_block_sums(q1, n, blk, m1)
    if idot == IDOT_Q8X2:
        coli_q8_residual(x, q1, s1, n, blk, xr)
        coli_quantize_q8(xr, n, blk, q2, s2)
        if m2 != NULL:
            coli_block_sums(q2, n, blk, m2)


cdef enum:
    QUANT_PARALLEL_MIN = 16384      # elements from which a matmul input is quantized (an FFN hidden
                                    # gated) on all threads


cdef inline void quant_row_at(const float *x, int S, int I, int blk, int nb, int idot, int8_t *xq, float *xs,
                              float *xr, int32_t *xsum, int s) noexcept nogil:
    """Row s of quant_rows (its Q8 row, then its residual's at S + s)."""
    cdef Py_ssize_t off2 = <Py_ssize_t>S * I
    quant_row(x + <Py_ssize_t>s * I, I, blk, idot, xq + <Py_ssize_t>s * I, xs + <Py_ssize_t>s * nb,
              xq + off2 + <Py_ssize_t>s * I, xs + <Py_ssize_t>(S + s) * nb, xr,
              xsum + <Py_ssize_t>s * nb if xsum != NULL else NULL,
              xsum + <Py_ssize_t>(S + s) * nb if xsum != NULL else NULL)


cdef inline void quant_rows(const float *x, int S, int I, int blk, int nb, int idot, int8_t *xq, float *xs,
                            float *xr, int32_t *xsum, int nt=1) noexcept nogil:
    """The integer matmuls' input: quant_row of each of the S rows of x [S, I] into xq [2·S·I]
    (first the S Q8 rows, then their S residual rows), xs / xsum [2·S·nb] the same way. nt > 1:
    on up to nt threads when the rows are many (not from inside a parallel region)."""
    cdef int s
    if <double>S * I < QUANT_PARALLEL_MIN:
        nt = 1
    cdef int short = 0
    cdef float *xt
    if nt > 1:      # rows on their own: any split gives the same bytes; a worker's residual row
        for s in prange(S, schedule='static', nogil=True, num_threads=nt):   # is its own scratch
            xt = <float *>coli_gemm_scratch(2, <long>I * sizeof(float)) if idot == IDOT_Q8X2 else xr
            if xt == NULL:
                short += 1              # no scratch for this thread: all rows again, serially
            else:
                quant_row_at(x, S, I, blk, nb, idot, xq, xs, xt, xsum, s)
        if short == 0:
            return
    for s in range(S):
        quant_row_at(x, S, I, blk, nb, idot, xq, xs, xr, xsum, s)


cdef inline bint gemm_ok(const QTc *W, int S, int nb, int idot) noexcept nogil:
    """Whether W's integer matmul of S rows takes a GEMM (AMX where on, else AVX-512 VNNI): int8 /
    int4 with one scale per row, one activation block per row, a batch of GEMM_MIN_ROWS rows or
    more (AMX), GEMM_VNNI_MIN_ROWS (VNNI)."""
    cdef int least = GEMM_MIN_ROWS if coli_amx_active() else GEMM_VNNI_MIN_ROWS
    return (GEMM and least > 0 and S >= least and nb == 1 and W.gs == 0 and (W.fmt == FMT_I8 or W.fmt == FMT_I4)
            and idot != IDOT_FLOAT and GROUP_KERNELS and coli_isa_active() == COLI_ISA_AVX512VNNI)


cdef inline int gemm_items(int O) noexcept nogil:
    return (O + COLI_GEMM_COLS - 1) // COLI_GEMM_COLS


cdef enum:
    GEMM_PACK_PARALLEL_ROWS = 64    # a GEMM's activation rows packed on all threads from here


cdef bint gemm_matmuls(const QTc **Ws, float **ys, int nW, int S, const int8_t *xq, const float *xs,
                       int idot, int nt) noexcept nogil:
    """ys[k][S, O_k] = the integer matmuls of the quantized rows xq (quant_rows' layout, one block
    per row) by the matrices Ws[k] of one input width, on a GEMM (coli_gemm_rows): the rows packed
    once into AMX's A-tile layout (and their sums, which the VNNI kernel takes), then
    COLI_GEMM_COLS weight rows a work item. Bit-identical to int_group
    (an item whose panel cannot be allocated takes it). False (nothing done) when the packed
    rows' memory cannot be had."""
    cdef int K = Ws[0].I, k, it, total = 0, o0, nw, g
    cdef int starts[MANY_MAX + 1]
    cdef long half = coli_gemm_packed_bytes(S, K)
    cdef bint two = idot == IDOT_Q8X2
    cdef int8_t *packed = coli_gemm_scratch(0, 2 * half + 2 * <long>S * sizeof(int32_t))
    if packed == NULL:
        return False
    cdef int32_t *sums = <int32_t *>(packed + 2 * half)     # [2·S] the packed rows' sums
    cdef int nblk = (S + 15) // 16, b, h
    cdef long bb = coli_gemm_packed_bytes(16, K)            # one block of 16 rows
    # each 16-row block of the packed layout on its own (a block of the whole is the pack of its rows)
    for it in prange(nblk * (2 if two else 1), schedule='static', nogil=True,
                     num_threads=nt if S >= GEMM_PACK_PARALLEL_ROWS else 1):
        b = it % nblk
        h = it // nblk
        coli_gemm_pack(xq + <Py_ssize_t>h * S * K + <Py_ssize_t>16 * b * K, min(16, S - 16 * b), K,
                       packed + h * half + b * bb, sums + h * S + 16 * b)
    for k in range(nW):
        starts[k] = total
        total += gemm_items(Ws[k].O)
    starts[nW] = total
    for it in prange(total, schedule='dynamic', nogil=True, num_threads=nt):
        k = 0
        while starts[k + 1] <= it:
            k = k + 1
        o0 = (it - starts[k]) * COLI_GEMM_COLS
        nw = Ws[k].O - o0 if Ws[k].O - o0 < COLI_GEMM_COLS else COLI_GEMM_COLS
        if coli_gemm_rows(Ws[k].q, Ws[k].rb, Ws[k].O, Ws[k].ilv, Ws[k].fmt == FMT_I4, o0, nw, Ws[k].s, packed,
                          sums, S, K, xs, two, ys[k], Ws[k].O) != 0:
            for g in range(o0 // GROUP_ROWS, (o0 + nw + GROUP_ROWS - 1) // GROUP_ROWS):
                int_group(Ws[k], g, S, xq, xs, 1, K, idot, ys[k])
    return True


cdef void matmul_qt(const QTc *W, const float *x, int S, float *y,
                    int8_t *xq, float *xs, float *xr, int block, int idot, int32_t *xsum=NULL,
                    uint8_t *xg=NULL) noexcept nogil:
    """y[S, O] = x[S, I] · Wᵀ. Each output element is computed by one thread, and a row's result
    does not depend on S, so batched verification computes exactly what single-row decode does.

    Integer paths (int8/int4 weights): x ≈ Σ_b xs_b · q_b per activation block; with IDOT_Q8X2 the
    residual x − xs·q is quantized again, so x ≈ xs·q + xs'·q' (error ~1/(127·254) of the block's
    max instead of 1/254) at the cost of a second integer dot.
    Scratch: xq int8 [2·S·I], xs f32 [2·S·nblocks], xr f32 [I]; xg (group-scaled int4 W; NULL:
    none) [2·S·coli_split_len(I)] bytes for the activations' split forms."""
    cdef int O = W.O, I = W.I
    cdef int o, s, nb, blk
    cdef Py_ssize_t gstride
    # Small products run on one thread: a parallel region costs more than it saves there.
    cdef int nt = 1 if <double>O * I * S < PARALLEL_MIN_MACS else coli_max_threads()
    if (W.fmt == FMT_I8 or W.fmt == FMT_I4) and idot != IDOT_FLOAT:
        nb = act_nblocks(I, block)
        blk = I if nb == 1 else block
        quant_rows(x, S, I, blk, nb, idot, xq, xs, xr, xsum, nt)
        if gemm_ok(W, S, nb, idot) and gemm_matmuls(&W, &y, 1, S, xq, xs, idot, nt):
            return
        gstride = coli_split_len(I)
        if xg != NULL and wants_split(W, nb):
            split_rows(xq, (2 if idot == IDOT_Q8X2 else 1) * S, I, xg, gstride)
        for o in prange(n_groups(O), schedule='guided', chunksize=GUIDED_MIN, nogil=True, num_threads=nt):
            int_group(W, o, S, xq, xs, nb, blk, idot, y, xsum, xg, gstride)
        return
    for o in prange(O, schedule='static', nogil=True, num_threads=nt):
        for s in range(S):
            y[<Py_ssize_t>s * O + o] = qt_rowdot_f(W, o, x + <Py_ssize_t>s * I)


cdef enum:
    MANY_MAX = 4        # matrices of one matmul_many call


cdef void matmul_many(const QTc **Ws, float **ys, int nW, const float *x, int S, int8_t *xq, float *xs,
                      float *xr, int block, int idot, int32_t *xsum, uint8_t *xg=NULL) noexcept nogil:
    """ys[k][S, O_k] = x[S, I] · W_kᵀ for nW (<= MANY_MAX) integer-format matrices of the same input
    width: x is quantized once and one parallel region covers the output groups of all of them
    (attention's input projections q_a, kv_a and the indexer's wk). Every output is computed as
    matmul_qt computes it, so the results are bit-identical to one call per matrix."""
    cdef int I = Ws[0].I, nb = act_nblocks(I, block), k, g, total = 0
    cdef int blk = I if nb == 1 else block
    cdef int starts[MANY_MAX + 1]
    cdef double macs = 0.0
    for k in range(nW):
        starts[k] = total
        total += n_groups(Ws[k].O)
        macs += <double>Ws[k].O * I * S
    starts[nW] = total
    cdef int nt = 1 if macs < PARALLEL_MIN_MACS else coli_max_threads()
    cdef Py_ssize_t gstride = coli_split_len(I)
    cdef bint split = False, gemm = True
    quant_rows(x, S, I, blk, nb, idot, xq, xs, xr, xsum, nt)
    for k in range(nW):
        gemm = gemm and gemm_ok(Ws[k], S, nb, idot)
    if gemm and gemm_matmuls(Ws, ys, nW, S, xq, xs, idot, nt):
        return
    for k in range(nW):
        split = split or wants_split(Ws[k], nb)
    if xg != NULL and split:
        split_rows(xq, (2 if idot == IDOT_Q8X2 else 1) * S, I, xg, gstride)
    for g in prange(total, schedule='guided', chunksize=GUIDED_MIN, nogil=True, num_threads=nt):
        k = 0
        while starts[k + 1] <= g:
            k = k + 1
        int_group(Ws[k], g - starts[k], S, xq, xs, nb, blk, idot, ys[k], xsum, xg, gstride)


# -- kernel front-ends (tests, tools) ---------------------------------------------------------

def split_len(int n):
    """Bytes of one activation row of width n in the split form (coli_split.h) int4 matmuls read."""
    return coli_split_len(n)


def dot_i8i8(w, x):
    cdef int8_t[::1] wv = np.ascontiguousarray(w, dtype=np.int8)
    cdef int8_t[::1] xv = np.ascontiguousarray(x, dtype=np.int8)
    if wv.shape[0] != xv.shape[0] or wv.shape[0] == 0:
        raise ValueError("dot_i8i8: lengths differ or are zero")
    return coli_dot_i8i8(&wv[0], &xv[0], wv.shape[0])


def dot_i4i8(w_packed, x):
    cdef uint8_t[::1] wv = np.ascontiguousarray(w_packed, dtype=np.uint8)
    cdef int8_t[::1] xv = np.ascontiguousarray(x, dtype=np.int8)
    if wv.shape[0] != (xv.shape[0] + 1) // 2 or xv.shape[0] == 0:
        raise ValueError("dot_i4i8: packed length must be ceil(n/2)")
    return coli_dot_i4i8(&wv[0], &xv[0], xv.shape[0])


def axpy(y, float c, x, int n=-1):
    """y + c·x through the dispatched element-wise kernels (tests): x float32, int8, or packed
    int4 (uint8, n elements, stored u = v + 8)."""
    cdef float[::1] yv = np.array(y, dtype=np.float32)
    cdef int m = yv.shape[0]
    cdef float[::1] xf
    cdef int8_t[::1] x8
    cdef uint8_t[::1] x4
    x = np.ascontiguousarray(x)
    if m == 0:
        raise ValueError("axpy: empty row")
    if x.dtype == np.float32 or x.dtype == np.int8:
        if x.shape[0] != m:
            raise ValueError("axpy: lengths differ")
        if x.dtype == np.float32:
            xf = x
            coli_axpy_f32(&yv[0], c, &xf[0], m)
        else:
            x8 = x
            coli_axpy_q8f32(&yv[0], c, &x8[0], m)
    elif x.dtype == np.uint8:
        if x.shape[0] != (m + 1) // 2:
            raise ValueError("axpy: packed length must be ceil(n/2)")
        x4 = x
        coli_axpy_q4f32(&yv[0], c, &x4[0], m)
    else:
        raise ValueError(f"axpy: unsupported dtype {x.dtype}")
    return np.asarray(yv)


def axpy_rows(y, c, rows, idx=None, int n=-1):
    """y + Σ_r c[r]·rows[idx[r] if idx else r] through the dispatched multi-row kernels (tests):
    rows float32 [R, n] (any idx), int8 [R, n] or packed int4 uint8 [R, ceil(n/2)] (no idx)."""
    cdef float[::1] yv = np.array(y, dtype=np.float32)
    cdef float[::1] cv = np.ascontiguousarray(c, dtype=np.float32)
    cdef int m = yv.shape[0], nrows = cv.shape[0]
    rows = np.ascontiguousarray(rows)
    if rows.ndim != 2 or m == 0 or nrows == 0:
        raise ValueError("axpy_rows: y and c must be non-empty, rows 2-D")
    cdef float[:, ::1] rf
    cdef int8_t[:, ::1] r8
    cdef uint8_t[:, ::1] r4
    cdef int[::1] iv
    if rows.dtype == np.float32:
        if rows.shape[1] != m:
            raise ValueError("axpy_rows: row length differs from y")
        rf = rows
        if idx is None:
            if nrows > rows.shape[0]:
                raise ValueError("axpy_rows: more coefficients than rows")
            coli_axpy_rows_f32(&yv[0], m, &cv[0], &rf[0, 0], m, NULL, nrows)
        else:
            iv = np.ascontiguousarray(idx, dtype=np.int32)
            if iv.shape[0] != nrows or min(iv) < 0 or max(iv) >= rows.shape[0]:
                raise ValueError("axpy_rows: bad row indices")
            coli_axpy_rows_f32(&yv[0], m, &cv[0], &rf[0, 0], m, &iv[0], nrows)
    elif rows.dtype == np.int8 and idx is None:
        if rows.shape[1] != m or nrows > rows.shape[0]:
            raise ValueError("axpy_rows: int8 rows of the wrong shape")
        r8 = rows
        coli_axpy_rows_q8f32(&yv[0], m, &cv[0], &r8[0, 0], rows.shape[1], nrows)
    elif rows.dtype == np.uint8 and idx is None:
        if rows.shape[1] != (m + 1) // 2 or nrows > rows.shape[0]:
            raise ValueError("axpy_rows: packed int4 rows of the wrong shape")
        r4 = rows
        coli_axpy_rows_q4f32(&yv[0], m, &cv[0], &r4[0, 0], rows.shape[1], nrows)
    else:
        raise ValueError(f"axpy_rows: unsupported rows {rows.dtype} (idx only with float32)")
    return np.asarray(yv)


def quantize_q8(x, int block=0):
    """Per-block Q8 activation quantization -> (q int8 [n], scales f32 [nblocks])."""
    cdef float[::1] xv = np.ascontiguousarray(x, dtype=np.float32)
    cdef int n = xv.shape[0]
    if n == 0:
        raise ValueError("quantize_q8: empty row")
    check_block(block, n)
    nb = act_nblocks(n, block)
    blk = n if nb == 1 else block
    q = np.empty(n, np.int8)
    s = np.empty(nb, np.float32)
    cdef int8_t[::1] qv = q
    cdef float[::1] sv = s
    coli_quantize_q8(&xv[0], n, blk, &qv[0], &sv[0])
    return q, s


def check_idot(int idot):
    if idot not in (IDOT_FLOAT, IDOT_Q8, IDOT_Q8X2):
        raise ValueError(f"idot must be 0 (float), 1 (Q8 activations) or 2 (Q8 + residual), got {idot}")


def check_block(int block, int n=0):
    if block < 0 or (block > 0 and block % 64 != 0):
        raise ValueError(f"activation block must be 0 (per row) or a multiple of 64, got {block}")


def matmul(QT W, x, int block=0, int idot=IDOT_Q8X2):
    """y[S, O] = x[S, I] · Wᵀ through the engine's dispatcher (tests, tools)."""
    x = np.ascontiguousarray(np.atleast_2d(x), dtype=np.float32)
    if x.shape[1] != W.c.I:
        raise ValueError(f"matmul: x has {x.shape[1]} columns, W has {W.c.I} inputs")
    check_block(block)
    S = x.shape[0]
    y = np.empty((S, W.c.O), np.float32)
    check_idot(idot)
    if idot == IDOT_FLOAT:
        W._plain("matmul with idot=0")
    xq = np.empty(2 * S * W.c.I, np.int8)
    xs = np.empty(2 * S * act_nblocks(W.c.I, block), np.float32)
    xr = np.empty(W.c.I, np.float32)
    xm = np.empty(2 * S * act_nblocks(W.c.I, block), np.int32)
    cdef float[:, ::1] xv = x
    cdef float[:, ::1] yv = y
    cdef int8_t[::1] qv = xq
    cdef float[::1] sv = xs, rv = xr
    cdef int32_t[::1] mv = xm
    cdef uint8_t[::1] gv
    cdef uint8_t *xg = NULL
    if W.c.fmt == FMT_I4:           # room for the activations' split forms
        gv = np.empty(2 * S * coli_split_len(W.c.I), np.uint8)
        xg = &gv[0]
    matmul_qt(&W.c, &xv[0, 0], S, &yv[0, 0], &qv[0], &sv[0], &rv[0], block, idot, &mv[0] if BLOCK_SUMS else NULL,
              xg)
    return y


# ---------------------------------------------------------------------------------------------
# 3. Primitives
# ---------------------------------------------------------------------------------------------

cdef inline void rmsnorm_row(float *out, const float *x, const float *w, int n, float eps) noexcept nogil:
    """out = x / sqrt(mean(x²) + eps) · w; the mean square is accumulated in double. Safe in place."""
    cdef double ms = 0.0
    cdef int i
    for i in range(n):
        ms += <double>x[i] * x[i]
    cdef float r = 1.0 / sqrtf(<float>(ms / n) + eps)
    for i in range(n):
        out[i] = (x[i] * r) * w[i]


cdef inline void layernorm_row(float *v, const float *w, const float *b, int n, float eps) noexcept nogil:
    """In-place LayerNorm (population variance), mean/variance in double (indexer k_norm)."""
    cdef double mean = 0.0, var = 0.0, d
    cdef int i
    for i in range(n):
        mean += v[i]
    mean /= n
    for i in range(n):
        d = v[i] - mean
        var += d * d
    var /= n
    cdef float r = 1.0 / sqrtf(<float>var + eps)
    for i in range(n):
        v[i] = (<float>(v[i] - mean)) * r * w[i] + b[i]


cdef inline void rope_interleave(float *v, int dr, int pos, const float *inv_freq) noexcept nogil:
    """Interleaved RoPE: pairs (v[2j], v[2j+1]) rotate by pos·inv_freq[j]; the output is
    de-interleaved ([rotated evens | rotated odds]), as HF's apply_rotary_pos_emb_interleave."""
    cdef float tmp[256]
    cdef int j, half = dr // 2
    cdef float ang, c, s, a, b
    for j in range(half):
        ang = (<float>pos) * inv_freq[j]
        c = cosf(ang)
        s = sinf(ang)
        a = v[2 * j]
        b = v[2 * j + 1]
        tmp[j] = a * c - b * s
        tmp[half + j] = b * c + a * s
    memcpy(v, tmp, dr * sizeof(float))


cdef inline float silu(float x) noexcept nogil:
    return x / (1.0 + expf(-x))


cdef inline void softmax_inplace(float *sc, int n) noexcept nogil:
    cdef float m = sc[0], sum = 0.0
    cdef int j
    for j in range(1, n):
        if sc[j] > m:
            m = sc[j]
    for j in range(n):
        sc[j] = expf(sc[j] - m)
        sum += sc[j]
    for j in range(n):
        sc[j] = sc[j] / sum


def rmsnorm(x, w, float eps):
    """rmsnorm over the last axis (numpy front-end to the engine's kernel, for tests)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    w = np.ascontiguousarray(w, dtype=np.float32)
    out = np.empty_like(x)
    cdef int ncol = x.shape[x.ndim - 1]
    cdef float[:, ::1] xv = x.reshape(-1, ncol)
    cdef float[:, ::1] ov = out.reshape(-1, ncol)
    cdef float[::1] wv = w
    cdef int r
    if wv.shape[0] != xv.shape[1]:
        raise ValueError("rmsnorm: weight length differs from the row length")
    for r in range(xv.shape[0]):
        rmsnorm_row(&ov[r, 0], &xv[r, 0], &wv[0], xv.shape[1], eps)
    return out


def rope(v, int pos, float theta):
    """Interleaved RoPE of one vector (numpy front-end, for tests)."""
    v = np.array(v, dtype=np.float32)
    dr = v.shape[0]
    inv = rope_inv_freq(dr, theta)
    cdef float[::1] vv = v
    cdef float[::1] iv = inv
    rope_interleave(&vv[0], dr, pos, &iv[0])
    return v


def rope_inv_freq(int dr, float theta):
    """inv_freq[j] = 1 / theta^(2j/dr), computed in float32 like HF's default RoPE."""
    exps = np.arange(0, dr, 2, dtype=np.float32) / np.float32(dr)
    return (np.float32(1.0) / (np.float32(theta) ** exps)).astype(np.float32)


# ---------------------------------------------------------------------------------------------
# 4. nogil attention / routing kernels
# ---------------------------------------------------------------------------------------------

cdef void attend_expanded(const float *q, const float *kvb, const float *Rc, const int *sel, int nsel,
                          int k0, int pos, int h, int H, int dn, int dr, int dv, float scale,
                          float *tbuf, float *ctx) noexcept nogil:
    """One (row, head) of expanded attention: keys/values from kvb [T, H·(dn+dv)] (kv_b applied to
    every cached latent) plus the shared rotated key Rc [T, dr]. Keys: the DSA selection sel[:nsel]
    when nsel > 0, else the causal window k0..pos."""
    cdef int dq = dn + dr, W = H * (dn + dv), j, i, nk = nsel if nsel > 0 else pos + 1 - k0
    cdef const float *qh = q + <Py_ssize_t>h * dq
    cdef float *sc = tbuf
    cdef float *o = ctx + <Py_ssize_t>h * dv
    cdef float *sr = sc + nk                          # the rope part of the scores
    cdef const int *keys = sel if nsel > 0 else NULL  # rows of kvb / Rc: sel[j], or k0 + j
    cdef const float *kh = kvb + h * (dn + dv) + (0 if nsel > 0 else <Py_ssize_t>k0 * W)   # head h's keys
    coli_dots_f32(qh, dn, kh, W, keys, nk, sc)
    coli_dots_f32(qh + dn, dr, Rc + (0 if nsel > 0 else <Py_ssize_t>k0 * dr), dr, keys, nk, sr)
    for j in range(nk):
        sc[j] = (sc[j] + sr[j]) * scale
    softmax_inplace(sc, nk)
    for i in range(dv):
        o[i] = 0.0
    coli_axpy_rows_f32(o, dv, sc, kh + dn, W, keys, nk)    # o = Σ_j p_j v_j


cdef enum:
    ATTN_BLOCK = 4          # prompt attention's work item: query rows of one head (expanded), or
                            # heads of one row (absorbed), that share their keys


cdef void attend_expanded_rows(const float *q, const float *kvb, const float *Rc, const int *sel,
                               const int *nsel, int topk, int s0, int s1, int k0, int pos_base, int h,
                               int H, int dn, int dr, int dv, float scale, float *tbuf,
                               float *ctx) noexcept nogil:
    """Head h of expanded attention for rows s0..s1-1 (q [S, H·(dn+dr)], ctx [S, H·dv], at positions
    pos_base + s), each bit-identical to attend_expanded. Causal rows (no DSA selection) go
    together: their common keys k0..pos_base+s0 through the multi-query kernels (one read of each
    key row for the block), row s's later keys through the one-row ones; every score and every
    output element sees the same operations in the same order as a row alone."""
    cdef int dq = dn + dr, W = H * (dn + dv), nb = s1 - s0, r, j, i, nk
    cdef int nk0 = pos_base + s0 + 1 - k0                     # keys every row of the block sees
    cdef Py_ssize_t ts = 2 * (nk0 + nb - 1)                   # tbuf floats per row: scores, rope part
    cdef const float *qh = q + <Py_ssize_t>s0 * H * dq + <Py_ssize_t>h * dq    # [nb, H·dq] row stride
    cdef const float *kh = kvb + h * (dn + dv) + <Py_ssize_t>k0 * W            # head h's key k0
    cdef const float *rh = Rc + <Py_ssize_t>k0 * dr
    cdef float *o = ctx + <Py_ssize_t>s0 * H * dv + <Py_ssize_t>h * dv         # [nb, H·dv] row stride
    cdef float *sc
    cdef bint selected = False
    if nsel != NULL:
        for r in range(nb):
            selected = selected or nsel[s0 + r] > 0
    if selected:                              # a DSA selection: every row on its own
        for r in range(nb):
            attend_expanded(q + <Py_ssize_t>(s0 + r) * H * dq, kvb, Rc, sel + <Py_ssize_t>(s0 + r) * topk,
                            nsel[s0 + r], k0, pos_base + s0 + r, h, H, dn, dr, dv, scale, tbuf,
                            ctx + <Py_ssize_t>(s0 + r) * H * dv)
        return
    # scores of row r: tbuf[r·ts + j] (q_nope·k_nope), tbuf[r·ts + ts/2 + j] (q_rope·k_rope)
    coli_dots_f32_multi(qh, H * dq, nb, dn, kh, W, NULL, nk0, tbuf, ts)
    coli_dots_f32_multi(qh + dn, H * dq, nb, dr, rh, dr, NULL, nk0, tbuf + ts // 2, ts)
    for r in range(1, nb):
        coli_dots_f32(qh + <Py_ssize_t>r * H * dq, dn, kh + <Py_ssize_t>nk0 * W, W, NULL, r,
                      tbuf + r * ts + nk0)
        coli_dots_f32(qh + <Py_ssize_t>r * H * dq + dn, dr, rh + <Py_ssize_t>nk0 * dr, dr, NULL, r,
                      tbuf + r * ts + ts // 2 + nk0)
    for r in range(nb):
        sc = tbuf + r * ts
        nk = nk0 + r
        for j in range(nk):
            sc[j] = (sc[j] + sc[ts // 2 + j]) * scale
        softmax_inplace(sc, nk)
        for i in range(dv):
            o[<Py_ssize_t>r * H * dv + i] = 0.0
    # o_r = Σ_j p_rj v_j: the common keys for the block, then row r's own later keys
    coli_axpy_rows_f32_multi(o, H * dv, nb, dv, tbuf, ts, kh + dn, W, NULL, nk0)
    for r in range(1, nb):
        coli_axpy_rows_f32(o + <Py_ssize_t>r * H * dv, dv, tbuf + r * ts + nk0, kh + dn + <Py_ssize_t>nk0 * W,
                           W, NULL, r)


cdef void attend_absorbed_heads(const QTc *kv_b, const float *q, const float *Lc, const float *Rc,
                                const int *sel, int nsel, int k0, int pos, int h0, int h1, int H, int dn,
                                int dr, int dv, int Lkv, float scale, float *tbuf, float *ctx) noexcept nogil:
    """Heads h0..h1-1 of one row of absorbed attention, entirely in the kv_lora latent space:
    qabs = W_k,hᵀ q_nope; score_t = qabs·Lc_t + q_rope·Rc_t; ctx = W_v,h (Σ_t p_t Lc_t). Keys: the
    DSA selection sel[:nsel] when nsel > 0, else the causal window k0..pos. The heads share the
    row's keys, so their scores and latent sums go through the multi-query kernels, which read each
    key once for all of them and give each head what it computes alone (decode: one head an item).
    tbuf: per head qabs [Lkv], clat [Lkv] and scores [max(2·nk, dn)]."""
    cdef int dq = dn + dr, nh = h1 - h0, j, t, i, nk = nsel if nsel > 0 else pos + 1 - k0
    cdef Py_ssize_t ss = 2 * nk if 2 * nk > dn else dn                  # a head's score floats
    cdef Py_ssize_t hs = 2 * Lkv + ss                                  # a head's tbuf floats
    cdef const int *keys = sel if nsel > 0 else NULL   # rows of Lc / Rc: sel[t], or k0 + t
    cdef Py_ssize_t first = 0 if nsel > 0 else k0
    cdef float *qabs
    cdef float *sc
    for j in range(nh):                                # qabs_j = W_k,hᵀ q_nope,h
        qabs = tbuf + j * hs
        for i in range(2 * Lkv):
            qabs[i] = 0.0                              # qabs and clat
        qt_addrows(kv_b, (h0 + j) * (dn + dv), dn, q + <Py_ssize_t>(h0 + j) * dq, qabs + 2 * Lkv, qabs)
    # scores of head j: tbuf[j·hs + 2·Lkv + t] (qabs·Lc_t), then + nk (q_rope·Rc_t)
    coli_dots_f32_multi(tbuf, hs, nh, Lkv, Lc + first * Lkv, Lkv, keys, nk, tbuf + 2 * Lkv, hs)
    coli_dots_f32_multi(q + <Py_ssize_t>h0 * dq + dn, dq, nh, dr, Rc + first * dr, dr, keys, nk,
                        tbuf + 2 * Lkv + nk, hs)
    for j in range(nh):
        sc = tbuf + j * hs + 2 * Lkv
        for t in range(nk):
            sc[t] = (sc[t] + sc[nk + t]) * scale
        softmax_inplace(sc, nk)
    # clat_j = Σ_t p_jt Lc_t, then ctx_h = W_v,h clat_j
    coli_axpy_rows_f32_multi(tbuf + Lkv, hs, nh, Lkv, tbuf + 2 * Lkv, hs, Lc + first * Lkv, Lkv, keys, nk)
    for j in range(nh):
        qt_rowdots_f(kv_b, (h0 + j) * (dn + dv) + dn, dv, tbuf + j * hs + Lkv, ctx + (h0 + j) * dv)


# -- the DSA indexer's selection --------------------------------------------------------------

cdef struct ScoreIdx:
    float v
    int t


cdef int cmp_int_asc(const void *a, const void *b) noexcept nogil:
    cdef int x = (<const int *>a)[0]
    cdef int y = (<const int *>b)[0]
    return (x > y) - (x < y)


cdef int dsa_topk(const float *qi, const float *w, const float *Ic, int nk, int nh, int hd, int topk,
                  float qscale, float wscale, bint force, float *buf, int *sel) noexcept nogil:
    """Select the top-k keys of one query; returns the count (0 = context fits: attend densely).
    buf holds nk ScoreIdx pairs (2 floats each). The selection is returned in ascending position."""
    if nk <= topk and not force:
        return 0
    dsa_scores(qi, w, Ic, 0, nk, nh, hd, qscale, wscale, <ScoreIdx *>buf)
    return dsa_pick(<ScoreIdx *>buf, nk, topk, sel)


cdef inline void dsa_scores(const float *qi, const float *w, const float *Ic, int t0, int t1, int nh, int hd,
                            float qscale, float wscale, ScoreIdx *pairs) noexcept nogil:
    """pairs[t] = (Σ_h w_h·wscale·relu(q_h·k_t·qscale), t) for the keys t0 <= t < t1."""
    cdef int t, h
    cdef float acc, d
    for t in range(t0, t1):
        acc = 0.0
        for h in range(nh):
            d = coli_dot_f32(qi + h * hd, Ic + <Py_ssize_t>t * hd, hd) * qscale
            if d > 0:
                acc = acc + (w[h] * wscale) * d
        pairs[t].v = acc
        pairs[t].t = t


cdef inline bint ranks_before(const ScoreIdx *a, const ScoreIdx *b) noexcept nogil:
    """a before b in the selection order: higher score, ties by lower position (glm.c's DSA tie order)."""
    return a.v > b.v or (not (a.v < b.v) and a.t < b.t)


cdef inline void swap_pairs(ScoreIdx *p, int i, int j) noexcept nogil:
    cdef ScoreIdx tmp = p[i]
    p[i] = p[j]
    p[j] = tmp


cdef void select_first(ScoreIdx *p, int n, int k) noexcept nogil:
    """Reorder p[0..n) so that p[0..k) holds the k first pairs of the selection order (in no
    particular order): quickselect, median-of-three pivots, Lomuto partitions (in bounds whatever
    the comparisons say, e.g. on NaN scores). Expected O(n), where sorting is O(n log n)."""
    cdef int lo = 0, hi = n - 1, mid, i, store
    while lo < hi:
        mid = lo + (hi - lo) // 2
        if ranks_before(&p[mid], &p[lo]):
            swap_pairs(p, mid, lo)
        if ranks_before(&p[hi], &p[lo]):
            swap_pairs(p, hi, lo)
        if ranks_before(&p[mid], &p[hi]):
            swap_pairs(p, mid, hi)          # p[hi]: the median of the three, the pivot
        store = lo
        for i in range(lo, hi):
            if ranks_before(&p[i], &p[hi]):
                swap_pairs(p, i, store)
                store += 1
        swap_pairs(p, store, hi)            # the pivot at its place in the order
        if store == k:
            return
        if store < k:
            lo = store + 1
        else:
            hi = store - 1


cdef inline int dsa_pick(ScoreIdx *pairs, int nk, int topk, int *sel) noexcept nogil:
    """The min(nk, topk) keys of highest score (ties: lower position first), in ascending position."""
    cdef int t, keep = nk if nk < topk else topk
    if keep < nk:
        select_first(pairs, nk, keep)
    for t in range(keep):
        sel[t] = pairs[t].t
    qsort(sel, keep, sizeof(int), cmp_int_asc)
    return keep


def dsa_pick_ids(scores, int topk):
    """The DSA selection of one query from its key scores [nk] (dsa_pick): the min(nk, topk) keys
    of highest score, ties by lower position, in ascending position."""
    cdef float[::1] sv = np.ascontiguousarray(scores, dtype=np.float32)
    cdef int nk = sv.shape[0], t, keep
    if nk < 1 or topk < 1:
        raise ValueError("dsa_pick_ids: at least one key and topk >= 1")
    cdef ScoreIdx *pairs = <ScoreIdx *>malloc(nk * sizeof(ScoreIdx))
    sel = np.zeros(min(nk, topk), np.int32)
    cdef int[::1] out = sel
    if pairs == NULL:
        raise MemoryError()
    for t in range(nk):
        pairs[t].v = sv[t]
        pairs[t].t = t
    keep = dsa_pick(pairs, nk, topk, &out[0])
    free(pairs)
    return sel[:keep]


# -- the router -------------------------------------------------------------------------------

cdef int route_row(const float *logit, const float *bias, int E, int K, bint norm, float rs,
                   int *sel, float *w) noexcept nogil:
    """Sigmoid router with correction bias (noaux_tc, n_group = 1): select K experts by biased
    score (ties -> lowest index), weight by the unbiased sigmoid, normalize, scale.
    Returns -1 on NaN scores."""
    cdef int k, e, best
    cdef float bv, sig, tot = 0.0
    for e in range(E):
        if isnan(logit[e]):
            return -1
    for k in range(K):
        best = -1
        bv = -1e30
        for e in range(E):
            if 1.0 / (1.0 + expf(-logit[e])) + bias[e] > bv and not _chosen(sel, k, e):
                bv = 1.0 / (1.0 + expf(-logit[e])) + bias[e]
                best = e
        if best < 0:
            return -1
        sel[k] = best
        w[k] = 1.0 / (1.0 + expf(-logit[best]))
        tot += w[k]
    for k in range(K):
        if norm:
            w[k] = w[k] / (tot + 1e-20)
        w[k] = w[k] * rs
    return 0


cdef int batch_union(const int *sel, const float *w, int S, int K, int E, int *ucount, int *uniq,
                     int *ustart, int *urow, float *uw) noexcept nogil:
    """Group the (row, weight) pairs of a routed batch by expert, experts in ascending id (as HF's
    index_add loop does). Each row then accumulates its experts in ascending id whatever the other
    rows of the batch are, so a batched verify computes bit for bit what single-row decode does.
    Returns the number of unique experts nu; expert uniq[u] serves rows urow[ustart[u]:ustart[u+1]]
    (ascending) with weights uw[...]. ucount [E] is scratch."""
    cdef int s, e, u, nu = 0, at = 0, n = S * K
    for e in range(E):
        ucount[e] = 0
    for s in range(n):
        ucount[sel[s]] += 1
    for e in range(E):                  # counts -> start offsets; ucount becomes e -> slot u
        if ucount[e] > 0:
            uniq[nu] = e
            ustart[nu] = at
            at += ucount[e]
            ucount[e] = nu
            nu += 1
    ustart[nu] = at
    for s in range(n):                  # fill, using ustart as cursors
        u = ucount[sel[s]]
        urow[ustart[u]] = s // K
        uw[ustart[u]] = w[s]
        ustart[u] += 1
    for u in range(nu - 1, 0, -1):      # cursors -> starts again
        ustart[u] = ustart[u - 1]
    ustart[0] = 0
    return nu


cdef inline bint _chosen(const int *sel, int k, int e) noexcept nogil:
    cdef int j
    for j in range(k):
        if sel[j] == e:
            return True
    return False


# -- a layer's attention half (and routing) in one parallel region ----------------------------

cdef enum:
    DSA_KEY_BLOCK = 256     # keys per work item of the indexer's scores in attend_step


cdef struct LayerStep:
    # One layer's attention half for S rows in one parallel region (attend_step): every pointer
    # is checked by Model._attend_step before the region starts.
    int S, D, H, dn, dr, dv, Lq, Lkv, pos_base, k0, idot, block, nt
    float eps, leps, scale              # the layer norms' eps, q_a / kv_a norms' (LORA_NORM_EPS)
    float *x                            # [S, D] residual (in/out)
    float *n                            # [S, D] post-attention norm of x (out): the MLP input
    float *a                            # [S, D] o_proj output
    const float *in_ln                  # [D]
    const float *post_ln                # [D]
    const float *qa_ln                  # [Lq]
    const float *kv_ln                  # [Lkv]
    const float *inv                    # [dr / 2] rope inverse frequencies
    const QTc *ins[MANY_MAX]            # q_a, kv_a (, the indexer's wk): one input, one pass
    float *ins_y[MANY_MAX]              # their outputs qr [S, Lq], ckv [S, Lkv + dr] (, ik [S, ihd])
    int n_ins
    const QTc *q_b
    const QTc *kv_b
    const QTc *o_proj
    float *qr                           # [S, Lq]
    float *ckv                          # [S, Lkv + dr]
    float *q                            # [S, H·(dn + dr)]
    float *ctx                          # [S, H·dv]
    float *Lc                           # [max_t, Lkv] this layer's latent cache
    float *Rc                           # [max_t, dr] its rotated shared keys
    float *Ic                           # [max_t, ihd] its indexer keys (NULL: the layer writes none)
    float *ik                           # [S, ihd] the indexer's keys of these rows
    const float *ik_w                   # [ihd] indexer k_norm weight, bias
    const float *ik_b
    int ihd
    float ieps
    float *tbuf                         # [nt, tstride] per-thread attention scratch
    Py_ssize_t tstride
    int8_t *xq                          # [2·S·I] activation scratch (see matmul_qt; Work.xq)
    float *xs                           # [2·S·nblocks] (Work.xs)
    float *xr                           # [I] (Work.xr)
    int32_t *xm                         # [2·S·nblocks] (Work.xm; NULL: no block sums)
    uint8_t *xg                         # split activations (group-scaled int4; NULL: none)
    # routing (MoE layers; router NULL: a dense layer)
    const QTc *router                   # [E, D]
    const float *rbias                  # [E]
    int E, K
    bint norm_topk
    float rs
    float *rl                           # [S, E] router logits
    int *rsel                           # [S, K]
    float *rw                           # [S, K]
    int *upos                           # [E] batch_union's scratch and results (see batch_union)
    int *uniq                           # [S·K]
    int *ustart                         # [S·K + 1]
    int *urow                           # [S·K]
    float *uw                           # [S·K]
    int nu                              # out: unique experts of the batch
    int bad                             # out: first row with NaN router scores, or -1
    # the DSA indexer (Ic NULL: the layer writes no keys; nsel NULL: it attends densely)
    int *nsel                           # [S] the selection counts of the rows (0: every key)
    int *sel                            # [S, topk] their selections (a shared layer reuses them)
    int topk, inh                       # index_topk, indexer heads
    bint force                          # select even when the context fits index_topk (--dsa-force)
    const QTc *iwq                      # [inh·ihd, Lq] wq_b, with q_b on the quantized q_a output
    const QTc *iwp                      # [inh, D] weights_proj (in the input group when wp_grouped)
    bint wp_grouped
    float *iq                           # [S, inh·ihd] indexer queries
    float *iw                           # [S, inh] indexer head weights
    float *isc                          # [2·ws.T] the key scores of one row (ScoreIdx pairs; _work gives
                                        # every forward a scratch with ws.T >= its keys)
    float qscale, wscale                # 1/√ihd, 1/√inh
    double macs_row                     # multiply-adds of the attention half per row (thread count)
    const QTc *gate                     # the dense MLP, or the shared expert (gate NULL: none)
    const QTc *up
    const QTc *down


cdef inline void quant_split(const float *x, int S, int I, int block, int idot, int8_t *xq, float *xs,
                             float *xr, int32_t *xm, uint8_t *xg, bint split) noexcept nogil:
    """quant_rows of x [S, I] as matmul_qt makes them (and the split forms when split)."""
    cdef int nb = act_nblocks(I, block)
    quant_rows(x, S, I, I if nb == 1 else block, nb, idot, xq, xs, xr, xm)
    if split:
        split_rows(xq, (2 if idot == IDOT_Q8X2 else 1) * S, I, xg, coli_split_len(I))


cdef inline void group_of(const QTc *W, int g, LayerStep *P, float *y) noexcept nogil:
    """Work item g of the matmul y = x · Wᵀ whose activations quant_split left in P's scratch."""
    cdef int nb = act_nblocks(W.I, P.block)
    int_group(W, g, P.S, P.xq, P.xs, nb, W.I if nb == 1 else P.block, P.idot, y, P.xm, P.xg,
              coli_split_len(W.I))


cdef inline bint wants_split_of(const QTc *W, LayerStep *P) noexcept nogil:
    return P.xg != NULL and wants_split(W, act_nblocks(W.I, P.block))


cdef void attend_step(LayerStep *P) noexcept nogil:
    """x += o_proj(attention(input_layernorm(x))); n = post_attention_layernorm(x); and for an MoE
    layer its routing (router logits, top-K, batch union) — the absorbed path of Model.attention
    (with the DSA indexer's selection when it runs), moe's routing and layer_forward's residual
    for S rows in ONE parallel region, phases separated by the barriers that end each prange.
    Every value is computed by one thread with the kernels and the order of the per-call path
    (matmul_many, kv_write, matmul_qt, _dsa_select, the head loop, route_row, batch_union), so
    the results are bit-identical to it; the indexer's key scores of a row are shared out among
    the threads. Decode and verify batches take it (Model._step_ok decides)."""
    cdef int S = P.S, D = P.D, H = P.H, dq = P.dn + P.dr, T = P.pos_base + P.S, t, g, k, s, h, item
    cdef int pos, nk, r, total = 0, nq
    cdef int starts[MANY_MAX + 1]
    cdef bint split = False, select = P.Ic != NULL and (T > P.topk or P.force)
    cdef ScoreIdx *pairs = <ScoreIdx *>P.isc
    for k in range(P.n_ins):
        starts[k] = total
        total += n_groups(P.ins[k].O)
        split = split or wants_split_of(P.ins[k], P)
    starts[P.n_ins] = total
    nq = n_groups(P.q_b.O)
    P.nu, P.bad = 0, -1
    with parallel(num_threads=P.nt):
        t = threadid()
        # 1. the layer input's norm and its Q8 form (one for q_a, kv_a, wk and wp)
        for item in prange(1, schedule='static'):
            for s in range(S):
                rmsnorm_row(P.n + <Py_ssize_t>s * D, P.x + <Py_ssize_t>s * D, P.in_ln, D, P.eps)
                if P.Ic != NULL and not select:
                    P.nsel[s] = 0           # the context fits index_topk: every key (as _dsa_select)
            quant_split(P.n, S, D, P.block, P.idot, P.xq, P.xs, P.xr, P.xm, P.xg, split)
        # 2. q_a, kv_a (, wk, wp): the groups of all of them in one pass
        for g in prange(total, schedule='guided', chunksize=GUIDED_MIN):
            k = 0
            while starts[k + 1] <= g:
                k = k + 1
            group_of(P.ins[k], g - starts[k], P, P.ins_y[k])
        # 3. the KV rows of these positions; q_a's norm, quantized for q_b (and wq); the indexer
        # keys; the indexer's head weights when wp is a float matrix. Items in the order 1, 3, 0, 2:
        # two threads get q_a's norm and quantization (the longest) and the KV rows with the keys
        for item in prange(4, schedule='static'):
            k = (2 * item + 1) % 5
            if k == 0:
                for s in range(S):
                    pos = P.pos_base + s
                    rmsnorm_row(P.Lc + <Py_ssize_t>pos * P.Lkv, P.ckv + <Py_ssize_t>s * (P.Lkv + P.dr),
                                P.kv_ln, P.Lkv, P.leps)
                    memcpy(P.Rc + <Py_ssize_t>pos * P.dr, P.ckv + <Py_ssize_t>s * (P.Lkv + P.dr) + P.Lkv,
                           P.dr * sizeof(float))
                    rope_interleave(P.Rc + <Py_ssize_t>pos * P.dr, P.dr, pos, P.inv)
            elif k == 1:
                for s in range(S):
                    rmsnorm_row(P.qr + <Py_ssize_t>s * P.Lq, P.qr + <Py_ssize_t>s * P.Lq, P.qa_ln, P.Lq, P.leps)
                quant_split(P.qr, S, P.Lq, P.block, P.idot, P.xq, P.xs, P.xr, P.xm, P.xg,
                            wants_split_of(P.q_b, P) or (select and wants_split_of(P.iwq, P)))
            elif k == 2 and P.Ic != NULL:
                for s in range(S):
                    pos = P.pos_base + s
                    layernorm_row(P.ik + <Py_ssize_t>s * P.ihd, P.ik_w, P.ik_b, P.ihd, P.ieps)
                    rope_interleave(P.ik + <Py_ssize_t>s * P.ihd, P.dr, pos, P.inv)
                    memcpy(P.Ic + <Py_ssize_t>pos * P.ihd, P.ik + <Py_ssize_t>s * P.ihd, P.ihd * sizeof(float))
            elif k == 3 and select and not P.wp_grouped:
                for s in range(S):
                    for h in range(P.inh):
                        P.iw[s * P.inh + h] = qt_rowdot_f(P.iwp, h, P.n + <Py_ssize_t>s * D)
        # 4. q_b (and the indexer's wq): groups over the quantized q_a output
        for g in prange(nq + (n_groups(P.iwq.O) if select else 0), schedule='guided', chunksize=GUIDED_MIN):
            if g < nq:
                group_of(P.q_b, g, P, P.q)
            else:
                group_of(P.iwq, g - nq, P, P.iq)
        # 5. the DSA selection of each row: rotated indexer queries, key scores shared out, top-k
        if select:
            for item in prange(S * P.inh, schedule='static'):
                rope_interleave(P.iq + <Py_ssize_t>item * P.ihd, P.dr, P.pos_base + item // P.inh, P.inv)
            for r in range(S):
                nk = P.pos_base + r + 1
                for g in prange((nk + DSA_KEY_BLOCK - 1) // DSA_KEY_BLOCK, schedule='static'):
                    dsa_scores(P.iq + <Py_ssize_t>r * P.inh * P.ihd, P.iw + r * P.inh, P.Ic, g * DSA_KEY_BLOCK,
                               nk if nk < (g + 1) * DSA_KEY_BLOCK else (g + 1) * DSA_KEY_BLOCK,
                               P.inh, P.ihd, P.qscale, P.wscale, pairs)
                for item in prange(1, schedule='static'):
                    P.nsel[r] = dsa_pick(pairs, nk, P.topk, P.sel + <Py_ssize_t>r * P.topk)
        # 6. per (row, head): rotate the query's rope part, attend in the latent space (over the
        # DSA selection of the row when the layer has one with keys in it)
        for item in prange(S * H, schedule='static'):
            s = item // H
            h = item % H
            rope_interleave(P.q + <Py_ssize_t>s * H * dq + h * dq + P.dn, P.dr, P.pos_base + s, P.inv)
            attend_absorbed_heads(P.kv_b, P.q + <Py_ssize_t>s * H * dq, P.Lc, P.Rc,
                                  P.sel + <Py_ssize_t>s * P.topk if P.nsel != NULL else NULL,
                                  P.nsel[s] if P.nsel != NULL else 0, P.k0,
                                  P.pos_base + s, h, h + 1, H, P.dn, P.dr, P.dv, P.Lkv, P.scale,
                                  P.tbuf + t * P.tstride, P.ctx + <Py_ssize_t>s * H * P.dv)
        # 7. o_proj
        for item in prange(1, schedule='static'):
            quant_split(P.ctx, S, H * P.dv, P.block, P.idot, P.xq, P.xs, P.xr, P.xm, P.xg,
                        wants_split_of(P.o_proj, P))
        for g in prange(n_groups(P.o_proj.O), schedule='guided', chunksize=GUIDED_MIN):
            group_of(P.o_proj, g, P, P.a)
        # 8. the residual and the MLP's input norm
        for s in prange(S, schedule='static'):
            for item in range(D):
                P.x[<Py_ssize_t>s * D + item] += P.a[<Py_ssize_t>s * D + item]
            rmsnorm_row(P.n + <Py_ssize_t>s * D, P.x + <Py_ssize_t>s * D, P.post_ln, D, P.eps)
        # 9. routing (MoE layers): the router's logits, then top-K and the batch union
        if P.router != NULL:
            if P.router.fmt == FMT_F32 or P.idot == IDOT_FLOAT:
                for item in prange(S * P.E, schedule='static'):
                    P.rl[item] = qt_rowdot_f(P.router, item % P.E, P.n + <Py_ssize_t>(item // P.E) * D)
            else:
                for item in prange(1, schedule='static'):
                    quant_split(P.n, S, D, P.block, P.idot, P.xq, P.xs, P.xr, P.xm, P.xg,
                                wants_split_of(P.router, P))
                for g in prange(n_groups(P.E), schedule='static'):
                    group_of(P.router, g, P, P.rl)
            for item in prange(1, schedule='static'):
                P.bad = -1
                for s in range(S):
                    if P.bad < 0 and route_row(P.rl + <Py_ssize_t>s * P.E, P.rbias, P.E, P.K, P.norm_topk,
                                               P.rs, P.rsel + <Py_ssize_t>s * P.K, P.rw + <Py_ssize_t>s * P.K) != 0:
                        P.bad = s
                if P.bad < 0:
                    P.nu = batch_union(P.rsel, P.rw, S, P.K, P.E, P.upos, P.uniq, P.ustart, P.urow, P.uw)


# ---------------------------------------------------------------------------------------------
# 5. Fused FFN group: every FFN of one MoE layer call (routed experts + shared expert), or a dense MLP,
#    in one parallel region
# ---------------------------------------------------------------------------------------------

# Rows up to which an MoE / dense MLP call runs fused (decode, and verify batches of up to 16 drafts).
FUSED_MAX_ROWS = 17
# Multiply-adds of a fused group below which it stays on one thread.
cdef double FUSED_MIN_MACS = float(switch("FUSED_MIN_MACS"))


cdef struct FfnJob:
    # One FFN y = down · (silu(gate · x) ⊙ (up · x)) over rows urow[row0 .. row0+nr) of the layer
    # input, added into out with the weights uw[row0 ..]. Offsets point into the group's scratch.
    const QTc *gate
    const QTc *up
    const QTc *down
    int nr, I, row0, w0                 # rows, intermediate width, first pair, first gate/up item
                                        # (row0, w0: within its group, see ffn_group)
    int pabs                            # first pair in the scratch's pair arrays
    int nbI, blkI                       # activation blocks of its hidden rows
    Py_ssize_t x0, xs0                  # its quantized inputs [2·nr, D] and their scales
    Py_ssize_t h0                       # its hidden g/u [nr, I]
    Py_ssize_t hq0, hs0                 # its quantized hidden [2·nr, I] and their scales
    Py_ssize_t y0                       # its down outputs [nr, D]
    Py_ssize_t xg0, hg0                 # split forms of its quantized inputs / hidden (int4)
    int src                             # the job whose quantized inputs it reads (set by ffn_group)


cdef inline int fill_job(FfnJob *J, const QTc *gate, const QTc *up, const QTc *down, int row0, int p0,
                         int nr, int w0, int D, int block, Py_ssize_t W, Py_ssize_t xgs,
                         Py_ssize_t hgs) noexcept nogil:
    """Job J: the FFN (gate, up, down) over the nr pairs from pair row0 of the scratch (a
    group starting at pair p0), its gate/up work items from w0; its scratch at its pairs' place
    (pair p: inputs at 2p rows of width D, hidden at p rows of the scratch's width W). Returns
    the next group's first work item."""
    cdef int nbD = act_nblocks(D, block)
    J.gate, J.up, J.down = gate, up, down
    J.nr, J.I, J.row0, J.w0, J.pabs = nr, gate.O, row0 - p0, w0, row0
    J.nbI = act_nblocks(J.I, block)
    J.blkI = J.I if J.nbI == 1 else block
    J.x0, J.xs0, J.y0 = 2 * <Py_ssize_t>row0 * D, 2 * <Py_ssize_t>row0 * nbD, <Py_ssize_t>row0 * D
    J.h0, J.hq0, J.hs0 = row0 * W, 2 * row0 * W, 2 * row0 * W
    J.xg0, J.hg0 = 2 * row0 * xgs, 2 * row0 * hgs
    return w0 + 2 * n_groups(J.I)


cdef inline int job_of(const FfnJob *jobs, int nj, int item, bint by_work) noexcept nogil:
    """The job that owns a gate/up work item (by_work) or a (job, row) pair."""
    cdef int j = 0
    if by_work:
        while j + 1 < nj and jobs[j + 1].w0 <= item:
            j += 1
    else:
        while j + 1 < nj and jobs[j + 1].row0 <= item:
            j += 1
    return j


cdef inline void share_inputs(FfnJob *jobs, int nj, const int *urow) noexcept nogil:
    """jobs[j].src = the first job i <= j with j's input rows (the same urow[row0 ..] sequence): the
    rows are quantized once, into job i's scratch, for all of them. Decode: every FFN of an MoE
    call reads the one row, quantized once instead of once per FFN."""
    cdef int j, i, r
    for j in range(nj):
        jobs[j].src = j
        for i in range(j):
            if jobs[i].src != i or jobs[i].nr != jobs[j].nr:
                continue
            r = 0
            while r < jobs[j].nr and urow[jobs[i].row0 + r] == urow[jobs[j].row0 + r]:
                r += 1
            if r == jobs[j].nr:
                jobs[j].src = i
                break


cdef void ffn_group(FfnJob *jobs, int nj, int npairs, int nwork, const float *x, int D,
                    const int *urow, const float *uw, int block, int idot,
                    int8_t *xq, float *xs, float *g, float *u, int8_t *hq, float *hs, float *yd,
                    float *xr, Py_ssize_t xr_stride, float *out, int nt,
                    int32_t *xm, int32_t *hm, bint accumulate=True, uint8_t *xg=NULL, Py_ssize_t xgs=0,
                    uint8_t *hg=NULL, Py_ssize_t hgs=0) noexcept nogil:
    """out[urow[p], :] += uw[p] · FFN_j(x[urow[p], :]) for every pair p of every job j, in job
    order (accumulate=False: only the FFN outputs, left in yd for ffn_accumulate). Five phases
    separated by barriers: quantize the inputs; gate and up rows of every FFN (one work item per
    group of GROUP_ROWS weight rows, int_group); silu(g)·u, quantized; down rows (GROUP_ROWS
    output columns of one FFN per item); the sums over the FFNs in job order. Each value is
    computed by one thread with the same kernels and the same order as the unfused path (matmul_qt
    per FFN, then out += w · y), so the results are bit-identical to it and independent of the
    thread count. Jobs with the same input rows share one quantization of them (share_inputs). xg /
    hg (NULL: none): room for the split forms of the quantized inputs / hidden rows (rows xgs / hgs
    bytes apart), made when a job's int4 matrices read them."""
    cdef int p, w, o, k, j, r, i, t, jp, nbD = act_nblocks(D, block)
    cdef int blkD = D if nbD == 1 else block
    cdef const FfnJob *J
    cdef const FfnJob *X
    cdef bint split_in = False
    share_inputs(jobs, nj, urow)
    if xg != NULL:
        for j in range(nj):
            split_in = split_in or wants_split(jobs[j].gate, nbD) or wants_split(jobs[j].up, nbD)
    with parallel(num_threads=nt):
        t = threadid()
        for p in prange(npairs, schedule='static'):
            jp = job_of(jobs, nj, p, False)
            J = &jobs[jp]
            r = p - J.row0
            if J.src == jp:         # else an earlier job quantizes these rows
                quant_row(x + <Py_ssize_t>urow[p] * D, D, blkD, idot,
                          xq + J.x0 + <Py_ssize_t>r * D, xs + J.xs0 + <Py_ssize_t>r * nbD,
                          xq + J.x0 + <Py_ssize_t>(J.nr + r) * D, xs + J.xs0 + <Py_ssize_t>(J.nr + r) * nbD,
                          xr + t * xr_stride, (xm + J.xs0 + <Py_ssize_t>r * nbD) if xm != NULL else NULL,
                          (xm + J.xs0 + <Py_ssize_t>(J.nr + r) * nbD) if xm != NULL else NULL)
                if split_in:
                    split_rows(xq + J.x0 + <Py_ssize_t>r * D, 1, D, xg + J.xg0 + r * xgs, xgs)
                    if idot == IDOT_Q8X2:
                        split_rows(xq + J.x0 + <Py_ssize_t>(J.nr + r) * D, 1, D, xg + J.xg0 + (J.nr + r) * xgs,
                                   xgs)
        for w in prange(nwork, schedule='guided', chunksize=GUIDED_MIN):
            J = &jobs[job_of(jobs, nj, w, True)]
            X = &jobs[J.src]
            k = w - J.w0
            if k < n_groups(J.I):
                int_group(J.gate, k, J.nr, xq + X.x0, xs + X.xs0, nbD, blkD, idot, g + J.h0,
                          (xm + X.xs0) if xm != NULL else NULL, (xg + X.xg0) if xg != NULL else NULL, xgs)
            else:
                int_group(J.up, k - n_groups(J.I), J.nr, xq + X.x0, xs + X.xs0, nbD, blkD, idot, u + J.h0,
                          (xm + X.xs0) if xm != NULL else NULL, (xg + X.xg0) if xg != NULL else NULL, xgs)
        for p in prange(npairs, schedule='static'):
            J = &jobs[job_of(jobs, nj, p, False)]
            r = p - J.row0
            for i in range(J.I):
                g[J.h0 + <Py_ssize_t>r * J.I + i] = silu(g[J.h0 + <Py_ssize_t>r * J.I + i]) * u[J.h0 + <Py_ssize_t>r * J.I + i]
            quant_row(g + J.h0 + <Py_ssize_t>r * J.I, J.I, J.blkI, idot,
                      hq + J.hq0 + <Py_ssize_t>r * J.I, hs + J.hs0 + <Py_ssize_t>r * J.nbI,
                      hq + J.hq0 + <Py_ssize_t>(J.nr + r) * J.I, hs + J.hs0 + <Py_ssize_t>(J.nr + r) * J.nbI,
                      xr + t * xr_stride, (hm + J.hs0 + <Py_ssize_t>r * J.nbI) if hm != NULL else NULL,
                      (hm + J.hs0 + <Py_ssize_t>(J.nr + r) * J.nbI) if hm != NULL else NULL)
            if hg != NULL and wants_split(J.down, J.nbI):
                split_rows(hq + J.hq0 + <Py_ssize_t>r * J.I, 1, J.I, hg + J.hg0 + r * hgs, hgs)
                if idot == IDOT_Q8X2:
                    split_rows(hq + J.hq0 + <Py_ssize_t>(J.nr + r) * J.I, 1, J.I, hg + J.hg0 + (J.nr + r) * hgs, hgs)
        # down rows job by job (one weight stream at a time: interleaving the jobs' streams ran
        # ~20% slower from RAM), then the sums over the jobs in job order
        for w in prange(nj * n_groups(D), schedule='guided', chunksize=GUIDED_MIN):
            J = &jobs[w // n_groups(D)]
            int_group(J.down, w % n_groups(D), J.nr, hq + J.hq0, hs + J.hs0, J.nbI, J.blkI, idot, yd + J.y0,
                      (hm + J.hs0) if hm != NULL else NULL, (hg + J.hg0) if hg != NULL else NULL, hgs)
        if accumulate:
            for i in prange(n_col_blocks(D), schedule='static'):
                add_ffn_outputs(jobs, NULL, nj, urow, uw, False, D, yd, out, i)


cdef void ffn_accumulate(const FfnJob *jobs, const int *order, int nj, const int *urow, const float *uw,
                         int D, const float *yd, float *out, int nt) noexcept nogil:
    """out[urow[p], :] += uw[p] · y_p for the pairs of jobs order[0], order[1], ... in that order
    (pairs by their place in urow / uw): ffn_group's accumulation, for an MoE call computed as two
    groups (the experts present first, those read from disk meanwhile after), so the sum is the
    one a single group makes, bit for bit."""
    cdef int i
    for i in prange(n_col_blocks(D), schedule='static', nogil=True, num_threads=nt):
        add_ffn_outputs(jobs, order, nj, urow, uw, True, D, yd, out, i)


cdef enum:
    COL_BLOCK = 64      # output columns per work item of the FFN sums (add_ffn_outputs)


cdef inline int n_col_blocks(int D) noexcept nogil:
    return (D + COL_BLOCK - 1) // COL_BLOCK


cdef inline void add_ffn_outputs(const FfnJob *jobs, const int *order, int nj, const int *urow,
                                 const float *uw, bint absolute, int D, const float *yd, float *out,
                                 int b) noexcept nogil:
    """Columns COL_BLOCK·b .. of out[urow[p], :] += uw[p] · y_p for the pairs of jobs order[0],
    order[1], ... (order NULL: 0, 1, ...), pairs counted from J.pabs (absolute) or J.row0. Each
    output element gets the same float additions in the same order (pair by pair) whatever the
    blocking; the running sums of a block stay in acc [COL_BLOCK] while consecutive pairs add into
    the same row (decode: all of them), and the inner loops run over contiguous columns."""
    cdef float acc[COL_BLOCK]
    cdef int j, r, p, k, row = -1, i0 = b * COL_BLOCK
    cdef int n = D - i0 if D - i0 < COL_BLOCK else COL_BLOCK
    cdef float w
    cdef const float *y
    cdef const FfnJob *J
    for j in range(nj):
        J = &jobs[order[j] if order != NULL else j]
        p = J.pabs if absolute else J.row0
        for r in range(J.nr):
            if urow[p + r] != row:
                if row >= 0:
                    memcpy(out + <Py_ssize_t>row * D + i0, acc, n * sizeof(float))
                row = urow[p + r]
                memcpy(acc, out + <Py_ssize_t>row * D + i0, n * sizeof(float))
            w = uw[p + r]
            y = yd + J.y0 + <Py_ssize_t>r * D + i0
            for k in range(n):
                acc[k] = acc[k] + w * y[k]
    if row >= 0:
        memcpy(out + <Py_ssize_t>row * D + i0, acc, n * sizeof(float))


cdef void add_pair_rows(const float *Y, const int *urow, const float *uw, int npairs, int D,
                        float *out, int nt) noexcept nogil:
    """out[urow[p], :] += uw[p] · Y[p, :] for p = 0, 1, ... in that order: the float additions
    add_ffn_outputs makes for the same pairs (routed experts computed elsewhere, _moe_remote)."""
    cdef int b, p, k, i0, n
    cdef float w
    for b in prange(n_col_blocks(D), schedule='static', nogil=True, num_threads=nt):
        i0 = b * COL_BLOCK
        n = D - i0 if D - i0 < COL_BLOCK else COL_BLOCK
        for p in range(npairs):
            w = uw[p]
            for k in range(n):
                out[<Py_ssize_t>urow[p] * D + i0 + k] = out[<Py_ssize_t>urow[p] * D + i0 + k] + \
                    w * Y[<Py_ssize_t>p * D + i0 + k]


cdef class FfnScratch:
    """Buffers of a fused FFN group: up to max_jobs FFNs over max_pairs (FFN, row) pairs."""
    cdef FfnJob *jobs
    cdef public int max_jobs, max_pairs, D, I
    # P = max_pairs; per pair two quantized rows (q1, q2) of its input (width D) and hidden (width I)
    cdef public object xq, xs                   # int8, f32 [2·P·D] quantized inputs, their scales
    cdef public object g, u                     # f32 [P·I] gate / up outputs
    cdef public object hq, hs                   # int8, f32 [2·P·I] quantized hidden rows, their scales
    cdef public object yd                       # f32 [P·D] down outputs
    cdef public object xr                       # f32 [nt, max(D, I)] per-thread residual rows
    cdef public object urow, uw                 # int32, f32 [P] each pair's row and weight
    cdef public object xm, hm                   # int32 [2·P·D], [2·P·I] block sums of xq / hq
    cdef public object xg, hg                   # uint8 [2·P·xgs], [2·P·hgs] split forms (split_room)
    # raw pointers into the arrays above (kept alive by this object): no buffer acquisition per call
    cdef int8_t *p_xq
    cdef int8_t *p_hq
    cdef float *p_xs
    cdef float *p_g
    cdef float *p_u
    cdef float *p_hs
    cdef float *p_yd
    cdef float *p_xr
    cdef float *p_uw
    cdef int *p_urow
    cdef int32_t *p_xm
    cdef int32_t *p_hm
    cdef uint8_t *p_xg
    cdef uint8_t *p_hg
    cdef Py_ssize_t xr_stride, xgs, hgs

    def __cinit__(self, int max_jobs, int max_pairs, int D, int I, int nt):
        self.jobs = <FfnJob *>malloc(max_jobs * sizeof(FfnJob))
        if self.jobs == NULL:
            raise MemoryError()
        self.max_jobs, self.max_pairs, self.D, self.I = max_jobs, max_pairs, D, I
        self.xq = np.zeros(2 * max_pairs * D, np.int8)
        self.xs = np.zeros(2 * max_pairs * D, np.float32)
        self.g = np.zeros(max_pairs * I, np.float32)
        self.u = np.zeros(max_pairs * I, np.float32)
        self.hq = np.zeros(2 * max_pairs * I, np.int8)
        self.hs = np.zeros(2 * max_pairs * I, np.float32)
        self.xm = np.zeros(2 * max_pairs * D, np.int32)       # block sums of xq / hq (same layout as xs / hs)
        self.hm = np.zeros(2 * max_pairs * I, np.int32)
        self.xgs, self.hgs = coli_split_len(D), coli_split_len(I)   # split rows of xq / hq (split_room)
        self.yd = np.zeros(max_pairs * D, np.float32)
        self.xr = np.zeros((max(nt, 1), max(D, I)), np.float32)
        self.urow = np.zeros(max_pairs, np.int32)
        self.uw = np.zeros(max_pairs, np.float32)
        cdef int8_t[::1] xq = self.xq, hq = self.hq
        cdef float[::1] xs = self.xs, g = self.g, u = self.u, hs = self.hs, yd = self.yd, uw = self.uw
        cdef float[:, ::1] xr = self.xr
        cdef int[::1] urow = self.urow
        cdef int32_t[::1] xm = self.xm, hm = self.hm
        self.p_xq, self.p_hq, self.p_xs, self.p_g, self.p_u = &xq[0], &hq[0], &xs[0], &g[0], &u[0]
        self.p_hs, self.p_yd, self.p_xr, self.p_uw, self.p_urow = &hs[0], &yd[0], &xr[0, 0], &uw[0], &urow[0]
        self.p_xm, self.p_hm = &xm[0], &hm[0]
        self.xr_stride = xr.shape[1]
        self.split_room()

    def split_room(self):
        """Allocate the room for the split forms of the quantized inputs and hidden rows (read by
        int4 matrices' tiles; made when the scratch is)."""
        if self.xg is None:
            self.xg = np.zeros(2 * self.max_pairs * self.xgs, np.uint8)
            self.hg = np.zeros(2 * self.max_pairs * self.hgs, np.uint8)
            self.p_xg = self._data(self.xg)
            self.p_hg = self._data(self.hg)

    @property
    def nbytes(self):
        """Bytes of the scratch's arrays (what ffn_scratch_bytes predicts)."""
        return sum(a.nbytes for a in (self.xq, self.xs, self.g, self.u, self.hq, self.hs, self.yd, self.xr,
                                      self.urow, self.uw, self.xm, self.hm, self.xg, self.hg))

    cdef uint8_t *_data(self, a):
        cdef uint8_t[::1] v = a          # a stays referenced by self: the pointer outlives v
        return &v[0]

    def __dealloc__(self):
        free(self.jobs)


def ffn_scratch_bytes(int pairs, int D, int I, int nt):
    """Bytes of the arrays of FfnScratch(jobs, pairs, D, I, nt) (the RAM plan's fused-group term):
    per pair the quantized inputs and hidden rows with their scales and block sums, the hidden g/u,
    the down outputs, the split forms; per thread a residual row."""
    return (pairs * (22 * D + 26 * I + 8 + 2 * coli_split_len(D) + 2 * coli_split_len(I))
            + 4 * max(nt, 1) * max(D, I))


cdef inline bint int_qt(QT W, int idot):
    return W is not None and idot != IDOT_FLOAT and (W.c.fmt == FMT_I8 or W.c.fmt == FMT_I4)


cdef inline bint fusable_c(const QTc *W, int idot) noexcept nogil:
    return W != NULL and idot != IDOT_FLOAT and (W.fmt == FMT_I8 or W.fmt == FMT_I4)


# ---------------------------------------------------------------------------------------------
# 6. Engine state: Layer, Expert, the forward's scratch (Work), KVState; the layers of a forward in C
# ---------------------------------------------------------------------------------------------

class EngineError(RuntimeError):
    """A runtime failure of the engine that names what is at fault (weights, routing, context)."""


# absorb = auto: batches up to this many rows (decode, and a verify of 1 + up to 16 drafts) use the
# absorbed path, so decode and verify compute the same function; longer ones (prefill) the expanded
# one while its kv_b rows stay small. Past ABSORB_KV_BYTES of kv_b rows (64 heads x 448 floats a key
# at GLM-5's widths: ~146 keys), or when the DSA selection runs, they are absorbed too: every
# (row, head) of the expanded path streams its keys' rows of kv_b from memory, while the absorbed
# one reads the latent rows all heads share (GLM-5 slice, 2 threads: 10 vs 17 ms a row and layer
# at ~1500 keys, 9 vs 35 with DSA's 2048 selected keys).
ABSORB_MAX_ROWS = 17
ABSORB_KV_BYTES = 16 << 20
# Router lookahead runs for forwards of up to this many rows (decode and small verify batches).
PILOT_MAX_ROWS = 8
# A long batch's routed experts are read this many at a time, the next group while one is
# multiplied: 2 · 8 = the 16 experts beyond capacity the RAM plan allows a call (budget.py).
STREAM_GROUP = 8
# With COLIBRI_MAP_STREAM=1 (Model.map_stream), prefill forwards of this many rows or more use the
# experts they load in place in the file mapping.
MAP_STREAM_MIN_ROWS = int(switch("MAP_STREAM_ROWS"))
cdef enum:
    DIRECT_ALIGN = 4096     # O_DIRECT: offsets, sizes and buffers aligned to this (logical block size)

# NOTE(HF): transformers builds q_a_layernorm and kv_a_layernorm with the RMSNorm default eps 1e-6;
# glm.c uses rms_norm_eps (1e-5) there. We follow transformers.
LORA_NORM_EPS = 1e-6
# The DSA indexer's k_norm is a LayerNorm with eps 1e-6 in both.
INDEXER_NORM_EPS = 1e-6


cdef class Layer:
    """Resident weights of one decoder layer (index = its KV / expert-cache row)."""
    cdef public int index
    cdef public bint sparse, idx_full
    cdef public object in_ln, post_ln, q_a_ln, kv_a_ln        # f32 [D], [D], [Lq], [Lkv]
    cdef public QT q_a                                       # [Lq, D] attention projections
    cdef public QT q_b                                       # [H·(dn + dr), Lq]
    cdef public QT kv_a                                      # [Lkv + dr, D]
    cdef public QT kv_b                                      # [H·(dn + dv), Lkv]
    cdef public QT o_proj                                    # [D, H·dv]
    cdef public QT gate, up, down                            # dense MLP, or shared expert (None if none):
                                                             # [I, D], [I, D], [D, I]
    cdef public object input_group       # [q_a, kv_a(, wk)] projected in one call, [] if they cannot be; None: not known yet
    cdef public QT router                                    # f32 [E, D]
    cdef public object router_bias                           # f32 [E]
    cdef public QT iwq, iwk, iwp                             # DSA indexer wq_b, wk, weights_proj:
                                                             # [inh·ihd, Lq], [ihd, D], [inh, D]
    cdef public object ik_w, ik_b                            # indexer k_norm weight, bias [index_hd]


cdef class Expert:
    """One routed expert's three matrices, read from disk into one slab, or used in place in the
    container's mapping (``mapped``: its _ExpertLayout; ``slab`` is then a view of the mapping)."""
    cdef public int eid
    cdef public QT gate, up, down       # [I, D], [I, D], [D, I] (I = moe_intermediate_size)
    cdef public object slab             # uint8 [nbytes]: the three payloads
    cdef public long long nbytes
    cdef public object mapped
    cdef object __weakref__             # the slab pool waits for an evicted expert's end (cache.SlabPool)


# A forward of more rows than this runs its attention, dense MLP, shared expert and each routed
# expert's FFN in row chunks of this size (prefill of long prompts): the scratch stays bounded by
# the chunk while each routed expert is still read once per layer (bit-identical to one batch).
PREFILL_CHUNK = int(switch("PREFILL_CHUNK"))


def chunk_rows(int S, int chunk=0):
    """Rows of a forward's attention / FFN chunks: S, or the chunk size (PREFILL_CHUNK when 0;
    at least 32, so a chunk is never a decode-sized batch)."""
    chunk = max(chunk or PREFILL_CHUNK, 32)
    return S if S <= chunk else chunk


def expanded_key_rows(c, int T, int absorb):
    """kv_b rows the expanded attention path may need in a context of T keys (see ABSORB_KV_BYTES)."""
    if absorb == 1:
        return 0
    if absorb == 0:
        return T
    return min(T, max(ABSORB_KV_BYTES // (4 * c.n_heads * (c.qk_nope + c.v_head)), 1))


def work_shapes(c, int S, int T, bint dsa, int kvb_rows, int nt, int chunk=0):
    """The scratch of a forward of S rows over T keys: {name: (shape, numpy dtype)}. Work allocates
    exactly this and the RAM plan (tiers.work_bytes_estimate) sums it: one formula for both.

    Per forward row (S): the layer's normalized input n and MLP output out, the routing, the DSA
    selection (shared layers reuse the rows of the last full layer). Per chunk
    row (C = min(S, chunk)): attention and FFN activations. Per key (T): the attention / indexer
    scores of each thread; the expanded path's kv_b rows (kvb_rows of them, expanded_key_rows)."""
    cdef int C = chunk_rows(S, chunk)
    inter = max(c.dense_inter, c.moe_inter * max(c.n_shared, 1), c.moe_inter)
    widest = max(2 * c.hidden, c.q_lora, c.kv_lora, c.n_heads * c.v_head, inter)   # 2D: eh_proj
    # activation quantization: C rows of the widest input, or T rows of kv_lora (expanded kv_b);
    # scales and block sums: one per 64 inputs at most (act_block is 0 or a multiple of 64)
    act = max(C * widest, kvb_rows * c.kv_lora)
    act_blocks = max(C * ((widest + 63) // 64), kvb_rows * ((c.kv_lora + 63) // 64))
    f4, i4 = np.float32, np.int32
    sh = {
        "n": ((S, c.hidden), f4), "out": ((S, c.hidden), f4),                         # [S, D]
        "rl": ((S, c.n_experts), f4), "rsel": ((S, c.topk), i4), "rw": ((S, c.topk), f4),
        "upos": ((c.n_experts,), i4), "uniq": ((S * c.topk,), i4), "ustart": ((S * c.topk + 1,), i4),
        "urow": ((S * c.topk,), i4), "uw": ((S * c.topk,), f4),
        "a": ((C, c.hidden), f4), "xg": ((C, c.hidden), f4), "yg": ((C, c.hidden), f4),  # [C, D]
        "qr": ((C, c.q_lora), f4), "q": ((C, c.n_heads * c.qk_head), f4),
        "ckv": ((C, c.kv_lora + c.qk_rope), f4), "ctx": ((C, c.n_heads * c.v_head), f4),
        "g": ((C * inter,), f4), "u": ((C * inter,), f4),     # flat: [C, width of the MLP at hand]
        "kvb": ((max(kvb_rows, 1), c.n_heads * (c.qk_nope + c.v_head)), f4),
        # per thread: ATTN_BLOCK heads' two latents and scores (absorbed attention), or a block of
        # ATTN_BLOCK rows' scores (expanded: fewer)
        "tbuf": ((nt, ATTN_BLOCK * (2 * c.kv_lora + max(2 * T, c.qk_nope))), f4),
        "xq": ((2 * act,), np.int8), "xs": ((2 * act_blocks,), f4), "xm": ((2 * act_blocks,), i4),
        "xr": ((widest,), f4),
    }
    if dsa:
        sh.update(ik=((C, c.index_hd), f4), iq=((C, c.index_nh * c.index_hd), f4), iw=((C, c.index_nh), f4),
                  isc=((nt, 2 * T), f4), sel=((S, max(c.index_topk, 1)), i4), nsel=((S,), i4))
    else:
        # Every buffer is bound, even one this model never uses: reading an unbound typed
        # memoryview (even to pass it along as an object) dereferences NULL. The paths that would
        # use these check has_dsa first; a [1, 1] buffer keeps a stray use in bounds.
        sh.update(ik=((1, 1), f4), iq=((1, 1), f4), iw=((1, 1), f4), isc=((1, 1), f4), sel=((1, 1), i4),
                  nsel=((1,), i4))
    return sh


def work_bytes(c, int S, int T, bint dsa, int kvb_rows, int nt, int chunk=0):
    """Bytes of work_shapes(...)."""
    return sum(int(np.prod(shape)) * np.dtype(dt).itemsize
               for shape, dt in work_shapes(c, S, T, dsa, kvb_rows, nt, chunk).values())


cdef class Work:
    """Scratch buffers of one forward: S rows (attention and FFNs in chunks of C), T keys. Sized
    once, reused while they fit."""
    cdef public int S, C, T, widest
    # shapes as work_shapes makes them (C: rows of a chunk; the DSA buffers [1, 1] without DSA)
    cdef public float[:, ::1] n         # [S, D] the layer's normalized input
    cdef public float[:, ::1] a         # [C, D]
    cdef public float[:, ::1] out       # [S, D] the MLP output
    cdef public float[:, ::1] qr        # [C, Lq]
    cdef public float[:, ::1] q         # [C, H·(dn + dr)]
    cdef public float[:, ::1] ckv       # [C, Lkv + dr]
    cdef public float[:, ::1] ctx       # [C, H·dv]
    cdef public float[:, ::1] xg        # [C, D]
    cdef public float[:, ::1] yg        # [C, D]
    cdef public float[:, ::1] rl        # [S, E] router logits
    cdef public float[:, ::1] rw        # [S, K] routing weights
    cdef public float[:, ::1] kvb       # [max(kvb_rows, 1), H·(dn + dv)] kv_b rows (expanded attention)
    cdef public float[:, ::1] tbuf      # [nt, ATTN_BLOCK·(2·Lkv + max(2·T, dn))] per-thread attention scratch
    cdef public float[:, ::1] ik        # [C, ihd] indexer keys
    cdef public float[:, ::1] iq        # [C, inh·ihd] indexer queries
    cdef public float[:, ::1] iw        # [C, inh] indexer head weights
    cdef public float[:, ::1] isc       # [nt, 2·T] indexer key scores (ScoreIdx pairs)
    cdef public float[::1] g            # [C·I] (I: the width of the MLP at hand)
    cdef public float[::1] u            # [C·I]
    cdef public float[::1] xs           # [2·act_blocks] activation scales (see matmul_qt)
    cdef public float[::1] xr           # [widest]
    cdef public float[::1] uw           # [S·K]
    cdef public int8_t[::1] xq          # [2·act] quantized activations
    cdef public int32_t[::1] xm         # [2·act_blocks] their block sums
    cdef public int[:, ::1] sel         # [S, index_topk] DSA selections
    cdef public int[:, ::1] rsel        # [S, K] routed experts
    cdef public int[::1] nsel           # [S] DSA selection counts
    cdef public int[::1] upos           # [E] batch_union's scratch and results
    cdef public int[::1] uniq           # [S·K]
    cdef public int[::1] ustart         # [S·K + 1]
    cdef public int[::1] urow           # [S·K]

    def __init__(self, c, int S, int T, bint dsa, int kvb_rows, int chunk=0):
        shapes = work_shapes(c, S, T, dsa, kvb_rows, max(coli_max_threads(), 1), chunk)
        self.S, self.T = S, T
        self.C = shapes["a"][0][0]
        self.widest = shapes["xr"][0][0]
        for name, (shape, dt) in shapes.items():
            setattr(self, name, np.zeros(shape, dt))


class KVState:
    """The KV state of positions 0 .. n-1 (Model.kv_snapshot / kv_restore): each layer's first
    valid position (kv_start), the MTP head's window (rows mtp_start .. n-1, mtp_start -1: none;
    mtp_next: its first position not yet absorbed) and hlast (the last position's residual row
    [D], or None). ``rows(kind, layer)``: the cache rows the state covers, for colibri.kvstore."""

    def __init__(self, n, kv_start, mtp_start=-1, mtp_next=0, hlast=None):
        self.n, self.kv_start = int(n), list(kv_start)
        self.mtp_start, self.mtp_next, self.hlast = int(mtp_start), int(mtp_next), hlast
        self._model = None

    def rows(self, kind, int layer):
        m = self._model
        start = self.mtp_start if layer == m.cfg.n_layers else 0
        return m.kv_rows(kind, layer, start, self.n)


# -- the layers of a decode / verify forward without Python (layers_step) ---------------------

cdef struct ExpertRef:
    # A resident routed expert's matrices (the engine's mirror of the expert cache's tiers;
    # gate NULL: not resident)
    const QTc *gate
    const QTc *up
    const QTc *down


cdef struct TokenStep:
    # The layers of one decode / verify forward (layers_step); filled by Model._token_step.
    LayerStep *steps                    # [nL] per layer (Model._steps), per-call fields set here
    const int *k0                       # [nL] each layer's KV window start
    int nL, S, pos_base, D, E, K
    float *x                            # [S, D] the residual
    float *out                          # [S, D] the MLP output (Work.out)
    const ExpertRef *etab               # [nL + 1, E] resident experts
    bint moe_c                          # MoE layers may take resident experts in place
    bint handoff                        # every layer's MLP to Python (router lookahead this forward)
    # the fused FFN group's scratch (FfnScratch; P = its max_pairs, W = its hidden width I)
    FfnJob *jobs                        # [max_jobs]
    int8_t *xq                          # [2·P·D]
    int8_t *hq                          # [2·P·W]
    float *xs                           # [2·P·D]
    float *g                            # [P·W]
    float *u                            # [P·W]
    float *hs                           # [2·P·W]
    float *yd                           # [P·D]
    float *xr                           # [nt, xr_stride]
    Py_ssize_t xr_stride, W, xgs, hgs
    int32_t *xm                         # [2·P·D] (NULL: no block sums)
    int32_t *hm                         # [2·P·W] (NULL: no block sums)
    uint8_t *xg                         # [2·P·xgs]
    uint8_t *hg                         # [2·P·hgs]
    int *urow                           # [P]
    float *uw                           # [P]
    int *rec_nu                         # out [nL]: experts of the layer used in place (-1: none)
    int *rec_ids                        # out [nL, rec_stride]: their ids (the batch union)
    Py_ssize_t rec_stride
    int bad                             # out: router NaN row of the layer returned, or -1
    double t_attn, t_moe                # out: seconds in the attention halves / the FFNs


cdef inline void ffn_fields(TokenStep *T, FfnScratch fs) noexcept:
    """T's fused-FFN scratch fields: pointers into fs (which the caller keeps alive)."""
    T.jobs, T.xq, T.hq, T.xs, T.g, T.u = fs.jobs, fs.p_xq, fs.p_hq, fs.p_xs, fs.p_g, fs.p_u
    T.hs, T.yd, T.xr, T.xr_stride, T.W = fs.p_hs, fs.p_yd, fs.p_xr, fs.xr_stride, fs.I
    T.xm = fs.p_xm if BLOCK_SUMS else NULL
    T.hm = fs.p_hm if BLOCK_SUMS else NULL
    T.xg, T.hg, T.xgs, T.hgs, T.urow, T.uw = fs.p_xg, fs.p_hg, fs.xgs, fs.hgs, fs.p_urow, fs.p_uw


cdef inline double now_s() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return ts.tv_sec + 1e-9 * ts.tv_nsec


cdef int mlp_step(TokenStep *T, LayerStep *P, int l) noexcept nogil:
    """T.out = the layer's MLP of P.n as Model.moe / dense_mlp compute it fused: the routed experts
    of the batch union (ascending id, each on its rows and weights), then the shared expert on
    every row; a dense layer its MLP. Returns 1 without computing when an expert is not resident
    (or not fusable): the caller hands the layer's MLP to Python."""
    cdef int S = P.S, D = P.D, u, e, i, nu = P.nu if P.router != NULL else 0, nj = 0, p = 0, nw = 0, nr
    cdef const ExpertRef *R
    cdef double h = 0.0
    if T.handoff:
        return 1
    if P.router != NULL:
        if not T.moe_c:
            return 1
        for u in range(nu):
            R = &T.etab[<Py_ssize_t>l * T.E + P.uniq[u]]
            if not (fusable_c(R.gate, P.idot) and fusable_c(R.up, P.idot) and fusable_c(R.down, P.idot)):
                return 1
    for u in range(nu + (1 if P.gate != NULL else 0)):
        if u < nu:
            R = &T.etab[<Py_ssize_t>l * T.E + P.uniq[u]]
            nr = P.ustart[u + 1] - P.ustart[u]
            for i in range(nr):
                T.urow[p + i] = P.urow[P.ustart[u] + i]
                T.uw[p + i] = P.uw[P.ustart[u] + i]
            nw = fill_job(&T.jobs[nj], R.gate, R.up, R.down, p, 0, nr, nw, D, P.block, T.W, T.xgs, T.hgs)
        else:                           # the shared expert (or the dense MLP): every row, weight 1
            nr = S
            for i in range(nr):
                T.urow[p + i] = i
                T.uw[p + i] = 1.0
            nw = fill_job(&T.jobs[nj], P.gate, P.up, P.down, p, 0, nr, nw, D, P.block, T.W, T.xgs, T.hgs)
        h += <double>nr * T.jobs[nj].I
        p += nr
        nj += 1
    for i in range(S * D):
        T.out[i] = 0.0
    if nj > 0:
        ffn_group(T.jobs, nj, p, nw, P.n, D, T.urow, T.uw, P.block, P.idot, T.xq, T.xs, T.g, T.u, T.hq,
                  T.hs, T.yd, T.xr, T.xr_stride, T.out,
                  1 if 3.0 * h * D < FUSED_MIN_MACS else coli_max_threads(), T.xm, T.hm, True,
                  T.xg, T.xgs, T.hg, T.hgs)
    return 0


cdef int layers_step(TokenStep *T, int l0, int *attn_done) noexcept nogil:
    """Layers l0.. of a forward of T.S rows, each in two parallel regions (attend_step, then the
    fused MLP), without returning to Python: x += attention; x += mlp. Returns the first layer it
    could not finish (T.nL: all done); *attn_done then says whether that layer's attention half
    (and routing) is done, T.bad whether its router saw NaN. Layers finished here record the
    experts they used in place (T.rec_nu, T.rec_ids) for the cache's bookkeeping."""
    cdef int l, i, S = T.S
    cdef LayerStep *P
    cdef double t0
    T.bad = -1
    for l in range(l0, T.nL):
        T.rec_nu[l] = -1
        P = &T.steps[l]
        P.x, P.S, P.pos_base, P.k0 = T.x, S, T.pos_base, T.k0[l]
        P.nt = 1 if <double>S * P.macs_row < PARALLEL_MIN_MACS else coli_max_threads()
        t0 = now_s()
        attend_step(P)
        T.t_attn += now_s() - t0
        attn_done[0] = 1
        if P.bad >= 0:
            T.bad = P.bad
            return l
        t0 = now_s()
        if mlp_step(T, P, l) != 0:
            return l
        T.t_moe += now_s() - t0
        for i in range(S * T.D):
            T.x[i] += T.out[i]
        if P.router != NULL:
            T.rec_nu[l] = P.nu
            for i in range(P.nu):
                T.rec_ids[l * T.rec_stride + i] = P.uniq[i]
    attn_done[0] = 0
    return T.nL


# ---------------------------------------------------------------------------------------------
# 7. Model
# ---------------------------------------------------------------------------------------------

cdef class Model:
    """A loaded glm_moe_dsa model: resident dense weights, streamed experts, KV cache, stats.

    Created by :func:`model_init`. Method names mirror glm.c.
    """
    cdef public object cfg, path, st
    cdef public QT embed, lm_head
    cdef public object final_norm, layers, inv_freq
    cdef public bint has_dsa, has_mtp
    cdef public str indexer_absent                # first DSA indexer tensor the container lacks ("" = none)
    cdef public bint dense_past_topk              # a forward attended densely past index_topk (no indexer)
    cdef public int idot, act_block, absorb, dsa_force, cache_experts, expert_bits, dense_bits
    # KV cache: per layer Lc [max_t, Lkv] (normalized latent), Rc [max_t, dr] (rotated shared key),
    # Ic [max_t, index_hd] (indexer keys, full DSA layers only)
    cdef public object Lc, Rc, Ic
    cdef public object kv_start                   # per KV row: first valid position (MTP row: -1 = empty)
    cdef public int max_t
    # MTP head (layer index n_layers): decoder layer + eh_proj [D, 2D], enorm, hnorm, shared_head.norm
    cdef public Layer mtp
    cdef public QT eh_proj
    cdef public object enorm, hnorm, mtp_norm
    cdef public int mtp_next                      # MTP KV rows kv_start..mtp_next-1 hold true pairs
    # Residual stream (before the final norm) of the last forward: all rows, and the last row
    cdef public object h_all, hlast
    cdef object _span                             # (rows, end position) of the prompt prefill() is forwarding
    cdef object _on_layer                         # prefill()'s per-layer progress hook
    cdef public object mtp_logits                 # draft logits of the last mtp_draft chain
    # Routed experts (colibri/cache.py)
    cdef public object cache                      # ExpertCache: pinned hot-store + per-layer LRU + prefetch
    cdef public bint pilot                        # router-lookahead prefetch of layer L+1's experts
    cdef public bint lookahead_on                 # ... in this iteration (the PrefetchPolicy's choice)
    cdef public object lookahead                  # PrefetchPolicy: prefetch only while it pays
    cdef public bint direct                       # O_DIRECT reads of expert payloads
    cdef public bint mapped                       # container experts used in place in the file mapping
    cdef public bint map_stream                   # ... those a long prefill streams (MAP_STREAM_MIN_ROWS)
    cdef bint _streaming                          # a long prefill's MoE call is loading experts now
    cdef bint _mapped_made                        # ... and at least one has been (_check_mapped)
    cdef object _direct_fds, _io, _slabs, _arena, _expert_layouts, _row_files
    cdef object _gsplit                           # split activation rows for group-scaled int4 (see _split_scratch)
    # Counters
    cdef public long long bytes_read, forwards, decode_forwards, emitted
    cdef readonly object routing                  # None, or the list record_routing() collects: (forward, layer, rows, experts)
    # A verify forward's trailing draft rows may be dropped at an MoE layer whose experts they alone
    # would read from disk (_rows_to_keep): None, or (seconds per expert read, [P(row r's draft and
    # the ones before it accepted), r = 0 .. S-1], seconds an accepted draft saves per MoE layer
    # besides reads); spec_decode sets it around the verify forward (_drop_plan).
    cdef public object drop_plan
    # None, or what computes routed experts in other processes (colibri.cluster: set_remote)
    cdef readonly object remote
    cdef object _ybuf                             # [pairs, D] routed experts' outputs of a remote MoE call
    cdef public long long rows_dropped            # draft rows verify forwards dropped (counter)
    cdef double _row_s                            # a decode row's seconds besides disk waits (EMA)
    cdef public double t_disk, t_attn, t_moe
    cdef public long overlapped_calls   # MoE calls that multiplied present experts during reads
    # Scratch
    cdef Work _ws
    cdef FfnScratch _fs
    cdef public bint fused                        # run MoE / dense MLP calls of <= FUSED_MAX_ROWS rows fused
    cdef public bint overlap                      # multiply present experts while the others are read
    cdef public int prefill_chunk                 # rows of a forward's attention / FFN chunks (PREFILL_CHUNK)
    cdef public int stream_group                  # experts a long batch reads at a time (STREAM_GROUP)
    cdef public bint stepped                      # decode / verify attention halves in one region (attend_step)
    cdef public long stepped_calls                # layer forwards whose attention half took attend_step
    cdef ExpertRef *etab                          # [(n_layers + 1) · E] the resident experts (cache.on_change)
    cdef LayerStep *_steps                        # [n_layers] attend_step fields of each layer (_build_steps)
    cdef object _steps_key                        # (Work, split scratch, Lc, Rc, Ic arrays) _steps was built over
    cdef object _c_layers                         # every layer's weights suit layers_step (None: not known yet)
    cdef object _hbuf                             # the head's activation scratch (_head)
    cdef object _rec                              # experts used in place per layer: (int32 [n_layers], [n_layers, S·K])
    cdef LayerStep *_mstep                        # [1] attend_step fields of the MTP layer (_build_mtp_step)
    cdef object _mstep_key                        # what _mstep was built over (as _steps_key)
    cdef object _dbuf                             # the draft chain's buffers (_chain_buffers)
    cdef DraftChain *_chain                       # [1] the draft chain's fields (_fill_chain)
    cdef object _chain_key                        # (Work, FfnScratch, buffers) _chain points into

    # -- loading -------------------------------------------------------------------------------

    def _load_qt(self, name, int O, int I, int bits):
        """A resident matrix: the container's U8 payload + .qs, or a float tensor kept f32
        (bits >= 16) or quantized at load time with the converter's quantizers."""
        st = self.st
        if name + ".qs" in st:
            info = st.info(name)
            if info.dtype not in ("U8", "I8"):
                raise _st.ContainerError(f"{info.path}: {name} has a .qs scale but dtype {info.dtype}, expected U8")
            W = QT.from_packed(st.read_raw(name, self._arena.take), st.read_f32(name + ".qs"), O, I,
                               f"{info.path}: {name}")
            return W
        w = st.read_f32(name)
        return self._qt_from_float(w, name, O, I, bits)

    def _lay_out(self, QT W):
        """Interleave W's rows for the tiles (QT.interleave) when this model's matmuls read them
        natively: the integer path (idot 1 or 2) on AVX-512 VNNI, and COLIBRI_INTERLEAVE not 0 (A/B
        measurements; the results are the same bit for bit either way). For matrices only the
        integer matmuls read. Returns whether W is laid out so."""
        if not self.lays_out():
            return False
        W.interleave()
        return W.interleaved

    def keeps_evicted(self):
        """Whether experts evicted from the LRU can stay in memory, the cache's kept tier (within
        the RAM plan's page-cache reserve): mapped ones (their pages stay mapped) and ones read
        into buffers from the page cache; not with --direct, whose reads bypass the page cache."""
        return not self.direct

    def lays_out(self):
        """Whether this model interleaves the rows of the matrices only the integer tiles read
        (_lay_out): the integer path (idot 1 or 2) on AVX-512 VNNI, unless COLIBRI_INTERLEAVE=0."""
        return not (self.idot == IDOT_FLOAT or coli_isa_active() != COLI_ISA_AVX512VNNI or
                    switch("INTERLEAVE") == "0")

    def _interleave_resident(self):
        """Lay out for the tiles (_lay_out) the resident matrices that only the integer matmuls
        read: attention's q_a, q_b, kv_a and o_proj, the indexer's projections, the dense MLP and
        shared expert, eh_proj and lm_head (unless it is the embedding). kv_b, whose rows the
        absorbed attention reads one by one, and the embedding keep the container's layout; the
        other ISAs read interleaved rows piece by piece (correct, slower), hence AVX-512 only."""
        layers = list(self.layers) + ([self.mtp] if self.has_mtp else [])
        for L in layers:
            for W in (L.q_a, L.q_b, L.kv_a, L.o_proj, L.iwq, L.iwk, L.iwp, L.gate, L.up, L.down):
                if W is not None:
                    self._lay_out(W)
        if self.lm_head is not self.embed:
            self._lay_out(self.lm_head)
        if self.has_mtp and self.eh_proj is not None:
            self._lay_out(self.eh_proj)

    def _qt_from_float(self, w, name, int O, int I, int bits):
        if tuple(w.shape) != (O, I):
            raise _st.ContainerError(f"{self.path}: tensor {name} has shape {tuple(w.shape)}, expected ({O}, {I})")
        if not np.all(np.isfinite(w)):
            raise _st.ContainerError(f"{self.path}: tensor {name} contains NaN or Inf")
        if bits >= 16:
            return QT.from_f32(w)
        payload, scale, _ = _quant.quantize(w, bits)
        return QT.from_packed(payload, scale, O, I, name)

    def _load_vec(self, name, int n):
        v = self.st.read_f32(name).reshape(-1)
        if v.shape[0] != n:
            raise _st.ContainerError(f"{self.path}: tensor {name} has {v.shape[0]} elements, expected {n}")
        if not np.all(np.isfinite(v)):
            raise _st.ContainerError(f"{self.path}: tensor {name} contains NaN or Inf")
        return np.ascontiguousarray(v, dtype=np.float32)

    def _load_layer(self, int i, sparse=None):
        """Layer i; for the MTP layer (i = n_layers) pass sparse (it has no DSA indexer)."""
        c = self.cfg
        p = f"model.layers.{i}."
        L = Layer()
        L.index = i
        L.sparse = c.sparse[i] if sparse is None else sparse
        db = self.dense_bits if i < c.n_layers else max(self.dense_bits, 8)   # MTP: never below int8
        L.in_ln = self._load_vec(p + "input_layernorm.weight", c.hidden)
        L.post_ln = self._load_vec(p + "post_attention_layernorm.weight", c.hidden)
        a = p + "self_attn."
        L.q_a = self._load_qt(a + "q_a_proj.weight", c.q_lora, c.hidden, db)
        L.q_a_ln = self._load_vec(a + "q_a_layernorm.weight", c.q_lora)
        L.q_b = self._load_qt(a + "q_b_proj.weight", c.n_heads * c.qk_head, c.q_lora, db)
        L.kv_a = self._load_qt(a + "kv_a_proj_with_mqa.weight", c.kv_lora + c.qk_rope, c.hidden, db)
        L.kv_a_ln = self._load_vec(a + "kv_a_layernorm.weight", c.kv_lora)
        L.kv_b = self._load_qt(a + "kv_b_proj.weight", c.n_heads * (c.qk_nope + c.v_head), c.kv_lora, db)
        L.o_proj = self._load_qt(a + "o_proj.weight", c.hidden, c.n_heads * c.v_head, db)
        L.idx_full = bool(self.has_dsa and i < c.n_layers and c.idx_full[i])
        if L.idx_full:
            ix = a + "indexer."
            L.iwq = self._load_qt(ix + "wq_b.weight", c.index_nh * c.index_hd, c.q_lora, db)
            L.iwk = self._load_qt(ix + "wk.weight", c.index_hd, c.hidden, db)
            L.iwp = self._load_qt(ix + "weights_proj.weight", c.index_nh, c.hidden, db)
            L.ik_w = self._load_vec(ix + "k_norm.weight", c.index_hd)
            L.ik_b = self._load_vec(ix + "k_norm.bias", c.index_hd)
        m = p + "mlp."
        if not L.sparse:
            L.gate = self._load_qt(m + "gate_proj.weight", c.dense_inter, c.hidden, db)
            L.up = self._load_qt(m + "up_proj.weight", c.dense_inter, c.hidden, db)
            L.down = self._load_qt(m + "down_proj.weight", c.hidden, c.dense_inter, db)
            return L
        L.router = self._qt_from_float(self.st.read_f32(m + "gate.weight"), m + "gate.weight",
                                       c.n_experts, c.hidden, 32)
        if m + "gate.e_score_correction_bias" in self.st:
            L.router_bias = self._load_vec(m + "gate.e_score_correction_bias", c.n_experts)
        else:
            L.router_bias = np.zeros(c.n_experts, np.float32)
        if c.n_shared > 0:
            si = c.moe_inter * c.n_shared
            L.gate = self._load_qt(m + "shared_experts.gate_proj.weight", si, c.hidden, db)
            L.up = self._load_qt(m + "shared_experts.up_proj.weight", si, c.hidden, db)
            L.down = self._load_qt(m + "shared_experts.down_proj.weight", c.hidden, si, db)
        self._check_expert_tensors(i)
        return L

    def _check_expert_tensors(self, int i):
        """Fail at load time, not mid-generation, if a layer's routed experts are not all there."""
        c = self.cfg
        p = f"model.layers.{i}.mlp.experts."
        for e in range(c.n_experts):
            for m in ("gate_proj", "up_proj", "down_proj"):
                name = f"{p}{e}.{m}.weight"
                if name not in self.st:
                    hint = ""
                    if f"model.layers.{i}.mlp.experts.gate_up_proj" in self.st:
                        hint = (" (this checkpoint stores fused 3-D expert tensors: convert it with "
                                "'python -m colibri convert', which splits them per expert)")
                    raise _st.ContainerError(f"{self.path}: missing tensor {name}{hint}")
                info = self.st.info(name)
                rows, cols = (c.hidden, c.moe_inter) if m == "down_proj" else (c.moe_inter, c.hidden)
                if name + ".qs" in self.st:
                    fmt = fmt_from_nbytes(info.nbytes, rows, cols)
                    if fmt < 0:
                        raise _st.ContainerError(f"{info.path}: {name} has {info.nbytes} bytes, which is no "
                                                 f"int8/int4/int2 packing of [{rows}, {cols}]")
                    qs = self.st.info(name + ".qs")     # per-row or group scales (read per expert later)
                    _quant.scale_group_size(qs.shape, FORMAT_NAMES[fmt], rows, cols, f"{qs.path}: {name}")
                elif tuple(info.shape) != (rows, cols):
                    raise _st.ContainerError(f"{info.path}: tensor {name} has shape {tuple(info.shape)}, "
                                             f"expected ({rows}, {cols})")

    # -- experts -------------------------------------------------------------------------------

    def expert_load(self, int li, int eid, bint own=False):
        """Read expert eid of layer li from disk: one pread when its three payloads are contiguous,
        into a buffer of the slab pool, its matrices then laid out for the tiles (_lay_out), or
        used in place in the file mapping (Model.mapped); own: in memory of its own, never a view
        of the mapping, for an expert that stays resident the whole run (tiers.warm_all).
        Bit-identical results either way."""
        c = self.cfg
        p = f"model.layers.{li}.mlp.experts.{eid}."
        names = [p + m + ".weight" for m in ("gate_proj", "up_proj", "down_proj")]
        shapes = [(c.moe_inter, c.hidden), (c.moe_inter, c.hidden), (c.hidden, c.moe_inter)]
        st = self.st
        self._io.start()
        try:
            E = self._expert_read(li, eid, names, shapes, own)
        finally:
            self._io.stop()
        if E.mapped is None:            # read into a buffer (a mapped expert's rows are the file's)
            for W in (E.gate, E.up, E.down):
                self._lay_out(W)
        return E


    def _expert_read(self, int li, int eid, names, shapes, bint own=False):
        c = self.cfg
        st = self.st
        E = Expert()
        E.eid = eid
        if names[0] + ".qs" in st:
            lay = self._expert_layouts.get((li, eid))
            if lay is None:
                lay = self._expert_layouts[(li, eid)] = _ExpertLayout(st, names)
            if (self.mapped or (self.map_stream and self._streaming)) and not own:
                return self._expert_mapped(eid, lay, names, shapes)
            slab, base = self._read_payloads(lay, own)
            scales = self._read_scales(lay)
            qts = []
            for k in range(3):
                a = base + lay.starts[k]
                qts.append(QT.from_packed(slab[a:a + lay.payloads[k].nbytes], scales[k],
                                          shapes[k][0], shapes[k][1], names[k]))
            E.slab = slab
            E.nbytes = lay.total
        else:
            qts = []
            E.nbytes = 0
            for k in range(3):
                w = st.read_f32(names[k])
                self.bytes_read += st.info(names[k]).nbytes
                bits = self.expert_bits if li < c.n_layers else max(self.expert_bits, 8)   # MTP: >= int8
                W = self._qt_from_float(w, names[k], shapes[k][0], shapes[k][1], bits)
                qts.append(W)
                E.nbytes += W.nbytes
        E.gate, E.up, E.down = qts
        return E

    def _expert_mapped(self, int eid, lay, names, shapes):
        """The expert used in place in the container's read-only mapping: its payloads are views
        of the file's pages, and so are its scales when they are F32 at a 4-byte aligned offset
        (else they are read). Made once per expert and handed out again by later loads; each
        load faults its pages in (``_map_in``), ``_release_expert`` drops them from the RSS."""
        E = lay.expert
        if E is None:
            st = self.st
            self._mapped_made = True
            E = Expert()
            E.eid = eid
            E.nbytes = lay.total
            qts = []
            for k in range(3):
                p, sc = lay.payloads[k], lay.scales[k]
                if sc.dtype == "F32" and sc.offset % 4 == 0:
                    scale = st.map(sc.file_index)[sc.offset:sc.offset + sc.nbytes].view(np.float32).reshape(sc.shape)
                else:
                    scale = st.read_f32(sc.name)
                E.nbytes += sc.nbytes
                qts.append(QT.from_packed(st.map(p.file_index)[p.offset:p.offset + p.nbytes], scale,
                                          shapes[k][0], shapes[k][1], names[k]))
            E.gate, E.up, E.down = qts
            first = lay.payloads[lay.order[0]]
            E.slab = st.map(first.file_index)[first.offset:first.offset + lay.total] if lay.contiguous else None
            E.mapped = lay
            lay.map_spans(st)
            lay.expert = E
        _map_in(lay.spans, lay)
        self.bytes_read += E.nbytes
        return E

    def mapped_experts_used(self):
        """Whether some expert has been used in place in the file mapping (Model.mapped, or a long
        prefill's streamed experts, Model.map_stream)."""
        return bool(self._mapped_made)

    def _release_expert(self, E):
        """on_evict hook of the expert cache: a mapped expert's pages leave the process's RSS (they
        stay in the page cache; a later use faults them back in, so this is safe at any time, even
        while a forward still multiplies with it); a read expert's buffer goes back to the pool."""
        if getattr(E, "mapped", None) is not None:
            _map_out((<Expert>E).mapped.drops)
        else:
            self._slabs.recycle(E)

    def _check_mapped(self, int li):
        """guard of the expert cache, before a call on row li (-1: any row) hands out experts: the
        files its mapped experts live in must still hold every mapped byte (a page cut off a mapped
        file would fault with SIGBUS in the middle of a matmul instead of raising). Nothing to check
        while no expert has been used in place (every one read at start-up, or with pread)."""
        if not self._mapped_made:
            return
        files = self._row_files.get(li)
        if files is None and li < 0:
            files = self._row_files[li] = list(range(len(self.st.paths)))
        elif files is None:
            p = f"model.layers.{li}.mlp.experts."
            files = sorted({self.st.info(f"{p}{e}.{m}.weight{x}").file_index for e in range(self.cfg.n_experts)
                            for m in ("gate_proj", "up_proj", "down_proj") for x in ("", ".qs")
                            if f"{p}{e}.{m}.weight{x}" in self.st})
            self._row_files[li] = files
        for fi in files:
            need = self.st.mapped_size(fi)
            if need:
                size = os.fstat(self.st.fileno(fi)).st_size
                if size < need:
                    raise _st.ContainerError(
                        f"{self.st.paths[fi]}: short read: the file now has {size} of the {need} bytes "
                        "it had when mapped; it was truncated or changed while running")

    def _read_payloads(self, lay, bint own=False):
        """An expert's three payloads into one buffer of the slab pool (own: of the arena of
        experts that stay for the whole run): (buffer, where the first payload in file order
        starts in it); lay.starts place the others. One pread when they are contiguous (the
        container's layout), O_DIRECT when --direct."""
        cdef Py_ssize_t at
        if lay.contiguous and self.direct:
            return self._pread_direct(lay.payloads[lay.order[0]], lay.total, lay.payloads[lay.order[0]].offset)
        slab = self._arena.take(lay.total) if own else self._slabs.take(lay.total)
        if lay.contiguous:
            self._pread(lay.payloads[lay.order[0]], slab, lay.payloads[lay.order[0]].offset)
            return slab, 0
        at = 0
        for k in lay.order:
            self._pread(lay.payloads[k], slab[at:at + lay.payloads[k].nbytes], lay.payloads[k].offset)
            at += lay.payloads[k].nbytes
        return slab, 0

    def _read_scales(self, lay):
        """The three F32 scale vectors: one pread of their common range when they are adjacent
        in one file (they are in the container: down, gate, up in name order), else one each."""
        st = self.st
        if lay.scale_span is None:
            out = [st.read_f32(i.name) for i in lay.scales]
            self.bytes_read += sum(i.nbytes for i in lay.scales)
            return out
        first, nbytes = lay.scale_span
        raw = np.empty(nbytes // 4, np.float32)
        self._pread(first, raw.view(np.uint8), first.offset)
        return [raw[(i.offset - first.offset) // 4:(i.offset - first.offset + i.nbytes) // 4] for i in lay.scales]

    def _pread_direct(self, info, Py_ssize_t nbytes, long long offset):
        """nbytes at offset with O_DIRECT (no page cache): the aligned superset is read into an
        aligned buffer taken from the slab pool (sized to a whole number of blocks plus one, so
        experts of one size share buffers); returns (buffer, where the wanted bytes start)."""
        fd = self._direct_fds.get(info.file_index)
        if fd is None:
            try:
                fd = os.open(info.path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
            except OSError as e:
                raise _st.ContainerError(f"{info.path}: cannot open with O_DIRECT ({e.strerror}); "
                                         "run without --direct") from None
            self._direct_fds[info.file_index] = fd
        cdef long long a0 = offset & ~(DIRECT_ALIGN - 1)
        cdef long long a1 = (offset + nbytes + DIRECT_ALIGN - 1) & ~(DIRECT_ALIGN - 1)
        raw = self._slabs.take(((nbytes + DIRECT_ALIGN - 1) // DIRECT_ALIGN + 2) * DIRECT_ALIGN)
        shift = (-raw.ctypes.data) % DIRECT_ALIGN
        buf = raw[shift:shift + (a1 - a0)]
        try:
            n = os.preadv(fd, [memoryview(buf)], a0)
        except OSError as e:
            raise _st.ContainerError(f"{info.path}: O_DIRECT read of {info.name} failed ({e.strerror}); "
                                     "run without --direct") from None
        if n < offset + nbytes - a0:
            raise _st.ContainerError(f"{info.path}: short read of {info.name} ({n} of {a1 - a0} bytes); "
                                     "the file was truncated or changed while running")
        self.bytes_read += nbytes
        return raw, shift + (offset - a0)

    def _pread(self, info, buf, long long offset):
        fd = self.st.fileno(info.file_index)
        n = os.preadv(fd, [memoryview(buf)], offset)
        if n != buf.shape[0]:
            raise _st.ContainerError(f"{info.path}: short read of {info.name} ({n} of {buf.shape[0]} bytes); "
                                     "the file was truncated or changed while running")
        self.bytes_read += n

    def expert_get(self, int li, int eid):
        """Expert eid of layer li from the expert cache (pinned, LRU, or loaded)."""
        return self.cache.get(li, [eid])[0]

    property expert_hits:
        """Experts found in memory (pinned, cached, kept mapped, or being loaded by a prefetch)."""
        def __get__(self):
            s = self.cache.stats
            return s["hits_pin"] + s["hits_lru"] + s["hits_kept"] + s["prefetch_waits"] + s["inflight_waits"]

    property expert_misses:
        """Experts a forward had to read from disk itself."""
        def __get__(self):
            return self.cache.miss_count()

    def io_stats(self):
        """Disk figures: bytes read (mapped experts: the bytes their loads faulted in), seconds with
        at least one read in flight, read GB/s."""
        busy = self._io.busy_s()
        return {"bytes_read": int(self.bytes_read), "disk_busy_s": busy,
                "read_gb_s": (self.bytes_read / busy / 1e9) if busy > 0 else 0.0,
                "buffers_reused": self._slabs.reused}

    # -- KV ------------------------------------------------------------------------------------

    def kv_bytes(self, max_t):
        """Bytes of a KV cache of max_t positions (latent + rope key per layer and MTP row, plus
        the indexer keys of full DSA layers)."""
        c = self.cfg
        nrows = c.n_layers + (1 if self.has_mtp else 0)
        per_pos = sum(4 * (c.kv_lora + c.qk_rope + (c.index_hd if (self.has_dsa and c.idx_full[i]) else 0))
                      for i in range(c.n_layers)) + (nrows - c.n_layers) * 4 * (c.kv_lora + c.qk_rope)
        return per_pos * int(max_t)

    def kv_alloc(self, max_t):
        """(Re)allocate the KV cache for max_t positions."""
        c = self.cfg
        max_t = int(max_t)
        if max_t > 2 ** 31 - 1:
            raise ValueError(f"a context of {max_t} positions is beyond any supported size")
        if max_t < 1:
            raise ValueError(f"context of {max_t} positions")
        if c.max_positions and max_t > c.max_positions + 64:
            raise ValueError(f"context of {max_t} positions exceeds max_position_embeddings = {c.max_positions}")
        nrows = c.n_layers + (1 if self.has_mtp else 0)
        per_pos = self.kv_bytes(1)
        try:
            phys = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            phys = 0
        if phys and per_pos * max_t > phys:
            raise ValueError(f"a KV cache of {max_t} positions needs {per_pos * max_t / 2**30:.1f} GiB, "
                             f"more than this machine's {phys / 2**30:.1f} GiB of memory")
        self.max_t = max_t
        self.Lc = [np.zeros((max_t, c.kv_lora), np.float32) for _ in range(nrows)]
        self.Rc = [np.zeros((max_t, c.qk_rope), np.float32) for _ in range(nrows)]
        self.kv_start = [0] * c.n_layers + [-1] * (nrows - c.n_layers)
        self.mtp_next = 0
        self.Ic = [np.zeros((max_t, c.index_hd), np.float32) if (self.has_dsa and c.idx_full[i]) else None
                   for i in range(c.n_layers)]

    # -- KV snapshot / restore (colibri.kvstore writes them to a file) -------------------------

    def kv_snapshot(self, int n):
        """The KV state of positions 0 .. n-1, as views of the cache (no copy; valid until the next
        forward): a KVState whose ``rows(kind, layer)`` are what a restore must write back."""
        c = self.cfg
        NL = int(c.n_layers)
        if n and (self.Lc is None or n > self.max_t):
            raise ValueError(f"a history of {n} tokens but the KV cache holds "
                             f"{self.max_t if self.Lc is not None else 0} positions")
        st = KVState(n, [int(self.kv_start[i]) for i in range(NL)] if self.Lc is not None else [0] * NL)
        if self.has_mtp and self.Lc is not None:
            st.mtp_next = min(int(self.mtp_next), n)
            a = int(self.kv_start[NL])
            # rows a .. n-1: the valid window a .. mtp_next-1 plus the rows below n that a later pass
            # of the MTP head could read before rewriting them, so the restored state equals the saved
            # one at every position < n
            if 0 <= a < n:
                st.mtp_start = a
        if self.hlast is not None and n > 0:
            st.hlast = np.ascontiguousarray(np.asarray(self.hlast, np.float32).reshape(-1))
            if st.hlast.size != c.hidden:
                raise ValueError(f"hlast has {st.hlast.size} elements, expected {c.hidden}")
        st._model = self
        return st

    def kv_index_layers(self):
        """The layers whose DSA indexer keys the KV cache keeps (as kv_alloc allocates them)."""
        c = self.cfg
        if self.Ic is not None:
            return [i for i in range(c.n_layers) if self.Ic[i] is not None]
        return [i for i in range(c.n_layers) if self.has_dsa and c.idx_full[i]]

    def kv_rows(self, kind, int layer, int start, int n):
        """The cache rows start .. n-1 of ``kind`` ('Lc', 'Rc' or 'Ic') at ``layer`` (the MTP head
        is layer n_layers): a writable view for a restore to fill."""
        arrs = {"Lc": self.Lc, "Rc": self.Rc, "Ic": self.Ic}.get(kind)
        if arrs is None or not 0 <= layer < len(arrs) or arrs[layer] is None:
            raise ValueError(f"the KV cache has no {kind} rows at layer {layer}")
        if not 0 <= start <= n <= self.max_t:
            raise ValueError(f"KV rows {start}..{n} outside the cache of {self.max_t} positions")
        return arrs[layer][start:n]

    def kv_reserve(self, int need):
        """A KV cache of at least ``need`` positions (grown, emptied, when smaller)."""
        if self.Lc is None or self.max_t < need:
            self.kv_alloc(max(self.max_t or 0, need))

    def kv_clear(self):
        """Every KV row invalid (a restore that failed half-way)."""
        self.kv_alloc(self.max_t)

    def kv_restore(self, st):
        """Install a restored state's positions and MTP window (its rows already written through
        kv_rows); the last forward's residual rows are dropped (they belong to no position now)."""
        c = self.cfg
        NL = int(c.n_layers)
        if len(st.kv_start) != NL:
            raise ValueError(f"kv_start has {len(st.kv_start)} entries, the model {NL} layers")
        kv_start = list(self.kv_start)
        kv_start[:NL] = [int(v) for v in st.kv_start]
        if self.has_mtp:
            kv_start[NL] = int(st.mtp_start)          # -1: no saved window, the head starts afresh
            self.mtp_next = int(st.mtp_next)
        self.kv_start = kv_start
        self.hlast = st.hlast
        self.h_all = None          # a stale prefill's residual rows must not feed the MTP catch-up

    # -- scratch -------------------------------------------------------------------------------

    def _work(self, int S, int T):
        """Scratch buffers for a forward of S rows over T keys (kept while the sizes fit)."""
        cdef Work ws = self._ws
        if ws is not None and S <= ws.S and T <= ws.T and coli_max_threads() <= ws.tbuf.shape[0] and \
                ws.C == chunk_rows(ws.S, self.prefill_chunk):
            return ws
        if ws is not None:
            S = max(S, ws.S)
            T = max(T, ws.T)
        T = max(T, self.max_t)          # size for the whole context at once: decode grows T by 1
        ws = Work(self.cfg, S, T, self.has_dsa, expanded_key_rows(self.cfg, T, self.absorb), self.prefill_chunk)
        self._ws = ws
        return ws

    def _split_scratch(self, int S, int I):
        """Room for the split forms of 2·S activation rows of width I (int4 matmuls, coli_split_q8),
        grown as needed and kept."""
        n = 2 * S * coli_split_len(I)
        if self._gsplit is None or self._gsplit.shape[0] < n:
            self._gsplit = np.zeros(n, np.uint8)
        return self._gsplit

    cdef int _mm(self, QT W, const float *x, int S, float *y, Work ws) except -1:
        """y[S, O] = x[S, I] · Wᵀ with the GIL released; the scratch must hold S rows of W's width."""
        cdef uint8_t[::1] gb
        cdef uint8_t *xg = NULL
        if 2 * <Py_ssize_t>S * W.c.I > ws.xq.shape[0] or W.c.I > ws.xr.shape[0] or \
                2 * <Py_ssize_t>S * act_nblocks(W.c.I, self.act_block) > ws.xs.shape[0]:
            raise EngineError(f"matmul of {S} rows x {W.c.I} inputs exceeds the activation scratch "
                              f"({ws.xq.shape[0] // 2} values)")
        if W.c.fmt == FMT_I4:
            gb = self._split_scratch(S, W.c.I)
            xg = &gb[0]
        with nogil:
            matmul_qt(&W.c, x, S, y, &ws.xq[0], &ws.xs[0], &ws.xr[0], self.act_block, self.idot,
                      &ws.xm[0] if BLOCK_SUMS else NULL, xg)
        return 0

    cdef int _mm_many(self, list Ws, const float *x, int S, list outs, Work ws) except -1:
        """outs[k][S, O_k] = x · Ws[k]ᵀ for integer matrices of one input width, in one region
        (matmul_many); outs are float32 [S', O_k] arrays with S' >= S."""
        cdef const QTc *cs[MANY_MAX]
        cdef float *ys[MANY_MAX]
        cdef float[:, ::1] o
        cdef uint8_t[::1] gb
        cdef int k, nW = len(Ws)
        if not 0 < nW <= MANY_MAX or len(outs) != nW:
            raise EngineError("matmul_many: 1 to 4 matrices, one output each")
        for k in range(nW):
            W = <QT>Ws[k]
            o = outs[k]
            if W.c.I != (<QT>Ws[0]).c.I or not int_qt(W, self.idot) or o.shape[0] < S or o.shape[1] < W.c.O:
                raise EngineError("matmul_many: matrices of one input width, integer formats, outputs that fit")
            cs[k] = &(<QT>Ws[k]).c
            ys[k] = &o[0, 0]
        if 2 * <Py_ssize_t>S * cs[0].I > ws.xq.shape[0] or cs[0].I > ws.xr.shape[0] or \
                2 * <Py_ssize_t>S * act_nblocks(cs[0].I, self.act_block) > ws.xs.shape[0]:
            raise EngineError(f"matmul of {S} rows x {cs[0].I} inputs exceeds the activation scratch")
        cdef uint8_t *xg = NULL
        if any((<QT>W).c.fmt == FMT_I4 for W in Ws):
            gb = self._split_scratch(S, cs[0].I)
            xg = &gb[0]
        with nogil:
            matmul_many(cs, ys, nW, x, S, &ws.xq[0], &ws.xs[0], &ws.xr[0], self.act_block, self.idot,
                        &ws.xm[0] if BLOCK_SUMS else NULL, xg)
        return 0

    # -- forward -------------------------------------------------------------------------------

    def embed_row(self, int tok, out):
        """out[D] = embedding row of tok (dequantized)."""
        cdef float[::1] o = out
        cdef QTc *E = &self.embed.c
        if not 0 <= tok < E.O:
            raise ValueError(f"token id {tok} is outside the vocabulary [0, {E.O})")
        memset(&o[0], 0, E.I * sizeof(float))
        qt_addrow(E, tok, 1.0, &o[0])

    def attention(self, Layer L, float[:, ::1] n, int S, int pos_base, float[:, ::1] out, Work ws,
                  int path=-1, int kvb_from=0, int row0=0):
        """MLA attention with the compressed KV cache (glm.c's attention). n [S, D] -> out [S, D], S <= ws.C.
        path: 1 absorbed, 0 expanded, -1 decided here (absorbed_path); a chunk of a longer forward
        gets the forward's, so every row computes the same function as in one batch.
        kvb_from: the expanded path's kv_b rows below it are already in ws.kvb (earlier chunks);
        row0: the chunk's first row in the forward, where its rows of the DSA selection (ws.sel,
        which shared layers reuse) live."""
        c = self.cfg
        if S > ws.C:
            raise EngineError(f"attention of {S} rows exceeds the scratch's chunk of {ws.C} rows")
        cdef int H = c.n_heads, dn = c.qk_nope, dr = c.qk_rope, dv = c.v_head, dq = c.qk_head
        cdef int Lq = c.q_lora, Lkv = c.kv_lora, T = pos_base + S
        cdef int s, h, pos, nblk
        cdef float eps = LORA_NORM_EPS
        cdef float[:, ::1] qr = ws.qr, q = ws.q, ctx = ws.ctx
        cdef float[:, ::1] Lc = self.Lc[L.index], Rc = self.Rc[L.index]
        cdef float[::1] qa_ln = L.q_a_ln, inv = self.inv_freq
        # Step 1: projections of the new rows; write their latent + rotated key into the cache.
        cdef bint sparse = self.has_dsa and L.index < c.n_layers
        if T > c.index_topk and self.indexer_absent:
            self.dense_past_topk = True
        if L.input_group is None:
            self._input_group(L, sparse)
        cdef bint together = len(L.input_group) > 0
        if together:
            outs = [ws.qr, ws.ckv, ws.ik] if len(L.input_group) == 3 else [ws.qr, ws.ckv]
            self._mm_many(L.input_group, &n[0, 0], S, outs, ws)
        else:
            self._mm(L.q_a, &n[0, 0], S, &qr[0, 0], ws)
        self.kv_write(L, n, S, pos_base, ws, together)
        with nogil:
            for s in range(S):
                rmsnorm_row(&qr[s, 0], &qr[s, 0], &qa_ln[0], Lq, eps)
        self._mm(L.q_b, &qr[0, 0], S, &q[0, 0], ws)
        with nogil:
            for s in range(S):
                pos = pos_base + s
                for h in range(H):
                    rope_interleave(&q[s, h * dq + dn], dr, pos, &inv[0])
        # Step 2: DSA lightning indexer (full layers select, shared layers reuse the last selection).
        # The MTP layer (index n_layers) has no indexer: it attends densely over its window k0..pos.
        cdef int k0 = self.kv_start[L.index]
        if k0 < 0 or k0 > pos_base:
            raise EngineError(f"layer {L.index}: KV window starts at {k0}, after position {pos_base}")
        if sparse and L.idx_full:
            self._dsa_select(L, n, S, pos_base, ws, together, row0)
        if sparse and row0 + S > ws.sel.shape[0]:
            raise EngineError(f"DSA selection rows {row0}..{row0 + S - 1} exceed the scratch")
        cdef int *sel = &ws.sel[row0, 0] if sparse else NULL
        cdef int *nsel = &ws.nsel[row0] if sparse else NULL
        cdef int topk = ws.sel.shape[1]
        # Step 3: attention, absorbed (latent space) or expanded (kv_b applied to every cached row).
        cdef bint absorbed = self.absorbed_path(S, T) if path < 0 else path == 1
        cdef float[:, ::1] tbuf = ws.tbuf, kvb
        cdef float scale = c.attn_scale
        cdef QTc *kv_b = &L.kv_b.c
        cdef int nta = 1 if <double>S * H * T * (Lkv + dr) < PARALLEL_MIN_MACS else coli_max_threads()
        # (row, head) items dynamically: a causal row attends to as many keys as its position, so
        # equal halves of the rows would leave the first thread a third of the second one's work
        if absorbed:
            if tbuf.shape[1] < ATTN_BLOCK * (2 * Lkv + max(2 * T, dn)):
                raise EngineError("absorbed attention's per-thread scratch too small")
            nblk = (H + ATTN_BLOCK - 1) // ATTN_BLOCK
            # items: (row, block of ATTN_BLOCK heads), which share the row's keys
            with nogil:
                for s in prange(S * nblk, schedule='dynamic', num_threads=nta):
                    attend_absorbed_heads(kv_b, &q[s // nblk, 0], &Lc[0, 0], &Rc[0, 0],
                                          sel + (s // nblk) * topk if sparse else NULL,
                                          nsel[s // nblk] if sparse else 0, k0, pos_base + s // nblk,
                                          (s % nblk) * ATTN_BLOCK, min(H, (s % nblk + 1) * ATTN_BLOCK), H,
                                          dn, dr, dv, Lkv, scale, &tbuf[threadid(), 0], &ctx[s // nblk, 0])
        else:
            kvb = ws.kvb
            if kvb.shape[0] < T or not 0 <= kvb_from < T:
                raise EngineError("expanded attention scratch too small")
            self._mm(L.kv_b, &Lc[kvb_from, 0], T - kvb_from, &kvb[kvb_from, 0], ws)
            if tbuf.shape[1] < 2 * T * ATTN_BLOCK:
                raise EngineError("expanded attention's per-thread scratch too small")
            nblk = (S + ATTN_BLOCK - 1) // ATTN_BLOCK
            # items: (head, block of ATTN_BLOCK rows), head-major, so that a thread's next item
            # reads the same head's keys (from L2) and a block reads each key once (from L1)
            with nogil:
                for s in prange(nblk * H, schedule='dynamic', num_threads=nta):
                    attend_expanded_rows(&q[0, 0], &kvb[0, 0], &Rc[0, 0], sel, nsel, topk,
                                         (s % nblk) * ATTN_BLOCK, min(S, (s % nblk + 1) * ATTN_BLOCK),
                                         k0, pos_base, s // nblk, H, dn, dr, dv, scale,
                                         &tbuf[threadid(), 0], &ctx[0, 0])
        self._mm(L.o_proj, &ctx[0, 0], S, &out[0, 0], ws)

    def _input_group(self, Layer L, bint sparse):
        """q_a, kv_a (and the indexer's wk) share the input: one quantization, one pass over their
        groups, when all are integer matrices of that width (L.input_group; [] when not)."""
        ins = [L.q_a, L.kv_a] + ([L.iwk] if sparse and L.idx_full else [])
        fit = all(int_qt(W, self.idot) and (<QT>W).c.I == (<QT>L.q_a).c.I for W in ins)
        L.input_group = ins if fit else []

    def _step_ok(self, Layer L, int S, int T, Work ws):
        """Can layer L's attention half for S rows ending at T keys take attend_step? (Else the
        per-call path: expanded attention, a DSA selection that runs, float matrices.)"""
        c = self.cfg
        cdef bint sparse = self.has_dsa and L.index < c.n_layers
        if not self.stepped or S > ws.C or not self.absorbed_path(S, T):
            return False
        if L.input_group is None:
            self._input_group(L, sparse)
        if sparse and L.idx_full and (T > c.index_topk or self.dsa_force) and \
                not (int_qt(L.iwq, self.idot) and L.iwq.c.I == c.q_lora):
            return False                        # the indexer selects keys with a float wq_b
        return bool(L.input_group) and int_qt(L.q_b, self.idot) and int_qt(L.o_proj, self.idot)

    cdef int _fill_step(self, Layer L, Work ws, LayerStep *P) except -1:
        """P: layer L's weights, KV cache rows and ws's scratch for attend_step (the per-call
        fields x, S, pos_base, k0, nt are the caller's); L must pass _step_ok."""
        c = self.cfg
        cdef int k
        cdef bint sparse = self.has_dsa and L.index < c.n_layers
        widest = max(c.hidden, c.q_lora, c.n_heads * c.v_head)
        if 2 * <Py_ssize_t>ws.C * widest > ws.xq.shape[0] or widest > ws.xr.shape[0] or \
                2 * <Py_ssize_t>ws.C * act_nblocks(widest, self.act_block) > ws.xs.shape[0]:
            raise EngineError(f"attention of {ws.C} rows exceeds the activation scratch")
        cdef float[:, ::1] n = ws.n, a = ws.a, qr = ws.qr, ckv = ws.ckv, q = ws.q, ctx = ws.ctx
        cdef float[:, ::1] tbuf = ws.tbuf, ik = ws.ik, Ic, rl = ws.rl, rw = ws.rw
        cdef float[:, ::1] iq = ws.iq, iw = ws.iw, isc = ws.isc
        cdef int[:, ::1] sel = ws.sel
        cdef float[:, ::1] Lc = self.Lc[L.index], Rc = self.Rc[L.index]
        cdef float[::1] in_ln = L.in_ln, post_ln = L.post_ln, qa_ln = L.q_a_ln, kv_ln = L.kv_a_ln
        cdef float[::1] inv = self.inv_freq, kw, kb, bias, uw = ws.uw
        cdef int[:, ::1] rsel = ws.rsel
        cdef int[::1] upos = ws.upos, uniq = ws.uniq, ustart = ws.ustart, urow = ws.urow, nsel = ws.nsel
        cdef uint8_t[::1] gb
        P.D, P.H, P.dn, P.dr, P.dv = c.hidden, c.n_heads, c.qk_nope, c.qk_rope, c.v_head
        P.Lq, P.Lkv, P.idot, P.block = c.q_lora, c.kv_lora, self.idot, self.act_block
        P.eps, P.leps, P.scale = c.eps, LORA_NORM_EPS, c.attn_scale
        P.n, P.a = &n[0, 0], &a[0, 0]
        P.in_ln, P.post_ln, P.qa_ln, P.kv_ln, P.inv = &in_ln[0], &post_ln[0], &qa_ln[0], &kv_ln[0], &inv[0]
        P.n_ins = len(L.input_group)
        for k in range(P.n_ins):
            P.ins[k] = &(<QT>L.input_group[k]).c
        P.ins_y[0], P.ins_y[1], P.ins_y[2] = &qr[0, 0], &ckv[0, 0], &ik[0, 0]     # q_a, kv_a, wk
        P.q_b, P.kv_b, P.o_proj = &L.q_b.c, &L.kv_b.c, &L.o_proj.c
        P.qr, P.ckv, P.q, P.ctx = &qr[0, 0], &ckv[0, 0], &q[0, 0], &ctx[0, 0]
        P.Lc, P.Rc = &Lc[0, 0], &Rc[0, 0]
        P.Ic, P.nsel, P.sel, P.wp_grouped = NULL, NULL, NULL, False
        if sparse:
            P.nsel, P.sel, P.topk, P.inh = &nsel[0], &sel[0, 0], sel.shape[1], c.index_nh
        if sparse and L.idx_full:
            Ic = self.Ic[L.index]
            kw, kb = L.ik_w, L.ik_b
            P.Ic, P.ik, P.ik_w, P.ik_b = &Ic[0, 0], &ik[0, 0], &kw[0], &kb[0]
            P.ihd, P.ieps, P.force = c.index_hd, INDEXER_NORM_EPS, self.dsa_force
            P.iwq, P.iwp, P.iq, P.iw, P.isc = &L.iwq.c, &L.iwp.c, &iq[0, 0], &iw[0, 0], &isc[0, 0]
            P.qscale, P.wscale = 1.0 / sqrt(c.index_hd), 1.0 / sqrt(c.index_nh)
            if P.n_ins < MANY_MAX and int_qt(L.iwp, self.idot) and L.iwp.c.I == c.hidden:
                P.ins[P.n_ins], P.ins_y[P.n_ins] = &L.iwp.c, &iw[0, 0]     # wp with the input group
                P.n_ins += 1
                P.wp_grouped = True
        P.tbuf, P.tstride = &tbuf[0, 0], tbuf.shape[1]
        P.xq, P.xs, P.xr, P.xm = &ws.xq[0], &ws.xs[0], &ws.xr[0], &ws.xm[0] if BLOCK_SUMS else NULL
        gb = self._split_scratch(ws.C, widest)       # int4 matmuls read their activations' split forms
        P.xg = &gb[0]
        P.router = NULL
        if L.sparse:
            bias = L.router_bias
            P.router, P.rbias, P.E, P.K = &L.router.c, &bias[0], c.n_experts, c.topk
            P.norm_topk, P.rs = c.norm_topk, c.routed_scale
            P.rl, P.rsel, P.rw = &rl[0, 0], &rsel[0, 0], &rw[0, 0]
            P.upos, P.uniq, P.ustart, P.urow, P.uw = &upos[0], &uniq[0], &ustart[0], &urow[0], &uw[0]
        P.gate = P.up = P.down = NULL
        if L.gate is not None:
            P.gate, P.up, P.down = &L.gate.c, &L.up.c, &L.down.c
        P.macs_row = (c.hidden * (c.q_lora + c.kv_lora) + c.q_lora * c.n_heads * c.qk_head
                      + c.n_heads * c.v_head * c.hidden)
        return 0

    def _attend_step(self, Layer L, float[:, ::1] x, int S, int pos_base, Work ws):
        """The attention half of layer_forward for S <= ws.C rows in one parallel region
        (attend_step): x += attention(norm(x)), ws.n = post_attention_layernorm(x), and an MoE
        layer's routing in ws. Returns the batch union's expert count (0 for a dense layer), or -1
        when the layer needs the per-call path (see _step_ok): that path computes the same
        values, call by call."""
        c = self.cfg
        cdef int T = pos_base + S
        if not self._step_ok(L, S, T, ws):
            return -1
        if T > c.index_topk and self.indexer_absent:
            self.dense_past_topk = True
        cdef int k0 = self.kv_start[L.index]
        if k0 < 0 or k0 > pos_base:
            raise EngineError(f"layer {L.index}: KV window starts at {k0}, after position {pos_base}")
        if pos_base < 0 or T > self.Lc[L.index].shape[0]:
            raise EngineError(f"KV rows {pos_base}..{T - 1} exceed the cache")
        cdef LayerStep P
        self._fill_step(L, ws, &P)
        P.x, P.S, P.pos_base, P.k0 = &x[0, 0], S, pos_base, k0
        P.nt = 1 if <double>S * P.macs_row < PARALLEL_MIN_MACS else coli_max_threads()
        with nogil:
            attend_step(&P)
        self.stepped_calls += 1
        if P.bad >= 0:
            raise EngineError(f"layer {L.index}: NaN in the router scores of row {P.bad} "
                              "(non-finite activations or weights)")
        return P.nu

    def absorbed_path(self, int S, int T):
        """Does a forward of S rows ending at T keys attend in the latent space? (--absorb; auto:
        see ABSORB_MAX_ROWS and ABSORB_KV_BYTES)."""
        c = self.cfg
        if self.absorb >= 0:
            return self.absorb == 1
        if self._span is not None:      # a piece of prefill(): the path of the whole prompt
            S, T = max(S, self._span[0]), max(T, self._span[1])
        return (S <= ABSORB_MAX_ROWS or T > expanded_key_rows(c, T, -1)
                or (self.has_dsa and T > c.index_topk))

    def kv_write(self, Layer L, float[:, ::1] n, int S, int pos_base, Work ws, bint projected=False):
        """The compressed KV rows of positions pos_base..pos_base+S-1 from the normalized layer
        input n [S, D]: Lc[pos] = kv_a_layernorm(latent), Rc[pos] = rope(shared key).
        projected: ws.ckv already holds kv_a · n (attention computed it with q_a)."""
        c = self.cfg
        cdef int Lkv = c.kv_lora, dr = c.qk_rope, s, pos
        cdef float eps = LORA_NORM_EPS
        cdef float[:, ::1] ckv = ws.ckv
        cdef float[:, ::1] Lc = self.Lc[L.index], Rc = self.Rc[L.index]
        cdef float[::1] kv_ln = L.kv_a_ln, inv = self.inv_freq
        if S > ckv.shape[0] or pos_base < 0 or pos_base + S > Lc.shape[0]:
            raise EngineError(f"KV rows {pos_base}..{pos_base + S - 1} exceed the scratch or the cache")
        if not projected:
            self._mm(L.kv_a, &n[0, 0], S, &ckv[0, 0], ws)
        with nogil:
            for s in range(S):
                pos = pos_base + s
                rmsnorm_row(&Lc[pos, 0], &ckv[s, 0], &kv_ln[0], Lkv, eps)
                memcpy(&Rc[pos, 0], &ckv[s, Lkv], dr * sizeof(float))
                rope_interleave(&Rc[pos, 0], dr, pos, &inv[0])

    def _dsa_select(self, Layer L, float[:, ::1] n, int S, int pos_base, Work ws, bint projected=False,
                    int row0=0):
        """Lightning indexer of a full layer: write this batch's indexer keys, then per query keep
        the index_topk keys of highest score Σ_h w_h·relu(q_h·k_t / √hd), w = weights_proj(n)/√nh
        (q from the q_a_layernorm output). A query whose causal context fits in index_topk keeps
        every key (nsel = 0 = dense), as HF's top-k over the causally masked scores does."""
        c = self.cfg
        cdef int nh = c.index_nh, hd = c.index_hd, dr = c.qk_rope, topk = c.index_topk
        cdef int s, h, pos
        cdef float[:, ::1] ik = ws.ik, iq = ws.iq, iw = ws.iw, isc = ws.isc, qr = ws.qr
        cdef float[:, ::1] Ic = self.Ic[L.index]
        cdef float[::1] kw = L.ik_w, kb = L.ik_b, inv = self.inv_freq
        cdef int[:, ::1] sel = ws.sel[row0:]            # this chunk's rows of the forward's selection
        cdef int[::1] nsel = ws.nsel[row0:]
        cdef bint force = self.dsa_force
        cdef float eps = INDEXER_NORM_EPS
        cdef float qscale = 1.0 / sqrt(hd), wscale = 1.0 / sqrt(nh)
        if not projected:                 # else attention computed ik = wk · n with q_a
            self._mm(L.iwk, &n[0, 0], S, &ik[0, 0], ws)
        with nogil:
            for s in range(S):
                pos = pos_base + s
                layernorm_row(&ik[s, 0], &kw[0], &kb[0], hd, eps)
                rope_interleave(&ik[s, 0], dr, pos, &inv[0])
                memcpy(&Ic[pos, 0], &ik[s, 0], hd * sizeof(float))
        if pos_base + S <= topk and not force:
            for s in range(S):
                nsel[s] = 0
            return
        self._mm(L.iwq, &qr[0, 0], S, &iq[0, 0], ws)
        self._mm(L.iwp, &n[0, 0], S, &iw[0, 0], ws)
        with nogil:
            for s in range(S):
                pos = pos_base + s
                for h in range(nh):
                    rope_interleave(&iq[s, h * hd], dr, pos, &inv[0])
            for s in prange(S, schedule='dynamic', num_threads=1 if S == 1 else coli_max_threads()):
                nsel[s] = dsa_topk(&iq[s, 0], &iw[s, 0], &Ic[0, 0], pos_base + s + 1, nh, hd, topk,
                                   qscale, wscale, force, &isc[threadid(), 0], &sel[s, 0])

    def dense_mlp(self, Layer L, float[:, ::1] n, int S, float[:, ::1] out, Work ws):
        """out = down · (silu(gate · n) ⊙ (up · n)). n [S, D] -> out [S, D]."""
        cdef int s
        if self._fusable(S, [(L.gate, L.up, L.down)]):
            with nogil:
                for s in range(S):
                    memset(&out[s, 0], 0, out.shape[1] * sizeof(float))
            self._ffn_fused([(L.gate, L.up, L.down, 0, S)], n, S, out, None)
            return
        self._ffn_rows(L.gate, L.up, L.down, n, 0, S, out, ws)

    def _ffn_rows(self, QT gate, QT up, QT down, float[:, ::1] x, int r0, int nr, float[:, ::1] out, Work ws):
        """out[r0:r0+nr] = FFN(x[r0:r0+nr]), ws.C rows at a time (rows are independent)."""
        cdef int c0
        for c0 in range(r0, r0 + nr, ws.C):
            self._ffn(gate, up, down, &x[c0, 0], min(ws.C, r0 + nr - c0), &out[c0, 0], ws)

    def _fusable(self, int S, ffns):
        if not self.fused or S > FUSED_MAX_ROWS:
            return False
        for gate, up, down in ffns:
            if not (int_qt(gate, self.idot) and int_qt(up, self.idot) and int_qt(down, self.idot)):
                return False
        return True

    def _ffn_scratch(self, int npairs, int njobs, int I):
        """The fused group's scratch, grown to hold npairs (FFN, row) pairs of width <= I."""
        cdef FfnScratch fs = self._fs
        D = self.cfg.hidden
        if fs is None or fs.max_pairs < npairs or fs.max_jobs < njobs or fs.I < I or \
                fs.xr.shape[0] < coli_max_threads():
            c = self.cfg
            width = max(c.dense_inter, c.moe_inter * max(c.n_shared, 1), c.moe_inter, I)
            pairs = max(npairs, FUSED_MAX_ROWS * (c.topk + 1), fs.max_pairs if fs is not None else 0)
            fs = FfnScratch(max(njobs, c.n_experts + 1), pairs, D, width, coli_max_threads())
            self._fs = fs
        return fs

    def _ffn_fused(self, ffns, float[:, ::1] n, int S, float[:, ::1] out, rows, int j0=0,
                   bint accumulate=True):
        """Run FFNs [(gate, up, down, first pair, pairs)] as one fused group (ffn_group). rows:
        True = the caller filled fs.urow / fs.uw for these pairs; None = rows 0..S-1 with weight
        1 for a single FFN. j0: the group's first job slot (a second group of one MoE call takes the
        slots and pairs after the first's, whose results stay in the scratch); accumulate=False
        leaves the outputs in the scratch for _ffn_accumulate. A job's scratch lies at its pairs'
        place (pair p: inputs at 2p rows, hidden at p rows of the scratch's width), so the jobs
        of both groups never overlap."""
        c = self.cfg
        cdef int D = c.hidden, nj = len(ffns), j, npairs, nwork = 0, Imax = 0, p0 = ffns[0][3]
        for f in ffns:
            Imax = max(Imax, (<QT>f[0]).c.O)
        npairs = sum(f[4] for f in ffns)
        cdef FfnScratch fs = self._ffn_scratch(p0 + npairs, j0 + nj, Imax)
        cdef int r
        if rows is None:                  # one FFN on rows 0..S-1 with weight 1
            for r in range(S):
                fs.p_urow[r] = r
                fs.p_uw[r] = 1.0
        cdef FfnJob *J
        cdef Py_ssize_t W = fs.I, h = 0
        for j in range(nj):
            gate, up, down, row0, nr = ffns[j]
            J = &fs.jobs[j0 + j]
            nwork = fill_job(J, &(<QT>gate).c, &(<QT>up).c, &(<QT>down).c, row0, p0, nr, nwork, D,
                             self.act_block, W, fs.xgs, fs.hgs)
            h += nr * J.I
        cdef double macs = 3.0 * <double>h * D
        cdef int nt = 1 if macs < FUSED_MIN_MACS else coli_max_threads()
        cdef int block = self.act_block, idot = self.idot
        with nogil:
            ffn_group(fs.jobs + j0, nj, npairs, nwork, &n[0, 0], D, fs.p_urow + p0, fs.p_uw + p0, block,
                      idot, fs.p_xq, fs.p_xs, fs.p_g, fs.p_u, fs.p_hq, fs.p_hs, fs.p_yd, fs.p_xr,
                      fs.xr_stride, &out[0, 0], nt, fs.p_xm if BLOCK_SUMS else NULL,
                      fs.p_hm if BLOCK_SUMS else NULL, accumulate, fs.p_xg, fs.xgs, fs.p_hg, fs.hgs)

    def _ffn_accumulate(self, order, float[:, ::1] out):
        """out += the outputs of the scratch's jobs, in the job slots' order `order` (see
        ffn_accumulate)."""
        cdef FfnScratch fs = self._fs
        cdef int nj = len(order), j
        cdef int[::1] ov = np.asarray(order, np.int32)
        for j in range(nj):
            if not 0 <= ov[j] < fs.max_jobs:
                raise EngineError(f"job slot {ov[j]} outside the fused scratch")
        cdef int nt = 1 if <double>nj * out.shape[1] < FUSED_MIN_MACS else coli_max_threads()
        with nogil:
            ffn_accumulate(fs.jobs, &ov[0], nj, fs.p_urow, fs.p_uw, out.shape[1], fs.p_yd, &out[0, 0], nt)

    cdef int _ffn(self, QT gate, QT up, QT down, const float *x, int S, float *out, Work ws) except -1:
        """out[S, D] = down · (silu(gate · x) ⊙ (up · x)), the hidden [S, I] kept in ws.g / ws.u."""
        cdef int r, i, I = gate.c.O
        cdef float *g = &ws.g[0]
        cdef float *u = &ws.u[0]
        if <Py_ssize_t>S * I > ws.g.shape[0]:
            raise EngineError("MLP scratch too small")
        self._mm(gate, x, S, g, ws)
        self._mm(up, x, S, u, ws)
        cdef int nt = 1 if <double>S * I < QUANT_PARALLEL_MIN else coli_max_threads()
        with nogil:
            for r in prange(S * I, schedule='static', num_threads=nt):
                g[r] = silu(g[r]) * u[r]
        self._mm(down, g, S, out, ws)
        return 0

    def moe(self, Layer L, float[:, ::1] n, int S, float[:, ::1] out, Work ws, int nu=-1):
        """Routed experts (sigmoid router + correction bias, top-K, batch union) + shared expert.
        nu >= 0: the routing is in ws already (attend_step made it), nu unique experts."""
        if nu < 0:
            nu = self._route(L, n, S, ws)
        cdef int s, u, D = self.cfg.hidden
        with nogil:
            for s in range(S):
                memset(&out[s, 0], 0, D * sizeof(float))
        self._moe_experts(L, n, S, out, ws, nu)

    def _route(self, Layer L, float[:, ::1] n, int S, Work ws):
        """The router's top-K of every row and their batch union in ws; returns its expert count."""
        c = self.cfg
        cdef int E = c.n_experts, K = c.topk, D = c.hidden
        cdef int s, u, nu = 0, bad = -1
        cdef float[:, ::1] rl = ws.rl, rw = ws.rw
        cdef int[:, ::1] rsel = ws.rsel
        cdef int[::1] upos = ws.upos, uniq = ws.uniq, ustart = ws.ustart, urow = ws.urow
        cdef float[::1] uw = ws.uw, bias = L.router_bias
        cdef float rs = c.routed_scale
        cdef bint norm = c.norm_topk
        for s in range(0, S, ws.C):                       # the router's input rows, ws.C at a time
            self._mm(L.router, &n[s, 0], min(ws.C, S - s), &rl[s, 0], ws)
        with nogil:
            for s in range(S):
                if route_row(&rl[s, 0], &bias[0], E, K, norm, rs, &rsel[s, 0], &rw[s, 0]) != 0:
                    bad = s
                    break
            if bad < 0:
                nu = batch_union(&rsel[0, 0], &rw[0, 0], S, K, E, &upos[0], &uniq[0], &ustart[0], &urow[0], &uw[0])
        if bad >= 0:
            raise EngineError(f"layer {L.index}: NaN in the router scores of row {bad} "
                              "(non-finite activations or weights)")
        return nu

    def _moe_experts(self, Layer L, float[:, ::1] n, int S, float[:, ::1] out, Work ws, int nu):
        """out [S, D] (zeroed) += the routed experts of the batch union in ws, then the shared expert."""
        cdef int[::1] uniq = ws.uniq, ustart = ws.ustart
        cdef int u
        if self.routing is not None:
            self.routing.append((self.forwards, L.index, S, [uniq[u] for u in range(nu)]))
        if self.remote is not None:
            self._moe_remote(L, n, S, out, ws, nu)
            return
        # Each unique expert once, in ascending id: gather its rows, FFN, scatter-add.
        if S > FUSED_MAX_ROWS:
            self._moe_streamed(L, n, S, out, ws, nu)
            return
        cdef Expert X
        t0 = time.perf_counter()
        fetch = self.cache.fetch(L.index, [uniq[u] for u in range(nu)])
        self.t_disk += time.perf_counter() - t0
        try:
            if self.overlap and fetch.pending and self._moe_overlapped(L, fetch, n, S, out, ws, nu):
                return
            t0 = time.perf_counter()
            experts = fetch.wait()
            self.t_disk += time.perf_counter() - t0
        except BaseException:
            try:
                fetch.wait()            # release the call's experts; its own error, if any, is secondary
            except Exception:
                pass
            raise
        t0 = time.perf_counter()
        ffns = [((<Expert>X).gate, (<Expert>X).up, (<Expert>X).down) for X in experts]
        if L.gate is not None:
            ffns.append((L.gate, L.up, L.down))
        if self._fusable(S, ffns):
            # routed experts in ascending id, then the shared expert (weight 1) on every row
            self._ffn_scratch(ustart[nu] + S, len(ffns), max((<QT>f[0]).c.O for f in ffns))
            jobs, _ = self._pair_jobs(list(range(len(ffns))), ffns, 0, ws, S, nu)
            self._ffn_fused(jobs, n, S, out, True)
            self.t_moe += time.perf_counter() - t0
            return
        self._expert_ffns(experts, 0, n, out, ws)
        self.t_moe += time.perf_counter() - t0
        self._shared_ffn(L, n, S, out, ws)

    # -- routed experts computed elsewhere (colibri.cluster) --------------------------------------

    def set_remote(self, remote):
        """Compute routed experts through ``remote`` (None: here again). remote.submit(layer, n,
        S, ids, ustart, urow) sends the MoE call's units (expert ids[u] on rows
        urow[ustart[u]:ustart[u+1]] of n [S, D]) it serves and returns a handle: handle.local, the
        units it did not take; handle.wait(Y) fills Y's rows of the others (unweighted outputs, one
        row per (expert, row) pair in union order) and returns the units it could not deliver.
        Those are computed here through the cache. The C paths (layers_step, the draft chain) read
        resident experts only, so they step aside."""
        self.remote = remote
        self._c_layers = None

    def _moe_remote(self, Layer L, float[:, ::1] n, int S, float[:, ::1] out, Work ws, int nu):
        """out [S, D] (zeroed) += the routed experts of the batch union in ws, computed by
        self.remote (and here for the units it does not or cannot deliver), then the shared expert.
        Every expert's output row arrives whole and unweighted, and the sums run here in the
        local order (ascending expert id per row, then the shared expert), so the result is the
        local path's bit for bit."""
        cdef int D = self.cfg.hidden, npairs = ws.ustart[nu], nt
        ids = [int(ws.uniq[u]) for u in range(nu)]
        Y = self._pair_rows(npairs, D)                                  # [npairs, D]
        handle = self.remote.submit(L.index, np.asarray(n)[:S], S, ids, np.asarray(ws.ustart)[:nu + 1].copy(),
                                    np.asarray(ws.urow)[:npairs].copy())
        t0 = time.perf_counter()
        if handle.local:
            self._units_here(L, handle.local, n, Y, ws)
        failed = handle.wait(Y)
        if failed:
            self._units_here(L, failed, n, Y, ws)
        cdef float[:, ::1] yv = Y
        cdef int[::1] urow = ws.urow
        cdef float[::1] uw = ws.uw
        nt = 1 if <double>npairs * D < FUSED_MIN_MACS else coli_max_threads()
        if npairs > 0:
            with nogil:
                add_pair_rows(&yv[0, 0], &urow[0], &uw[0], npairs, D, &out[0, 0], nt)
        self.t_moe += time.perf_counter() - t0
        self._shared_ffn(L, n, S, out, ws)

    def _pair_rows(self, int npairs, int D):
        """The [npairs, D] buffer of a remote MoE call's expert outputs (grown as needed, kept)."""
        if self._ybuf is None or self._ybuf.shape[0] < npairs or self._ybuf.shape[1] != D:
            self._ybuf = np.zeros((max(npairs, 1), D), np.float32)
        return self._ybuf[:max(npairs, 1)]

    def _units_here(self, Layer L, units, float[:, ::1] n, float[:, ::1] Y, Work ws):
        """Y[p] = FFN_u(n[urow[p]]) for the pairs p of batch-union units `units`, with experts
        from this machine's cache (their reads counted as disk time)."""
        cdef int[::1] uniq = ws.uniq, ustart = ws.ustart, urow = ws.urow
        cdef float[:, ::1] xg = ws.xg, yg = ws.yg
        cdef int u, j, j0, jn, C = ws.C, D = self.cfg.hidden
        cdef Expert X
        t0 = time.perf_counter()
        experts = self.cache.fetch(L.index, [uniq[u] for u in units]).wait()
        self.t_disk += time.perf_counter() - t0
        for k in range(len(units)):
            u = units[k]
            X = experts[k]
            for j0 in range(ustart[u], ustart[u + 1], C):      # its rows, C at a time
                jn = min(C, ustart[u + 1] - j0)
                with nogil:
                    for j in range(jn):
                        memcpy(&xg[j, 0], &n[urow[j0 + j], 0], D * sizeof(float))
                self._ffn(X.gate, X.up, X.down, &xg[0, 0], jn, &Y[j0, 0], ws)

    def expert_outputs(self, int li, float[:, ::1] x, ids, int[::1] starts, int[::1] rows, float[:, ::1] y):
        """y[p] = FFN of expert ids[u] on row x[rows[p]] for the pairs p in starts[u]..starts[u+1]
        (an expert worker's part of an MoE call: outputs unweighted, in pair order; see
        _moe_remote). The experts come from the cache (an expert worker holds its share there)."""
        c = self.cfg
        cdef int nu = len(ids), npairs = rows.shape[0], R = x.shape[0], D = c.hidden, u, p, j0, jn, j
        if not 0 <= li <= c.n_layers or x.shape[1] != D or y.shape[1] != D or y.shape[0] < npairs or \
                starts.shape[0] != nu + 1 or starts[0] != 0 or starts[nu] != npairs:
            raise EngineError(f"expert_outputs: layer {li}, {nu} experts, {npairs} pairs over rows "
                              f"{tuple(x.shape)} into {tuple(y.shape)}: inconsistent shapes")
        for u in range(nu):
            if not 0 <= ids[u] < c.n_experts or starts[u + 1] <= starts[u]:
                raise EngineError(f"expert_outputs: expert {ids[u]} (unit {u}) out of range or without rows")
        for p in range(npairs):
            if not 0 <= rows[p] < R:
                raise EngineError(f"expert_outputs: pair {p} names row {rows[p]} of {R}")
        if nu == 0:
            return
        experts = self.cache.fetch(li, [int(e) for e in ids]).wait()
        ffns = [((<Expert>X).gate, (<Expert>X).up, (<Expert>X).down) for X in experts]
        cdef FfnScratch fs
        if self._fusable(R, ffns):
            fs = self._ffn_scratch(npairs, nu, max((<QT>f[0]).c.O for f in ffns))
            for p in range(npairs):
                fs.p_urow[p] = rows[p]
                fs.p_uw[p] = 1.0
            jobs = [tuple(ffns[u]) + (starts[u], starts[u + 1] - starts[u]) for u in range(nu)]
            self._ffn_fused(jobs, x, R, y, True, 0, False)
            memcpy(&y[0, 0], fs.p_yd, <Py_ssize_t>npairs * D * sizeof(float))
            return
        cdef Work ws = self._work(min(max(R, 1), self.prefill_chunk), 1)
        cdef float[:, ::1] xg = ws.xg
        cdef Expert X
        for u in range(nu):
            X = experts[u]
            for j0 in range(starts[u], starts[u + 1], ws.C):
                jn = min(ws.C, starts[u + 1] - j0)
                for j in range(jn):
                    memcpy(&xg[j, 0], &x[rows[j0 + j], 0], D * sizeof(float))
                self._ffn(X.gate, X.up, X.down, &xg[0, 0], jn, &y[j0, 0], ws)

    def _expert_ffns(self, experts, int u0, float[:, ::1] n, float[:, ::1] out, Work ws):
        """out[r] += w · FFN_u(n[r]) for the batch-union experts u0, u0+1, ... (experts[k] is unit
        u0 + k), each on its rows ws.C at a time."""
        cdef float[:, ::1] xg = ws.xg, yg = ws.yg
        cdef int[::1] ustart = ws.ustart, urow = ws.urow
        cdef float[::1] uw = ws.uw
        cdef int u, j, j0, jn, r, i, C = ws.C, D = self.cfg.hidden
        cdef Expert X
        for u in range(u0, u0 + len(experts)):
            X = experts[u - u0]
            for j0 in range(ustart[u], ustart[u + 1], C):      # its rows, C at a time
                jn = min(C, ustart[u + 1] - j0)
                with nogil:
                    for j in range(jn):
                        memcpy(&xg[j, 0], &n[urow[j0 + j], 0], D * sizeof(float))
                self._ffn(X.gate, X.up, X.down, &xg[0, 0], jn, &yg[0, 0], ws)
                with nogil:
                    for j in range(jn):
                        r = urow[j0 + j]
                        for i in range(D):
                            out[r, i] += uw[j0 + j] * yg[j, i]

    def _moe_streamed(self, Layer L, float[:, ::1] n, int S, float[:, ::1] out, Work ws, int nu):
        """The routed experts of a long batch (prefill), which may need every expert of the
        layer: read stream_group (STREAM_GROUP) of them at a time, the next group while this one
        is multiplied, so the call holds at most 2 · STREAM_GROUP experts beyond the cache (the
        RAM plan's call allowance) and each expert is read once. Same order of sums as one group."""
        cdef int[::1] uniq = ws.uniq
        cdef int g0, G = max(self.stream_group, 1)
        ids = [uniq[u] for u in range(nu)]
        # with map_stream a long prompt, which multiplies each expert it reads by many rows once,
        # uses the experts it loads in place in the file mapping instead of copying them into
        # buffers (on 2 cores the copy and the fresh buffers' page zeroing take the matmuls' CPU)
        self._streaming = S >= MAP_STREAM_MIN_ROWS
        t0 = time.perf_counter()
        fetch = self.cache.fetch(L.index, ids[:G])
        self.t_disk += time.perf_counter() - t0
        try:
            for g0 in range(0, nu, G):
                t0 = time.perf_counter()
                experts = fetch.wait()
                self.t_disk += time.perf_counter() - t0
                fetch = self.cache.fetch(L.index, ids[g0 + G:g0 + 2 * G]) if g0 + G < nu else None
                t0 = time.perf_counter()
                self._expert_ffns(experts, g0, n, out, ws)
                self.t_moe += time.perf_counter() - t0
        finally:
            self._streaming = False
            if fetch is not None:
                try:
                    fetch.wait()          # release the next group's experts
                except Exception:
                    pass
        self._shared_ffn(L, n, S, out, ws)

    def _shared_ffn(self, Layer L, float[:, ::1] n, int S, float[:, ::1] out, Work ws):
        """out += shared expert(n), ws.C rows at a time, after every routed contribution."""
        cdef float[:, ::1] yg = ws.yg
        cdef int j0, jn, s, i, C = ws.C, D = self.cfg.hidden
        if L.gate is not None:
            # Shared expert, added after every routed contribution (HF: experts(x) + shared(x)).
            for j0 in range(0, S, C):
                jn = min(C, S - j0)
                self._ffn(L.gate, L.up, L.down, &n[j0, 0], jn, &yg[0, 0], ws)
                with nogil:
                    for s in range(jn):
                        for i in range(D):
                            out[j0 + s, i] += yg[s, i]

    def _moe_overlapped(self, Layer L, fetch, float[:, ::1] n, int S, float[:, ::1] out, Work ws, int nu):
        """The fused MoE call while some of its experts are still being read (glm.c's moe only
        asks for WILLNEED readahead of its next block of experts): the experts already present
        and the shared expert are multiplied first, the others once read, and the outputs are
        summed in the one-group order (ascending expert id, then the shared expert), so the result
        is bit-identical to the plain call. Returns False, having changed nothing in out, when the
        FFNs cannot be fused (the caller takes the plain path)."""
        cdef int[::1] uniq = ws.uniq
        cdef int u, p
        ready = fetch.ready
        shared = [(L.gate, L.up, L.down)] if L.gate is not None else []
        first = [u for u in range(nu) if uniq[u] in ready] + ([nu] if shared else [])
        later = [u for u in range(nu) if uniq[u] not in ready]
        ffns_first = [((<Expert>ready[uniq[u]]).gate, (<Expert>ready[uniq[u]]).up,
                       (<Expert>ready[uniq[u]]).down) for u in first if u < nu] + shared
        if not ffns_first or not self._fusable(S, ffns_first):
            return False
        # pairs (and job slots) in the order of computing: present experts, shared, later experts
        self._ffn_scratch(ws.ustart[nu] + S, nu + 1, max((<QT>f[0]).c.O for f in ffns_first))
        jobs_first, p = self._pair_jobs(first, ffns_first, 0, ws, S, nu)
        t0 = time.perf_counter()
        self._ffn_fused(jobs_first, n, S, out, True, 0, False)
        self.t_moe += time.perf_counter() - t0
        t0 = time.perf_counter()
        experts = fetch.wait()
        self.t_disk += time.perf_counter() - t0
        t0 = time.perf_counter()
        ffns_later = [((<Expert>experts[u]).gate, (<Expert>experts[u]).up, (<Expert>experts[u]).down)
                      for u in later]
        if not self._fusable(S, ffns_later):
            return False
        jobs_later, p = self._pair_jobs(later, ffns_later, p, ws, S, nu)
        self._ffn_fused(jobs_later, n, S, out, True, len(jobs_first), False)
        slot_of = {u: k for k, u in enumerate(first + later)}
        self._ffn_accumulate([slot_of[u] for u in sorted(slot_of)], out)   # ascending id, shared (nu) last
        self.t_moe += time.perf_counter() - t0
        self.overlapped_calls += 1
        return True

    def _pair_jobs(self, units, ffns, int p, Work ws, int S, int nu):
        """Fused-group jobs (gate, up, down, first pair, pairs) for MoE units in order (u < nu:
        expert u of the batch union on its rows and weights; u == nu: the shared expert on rows
        0..S-1 with weight 1), their pairs written into the fused scratch from pair p on.
        Returns (jobs, the next free pair)."""
        cdef FfnScratch fs = self._fs
        cdef int[::1] ustart = ws.ustart, urow = ws.urow
        cdef float[::1] uw = ws.uw
        cdef int u, i, nr
        jobs = []
        for k in range(len(units)):
            u = units[k]
            nr = S if u == nu else ustart[u + 1] - ustart[u]
            for i in range(nr):
                fs.p_urow[p + i] = i if u == nu else urow[ustart[u] + i]
                fs.p_uw[p + i] = 1.0 if u == nu else uw[ustart[u] + i]
            jobs.append(tuple(ffns[k]) + (p, nr))
            p += nr
        return jobs, p

    def layer_forward(self, Layer L, float[:, ::1] x, int S, int pos_base):
        """x[S, D] += attention(norm(x)); x += mlp(norm(x)) (glm.c's layer_forward). Attention takes the rows
        ws.C at a time (a chunk's KV rows are written before its queries attend, and the expanded
        path keeps the kv_b rows of earlier chunks), the MLP all S rows (each routed expert read
        once), so the result is the same as one batch."""
        cdef Work ws = self._work(S, pos_base + S)
        t0 = time.perf_counter()
        cdef int nu = self._attend_step(L, x, S, pos_base, ws)         # decode / verify: one region
        if nu < 0:      # one attention path for every chunk
            self._attend_calls(L, x, S, pos_base, ws, self.absorbed_path(S, pos_base + S))
        self.t_attn += time.perf_counter() - t0
        return self._mlp_calls(L, x, S, ws, nu)

    def _attend_calls(self, Layer L, float[:, ::1] x, int S, int pos_base, Work ws, bint absorbed):
        """layer_forward's attention half call by call: x += attention(norm(x)) ws.C rows at a time,
        then ws.n = post_attention_layernorm(x)."""
        cdef float[:, ::1] n = ws.n, a = ws.a
        cdef float[::1] w1 = L.in_ln, w2 = L.post_ln
        cdef int s, i, c0, sc, D = self.cfg.hidden
        cdef float eps = self.cfg.eps
        for c0 in range(0, S, ws.C):
            sc = min(ws.C, S - c0)
            with nogil:
                for s in range(sc):
                    rmsnorm_row(&n[s, 0], &x[c0 + s, 0], &w1[0], D, eps)
            self.attention(L, n, sc, pos_base + c0, a, ws, absorbed, 0 if c0 == 0 else pos_base + c0, c0)
            with nogil:
                for s in range(sc):
                    for i in range(D):
                        x[c0 + s, i] += a[s, i]
        with nogil:
            for s in range(S):
                rmsnorm_row(&n[s, 0], &x[s, 0], &w2[0], D, eps)

    # -- the layers of a decode / verify forward in C ----------------------------------------------

    def _on_cache_change(self, int layer, int eid, obj):
        """The expert cache's on_change: mirror what it holds for (layer, eid) in self.etab."""
        cdef ExpertRef *R
        if self.etab == NULL or not 0 <= layer <= self.cfg.n_layers or not 0 <= eid < self.cfg.n_experts:
            return
        R = &self.etab[<Py_ssize_t>layer * self.cfg.n_experts + eid]
        if obj is None:
            R.gate = R.up = R.down = NULL
        else:
            R.gate, R.up, R.down = &(<Expert>obj).gate.c, &(<Expert>obj).up.c, &(<Expert>obj).down.c

    def table_resident(self, int layer):
        """The experts of a layer row that self.etab holds (the cache's pinned, LRU and kept ones)."""
        if self.etab == NULL or not 0 <= layer <= self.cfg.n_layers:
            return []
        return [e for e in range(self.cfg.n_experts)
                if self.etab[<Py_ssize_t>layer * self.cfg.n_experts + e].gate != NULL]

    def _layers_ok(self, int S, int pos_base, Work ws):
        """Can every layer of this forward take layers_step? (attend_step for each (_step_ok), the
        fused MLP); what does not depend on the forward is worked out once (_c_layers)."""
        if not self.stepped or not self.fused or S > FUSED_MAX_ROWS or self.etab == NULL or not self.layers \
                or self.remote is not None:
            return False
        if self._c_layers is None:
            self._c_layers = all(
                self._step_ok(L, 1, 1, ws) and (L.gate is None or (int_qt(L.gate, self.idot) and
                                                                  int_qt(L.up, self.idot) and
                                                                  int_qt(L.down, self.idot)))
                for L in self.layers)
        # the conditions of _step_ok that depend on S and T are the same for every main layer
        return self._c_layers and self._step_ok(self.layers[0], S, pos_base + S, ws)

    cdef int _build_steps(self, Work ws) except -1:
        """self._steps: every main layer's attend_step fields over ws, the KV cache arrays and the
        split scratch, rebuilt when any of them is replaced (the key holds the objects the raw
        pointers point into, so none is freed while the steps use it)."""
        cdef int nL = self.cfg.n_layers, l
        key = self._steps_key
        now = (tuple(self.Lc), tuple(self.Rc), tuple(self.Ic or ()))
        if self._steps != NULL and key is not None and key[0] is ws and key[1] is self._gsplit and \
                all(len(a) == len(b) and all(x is y for x, y in zip(a, b)) for a, b in zip(key[2:], now)):
            return 0
        if self._steps == NULL:
            self._steps = <LayerStep *>calloc(nL, sizeof(LayerStep))
            if self._steps == NULL:
                raise MemoryError()
        for l in range(nL):
            self._fill_step(self.layers[l], ws, &self._steps[l])
        self._steps_key = (ws, self._gsplit) + now
        return 0

    def _layers_c(self, float[:, ::1] x, int S, int pos_base):
        """layers_forward of a decode / verify batch (see _layers_ok) through layers_step: each
        layer's attention half in one region, its fused MLP in another, without Python between
        layers. A layer whose MLP needs Python (an expert not resident, or router-lookahead
        prefetch running this forward) is handed back after its attention half and finished
        here through the cache, then the C loop goes on with the next layer."""
        c = self.cfg
        cdef Work ws = self._work(S, pos_base + S)
        cdef int nL = c.n_layers, K = c.topk, l = 0, l2, done, i
        cdef TokenStep T
        self._build_steps(ws)
        cdef FfnScratch fs = self._ffn_scratch(S * (K + 1), c.n_experts + 1, 0)
        if self._rec is None or self._rec[1].shape[1] < S * K:
            self._rec = (np.zeros(nL, np.int32), np.zeros((nL, S * K), np.int32))
        cdef int[::1] rec_nu = self._rec[0]
        cdef int[:, ::1] rec_ids = self._rec[1]
        cdef int[::1] k0 = np.asarray(self.kv_start[:nL], np.int32)
        for l in range(nL):
            if not 0 <= k0[l] <= pos_base:
                raise EngineError(f"layer {l}: KV window starts at {k0[l]}, after position {pos_base}")
        if pos_base < 0 or pos_base + S > self.Lc[0].shape[0]:
            raise EngineError(f"KV rows {pos_base}..{pos_base + S - 1} exceed the cache")
        if pos_base + S > c.index_topk and self.indexer_absent:
            self.dense_past_topk = True
        prefetching = self.pilot and self.lookahead_on and S <= PILOT_MAX_ROWS
        T.steps, T.k0, T.nL, T.S, T.pos_base = self._steps, &k0[0], nL, S, pos_base
        T.D, T.E, T.K, T.x, T.out = c.hidden, c.n_experts, K, &x[0, 0], &ws.out[0, 0]
        T.etab = self.etab
        # experts in place only while nothing else can evict them (no prefetch running or queued)
        T.moe_c = not prefetching and (not self.pilot or self.cache.prefetch_idle())
        T.handoff = prefetching             # the lookahead runs between a layer's two halves
        ffn_fields(&T, fs)
        T.rec_nu, T.rec_ids, T.rec_stride = &rec_nu[0], &rec_ids[0, 0], rec_ids.shape[1]
        T.t_attn = T.t_moe = 0.0
        l = 0
        while l < nL:
            with nogil:
                l2 = layers_step(&T, l, &done)
            self.stepped_calls += l2 - l + done
            self._note_in_place(l, l2, S)
            if l2 >= nL:
                break
            L = self.layers[l2]
            if T.bad >= 0:
                raise EngineError(f"layer {l2}: NaN in the router scores of row {T.bad} "
                                  "(non-finite activations or weights)")
            S = self._mlp_calls(L, x, S, ws, self._steps[l2].nu)
            T.S = S                         # rows dropped there stay dropped (drop_plan)
            l = l2 + 1
        self.t_attn += T.t_attn
        self.t_moe += T.t_moe
        return S

    def _note_in_place(self, int l0, int l1, int S):
        """The cache's bookkeeping (and the trace) for layers l0..l1-1 that layers_step finished
        with resident experts used in place."""
        cdef int l, nu
        cdef int[::1] rec_nu = self._rec[0]
        rec_ids = self._rec[1]
        calls = []
        for l in range(l0, l1):
            nu = rec_nu[l]
            if nu >= 0:
                ids = rec_ids[l, :nu].tolist()
                calls.append((l, ids))
                if self.routing is not None:
                    self.routing.append((self.forwards, l, S, ids))
        if calls:
            self.cache.note_hits_calls(calls)     # one call for the whole token: Python runs cold here

    def _mlp_calls(self, Layer L, float[:, ::1] x, int S, Work ws, int nu):
        """layer_forward's second half after its attention half (ws.n, the routing): trailing
        draft rows dropped under a drop_plan (_rows_to_keep), the router lookahead for the next
        layer, the MLP through the cache, the residual. Returns the rows kept (S, or fewer)."""
        cdef float[:, ::1] n = ws.n, f = ws.out
        cdef int s, i, D = self.cfg.hidden
        if L.sparse and self.drop_plan is not None and S > 1 and self.remote is None:
            s = self._rows_to_keep(L, S, ws, nu)
            if s < S:
                self.rows_dropped += S - s
                S = s
                nu = self._union(S, ws)
        if self.pilot and self.lookahead_on and S <= PILOT_MAX_ROWS and L.index + 1 < self.cfg.n_layers \
                and self.layers[L.index + 1].sparse:
            self.pilot_prefetch(self.layers[L.index + 1], x, S, ws)
        if L.sparse:
            self.moe(L, n, S, f, ws, nu)
        else:
            self.dense_mlp(L, n, S, f, ws)
        with nogil:
            for s in range(S):
                for i in range(D):
                    x[s, i] += f[s, i]
        return S

    def _rows_to_keep(self, Layer L, int S, Work ws, int nu):
        """Rows of this verify batch worth computing on at layer L (drop_plan): row 0 (the
        sampled token) always; a draft row r's reads here (experts not resident and not needed
        by an earlier row) are prepaid work when its draft is accepted (the next forward would
        read them) and waste when it is not, while an accepted draft saves the rest of a forward:
        row r is worth P_r × (a forward's time besides reads, per MoE layer) − (1 − P_r) × its
        reads. The prefix with the most value is kept; a dropped row is simply not accepted, and
        the kept rows compute exactly what they would have (a row's result never depends on the
        other rows of its batch)."""
        cdef int E = self.cfg.n_experts, K = self.cfg.topk, r, k, e, best = 1, new
        cdef int[:, ::1] rsel = ws.rsel
        t_read, accept, saved = self.drop_plan
        seen = set()
        cdef double net = 0.0, top = 0.0, a
        for r in range(S):
            new = 0
            for k in range(K):
                e = rsel[r, k]
                if e not in seen and self.etab[<Py_ssize_t>L.index * E + e].gate == NULL:
                    seen.add(e)
                    new += 1
            if r == 0:
                continue
            a = accept[r]
            net += a * saved - (1.0 - a) * new * t_read
            if net > top:
                top, best = net, r + 1
        return best

    def _union(self, int S, Work ws):
        """The batch union of the first S rows of the routing in ws (after rows were dropped)."""
        cdef int[:, ::1] rsel = ws.rsel
        cdef float[:, ::1] rw = ws.rw
        cdef int[::1] upos = ws.upos, uniq = ws.uniq, ustart = ws.ustart, urow = ws.urow
        cdef float[::1] uw = ws.uw
        cdef int nu, K = self.cfg.topk, E = self.cfg.n_experts
        with nogil:
            nu = batch_union(&rsel[0, 0], &rw[0, 0], S, K, E, &upos[0], &uniq[0], &ustart[0], &urow[0], &uw[0])
        return nu

    def pilot_prefetch(self, Layer Nx, float[:, ::1] x, int S, Work ws):
        """Router lookahead (glm.c's PILOT prefetch in layer_forward): layer Nx's router applied to
        the current post-attention residual x [S, D], normalized with Nx's post_attention_layernorm,
        predicts Nx's experts; they are loaded into the cache on the prefetch thread while this
        layer computes. The prediction is recorded so the cache counts its recall against Nx's
        true routing."""
        c = self.cfg
        cdef int E = c.n_experts, K = c.topk, D = c.hidden, s, k
        cdef float[:, ::1] rl = ws.rl, rw = ws.rw, pn = ws.xg
        cdef int[:, ::1] rsel = ws.rsel
        cdef float[::1] w2 = Nx.post_ln, bias = Nx.router_bias
        cdef float eps = c.eps, rs = c.routed_scale
        cdef bint norm = c.norm_topk
        with nogil:
            for s in range(S):
                rmsnorm_row(&pn[s, 0], &x[s, 0], &w2[0], D, eps)
        self._mm(Nx.router, &pn[0, 0], S, &rl[0, 0], ws)
        pred = set()
        for s in range(S):
            if route_row(&rl[s, 0], &bias[0], E, K, norm, rs, &rsel[s, 0], &rw[s, 0]) != 0:
                return                      # NaN scores: the real routing will report it
            for k in range(K):
                pred.add(rsel[s, k])
        pred = sorted(pred)
        self.cache.record_prediction(Nx.index, pred)
        self.cache.prefetch(Nx.index, pred, protect=pred)

    def layers_forward(self, float[:, ::1] x, int S, int pos_base):
        """Every layer on x [S, D]; returns the rows computed to the end (S, unless a drop_plan
        dropped trailing rows)."""
        if self._layers_ok(S, pos_base, self._work(S, pos_base + S)):
            if self._mapped_made:
                self._check_mapped(-1)      # the C path uses mapped experts in place, past the cache's guard
            return self._layers_c(x, S, pos_base)
        for L in self.layers:
            S = self.layer_forward(L, x, S, pos_base)
            if self._on_layer is not None:
                self._on_layer()
        return S

    def _forward(self, ids, int pos_base):
        """Embed ids at positions pos_base.. and run every layer; returns the residual x [S, D]."""
        ids = [int(t) for t in ids]
        S = len(ids)
        if S < 1:
            raise ValueError("empty token batch")
        if self.Lc is None or pos_base < 0 or pos_base + S > self.max_t:
            raise ValueError(f"positions {pos_base}..{pos_base + S - 1} do not fit the KV cache of "
                             f"{self.max_t} positions (call kv_alloc with a larger context)")
        if self.has_mtp and self.mtp_next > pos_base:
            # the MTP KV rows from pos_base on belong to tokens this forward replaces
            self.mtp_next = pos_base
        x = np.empty((S, self.cfg.hidden), np.float32)
        for s, t in enumerate(ids):
            self.embed_row(t, x[s])
        t0, d0, S0 = time.perf_counter(), self.t_disk, S
        S = self.layers_forward(x, S, pos_base)
        if S0 <= FUSED_MAX_ROWS:            # decode / verify: a row's time besides disk waits (EMA)
            t0 = (time.perf_counter() - t0 - (self.t_disk - d0)) / S0
            self._row_s = t0 if self._row_s <= 0 else self._row_s + 0.2 * (t0 - self._row_s)
        x = x[:S]
        self.forwards += 1
        self.h_all = x
        self.hlast = x[S - 1].copy()
        return x

    def logits_rows(self, x):
        """lm_head · final_norm(x) for every row of x [S, D] -> [S, V]."""
        return self._head(rmsnorm(np.ascontiguousarray(x, dtype=np.float32), self.final_norm, self.cfg.eps))

    def _head(self, h):
        """lm_head · h for every row of the normalized h [S, D] -> [S, V]."""
        h = np.ascontiguousarray(h, dtype=np.float32)
        cdef int S = h.shape[0], D = self.cfg.hidden
        cdef Py_ssize_t i, bad = -1
        logits = np.empty((S, self.lm_head.c.O), np.float32)
        if self._hbuf is None or self._hbuf[0].shape[0] < 2 * S * D:
            self._hbuf = (np.empty(2 * S * D, np.int8), np.empty(2 * S * D, np.float32),
                          np.empty(D, np.float32), np.empty(2 * S * D, np.int32))
        cdef float[:, ::1] hv = h, lv = logits
        cdef int8_t[::1] qv = self._hbuf[0]
        cdef float[::1] sv = self._hbuf[1], rv = self._hbuf[2]
        cdef int32_t[::1] mv = self._hbuf[3]
        cdef float *lp = &lv[0, 0]
        cdef uint8_t[::1] gb
        cdef uint8_t *xg = NULL
        if self.lm_head.c.fmt == FMT_I4:
            gb = self._split_scratch(S, D)
            xg = &gb[0]
        with nogil:
            matmul_qt(&self.lm_head.c, &hv[0, 0], S, lp, &qv[0], &sv[0], &rv[0], self.act_block, self.idot,
                      &mv[0] if BLOCK_SUMS else NULL, xg)
            for i in range(<Py_ssize_t>S * self.lm_head.c.O):
                if isnan(lp[i]):
                    bad = i
                    break
        if bad >= 0:
            raise EngineError("NaN in the logits (non-finite activations or weights)")
        return logits

    def step(self, ids, int pos_base, bint absorb_mtp=False):
        """Forward ids at pos_base..; logits of the last row [V] (glm.c step). absorb_mtp: the MTP
        head (if any) absorbs the batch's pairs (token p+1, hidden p) into its KV."""
        x = self._forward(ids, pos_base)
        S = len(x)
        if self.has_mtp and absorb_mtp and S >= 2:
            self.mtp_absorb(ids[1:], x[:S - 1], pos_base)
        return self.logits_rows(x[S - 1:])[0]

    def prefill(self, ids, int pos_base=0, int batch=0, progress=None, bint absorb_mtp=False):
        """Forward a prompt at pos_base..; the logits of its last row [V], as step(). batch > 0:
        in forwards of at most batch rows (near-equal pieces, ceil(S / batch) of them): the
        scratch is bounded by the piece and each routed expert is read once per piece and layer.
        Every piece takes the attention path a single forward of the whole prompt takes, so the
        result does not depend on batch (pieces of <= FUSED_MAX_ROWS rows excepted: they run as
        decode batches). progress(rows_done, rows): after each layer of each piece (rows_done
        counts a piece's rows in proportion to its layers). absorb_mtp: the MTP head (if any) learns
        every (token p+1, hidden p) pair of the prompt, across the pieces' borders."""
        ids = [int(t) for t in ids]
        cdef int S = len(ids), n, size, a, b, k, done = 0, nl = len(self.layers)
        if S < 1:
            raise ValueError("empty prompt")
        if batch < 0:
            raise ValueError(f"batch must be >= 0 (0 = the whole prompt in one forward), got {batch}")
        n = 1 if batch == 0 or batch >= S else (S + batch - 1) // batch
        size = (S + n - 1) // n
        layers_done = [0]

        def on_layer():
            layers_done[0] += 1
            progress(min(done + (b - a) * layers_done[0] // nl, S), S)
        h = np.empty((S, self.cfg.hidden), np.float32) if n > 1 else None    # [S, D] every row's residual
        self._span = (S, pos_base + S) if n > 1 else None
        self._on_layer = on_layer if progress is not None else None
        try:
            for k in range(n):
                a, b = k * size, min(S, (k + 1) * size)
                layers_done[0] = 0
                x = self._forward(ids[a:b], pos_base + a)
                if h is not None:
                    h[a:b] = x
                done = b
                if self.has_mtp and absorb_mtp and a + 1 < S:
                    nxt = ids[a + 1:b + 1]          # the token after each row of the piece
                    self.mtp_absorb(nxt, x[:len(nxt)], pos_base + a)
        finally:
            self._span = None
            self._on_layer = None
        if h is not None:                  # the MTP catch-up of --draft auto reads every prompt row
            self.h_all = h
        return self.logits_rows(x[len(x) - 1:])[0]

    def step_all(self, ids, int pos_base):
        """Forward ids at pos_base..; logits of every row [S, V] (glm.c's step_all)."""
        x = self._forward(ids, pos_base)
        return self.logits_rows(x)

    def forward_all(self, ids):
        """Teacher forcing from position 0: (argmax per position [S], logits [S, V]) (glm.c's forward_all)."""
        self.kv_alloc(len(ids))
        logits = self.step_all(ids, 0)
        return np.argmax(logits, axis=1).astype(np.int64), logits

    def generate(self, prompt, int n_new, callback=None):
        """Greedy continuation of prompt by n_new tokens (glm.c's generate, no drafts, no stop set)."""
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise ValueError("empty prompt")
        self.kv_alloc(len(prompt) + n_new + 2)
        logits = self.step(prompt, 0)
        out = []
        kv = len(prompt)
        while len(out) < n_new:
            tok = int(np.argmax(logits))
            out.append(tok)
            if callback is not None:
                callback(tok)
            if len(out) >= n_new:
                break
            logits = self.step([tok], kv)
            kv += 1
        return out

    # -- speculative decoding ------------------------------------------------------------------

    def _mtp_input(self, int tok, h, bint final_norm):
        """hx = eh_proj · [enorm(embed(tok)) ; hnorm(h')], h' = model.norm(h) if final_norm else h."""
        c = self.cfg
        e = np.empty(c.hidden, np.float32)
        self.embed_row(tok, e)
        cat = np.empty((1, 2 * c.hidden), np.float32)
        cat[0, :c.hidden] = rmsnorm(e[None], self.enorm, c.eps)[0]
        hh = rmsnorm(np.asarray(h, np.float32)[None], self.final_norm, c.eps) if final_norm else \
            np.asarray(h, np.float32)[None]
        cat[0, c.hidden:] = rmsnorm(hh, self.hnorm, c.eps)[0]
        hx = np.empty((1, c.hidden), np.float32)
        cdef Work ws = self._work(1, 1)
        cdef float[:, ::1] cv = cat, hv = hx
        self._mm(self.eh_proj, &cv[0, 0], 1, &hv[0, 0], ws)
        return hx

    def mtp_draft(self, int next_tok, int kv, int G, double min_p=0.0, Sampler sampler=None):
        """Native MTP chain (glm.c's mtp_draft): up to G draft tokens for positions kv+1.. given next_tok
        (the token chosen for position kv) and hlast (the residual at kv-1). Drafts are argmax (glm.c),
        or with a sampling ``sampler`` raced from the head's distribution under the sampler's key of
        their position (race_pick: the target's own draw at that position whenever the head's
        distribution agrees with the model's, so sampled drafts are accepted about as often as the
        two distributions overlap, not only as often as the model draws the head's argmax).
        min_p > 0: the chain ends before a draft whose top-1 probability under the head is below
        min_p (it would likely be rejected and its verify row costs time). The chain runs in C
        (mtp_chain) where the MTP layer suits layers_step; a step whose experts are not resident
        finishes its MLP through the cache, then the chain goes on in C."""
        if not self.has_mtp or G < 1:
            return []
        cdef int p = kv - 1
        if p < 0:
            return []
        NL = self.cfg.n_layers
        if self.kv_start[NL] < 0 or self.kv_start[NL] > p:
            self.kv_start[NL] = p
        G = min(G, self.max_t - 2 - p)       # draft g sits at position p + g + 1 < max_t - 1
        if G < 1:
            drafts, self.mtp_logits = [], []
        elif self._chain_ok(p + G):
            drafts = self._mtp_chain(next_tok, p, G, min_p, sampler)
        else:
            drafts = self._mtp_draft_calls(next_tok, p, G, min_p, sampler)
        self.mtp_next = kv                # row kv-1 now holds the true pair; later rows are speculative
        return drafts

    def _mtp_draft_calls(self, int tok, int p, int G, double min_p, Sampler sampler=None):
        """mtp_draft call by call (float matrices, or attention that needs the per-call path)."""
        h = self.hlast
        drafts = []
        self.mtp_logits = []
        for g in range(G):
            hx = self._mtp_input(tok, h, g == 0)
            self.layer_forward(self.mtp, hx, 1, p + g)
            logits = self._mtp_logits(hx)[0]
            top = int(np.argmax(logits))
            tok = sampler.draft_pick(logits, p + 2 + g) if sampler is not None else top   # (greedy: top)
            if min_p > 0 and 1.0 / np.exp(logits - logits[top]).sum(dtype=np.float32) < min_p:
                break
            self.mtp_logits.append(logits)
            drafts.append(tok)
            h = hx[0]
        return drafts

    def _chain_ok(self, int T):
        """Can the draft chain run in C (mtp_chain)? The MTP layer's attention takes attend_step
        and its dense MLP / shared expert is an integer matrix the fused MLP reads."""
        if not self.stepped or not self.fused or self.etab == NULL or self.remote is not None:
            return False
        L = self.mtp
        cdef Work ws = self._work(1, T)
        return self._step_ok(L, 1, T, ws) and (L.gate is None or (
            int_qt(L.gate, self.idot) and int_qt(L.up, self.idot) and int_qt(L.down, self.idot)))

    cdef int _build_mtp_step(self, Work ws) except -1:
        """self._mstep: the MTP layer's attend_step fields over ws (rebuilt as _build_steps is)."""
        now = (ws, self._gsplit, self.Lc[self.cfg.n_layers], self.Rc[self.cfg.n_layers])
        key = self._mstep_key
        if self._mstep != NULL and key is not None and all(x is y for x, y in zip(key, now)):
            return 0
        if self._mstep == NULL:
            self._mstep = <LayerStep *>calloc(1, sizeof(LayerStep))
            if self._mstep == NULL:
                raise MemoryError()
        if self.mtp.input_group is None:
            self._input_group(self.mtp, False)
        self._fill_step(self.mtp, ws, self._mstep)
        self._mstep_key = (ws, self._gsplit, self.Lc[self.cfg.n_layers], self.Rc[self.cfg.n_layers])
        return 0

    def _chain_buffers(self, int G, int K):
        """The draft chain's buffers for G drafts (grown as needed and kept)."""
        c = self.cfg
        b = self._dbuf
        if b is None or b["logits"].shape[0] < G:
            D, W = c.hidden, 2 * c.hidden
            nb = act_nblocks(W, self.act_block)
            b = self._dbuf = {
                "e": np.zeros(D, np.float32), "cat": np.zeros(W, np.float32),
                "hx": np.zeros((1, D), np.float32), "hn": np.zeros(D, np.float32),
                "logits": np.zeros((G, c.vocab), np.float32),
                "q": np.zeros(c.vocab, np.float32), "pairs": np.zeros(2 * c.vocab, np.float32),
                "toks": np.zeros(G + 1, np.int32),
                "rec_nu": np.zeros(G, np.int32), "rec_ids": np.zeros((G, max(K, 1)), np.int32),
                "t_nu": np.zeros(1, np.int32), "t_ids": np.zeros((1, max(K, 1)), np.int32),
                "xq": np.zeros(2 * W, np.int8), "xs": np.zeros(2 * nb, np.float32),
                "xr": np.zeros(W, np.float32), "xm": np.zeros(2 * nb, np.int32),
                "xg": np.zeros(2 * coli_split_len(W) + 64, np.uint8),
                "h0": np.zeros(D, np.float32), "k0": np.zeros(1, np.int32)}
        return b

    def _note_chain(self, int g0, int g1):
        """The cache's bookkeeping (and the trace) of draft steps g0..g1-1 that mtp_chain finished
        with resident experts used in place."""
        NL = self.cfg.n_layers
        nu, ids = self._dbuf["rec_nu"], self._dbuf["rec_ids"]
        calls = [(NL, ids[i, :nu[i]].tolist()) for i in range(g0, g1) if nu[i] >= 0]
        if calls:
            self.cache.note_hits_calls(calls)
            if self.routing is not None:
                self.routing.extend((self.forwards, NL, 1, e) for _, e in calls)

    cdef int _fill_chain(self, Work ws, FfnScratch fs, dict b) except -1:
        """self._chain: the draft chain's pointers into ws, fs, the buffers b and the weights,
        rebuilt only when one of ws, fs, b is replaced (the key holds them, so none is freed while
        the chain points into it); mtp_draft sets the per-call fields."""
        if self._chain != NULL and self._chain_key is not None and all(
                x is y for x, y in zip(self._chain_key, (ws, fs, b))):
            return 0
        if self._chain == NULL:
            self._chain = <DraftChain *>calloc(1, sizeof(DraftChain))
            if self._chain == NULL:
                raise MemoryError()
        c = self.cfg
        cdef int E = c.n_experts
        cdef DraftChain *C = self._chain
        cdef TokenStep *T = &C.T
        cdef float[:, ::1] hxv = b["hx"], lgv = b["logits"]
        cdef float[::1] ev = b["e"], cv = b["cat"], nv = b["hn"], h0 = b["h0"], qv = b["q"], pv = b["pairs"]
        cdef float[::1] en = self.enorm, hn = self.hnorm, fn = self.final_norm, mn = self.mtp_norm
        cdef int[::1] toks = b["toks"], rnu = b["rec_nu"], tnu = b["t_nu"], k0 = b["k0"]
        cdef int[:, ::1] rids = b["rec_ids"], tids = b["t_ids"]
        cdef int8_t[::1] xq = b["xq"]
        cdef float[::1] xs = b["xs"], xr = b["xr"]
        cdef int32_t[::1] xm = b["xm"]
        cdef uint8_t[::1] xg = b["xg"]
        T.steps, T.k0, T.nL, T.S = self._mstep, &k0[0], 1, 1
        T.D, T.E, T.K, T.x, T.out = c.hidden, E, c.topk, &hxv[0, 0], &ws.out[0, 0]
        T.etab = self.etab + <Py_ssize_t>c.n_layers * E
        T.handoff = False
        ffn_fields(T, fs)
        T.rec_nu, T.rec_ids, T.rec_stride = &tnu[0], &tids[0, 0], tids.shape[1]
        C.embed, C.eh, C.head = &self.embed.c, &self.eh_proj.c, &self.lm_head.c
        C.enorm, C.hnorm, C.fnorm, C.mnorm, C.h0 = &en[0], &hn[0], &fn[0], &mn[0], &h0[0]
        C.D, C.V, C.idot, C.block, C.eps = c.hidden, c.vocab, self.idot, self.act_block, c.eps
        C.e, C.cat, C.hx, C.hn = &ev[0], &cv[0], &hxv[0, 0], &nv[0]
        C.logits, C.toks, C.rec_nu, C.rec_ids = &lgv[0, 0], &toks[1], &rnu[0], &rids[0, 0]
        C.Q, C.pairs = &qv[0], <ProbIdx *>&pv[0]
        C.xq, C.xs, C.xr, C.xm, C.xg = &xq[0], &xs[0], &xr[0], &xm[0] if BLOCK_SUMS else NULL, &xg[0]
        self._chain_key = (ws, fs, b)
        return 0

    def _mtp_chain(self, int next_tok, int p, int G, double min_p, Sampler sampler=None):
        """mtp_draft through mtp_chain (see there); returns the drafts."""
        c = self.cfg
        cdef int NL = c.n_layers, K = c.topk, g = 0, n
        cdef bint resume = False
        cdef Work ws = self._work(1, p + G)
        self._build_mtp_step(ws)
        cdef FfnScratch fs = self._ffn_scratch(K + 1, c.n_experts + 1, 0)
        b = self._chain_buffers(G, K)
        self._fill_chain(ws, fs, b)
        cdef DraftChain *C = self._chain
        cdef int k0 = self.kv_start[NL]
        if not 0 <= k0 <= p:
            raise EngineError(f"MTP layer: KV window starts at {k0}, after position {p}")
        if p + G > self.Lc[NL].shape[0]:
            raise EngineError(f"MTP KV rows {p}..{p + G - 1} exceed the cache")
        if not 0 <= next_tok < self.embed.c.O:
            raise ValueError(f"token id {next_tok} is outside the vocabulary [0, {self.embed.c.O})")
        if self._mapped_made:
            self._check_mapped(NL)
        b["k0"][0] = k0
        b["h0"][:] = self.hlast
        b["toks"][0] = next_tok
        C.T.pos_base, C.p, C.min_p = p, p, min_p
        C.temp = sampler.temperature if sampler is not None and sampler.temperature > 0 else 0.0
        if C.temp > 0:
            C.top_k, C.top_p, C.base = sampler.top_k, sampler.top_p, sampler.base
        C.T.moe_c = not self.pilot or self.cache.prefetch_idle()
        C.T.t_attn = C.T.t_moe = 0.0
        C.top1, C.stop, C.bad = 1.0, 0, -1
        while True:
            with nogil:
                n = mtp_chain(C, g, resume, G)
            if C.bad >= 0:
                raise EngineError(f"MTP layer: NaN in draft step {C.bad} (non-finite activations or weights)")
            # the cache's bookkeeping of this segment's steps, before a hand-off may evict their experts
            self._note_chain(g + (1 if resume else 0), n)
            if C.stop != 2:
                break
            # step n's attention half is done; its MLP needs the cache (an expert not resident)
            self._mlp_calls(self.mtp, b["hx"], 1, ws, self._mstep.nu)
            b["rec_nu"][n] = -1
            g, resume, C.stop = n, True, 0
        if C.stop == 1:
            n -= 1                          # the last draft fell below the threshold: dropped
        self.stepped_calls += n
        self.t_attn += C.T.t_attn
        self.t_moe += C.T.t_moe
        self.mtp_logits = b["logits"][:n].copy()
        return b["toks"][1:1 + n].tolist()

    def _mtp_logits(self, hx):
        """Draft logits: lm_head · shared_head.norm(hx)."""
        return self._head(rmsnorm(hx, self.mtp_norm, self.cfg.eps))

    def mtp_absorb(self, next_ids, x, int pos_base):
        """Teach the MTP KV the verified pairs (token at p+1, residual at p) for
        p = pos_base .. pos_base+S-1 in one batched pass through the MTP layer (glm.c's mtp_absorb)."""
        c = self.cfg
        NL = c.n_layers
        cdef int S = len(next_ids), i
        if S < 1:
            return
        if self.kv_start[NL] < 0 or self.kv_start[NL] > pos_base:
            self.kv_start[NL] = pos_base
        if pos_base < 0 or pos_base + S > self.max_t:
            raise ValueError(f"MTP rows {pos_base}..{pos_base + S - 1} do not fit the KV cache of {self.max_t}")
        hx = np.empty((S, c.hidden), np.float32)
        for i in range(S):
            hx[i] = self._mtp_input(int(next_ids[i]), x[i], True)[0]
        # Only the KV rows of these positions outlive this pass (the layer's outputs for them are
        # never used), and a KV row depends on its own input row alone: write them directly, skipping
        # the attention core, o_proj and the MoE (glm.c runs the whole layer; the KV is identical).
        cdef Work ws = self._work(S, pos_base + S)
        n = rmsnorm(hx, self.mtp.in_ln, c.eps)
        for i in range(0, S, ws.C):
            self.kv_write(self.mtp, n[i:i + ws.C], min(ws.C, S - i), pos_base + i, ws)
        self.mtp_next = pos_base + S

    def spec_decode(self, ids, int kv, int n_new, logits, Sampler sampler, policy=None, stops=(), emit=None,
                    trace=None, constraint=None):
        """Generate up to n_new tokens with speculative decoding (glm.c's spec_decode).

        ids: the token history (a list; ids[:kv] are in the KV cache and are extended in place);
        logits: the distribution for position kv-1. Each iteration picks a token, asks for drafts
        (MTP chain when the model has a head, else n-gram lookup) at the depth the policy chooses,
        verifies [token, drafts] in one batched forward and accepts the longest agreeing prefix:
        greedy by exact argmax; sampled, a draft is accepted when it is the token the position's
        race draws from p (Sampler), else the token is that draw (the draft banned): whatever the
        drafts, every emitted token is plain sampling's with the same seed, so this is lossless.
        glm.c instead tests a point-mass draft against a sequential stream (accepted with probability
        p(draft)), which makes its sampled output depend on the drafts tested; MTP drafts here are
        raced from the head's distribution with the position's key (mtp_draft), which the target's
        draw matches as often as the two distributions overlap.
        Returns (emitted tokens, kv). Stops (not emitted) on a token in ``stops``. ``trace``, a list,
        receives (kv, token, drafts) for every iteration that drafted.

        ``constraint`` (colibri.grammar.Constraint): every pick and every draft test sees the logits
        masked to what the grammar allows after the tokens before it, so the output is constrained
        sampling's (greedy: the allowed argmax) whatever the drafts; drafts the grammar refuses are
        cut before the verify, and where it allows one token alone, that token (and the next ones
        it forces) is the draft, without asking the policy or the head. The generation ends when
        the grammar's output is complete."""
        from .draft import DraftPolicy
        if policy is None:
            policy = DraftPolicy(0)
        if len(ids) < kv:
            raise ValueError("history shorter than the KV position")
        del ids[kv:]
        stops = set(stops)
        cdef bint greedy = sampler.temperature <= 0
        cdef int carry_ban = -1, g, k, nxt, d, i
        cdef bint forced
        con = constraint
        out = []
        # MTP context, absorbed lazily: residual rows of positions whose (token, hidden) pair is not
        # yet in the MTP KV. Iterations without drafts cost nothing for the head; before the next
        # draft the missing rows are absorbed in one batched pass, so its context is always exact.
        pending = {}
        if self.has_mtp and not policy.off:
            # h_all holds the residual rows of the last forward: positions base .. kv-1
            base = kv - len(self.h_all) if self.h_all is not None and len(self.h_all) <= kv else kv - 1
            if self.mtp_next < base:
                # the hidden states of positions before this forward are gone (a reused prompt
                # prefix): the MTP window starts afresh at the forward's first row
                self.kv_start[self.cfg.n_layers] = -1
                self.mtp_next = base
            if self.h_all is not None and base < kv:
                pending = {p: self.h_all[p - base] for p in range(self.mtp_next, kv)}
        while len(out) < n_new:
            if con is not None:
                logits = mask_logits(logits, con.allowed(), con.out)
            nxt = sampler.pick_tok(logits, carry_ban, len(ids), ids)
            carry_ban = -1
            if nxt in stops:
                break
            out.append(nxt)
            ids.append(nxt)
            if emit is not None:
                emit(nxt)
            if con is not None:
                con.consume(nxt)
                if con.stopped:
                    break                 # the grammar's output is complete
            if len(out) >= n_new:
                break                     # the last token is not forwarded (as in glm.c's spec_decode)
            t0 = time.perf_counter()
            t_catch = t_absorb = 0.0
            self.lookahead_on = self.pilot and self.lookahead.enabled()    # (no lookahead: no counters read)
            drafts = con.forced(min(n_new - len(out), self.max_t - kv - 2, 16)) if con is not None else []
            forced = len(drafts) > 0
            d = 0 if forced else policy.depth()
            if d > 0 and self.has_mtp:
                if self.mtp_next < kv - 1:
                    # catch-up after draft-free iterations (or the prompt): a one-off cost, kept out
                    # of the per-iteration cost the policy compares depths with
                    t_catch = time.perf_counter()
                    rows = range(self.mtp_next, kv - 1)
                    self.mtp_absorb(ids[self.mtp_next + 1:kv], np.stack([pending[p] for p in rows]), self.mtp_next)
                    t_catch = time.perf_counter() - t_catch
                for p in [p for p in pending if p < kv]:
                    del pending[p]
                drafts = self.mtp_draft(nxt, kv, d, policy.min_p, sampler)
            elif d > 0:
                drafts = ngram_draft(ids, d)
            if con is not None and drafts and not forced:
                drafts = drafts[:con.valid_prefix(drafts)]
            t_draft = time.perf_counter() - t0 - t_catch
            proposed = len(drafts)
            if trace is not None and drafts:
                trace.append((kv, nxt, list(drafts)))
            g = min(len(drafts), n_new - len(out), self.max_t - kv - 2)
            drafts = drafts[:max(g, 0)]
            g = len(drafts)
            if kv + 1 + g > self.max_t:
                raise ValueError(f"position {kv + g} is beyond the KV cache of {self.max_t} positions")
            t_verify = time.perf_counter()
            self.drop_plan = None if forced else self._drop_plan(policy, g)
            try:
                lo = self.step_all([nxt] + drafts, kv)
            finally:
                self.drop_plan = None
            if len(lo) < 1 + g:             # trailing drafts dropped at a layer that would read for them
                g = len(lo) - 1
                drafts = drafts[:g]
            t_verify = time.perf_counter() - t_verify
            h_all = self.h_all
            k = 0
            done = False
            while k < g and len(out) < n_new:
                ok = sampler.accepts(lo[k] if con is None else mask_logits(lo[k], con.allowed(), con.out), drafts[k], len(ids), ids)
                if not ok:
                    if not greedy:
                        carry_ban = drafts[k]
                    break
                if drafts[k] in stops:
                    done = True
                    break
                out.append(drafts[k])
                ids.append(drafts[k])
                if emit is not None:
                    emit(drafts[k])
                k += 1
                if con is not None:
                    con.consume(drafts[k - 1])
                    if con.stopped:
                        done = True
                        break
            if forced:
                con.forced_tokens += k
            if self.has_mtp and d > 0 and k >= 1:
                t_absorb = time.perf_counter()
                self.mtp_absorb(ids[kv + 1:kv + 1 + k], h_all[:k], kv)   # rows kv..kv+k-1
                t_absorb = time.perf_counter() - t_absorb
            if self.has_mtp and not policy.off:
                for i in range(k if (d > 0 and k >= 1) else 0, k + 1):
                    pending[kv + i] = np.array(h_all[i], copy=True)
            self.hlast = np.array(h_all[k], copy=True)
            kv += 1 + k
            logits = lo[k]
            t_iter = time.perf_counter() - t0
            if not forced:                # forced drafts are the grammar's, not a depth the policy chose
                policy.record(d, proposed, k, t_iter - t_catch, verified=g,
                              parts=(t_draft, t_verify, t_absorb + t_catch, t_iter))
            if self.pilot:
                self.lookahead.record(time.perf_counter() - t0, 1 + k)
            self.decode_forwards += 1
            if done:
                break
        self.emitted += len(out)
        return out, kv

    def _drop_plan(self, policy, int g):
        """The drop_plan of a verify forward with g drafts (None: keep every row): while experts
        stream from disk and the policy knows its drafts' acceptance (verify_values): the seconds
        the forwards have waited per expert read, each row's chance, and what an accepted draft
        saves per MoE layer besides reads (a decode forward's time without its disk waits, per row:
        _row_s)."""
        c = self.cfg
        if g < 1 or self.cache.capacity >= c.n_experts or self.remote is not None:
            return None
        accept = policy.verify_values(g)
        misses = self.cache.miss_count()
        if accept is None or misses < 1 or self._row_s <= 0:
            return None
        n_moe = max(sum(c.sparse[:c.n_layers]), 1)
        return (self.t_disk / misses, [1.0] + list(accept), self._row_s / n_moe)

    def dsa_note(self):
        """One line on how attention departs from the model's DSA selection, or None."""
        if not self.indexer_absent:
            return None
        c = self.cfg
        return (f"{self.path} has no DSA indexer (missing {self.indexer_absent}): attention is dense; exact "
                f"while the context fits in index_topk = {c.index_topk} tokens, dense instead of the "
                f"model's top-{c.index_topk} selection beyond")

    def set_cache_capacity(self, int capacity, bint prefetch=True, keep_bytes=None):
        """Routed experts kept per layer in the LRU (colibri.tiers sizes it for the RAM budget):
        ``keep_bytes`` of evicted experts stay in memory where the model keeps them (keeps_evicted);
        the router-lookahead prefetch runs when asked, allowed by model_init's prefetch mode, and
        not every expert fits."""
        if not 1 <= capacity <= self.cfg.n_experts:
            raise ValueError(f"cache capacity must be in 1..{self.cfg.n_experts}, got {capacity}")
        self.cache.set_capacity(capacity)
        if keep_bytes is not None and self.keeps_evicted():
            self.cache.set_keep_bytes(int(keep_bytes))
        self.cache_experts = capacity
        self.pilot = prefetch and self.lookahead.mode != "off" and capacity < self.cfg.n_experts

    def record_routing(self, bint on=True):
        """Start (a fresh list) or stop collecting ``routing``: one (forward, layer, rows, unique
        experts ascending) tuple per MoE layer call, for ``run --trace``."""
        self.routing = [] if on else None

    def reset_stats(self):
        self.bytes_read = self.forwards = 0
        self.decode_forwards = self.emitted = 0
        self.t_disk = self.t_attn = self.t_moe = 0.0
        self.rows_dropped = 0
        self.overlapped_calls = self.stepped_calls = 0
        self.cache.reset_stats()
        self._io.reset()

    def resident_bytes(self):
        """Bytes of every resident weight: embeddings, lm_head, final norm, and per layer (the MTP
        head's included) the attention and indexer projections, dense/shared MLP, router and its
        bias, and the norm vectors; plus the MTP head's eh_proj and norms. Routed experts are not
        resident (the expert cache holds them)."""
        tot = self.embed.nbytes + (0 if self.lm_head is self.embed else self.lm_head.nbytes)
        tot += self.final_norm.nbytes
        for L in list(self.layers) + ([self.mtp] if self.has_mtp else []):
            for W in (L.q_a, L.q_b, L.kv_a, L.kv_b, L.o_proj, L.gate, L.up, L.down, L.iwq, L.iwk, L.iwp,
                      L.router):
                if W is not None:
                    tot += W.nbytes
            for v in (L.in_ln, L.post_ln, L.q_a_ln, L.kv_a_ln, L.router_bias, L.ik_w, L.ik_b):
                if v is not None:
                    tot += v.nbytes
        if self.has_mtp:
            tot += self.eh_proj.nbytes + self.enorm.nbytes + self.hnorm.nbytes + self.mtp_norm.nbytes
        return tot

    def __dealloc__(self):
        free(self.etab)
        free(self._steps)
        free(self._mstep)
        free(self._chain)

    def close(self):
        if self.cache is not None:
            self.cache.close()
        for fd in (self._direct_fds or {}).values():
            os.close(fd)
        self._direct_fds = {}
        if self.st is not None:
            self.st.close()


# ---------------------------------------------------------------------------------------------
# 8. model_init and its loading helpers
# ---------------------------------------------------------------------------------------------

MTP_REQUIRED = ("eh_proj.weight", "enorm.weight", "hnorm.weight", "shared_head.norm.weight",
                "input_layernorm.weight", "post_attention_layernorm.weight",
                "self_attn.q_a_proj.weight", "self_attn.q_b_proj.weight", "self_attn.kv_a_proj_with_mqa.weight",
                "self_attn.kv_b_proj.weight", "self_attn.o_proj.weight")


def _has_mtp_tensors(st, int n_layers):
    """MTP head present: the layer after the last one has the MTP tensors (any expert count;
    glm.c's check for expert 255 is a bug)."""
    p = f"model.layers.{n_layers}."
    return all(p + name in st for name in MTP_REQUIRED)


def _load_mtp(Model m):
    c = m.cfg
    NL = c.n_layers
    p = f"model.layers.{NL}."
    sparse = p + "mlp.gate.weight" in m.st
    m.mtp = m._load_layer(NL, sparse=sparse)
    # runtime quantization of a float MTP head: never below int8 (an int4 head drafts badly)
    bits = m.dense_bits if m.dense_bits >= 8 else 8
    m.eh_proj = m._load_qt(p + "eh_proj.weight", c.hidden, 2 * c.hidden, bits)
    m.enorm = m._load_vec(p + "enorm.weight", c.hidden)
    m.hnorm = m._load_vec(p + "hnorm.weight", c.hidden)
    m.mtp_norm = m._load_vec(p + "shared_head.norm.weight", c.hidden)


def _init_dsa(Model m, cfg, bint dsa, bint dsa_force):
    """Decide sparse (DSA) or dense attention from the config and the tensors present.

    A container without the indexer tensors (colibrì's converter omits them unless its --indexer
    pass ran) attends densely: the same output while every context fits in index_topk, since the
    indexer then keeps every key; past index_topk it is dense instead of the model's top-k, which
    the engine records (dense_past_topk) and dsa_note() describes. --dsa-force needs the indexer."""
    m.indexer_absent = ""
    m.dense_past_topk = False
    m.has_dsa = False
    if not dsa:
        return
    missing = indexer_missing(cfg, m.st, m.path)
    if missing is not None:
        m.indexer_absent = missing
        if dsa_force:
            raise _st.ContainerError(f"{m.path}: --dsa-force needs the DSA indexer, but the container has no "
                                     f"tensor {missing} (colibrì's converter writes the indexer only in "
                                     "its --indexer pass; 'python -m colibri convert' keeps it)")
        return
    m.has_dsa = cfg.dsa


def model_init(path, *, int cache_experts=0, int dense_bits=32, int expert_bits=32, int idot=IDOT_Q8X2,
               int act_block=0, int absorb=-1, bint dsa_force=False, bint dsa=True, bint mtp=True,
               isa=None, threads=0, int io_threads=4, prefetch=True, bint direct=False):
    """Load a model directory (our container or a plain HF checkpoint).

    cache_experts: routed experts kept per layer in the LRU cache (0 = all of them).
    dense_bits / expert_bits: precision for tensors stored as floats (>= 16 keeps f32; 8 int8; 4 int4);
        container tensors keep the format they were converted to.
    idot: matmul path for int8/int4 weights: 2 = integer dots on Q8 activations plus their Q8
        residual (default, near-float accuracy), 1 = plain per-block Q8 activations (colibrì's IDOT,
        fastest), 0 = float dequant-on-use dots.
    act_block: activation quantization block (0 = one scale per row, else a multiple of 64).
    absorb: -1 auto (absorbed attention for batches of <= 17 rows, decode and verify, and for longer
        ones past ABSORB_KV_BYTES of kv_b rows or when the DSA selection runs), 0 never, 1 always.
    io_threads: readers that load the missing experts of one MoE call concurrently.
    prefetch: router-lookahead prefetch of the next layer's experts (only when experts stream):
        True / 'auto' = while it pays in wall time (colibri.lookahead), 'on' always, False / 'off'
        never (Options.prefetch: COLIBRI_PREFETCH=on|off|auto for A/B runs).
    direct: read expert payloads with O_DIRECT (bypassing the OS page cache).
    """
    path = os.fspath(path)
    mode = parse_prefetch(prefetch)
    cfg = load_config(path)
    if absorb not in (-1, 0, 1):
        raise ValueError(f"absorb must be -1, 0 or 1, got {absorb}")
    if cache_experts < 0:
        raise ValueError(f"cache_experts must be >= 0, got {cache_experts}")
    _kernel_settings(act_block, idot, io_threads, isa, threads)
    cdef Model m = _new_model(path, cfg)
    m.idot = idot
    m.act_block = act_block
    m.absorb = absorb
    m.fused = switch("FUSED") != "0"
    m.overlap = switch("OVERLAP") != "0"     # 0: for A/B measurements
    m.prefill_chunk = PREFILL_CHUNK
    m.stream_group = STREAM_GROUP
    m.stepped = switch("STEP") != "0"       # 0: call by call, for A/B runs
    m.dsa_force = dsa_force
    m.dense_bits = dense_bits
    m.expert_bits = expert_bits
    m.cache_experts = cache_experts if cache_experts > 0 else cfg.n_experts
    m.inv_freq = rope_inv_freq(cfg.qk_rope, cfg.rope_theta)
    m._arena = _Arena()       # the resident matrices, then the experts read at start-up
    io_bits = 32 if dense_bits >= 8 else dense_bits
    m.embed = m._load_qt("model.embed_tokens.weight", cfg.vocab, cfg.hidden, io_bits)
    if "lm_head.weight" in m.st:
        m.lm_head = m._load_qt("lm_head.weight", cfg.vocab, cfg.hidden, io_bits)
    elif cfg.tie_embeddings:
        m.lm_head = m.embed
    else:
        raise _st.ContainerError(f"{path}: missing tensor lm_head.weight")
    m.final_norm = m._load_vec("model.norm.weight", cfg.hidden)
    _init_dsa(m, cfg, dsa, dsa_force)
    m.layers = [m._load_layer(i) for i in range(cfg.n_layers)]
    m.has_mtp = bool(mtp) and _has_mtp_tensors(m.st, cfg.n_layers)
    if m.has_mtp:
        _load_mtp(m)
    m._interleave_resident()
    _expert_io(m, direct)
    mappable = not direct and _mappable_experts(m)
    m.mapped = mappable and _maps_experts(m)
    # opt-in (COLIBRI_MAP_STREAM=1): the prefill gains, but the experts it leaves mapped in the LRU
    # slow the decode after it (GLM-5 slice, 1024-token prompt: prefill 15.6-25.4 s vs 22.8-30.4 s,
    # decode 2.0-2.4 vs 6.6-7.1 tok/s)
    m.map_stream = mappable and switch("MAP_STREAM") == "1"
    # Rows of the cache: every layer index (dense ones stay empty) plus the MTP row.
    m.cache = ExpertCache(m.expert_load, cfg.n_layers + 1, m.cache_experts, io_threads=io_threads,
                          prefetch=mode != "off", n_experts=cfg.n_experts)
    m.pilot = mode != "off" and m.cache_experts < cfg.n_experts
    cache = m.cache
    m.lookahead = PrefetchPolicy(mode, counters=lambda: cache.stats)   # judged by its reads as well as its time
    m.lookahead_on = True
    m.cache.overshoot = cfg.topk            # within the RAM plan's per-call allowance
    m._slabs = SlabPool(_Arena._fresh)
    m.cache.on_evict = m._release_expert
    m.etab = <ExpertRef *>calloc((cfg.n_layers + 1) * cfg.n_experts, sizeof(ExpertRef))
    if m.etab == NULL:
        raise MemoryError()
    m.cache.on_change = m._on_cache_change
    if mappable:        # a no-op until an expert is used in place (_check_mapped)
        m.cache.guard = m._check_mapped
    if m.mapped:
        # evicted experts stay mapped while a call may still use them (the RAM plan's call allowance)
        m.cache.set_keep_bytes(EXTRA_CALL_EXPERTS * max(_expert_disk_bytes(m.st, li) for li in range(cfg.n_layers + 1)))
    m.reset_stats()
    return m


def _kernel_settings(int act_block, int idot, int io_threads, isa, threads):
    """Check the settings model_init and experts_init share, then select the ISA (None: the
    COLIBRI_ISA switch) and the thread count (0: keep)."""
    check_block(act_block)
    check_idot(idot)
    if io_threads < 1:
        raise ValueError(f"io_threads must be >= 1, got {io_threads}")
    if isa is None:
        isa = switch("ISA")
    if isa:
        select_isa(isa)
    if threads:
        coli_set_threads(threads)


def _new_model(path, cfg):
    """A Model over the container at path (config checked), before any weight is read."""
    cdef Model m = Model()
    m.cfg = cfg
    m.path = path
    m.st = _st.SafeTensorsDir(path)
    fp8 = next((n for n in m.st.names() if m.st.info(n).dtype.startswith("F8")), None)
    if fp8 is not None:
        # FP8 weights need their *_scale_inv block scales, which only the converter applies
        info = m.st.info(fp8)
        raise _st.ContainerError(f"{info.path}: tensor {fp8} is {info.dtype}: FP8 checkpoints run after "
                                 "conversion ('python -m colibri convert SRC DST'), which applies their "
                                 "block scales")
    return m


def _expert_io(Model m, bint direct):
    m.direct = direct
    m._direct_fds = {}
    m._expert_layouts = {}
    m._row_files = {}
    m._io = IoClock()


def experts_init(path, *, int expert_bits=32, int idot=IDOT_Q8X2, int act_block=0, isa=None, threads=0,
                 int io_threads=4, bint direct=False):
    """A Model that holds routed experts only (an expert worker of colibri.cluster): the config and
    the container's expert tensors are checked as model_init checks them, no dense weight is read;
    expert_outputs computes with the experts its cache holds (every expert of a layer fits; load
    them with cache.fetch), with the kernels and settings of the coordinator's model."""
    path = os.fspath(path)
    cfg = load_config(path)
    _kernel_settings(act_block, idot, io_threads, isa, threads)
    cdef Model m = _new_model(path, cfg)
    m.idot, m.act_block, m.absorb = idot, act_block, 0
    m.fused = switch("FUSED") != "0"
    m.prefill_chunk = PREFILL_CHUNK
    m.stream_group = STREAM_GROUP
    m.expert_bits = expert_bits
    m.dense_bits = 32
    m.cache_experts = cfg.n_experts
    m.layers = []
    m._arena = _Arena()
    for i in range(cfg.n_layers):
        if cfg.sparse[i]:
            m._check_expert_tensors(i)
    if _has_mtp_tensors(m.st, cfg.n_layers) and f"model.layers.{cfg.n_layers}.mlp.gate.weight" in m.st:
        m._check_expert_tensors(cfg.n_layers)
    _expert_io(m, direct)
    m.mapped = m.map_stream = False
    m.cache = ExpertCache(m.expert_load, cfg.n_layers + 1, cfg.n_experts, io_threads=io_threads,
                          prefetch=False, n_experts=cfg.n_experts)
    m.pilot = False
    m._slabs = SlabPool(_Arena._fresh)
    m.cache.on_evict = m._release_expert
    m.reset_stats()
    return m


def _expert_disk_bytes(st, int li):
    """Payload + scale bytes of expert 0 of row li in the container (0 if it has none)."""
    p = f"model.layers.{li}.mlp.experts.0."
    return sum(st.info(p + m + ".weight" + x).nbytes for m in ("gate_proj", "up_proj", "down_proj")
               for x in ("", ".qs") if p + m + ".weight" + x in st)


def _maps_experts(Model m):
    """COLIBRI_MMAP: 1 = use container experts in place in the file mapping, 0 = read them with
    pread, auto (default) = in place unless the model lays rows out for the tiles (Model.lays_out):
    an expert that stays in memory is multiplied faster in the interleaved layout than read in
    place in the file's (bench fixture, 4 experts per layer over the page cache, every one kept:
    decode 1.2x) and a read from the page cache costs about its bytes at copy speed, once."""
    v = switch("MMAP").lower()
    if v not in ("0", "1", "auto"):
        raise ValueError(f"COLIBRI_MMAP={v!r}: expected 0, 1 or auto")
    return v == "1" or (v == "auto" and not m.lays_out())


def _mappable_experts(Model m):
    """Whether the container's experts can be used in place: every file holding routed experts
    maps (a filesystem that cannot is read with pread instead)."""
    c = m.cfg
    files = set()
    for li in range(c.n_layers + 1):
        name = f"model.layers.{li}.mlp.experts.0.gate_proj.weight"
        if name + ".qs" in m.st:
            files.add(m.st.info(name).file_index)
    if not files:
        return False
    try:
        for fi in range(len(m.st.paths)):
            m.st.map(fi)
    except _st.ContainerError:
        return False
    return True


class _ExpertLayout:
    """Where one container expert lies on disk, worked out once: its three payloads (gate, up,
    down TensorInfos), their file order, whether they form one contiguous range (and each one's
    start in it), and the byte span of their three F32 scale vectors when those are adjacent.
    Mapped experts (Model.mapped) also keep here their Expert, made once, ``spans``: the
    page-aligned (address, bytes) ranges of the mapping their tensors cover (faulted in by a load),
    and ``drops``: the same widened to the kernel's fault-around windows (dropped by a release)."""
    __slots__ = ("payloads", "order", "contiguous", "starts", "total", "scales", "scale_span", "expert",
                 "spans", "drops")

    def __init__(self, st, names):
        p = self.payloads = [st.info(n) for n in names]
        self.order = sorted(range(3), key=lambda k: p[k].offset)
        o = self.order
        self.total = sum(i.nbytes for i in p)
        self.contiguous = all(p[o[k]].file_index == p[o[0]].file_index and
                              p[o[k]].offset == p[o[k - 1]].offset + p[o[k - 1]].nbytes for k in range(1, 3))
        self.starts = [0, 0, 0]
        at = 0
        for k in o:                   # in one range: offsets from the first; else packed in order
            self.starts[k] = p[k].offset - p[o[0]].offset if self.contiguous else at
            at += p[k].nbytes
        sc = self.scales = [st.info(n + ".qs") for n in names]
        lo = min(sc, key=lambda i: i.offset)
        span = max(i.offset + i.nbytes for i in sc) - lo.offset
        adjacent = (all(i.dtype == "F32" and i.file_index == lo.file_index and (i.offset - lo.offset) % 4 == 0
                        for i in sc) and span == sum(i.nbytes for i in sc))
        self.scale_span = (lo, span) if adjacent else None
        self.expert = None
        self.spans = self.drops = None

    def map_spans(self, st):
        """Set ``spans`` and ``drops`` from st's mappings (see the class doc). A fault maps the
        pages of its whole fault-around window that are in the page cache (64 KiB by default), so
        a load maps a little of its neighbours' ranges too; a release drops those as well (a page
        a neighbour in use loses is faulted back in when it is next touched)."""
        def ranges(align):
            rs = []
            for i in self.payloads + self.scales:
                m = st.map(i.file_index)
                base, end = m.ctypes.data, m.ctypes.data + ((m.shape[0] + _PAGE - 1) & ~(_PAGE - 1))
                rs.append([max((base + i.offset) & ~(align - 1), base),
                           min((base + i.offset + i.nbytes + align - 1) & ~(align - 1), end)])
            rs.sort()
            out = [rs[0]]
            for a, b in rs[1:]:
                last = out[len(out) - 1]       # (no negative indices: the module has wraparound off)
                if a <= last[1]:
                    last[1] = max(last[1], b)
                else:
                    out.append([a, b])
            return [(a, b - a) for a, b in out]
        self.spans = ranges(_PAGE)
        self.drops = ranges(max(_FAULT_AROUND, _PAGE))


# -- the container mapping: pages in, pages out -----------------------------------------------

cdef extern from *:
    """
    #include <sys/mman.h>
    #include <errno.h>
    #if defined(MADV_POPULATE_READ)
    #define COLI_MADV_POPULATE_READ MADV_POPULATE_READ
    #elif defined(__linux__)
    #define COLI_MADV_POPULATE_READ 22      /* Linux >= 5.14 */
    #else
    #define COLI_MADV_POPULATE_READ -1
    #endif
    #if defined(MADV_HUGEPAGE)
    #define COLI_MADV_HUGEPAGE MADV_HUGEPAGE
    #else
    #define COLI_MADV_HUGEPAGE -1
    #endif
    static volatile unsigned char coli_touch_sink;
    /* Read one byte of every page of [p, p + n): the fallback that faults pages in where
       MADV_POPULATE_READ does not exist (a page beyond the end of the file raises SIGBUS here). */
    static void coli_touch_pages(const unsigned char *p, size_t n, size_t page) {
        unsigned char acc = 0;
        for (size_t i = 0; i < n; i += page) acc ^= p[i];
        coli_touch_sink = acc;
    }
    """
    int madvise(void *addr, size_t n, int advice) nogil
    int MADV_DONTNEED, MADV_WILLNEED, COLI_MADV_POPULATE_READ, COLI_MADV_HUGEPAGE
    int errno
    int EINVAL, EFAULT, EINTR, EAGAIN
    void coli_touch_pages(const unsigned char *p, size_t n, size_t page) nogil

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_FAULT_AROUND = 65536          # Linux's default fault_around_bytes
cdef bint _populate_ok = COLI_MADV_POPULATE_READ >= 0


def _map_in(spans, lay):
    """Fault the pages of spans into the process (I/O threads call this, so that the matmuls do
    not stall on page faults): readahead of the whole ranges (MADV_WILLNEED: one large read each
    for pages not in the page cache), then MADV_POPULATE_READ (or a read per page where it does
    not exist). A range beyond the end of the file is a ContainerError naming lay's first tensor."""
    global _populate_ok
    cdef uintptr_t a
    cdef size_t n, page = _PAGE
    cdef int r, err
    for addr, nbytes in spans:
        a, n = addr, nbytes
        with nogil:
            madvise(<void *>a, n, MADV_WILLNEED)
            while True:
                if not _populate_ok:
                    coli_touch_pages(<const unsigned char *>a, n, page)
                    r = 0
                    break
                r = madvise(<void *>a, n, COLI_MADV_POPULATE_READ)
                err = errno
                if r == 0 or (err != EINTR and err != EAGAIN):
                    break
        if r != 0:
            if err == EINVAL:              # a kernel before 5.14: touch the pages instead
                _populate_ok = False
                with nogil:
                    coli_touch_pages(<const unsigned char *>a, n, page)
                continue
            info = lay.payloads[lay.order[0]]
            if err == EFAULT:
                raise _st.ContainerError(f"{info.path}: short read of {info.name} (its pages are beyond the "
                                         "end of the file); the file was truncated or changed while running")
            raise _st.ContainerError(f"{info.path}: cannot read the pages of {info.name} "
                                     f"({os.strerror(err)})")


def _map_out(spans):
    """Drop the pages of spans from the process's RSS (MADV_DONTNEED on a shared read-only file
    mapping: they stay in the page cache, and a later touch maps them again)."""
    cdef uintptr_t a
    cdef size_t n
    for addr, nbytes in spans:
        a, n = addr, nbytes
        with nogil:
            madvise(<void *>a, n, MADV_DONTNEED)


# -- buffers: transparent huge pages, the arena -----------------------------------------------

_HUGE = 2 << 20      # bytes of a transparent huge page
# RSS the expert buffers (cache.SlabPool) may hold beyond their bytes, counted by the RAM plan
# (tiers.work_bytes_estimate): the huge page being carved, for each expert size (main rows, MTP)
BUFFER_SLACK_BYTES = 2 * _HUGE


def _advise_huge_pages(a):
    """Ask the kernel to back the whole 2 MiB spans of array a with transparent huge pages (a
    hint: nothing changes where THP is off or the call fails)."""
    cdef uintptr_t lo = (<uintptr_t>a.ctypes.data + _HUGE - 1) & ~(<uintptr_t>_HUGE - 1)
    cdef uintptr_t hi = (<uintptr_t>a.ctypes.data + <uintptr_t>a.nbytes) & ~(<uintptr_t>_HUGE - 1)
    if COLI_MADV_HUGEPAGE >= 0 and hi > lo:
        madvise(<void *>lo, hi - lo, COLI_MADV_HUGEPAGE)


class _Arena:
    """Buffers that stay for the whole run (the resident matrices, the experts read at start-up),
    carved one after the other out of chunks of CHUNK bytes that the kernel is asked to back with
    transparent huge pages (_advise_huge_pages), so a token's weight reads walk one TLB entry per 2 MiB instead of
    one per 4 KiB page (bench fixture: decode 1.04-1.06x; with 4 KiB pages a model's speed also
    depended on what the process had allocated before it, up to 8%). Buffers are never given back."""
    CHUNK = 64 << 20

    def __init__(self):
        self._chunk = None
        self._used = 0
        self._lock = threading.Lock()

    def take(self, nbytes):
        """nbytes of a chunk, starting on a BUFFER_ALIGN boundary (more than a quarter chunk: an
        allocation of its own, advised the same way)."""
        align = _st.BUFFER_ALIGN
        if nbytes > self.CHUNK // 4:
            return self._fresh(nbytes)
        with self._lock:
            at = -(-self._used // align) * align
            if self._chunk is None or at + nbytes > self._chunk.shape[0]:
                self._chunk = self._fresh(self.CHUNK)
                at = 0
            self._used = at + nbytes
            return self._chunk[at:at + nbytes]

    @staticmethod
    def _fresh(nbytes):
        a = _st.aligned_empty(nbytes)
        _advise_huge_pages(a)
        return a


# ---------------------------------------------------------------------------------------------
# 9. Drafts: n-gram prompt lookup, the native MTP chain
# ---------------------------------------------------------------------------------------------

def ngram_draft(ids, int G):
    """Prompt lookup: find the most recent earlier occurrence of the last two tokens and propose
    the (at most G) tokens that followed it."""
    cdef int n = len(ids), i
    if n < 4 or G < 1:
        return []
    a, b = ids[n - 2], ids[n - 1]
    for i in range(n - 3, 0, -1):
        if ids[i - 1] == a and ids[i] == b:
            return list(ids[i + 1:min(i + G, n - 1) + 1])
    return []


cdef struct ProbIdx:
    float p
    int i


cdef inline unsigned long long mix64(unsigned long long z) noexcept nogil:
    """splitmix64's output function."""
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL
    return z ^ (z >> 31)


cdef inline unsigned long long pos_key(unsigned long long base, long long pos) noexcept nogil:
    """The key of sequence position pos under a sampler's seed state."""
    return mix64(base + (<unsigned long long>pos) * 0x9E3779B97F4A7C15ULL)


cdef inline double key_u(unsigned long long key, int i) noexcept nogil:
    """Token i's uniform in (0, 1) under a position's key (the splitmix64 stream that starts at it)."""
    return (<double>(mix64(key + (<unsigned long long>(i + 1)) * 0x9E3779B97F4A7C15ULL) >> 11) + 0.5) * (
        1.0 / 9007199254740992.0)


cdef int race_pick(const float *P, int V, unsigned long long key, int ban) noexcept nogil:
    """The winner of an exponential race over P [V] (token ``ban`` left out, -1: none): argmax of
    P[i] / E_i with E_i = -log(key_u(key, i)) ~ Exp(1), i.e. the first of independent exponential
    clocks with rates P[i] to ring - a draw from P (without ban, renormalized). It is a function of
    the key, so two distributions raced with one key pick the same token as often as they overlap
    (P[same] >= (1 - TV) / (1 + TV)): a draft raced from the MTP head's distribution is the target's
    draw whenever the two agree, not only when the target happens to pick the head's argmax. And
    leaving ``ban`` out changes the winner only when ``ban`` won. A token cannot win unless
    u_i > exp(-P[i]/best) >= 1 - P[i]/best: the others are skipped without a log (with a margin far
    above rounding, so the skips never change the winner)."""
    cdef int i, top = -1, win
    cdef double best, x, r, u
    for i in range(V):
        if i != ban and P[i] > 0 and (top < 0 or P[i] > P[top]):
            top = i
    if top < 0:                         # no mass outside ban (cannot happen after a rejection)
        return 1 if ban == 0 and V > 1 else 0
    win = top
    best = P[top] / -log(key_u(key, top))
    for i in range(V):
        if i == top or i == ban or not P[i] > 0:
            continue
        x = P[i] / best
        u = key_u(key, i)
        if u <= 1.0 - x * 1.000001 - 1e-12:
            continue
        r = P[i] / -log(u)
        if r > best:
            best, win = r, i
    return win


cdef struct DraftChain:
    # The MTP head's draft chain (mtp_chain) of one mtp_draft call; filled by Model._chain.
    TokenStep T                         # the MTP layer as a one-layer forward (T.x = hx)
    const QTc *embed                    # [V, D]
    const QTc *eh                       # eh_proj [D, 2D]
    const QTc *head                     # lm_head [V, D]
    const float *enorm                  # [D]
    const float *hnorm                  # [D]
    const float *fnorm                  # [D] the model's final norm (the first step's hidden)
    const float *mnorm                  # [D] shared_head.norm
    const float *h0                     # [D] the main model's residual at position p (hlast)
    int D, V, p, idot, block
    float eps
    float min_p                         # stop after a draft whose top-1 probability is below this
    double temp, top_p                  # sampled drafts (temp > 0): raced from the head's distribution
    int top_k                           # (the sampler's temperature / top-k / top-p) under ...
    unsigned long long base             # ... the key of the draft's position (pos_key); temp 0: argmax
    float *Q                            # [V] the head's distribution (temp > 0)
    ProbIdx *pairs                      # [V] dist_build's scratch
    float *e                            # [D] embedding row
    float *cat                          # [2D] eh_proj's input
    float *hx                           # [D] the MTP residual (in/out of each step)
    float *hn                           # [D] a normalized row
    float *logits                       # [G, V] out: each draft's logits
    int *toks                           # [G] in: toks[-1] is next_tok (toks - 1 valid); out: drafts
    int *rec_nu                         # [G] out: experts each step used in place (-1: Python did it)
    int *rec_ids                        # [G, K]
    int8_t *xq                          # [2·2D] matmul scratch for rows of width <= 2D (see matmul_qt)
    float *xs                           # [2·nblocks(2D)]
    float *xr                           # [2D]
    int32_t *xm                         # [2·nblocks(2D)] (NULL: no block sums)
    uint8_t *xg                         # [2·coli_split_len(2D) + 64]
    float top1                          # out: top-1 probability of the last draft (min_p > 0)
    int stop                            # out: why mtp_chain returned before G: 1 min_p, 2 hand-off
    int bad                             # out: the step whose router or logits saw NaN, or -1


cdef int mtp_chain(DraftChain *C, int g0, bint resume, int G) noexcept nogil:
    """Draft steps g0 .. G-1 of the native MTP chain (glm.c's mtp_draft) without Python between them:
    hx = eh_proj · [enorm(embed(tok)) ; hnorm(h)] (h: final_norm(hlast) at step 0, the MTP layer's
    last output after), the MTP layer on hx at position p + g (layers_step), then the draft
    argmax(lm_head · shared_head.norm(hx)), or when sampling (C.temp > 0) the race over its
    distribution under the key of the draft's position p + 2 + g (race_pick). resume: step g0's layer is already done (Python
    finished its MLP). Returns the steps done (their drafts in C.toks); C.stop = 1: the last of
    them fell below min_p; C.stop = 2: step g's attention half is done and its MLP is Python's
    (an expert not resident)."""
    cdef int g, i, D = C.D, V = C.V, best, done
    cdef float mx, z
    cdef float *lg
    for g in range(g0, G):
        if not (resume and g == g0):
            memset(C.e, 0, D * sizeof(float))
            qt_addrow(C.embed, C.toks[g - 1], 1.0, C.e)
            rmsnorm_row(C.cat, C.e, C.enorm, D, C.eps)
            if g == 0:
                rmsnorm_row(C.hn, C.h0, C.fnorm, D, C.eps)
                rmsnorm_row(C.cat + D, C.hn, C.hnorm, D, C.eps)
            else:
                rmsnorm_row(C.cat + D, C.hx, C.hnorm, D, C.eps)
            matmul_qt(C.eh, C.cat, 1, C.hx, C.xq, C.xs, C.xr, C.block, C.idot, C.xm, C.xg)
            C.T.pos_base = C.p + g
            if layers_step(&C.T, 0, &done) < 1:
                if C.T.bad >= 0:
                    C.bad = g
                else:
                    C.stop = 2
                return g
            C.rec_nu[g] = C.T.rec_nu[0]
            for i in range(C.T.rec_nu[0] if C.T.rec_nu[0] > 0 else 0):
                C.rec_ids[g * C.T.rec_stride + i] = C.T.rec_ids[i]
        rmsnorm_row(C.hn, C.hx, C.mnorm, D, C.eps)
        lg = C.logits + <Py_ssize_t>g * V
        matmul_qt(C.head, C.hn, 1, lg, C.xq, C.xs, C.xr, C.block, C.idot, C.xm, C.xg)
        best = 0
        for i in range(V):
            if isnan(lg[i]):
                C.bad = g
                return g
            if lg[i] > lg[best]:
                best = i
        if C.temp > 0:
            dist_build_c(lg, V, C.temp, C.top_k, C.top_p, C.Q, C.pairs)
            C.toks[g] = race_pick(C.Q, V, pos_key(C.base, C.p + 2 + g), -1)
        else:
            C.toks[g] = best
        if C.min_p > 0:
            mx = lg[best]
            z = 0.0
            for i in range(V):
                z += expf(lg[i] - mx)
            C.top1 = 1.0 / z
            if C.top1 < C.min_p:
                C.stop = 1
                return g + 1
    return G


# ---------------------------------------------------------------------------------------------
# 10. Sampler
# ---------------------------------------------------------------------------------------------

cdef int cmp_prob_desc(const void *a, const void *b) noexcept nogil:
    """Descending probability, ties by ascending token id (a stable, libc-independent order)."""
    cdef const ProbIdx *x = <const ProbIdx *>a
    cdef const ProbIdx *y = <const ProbIdx *>b
    if x.p > y.p:
        return -1
    if x.p < y.p:
        return 1
    return (x.i > y.i) - (x.i < y.i)


def mask_logits(logits, const int32_t[::1] bits, float[::1] out):
    """out [V] = logits [V] with token i at -inf wherever bit i of bits [ceil(V/32)] is clear (the
    tokens a grammar forbids next; colibri.grammar.Constraint.mask). softmax then spreads the mass
    over the allowed tokens only: the constrained distribution."""
    cdef float[::1] lg = np.ascontiguousarray(logits, dtype=np.float32)
    cdef int V = out.shape[0], i
    if lg.shape[0] != V:
        raise ValueError(f"logits of length {lg.shape[0]} for a vocabulary of {V}")
    if bits.shape[0] * 32 < V:
        raise ValueError(f"a token bitmask of {bits.shape[0]} words for a vocabulary of {V}")
    with nogil:
        for i in range(V):
            out[i] = lg[i] if (bits[i >> 5] >> (i & 31)) & 1 else -INFINITY
    return out


cdef class Sampler:
    """Temperature, top-k and nucleus (top-p) sampling with a seedable xorshift64 RNG; greedy when
    temperature <= 0. ``P`` holds the distribution built by the last ``dist_build``.

    Penalties (llama.cpp's order and meaning) change the logits of a position from the tokens
    before it, the last ``repeat_last_n`` of ``history`` (0: none, -1: all): a token seen there has
    its logit divided by ``repeat_penalty`` (multiplied when negative), then lowered by
    ``frequency_penalty`` per occurrence and by ``presence_penalty`` once. They are a function of
    (logits, history) only, applied alike where a token is picked and where a draft is tested, so
    speculation stays lossless with them.

    Generation draws each token by an exponential race over P keyed by its position in the
    sequence (race_pick under pos_key): the token of a position depends on the seed, the position
    and the logits only, never on how many draws speculation made before it, so a seeded generation
    gives the same text whatever the drafts (and ``--draft auto`` decides by wall time). A sampled
    draft raced from another distribution with the same key (``draft_pick``) is that token as often
    as the two distributions overlap."""
    cdef public double temperature, top_p
    cdef public int top_k, repeat_last_n
    cdef public double repeat_penalty, frequency_penalty, presence_penalty
    cdef unsigned long long rng, base
    cdef public object P
    cdef object _pairs, _pen, _Q

    def __init__(self, int vocab, double temperature=0.7, double top_p=0.9, seed=None, int top_k=0,
                 double repeat_penalty=1.0, int repeat_last_n=64, double frequency_penalty=0.0,
                 double presence_penalty=0.0):
        if not (temperature >= 0 and temperature == temperature):
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if not (0 < top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        if top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {top_k}")
        if not (repeat_penalty > 0 and repeat_penalty < float("inf")):
            raise ValueError(f"repeat_penalty must be a number > 0, got {repeat_penalty}")
        if repeat_last_n < -1:
            raise ValueError(f"repeat_last_n must be >= -1 (-1 = the whole history), got {repeat_last_n}")
        for name, v in (("frequency_penalty", frequency_penalty), ("presence_penalty", presence_penalty)):
            if not (-1e30 < v < 1e30):
                raise ValueError(f"{name} must be a finite number, got {v}")
        if vocab < 1:
            raise ValueError("empty vocabulary")
        self.temperature = temperature
        self.top_p = top_p
        self.top_k = top_k
        self.repeat_penalty, self.repeat_last_n = repeat_penalty, repeat_last_n
        self.frequency_penalty, self.presence_penalty = frequency_penalty, presence_penalty
        self.P = np.zeros(vocab, np.float32)
        self._pairs = np.zeros(2 * vocab, np.float32)      # ProbIdx scratch
        self._pen = np.zeros(vocab, np.float32)            # penalized logits [V]
        self._Q = np.zeros(vocab, np.float32)              # a draft's distribution [V] (draft_pick)
        self.seed(seed)

    @property
    def penalizes(self):
        """Whether any penalty changes logits."""
        return self.repeat_last_n != 0 and (self.repeat_penalty != 1.0 or self.frequency_penalty != 0.0
                                            or self.presence_penalty != 0.0)

    def penalize(self, logits, history):
        """The logits of the position after ``history`` with the penalties applied (a buffer of
        this sampler, valid until the next call); ``logits`` itself when no penalty applies."""
        if not self.penalizes or not history:
            return logits
        cdef float[::1] lg = np.ascontiguousarray(logits, dtype=np.float32)
        cdef float[::1] out = self._pen
        cdef int V = out.shape[0]
        if lg.shape[0] != V:
            raise ValueError(f"logits of length {lg.shape[0]} for a vocabulary of {V}")
        n = len(history) if self.repeat_last_n < 0 else min(self.repeat_last_n, len(history))
        cdef int[::1] win = np.asarray(history[len(history) - n:], dtype=np.int32)
        cdef int j
        for j in range(win.shape[0]):
            if not 0 <= win[j] < V:
                raise ValueError(f"history token {win[j]} outside the vocabulary [0, {V})")
        with nogil:
            penalize_c(&lg[0], V, &win[0], <int>win.shape[0], self.repeat_penalty, self.frequency_penalty,
                       self.presence_penalty, &out[0])
        return self._pen

    def seed(self, seed=None):
        """SEED × 0x9E3779B97F4A7C15 + 1 (mod 2^64); without a seed, time and pid."""
        cdef unsigned long long golden = 0x9E3779B97F4A7C15ULL
        if seed is None:
            self.rng = golden ^ ((<unsigned long long>time.monotonic_ns()) << 20) ^ <unsigned long long>os.getpid()
        else:
            self.rng = (<unsigned long long>(int(seed) & 0xFFFFFFFFFFFFFFFF)) * golden + 1
        if self.rng == 0:
            self.rng = golden
        self.base = self.rng

    cpdef double rndu(self):
        """xorshift64 (13, 7, 17) -> a double in [0, 1) from the top 53 bits."""
        cdef unsigned long long r = self.rng
        r ^= r << 13
        r ^= r >> 7
        r ^= r << 17
        self.rng = r
        return <double>(r >> 11) * (1.0 / 9007199254740992.0)

    def dist_build(self, logits):
        """P = softmax(logits / T), restricted to the top_k most likely tokens (0: all), then to the
        top-p nucleus of those, renormalized."""
        cdef float[::1] lg = np.ascontiguousarray(logits, dtype=np.float32)
        cdef float[::1] P = self.P
        cdef int V = P.shape[0]
        if lg.shape[0] != V:
            raise ValueError(f"logits of length {lg.shape[0]} for a vocabulary of {V}")
        cdef float[::1] pairs = self._pairs
        with nogil:
            dist_build_c(&lg[0], V, self.temperature, self.top_k, self.top_p, &P[0], <ProbIdx *>&pairs[0])

    def dist_sample(self, int ban=-1, pos=None):
        """Draw from P with token ``ban`` removed (its mass renormalized away): from the sequential
        RNG (inverse CDF), or at position ``pos`` by the position's race (race_pick). With a
        position, the draw is coupled to the unbanned one: if the race's winner is not ``ban`` it is
        that token (which, given that it is not ``ban``, is distributed as P with ``ban`` removed),
        so a rejected draft's resample is the token plain sampling would have drawn there."""
        cdef float[::1] P = self.P
        cdef int V = P.shape[0], i, last = -1
        cdef double z = 1.0, u, cum = 0.0
        if ban >= V:
            raise ValueError(f"banned token {ban} outside the vocabulary")
        if pos is not None:
            return race_pick(&P[0], V, pos_key(self.base, pos), ban)
        u = self.rndu()
        if ban >= 0:
            z = 1.0 - P[ban]
        if z < 1e-12:
            z = 1e-12
        u = u * z
        for i in range(V):
            if i == ban:
                continue
            if P[i] > 0:
                last = i
            cum += P[i]
            if cum >= u and P[i] > 0:
                return i
        return last if last >= 0 else 0

    def draft_pick(self, logits, long long pos):
        """A sampled draft for position ``pos``: the race (the position's key) over the distribution
        that dist_build would make of ``logits`` (a draft head's), built in a buffer of its own (P
        stays as it was); the argmax when greedy. Penalties are not applied: a draft only has to
        be likely, the verify tests it against the penalized target."""
        cdef float[::1] lg = np.ascontiguousarray(logits, dtype=np.float32)
        cdef float[::1] Q = self._Q
        cdef float[::1] pairs = self._pairs
        cdef int V = Q.shape[0], t
        if lg.shape[0] != V:
            raise ValueError(f"logits of length {lg.shape[0]} for a vocabulary of {V}")
        if self.temperature <= 0:
            return int(np.argmax(logits))
        cdef unsigned long long key = pos_key(self.base, pos)
        with nogil:
            dist_build_c(&lg[0], V, self.temperature, self.top_k, self.top_p, &Q[0], <ProbIdx *>&pairs[0])
            t = race_pick(&Q[0], V, key, -1)
        return t

    def pick_tok(self, logits, int ban=-1, pos=None, history=None):
        """Greedy argmax (first maximum) when temperature <= 0, else dist_build + dist_sample(ban)
        (at position ``pos`` when given, see dist_sample); the logits penalized for ``history``
        (the tokens before the position) first."""
        if logits is not None and history is not None:
            logits = self.penalize(logits, history)
        if self.temperature <= 0:
            return int(np.argmax(logits))
        if logits is not None:              # None: P as the last dist_build left it
            self.dist_build(logits)
        return self.dist_sample(ban, pos)

    def accepts(self, logits, int draft, long long pos, history=None):
        """Whether a draft for position pos is accepted: P = dist_build(logits) and the position's
        race draws the draft (for a draft chosen without the key, probability P[draft]: the
        Leviathan rule for a point-mass draft); greedy: the argmax is the draft. Penalized as
        pick_tok."""
        if logits is not None and history is not None:
            logits = self.penalize(logits, history)
        if self.temperature <= 0:
            return int(np.argmax(logits)) == draft
        if logits is not None:              # None: P as the last dist_build left it
            self.dist_build(logits)
        cdef float[::1] P = self.P
        return race_pick(&P[0], P.shape[0], pos_key(self.base, pos), -1) == draft


cdef void penalize_c(const float *lg, int V, const int *win, int n, double rep, double freq, double pres,
                     float *out) noexcept nogil:
    """out = lg with each distinct token of win[n] penalized once (see Sampler)."""
    cdef int j, i, t, c
    cdef float l
    memcpy(out, lg, V * sizeof(float))
    for j in range(n):
        t = win[j]
        c = 1
        for i in range(j):
            if win[i] == t:
                c = 0                       # counted at its first occurrence
                break
        if c == 0:
            continue
        for i in range(j + 1, n):
            if win[i] == t:
                c += 1
        l = lg[t]
        l = <float>(l / rep) if l > 0 else <float>(l * rep)
        out[t] = <float>(l - c * freq - pres)


cdef void dist_build_c(const float *lg, int V, double temp, int top_k, double top_p, float *P,
                       ProbIdx *pairs) noexcept nogil:
    """P = softmax(lg / temp); then (transformers' order) the top_k most likely tokens, then the
    smallest prefix of those, in descending order, whose mass reaches top_p of theirs."""
    cdef int i, n, keep, cnt
    cdef float mx = lg[0], invt, tau
    cdef double sum = 0.0, cum, mass, need
    cdef bint nucleus = 0 < top_p < 1
    for i in range(1, V):
        if lg[i] > mx:
            mx = lg[i]
    invt = <float>(1.0 / (temp if temp > 1e-4 else 1e-4))
    for i in range(V):
        P[i] = expf((lg[i] - mx) * invt)
        sum += P[i]
    for i in range(V):
        P[i] = P[i] / <float>sum
    if top_k <= 0 or top_k > V:
        top_k = V
    if top_k == V and not nucleus:
        return
    # Without sorting the whole vocabulary: find tau such that {P >= tau}, a prefix of the
    # descending order, holds the top_k tokens or a mass >= top_p (then the nucleus lies inside
    # it); sort only those.
    tau = 0.5
    while True:
        mass = 0.0
        cnt = 0
        for i in range(V):
            if P[i] >= tau:
                mass += P[i]
                cnt += 1
        if cnt >= top_k or (nucleus and mass >= top_p) or tau == 0:
            break
        tau = tau * 0.25 if tau > 1e-30 else 0
    n = 0
    for i in range(V):
        if P[i] >= tau:
            pairs[n].p = P[i]
            pairs[n].i = i
            n += 1
    qsort(pairs, n, sizeof(ProbIdx), cmp_prob_desc)
    keep = n if n < top_k else top_k
    if nucleus:
        need = top_p                        # of the whole mass (1), or of the top_k tokens' mass
        if top_k < V:
            mass = 0.0
            for i in range(keep):
                mass += pairs[i].p
            need = top_p * mass
        cum = 0.0
        for i in range(keep):
            cum += pairs[i].p
            if cum >= need:
                keep = i + 1
                break
    for i in range(V):
        P[i] = 0
    sum = 0.0
    for i in range(keep):
        sum += pairs[i].p
    for i in range(keep):
        P[pairs[i].i] = pairs[i].p / <float>sum
