"""SIMD kernels against numpy, for every variant this CPU supports (forced in turn)."""
import numpy as np
import pytest

from colibri import _core, quant

VARIANTS = ["scalar", "avx2", "avx512vnni"]
SIZES = list(range(1, 70)) + [127, 128, 129, 255, 256, 257, 511, 1000, 1023, 1024, 1025, 4097]


def _supported():
    best = _core.ISA_NAMES[_core.isa_best()]
    return [v for v in VARIANTS if _core.ISA_NAMES[v] <= best]


@pytest.fixture(params=_supported())
def isa(request):
    before = _core.isa_active()
    assert _core.select_isa(request.param) == request.param
    yield request.param
    _core.select_isa(before)


def test_variant_selection_clamps_to_cpu():
    best = _core.isa_best()
    assert _core.select_isa("avx512vnni") in VARIANTS
    _core.select_isa(best)
    assert _core.isa_active() == best
    with pytest.raises(ValueError):
        _core.select_isa("neon9000")


def test_integer_dots_exact(isa):
    rng = np.random.default_rng(1)
    for n in SIZES:
        w = rng.integers(-128, 128, n).astype(np.int8)
        x = rng.integers(-127, 128, n).astype(np.int8)
        assert _core.dot_i8i8(w, x) == int(np.dot(w.astype(np.int64), x.astype(np.int64))), n
        v4 = rng.integers(-8, 8, n)
        packed = quant.pack_int4(v4.reshape(1, n)).reshape(-1)
        assert _core.dot_i4i8(packed, x) == int(np.dot(v4, x.astype(np.int64))), n


def test_integer_dots_worst_case(isa):
    n = 16384
    w = np.full(n, -128, np.int8)
    x = np.full(n, -127, np.int8)
    assert _core.dot_i8i8(w, x) == 128 * 127 * n
    packed = quant.pack_int4(np.full((1, n), -8)).reshape(-1)
    assert _core.dot_i4i8(packed, x) == 8 * 127 * n


def _np_quant_q8(x, block):
    n = x.shape[0]
    blk = n if block == 0 or block >= n else block
    q = np.empty(n, np.int8)
    s = []
    for b0 in range(0, n, blk):
        seg = x[b0:b0 + blk]
        sc = np.float32(max(np.float32(np.max(np.abs(seg))) / np.float32(127), np.float32(1e-12)))
        inv = np.float32(1) / sc
        q[b0:b0 + blk] = np.rint(seg * inv).astype(np.int8)
        s.append(sc)
    return q, np.array(s, np.float32)


@pytest.mark.parametrize("block", [0, 64, 128])
def test_quantize_q8_matches_numpy(isa, block):
    rng = np.random.default_rng(2)
    for n in SIZES:
        x = (rng.standard_normal(n) * rng.uniform(0.01, 10)).astype(np.float32)
        q, s = _core.quantize_q8(x, block)
        q_ref, s_ref = _np_quant_q8(x, block)
        np.testing.assert_array_equal(s, s_ref)
        np.testing.assert_array_equal(q, q_ref)


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("block", [0, 64])
def test_matmul_integer_path_matches_numpy(isa, bits, block):
    """Integer path: (Σ_b xs_b · Σ w_q x_q) · w_scale, against the same math in float64."""
    rng = np.random.default_rng(3)
    for I in [1, 7, 31, 64, 65, 130, 257, 1000]:
        O, S = 37, 3
        W = rng.standard_normal((O, I)).astype(np.float32)
        x = rng.standard_normal((S, I)).astype(np.float32)
        payload, scale, fmt = quant.quantize(W, bits)
        qt = _core.QT.from_packed(payload, scale, O, I)
        Wd = qt.dequantize().astype(np.float64)
        y = _core.matmul(qt, x, block=block, idot=1)
        if bits == 2:   # int2 always takes the float path
            ref = x.astype(np.float64) @ Wd.T
        else:
            ref = np.empty((S, O))
            v = quant.unpack(payload, fmt, O, I).astype(np.float64)
            for s in range(S):
                q, xs = _np_quant_q8(x[s], block)
                blk = I if block == 0 or block >= I else block
                acc = np.zeros(O)
                for b, b0 in enumerate(range(0, I, blk)):
                    acc += xs[b] * (v[:, b0:b0 + blk] @ q[b0:b0 + blk].astype(np.float64))
                ref[s] = acc * scale
        np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


@pytest.mark.parametrize("bits", [32, 8, 4, 2])
def test_matmul_float_path_matches_numpy(isa, bits):
    rng = np.random.default_rng(4)
    for I in [1, 5, 16, 33, 64, 100, 513]:
        O, S = 19, 2
        W = rng.standard_normal((O, I)).astype(np.float32)
        x = rng.standard_normal((S, I)).astype(np.float32)
        if bits == 32:
            qt = _core.QT.from_f32(W)
        else:
            payload, scale, _ = quant.quantize(W, bits)
            qt = _core.QT.from_packed(payload, scale, O, I)
        ref = x.astype(np.float64) @ qt.dequantize().astype(np.float64).T
        y = _core.matmul(qt, x, idot=0)
        np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5 * np.sqrt(I) * np.abs(ref).max())


def test_matmul_rows_independent_of_batch(isa):
    """A row's result does not depend on the other rows of the batch (draft == verify numerics)."""
    rng = np.random.default_rng(5)
    W = rng.standard_normal((50, 300)).astype(np.float32)
    x = rng.standard_normal((6, 300)).astype(np.float32)
    for bits in (8, 4):
        payload, scale, _ = quant.quantize(W, bits)
        qt = _core.QT.from_packed(payload, scale, 50, 300)
        full = _core.matmul(qt, x)
        for s in range(6):
            np.testing.assert_array_equal(_core.matmul(qt, x[s:s + 1])[0], full[s])


def test_axpy_bit_identical_to_numpy(isa):
    """y += c·x element by element, the product rounded before the add: numpy's float32 y + c*x."""
    rng = np.random.default_rng(7)
    for n in SIZES:
        y = rng.standard_normal(n).astype(np.float32)
        c = np.float32(rng.standard_normal())
        xf = rng.standard_normal(n).astype(np.float32)
        np.testing.assert_array_equal(_core.axpy(y, c, xf), y + c * xf, err_msg=str(n))
        x8 = rng.integers(-128, 128, n).astype(np.int8)
        np.testing.assert_array_equal(_core.axpy(y, c, x8), y + c * x8.astype(np.float32), err_msg=str(n))
        v4 = rng.integers(-8, 8, n)
        packed = quant.pack_int4(v4.reshape(1, n)).reshape(-1)
        np.testing.assert_array_equal(_core.axpy(y, c, packed), y + c * v4.astype(np.float32), err_msg=str(n))


def test_axpy_rows_equal_one_call_per_row(isa):
    """y += Σ_r c[r]·row_r (f32 rows by stride or index, int8 / int4 rows) equals one axpy per
    row, in row order, bit for bit."""
    rng = np.random.default_rng(8)
    for n in [1, 15, 16, 17, 63, 64, 65, 128, 130, 200]:
        for nrows in [1, 3, 9]:
            y = rng.standard_normal(n).astype(np.float32)
            c = rng.standard_normal(nrows).astype(np.float32)
            table = rng.standard_normal((12, n)).astype(np.float32)
            idx = rng.permutation(12)[:nrows].astype(np.int32)
            expect = y.copy()
            for r in range(nrows):
                expect = _core.axpy(expect, c[r], table[idx[r]])
            np.testing.assert_array_equal(_core.axpy_rows(y, c, table, idx), expect, err_msg=f"f32 {n} {nrows}")
            expect = y.copy()
            for r in range(nrows):
                expect = _core.axpy(expect, c[r], table[r])
            np.testing.assert_array_equal(_core.axpy_rows(y, c, table[:nrows]), expect)
            w8 = rng.integers(-128, 128, (nrows, n)).astype(np.int8)
            expect = y.copy()
            for r in range(nrows):
                expect = _core.axpy(expect, c[r], w8[r])
            np.testing.assert_array_equal(_core.axpy_rows(y, c, w8), expect, err_msg=f"i8 {n} {nrows}")
            w4 = quant.pack_int4(rng.integers(-8, 8, (nrows, n)))
            expect = y.copy()
            for r in range(nrows):
                expect = _core.axpy(expect, c[r], w4[r], n)
            np.testing.assert_array_equal(_core.axpy_rows(y, c, w4, n=n), expect, err_msg=f"i4 {n} {nrows}")


@pytest.fixture
def kernel_flags():
    before = _core.set_kernel_flags()
    yield _core.set_kernel_flags
    _core.set_kernel_flags(**before)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("block", [0, 64])
@pytest.mark.parametrize("S", [1, 2, 3, 5])
def test_four_row_kernels_are_bit_identical(isa, bits, block, S, kernel_flags):
    """Decode matmuls and verify batches take four weight rows per kernel call (with the
    activations' block sums, two activation rows at a time); every output equals the one-row
    kernels' bit for bit, for partial last groups and tails too."""
    rng = np.random.default_rng(6)
    for O, I in [(1, 64), (3, 100), (4, 64), (37, 130), (64, 512), (13, 1000), (8, 1025), (9, 4097)]:
        W = rng.standard_normal((O, I)).astype(np.float32)
        x = rng.standard_normal((S, I)).astype(np.float32) * np.float32(rng.uniform(0.1, 10))
        payload, scale, _ = quant.quantize(W, bits)
        qt = _core.QT.from_packed(payload, scale, O, I)
        kernel_flags(block_sums=True, group_kernels=True)
        grouped = _core.matmul(qt, x, block=block)
        kernel_flags(block_sums=True, group_kernels=False)
        one_row_sums = _core.matmul(qt, x, block=block)
        kernel_flags(block_sums=False, group_kernels=False)
        one_row = _core.matmul(qt, x, block=block)
        np.testing.assert_array_equal(grouped, one_row_sums, err_msg=f"{O}x{I}")
        np.testing.assert_array_equal(grouped, one_row, err_msg=f"{O}x{I}")


def test_int8_four_row_kernel_extremes(isa, kernel_flags):
    """The int8 four-row kernel biases the weights by 128 and corrects with the activation sums:
    exact at the extremes (weights -128 / 127, activations ±127, long rows)."""
    n = 4096
    for wv, xv in [(-128, -127), (127, 127), (-128, 127)]:
        payload = np.full((4, n), wv, np.int8).view(np.uint8).reshape(-1)
        qt = _core.QT.from_packed(payload, np.ones(4, np.float32), 4, n)
        x = np.full((1, n), xv, np.float32)
        kernel_flags(block_sums=True, group_kernels=True)
        grouped = _core.matmul(qt, x, idot=2)
        kernel_flags(block_sums=False, group_kernels=False)
        np.testing.assert_array_equal(grouped, _core.matmul(qt, x, idot=2))
        np.testing.assert_allclose(grouped, float(wv) * xv * n, rtol=1e-6)


def test_matmul_rejects_bad_shapes():
    qt = _core.QT.from_f32(np.ones((4, 8), np.float32))
    with pytest.raises(ValueError):
        _core.matmul(qt, np.ones((2, 7), np.float32))
    with pytest.raises(ValueError):
        _core.QT.from_packed(np.zeros(10, np.uint8), np.ones(4, np.float32), 4, 8)
    with pytest.raises(ValueError):
        _core.matmul(qt, np.ones((1, 8), np.float32), block=30)


@pytest.mark.parametrize("opt", ["-O0", "-O2"])
def test_kernel_headers_build_at_any_optimization_and_pass_the_selftest(tmp_path, opt):
    """The C kernels compile as plain C at -O0 and -O2 too (no intrinsic immediates that only
    unrolling makes constant) and pass tools/kernel_selftest.c: exact integer dots, bit-identical
    variants, no read past a buffer's end (guard pages)."""
    import shutil
    import subprocess
    from pathlib import Path
    cc = shutil.which("cc") or shutil.which("gcc")
    assert cc, "a C compiler builds the extension, so one is installed"
    root = Path(__file__).resolve().parent.parent
    exe = tmp_path / "kst"
    subprocess.run([cc, opt, "-I", str(root / "include"), str(root / "tools" / "kernel_selftest.c"),
                    "-o", str(exe), "-lm"], check=True, capture_output=True, timeout=300)
    p = subprocess.run([str(exe), "--no-bench"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert "0 failures" in p.stdout

