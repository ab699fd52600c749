"""Tests for colibri.quant (per-row symmetric quantizers, packers, dequantizers)."""

import numpy as np
import pytest

from colibri import quant
from colibri.st import ContainerError


def f32(x):
    return np.asarray(x, dtype=np.float32)


# -- bits and formats ------------------------------------------------------------

def test_bits_mapping():
    assert [quant.qmax_for_bits(b) for b in (2, 3, 4, 5, 8)] == [1, 3, 7, 15, 127]
    assert quant.container_format(2) == "int2"
    assert quant.container_format(3) == quant.container_format(4) == "int4"
    assert all(quant.container_format(b) == "int8" for b in (5, 6, 7, 8))
    assert quant.container_format(16) == quant.container_format(32) == "f32"
    for bad in (0, 1, 9, 15, -4):
        with pytest.raises(ValueError):
            quant.container_format(bad)
    with pytest.raises(ValueError):
        quant.qmax_for_bits(16)


def test_infer_format_from_size():
    O, I = 3, 10
    assert quant.infer_format(30, O, I) == "int8"
    assert quant.infer_format(15, O, I) == "int4"
    assert quant.infer_format(9, O, I) == "int2"
    with pytest.raises(ContainerError, match="blk.weight"):
        quant.infer_format(7, O, I, "blk.weight")
    # odd row length: ceil
    assert quant.payload_nbytes("int4", 2, 7) == 8 and quant.payload_nbytes("int2", 2, 7) == 4


def test_storage_format_avoids_ambiguous_sizes():
    # sizes the engine would read as a wider container are written in that container
    assert quant.storage_format(2, 5, 2) == "int4"   # int2 and int4 both 1 byte/row
    assert quant.storage_format(4, 5, 1) == "int8"   # 1 value per row: all sizes equal
    assert quant.storage_format(2, 5, 1) == "int8"
    assert quant.storage_format(2, 5, 8) == "int2"
    assert quant.storage_format(4, 5, 3) == "int4"
    w = f32([[0.5, -1.0], [0.25, 0.75]])
    payload, s, fmt = quant.quantize(w, 2)
    assert fmt == "int4"
    np.testing.assert_array_equal(quant.dequantize(payload, s, 2, 2), f32([[0, -1], [0, 0.75]]))


# -- hand-computed examples --------------------------------------------------------

def test_int8_ties_round_half_even():
    # amax = 127 -> s = 1 exactly, so w/s is exact and ties are visible
    w = f32([[127, 2.5, -2.5, 3.5, -0.5, 0.5, 1.5, -126.5, 0.49]])
    v, s = quant.quantize_rows(w, 8)
    assert s.dtype == np.float32 and s.tolist() == [1.0]
    assert v.dtype == np.int8
    assert v.tolist() == [[127, 2, -2, 4, 0, 0, 2, -126, 0]]
    payload, s2, fmt = quant.quantize(w, 8)
    assert fmt == "int8" and payload.dtype == np.uint8
    assert payload.tolist() == [127, 2, 254, 4, 0, 0, 2, 130, 0]  # two's complement bytes
    assert s2.tolist() == [1.0]


def test_int4_odd_row_packing():
    w = f32([[7, 0.5, 1.5, 2.5, -3.5, -7, 6.5],
             [0, 0, 0, 0, 0, 0, 0]])
    v, s = quant.quantize_rows(w, 4)
    assert s[0] == 1.0 and s[1] == np.float32(1e-8)
    assert v.tolist() == [[7, 0, 2, 2, -4, -7, 6], [0] * 7]
    payload, _, fmt = quant.quantize(w, 4)
    assert fmt == "int4" and payload.size == 2 * 4
    # stored nibble = v + 8, low nibble = even element; pad nibble is 0
    assert payload.tolist() == [0x8F, 0xAA, 0x14, 0x0E, 0x88, 0x88, 0x88, 0x08]
    np.testing.assert_array_equal(quant.unpack_int4(payload, 2, 7), v)


def test_int2_packing():
    w = f32([[1, -1, 0.5, -0.5, 0.4, 1]])
    v, s = quant.quantize_rows(w, 2)
    assert s.tolist() == [1.0] and v.tolist() == [[1, -1, 0, 0, 0, 1]]
    payload, _, fmt = quant.quantize(w, 2)
    assert fmt == "int2"
    # element 4j+k in bits 2k..2k+1 as v+2; tail bits 0
    assert payload.tolist() == [3 | 1 << 2 | 2 << 4 | 2 << 6, 2 | 3 << 2]
    np.testing.assert_array_equal(quant.unpack_int2(payload, 1, 6), v)


def test_int3_uses_int4_container_with_qmax3():
    w = f32([[3, 1.5, -3, 0.5]])
    v, s = quant.quantize_rows(w, 3)
    assert s.tolist() == [1.0] and v.tolist() == [[3, 2, -3, 0]]
    assert quant.quantize(w, 3)[2] == "int4"


def test_clamping_with_given_scales():
    w = f32([[100, -100, 3.5, -3.5]])
    one = f32([1])
    assert quant.quantize_with_scales(w, one, 8).tolist() == [[100, -100, 4, -4]]
    assert quant.quantize_with_scales(w, one, 4).tolist() == [[7, -8, 4, -4]]
    assert quant.quantize_with_scales(w, one, 3).tolist() == [[3, -4, 3, -4]]
    assert quant.quantize_with_scales(w, one, 2).tolist() == [[1, -2, 1, -2]]
    assert quant.quantize_with_scales(f32([[300, -300]]), one, 8).tolist() == [[127, -128]]


def test_scale_floor_and_float32_division():
    w = f32([[1e-12, -2e-12], [0.1, -0.3]])
    s = quant.row_scales(w, 8)
    assert s[0] == np.float32(1e-8)
    assert s[1] == np.float32(0.3) / np.float32(127)
    v, _ = quant.quantize_rows(w, 8)
    assert v[0].tolist() == [0, 0]


def test_rejects_nonfinite_and_bad_shapes():
    with pytest.raises(ValueError, match="NaN"):
        quant.quantize_rows(f32([[1, np.nan]]), 8)
    with pytest.raises(ValueError, match="NaN"):
        quant.quantize(f32([[np.inf, 1]]), 4)
    with pytest.raises(ValueError):
        quant.quantize(f32([1, 2, 3]), 8)
    with pytest.raises(ValueError):
        quant.quantize(f32([[1, 2]]), 16)  # f32 is not a quantization
    with pytest.raises(ValueError):
        quant.pack_int4(np.array([[8]], np.int8))
    with pytest.raises(ValueError):
        quant.pack_int2(np.array([[-3]], np.int8))


# -- bit-exactness against an independent scalar reference ---------------------------

def _reference(w, bits):
    """Element-by-element reference in plain Python (float64 division correctly
    rounded to float32 equals IEEE float32 division)."""
    qmax = (1 << (bits - 1)) - 1
    O, I = w.shape
    v = np.zeros((O, I), np.int64)
    s = np.zeros(O, np.float32)
    for o in range(O):
        amax = max(abs(float(x)) for x in w[o])
        so = np.float32(float(np.float32(amax)) / qmax)  # f32(amax)/qmax rounded to f32
        so = max(so, np.float32(1e-8))
        s[o] = so
        for i in range(I):
            q = float(np.float32(float(w[o, i]) / float(so)))
            r = round(q)  # Python round = half to even
            v[o, i] = min(max(r, -qmax - 1), qmax)
    return v, s


def _ref_pack(v, fmt):
    O, I = v.shape
    rows = []
    for o in range(O):
        if fmt == "int8":
            rows.append([int(x) & 0xFF for x in v[o]])
        elif fmt == "int4":
            b = [0] * ((I + 1) // 2)
            for i in range(I):
                b[i // 2] |= (int(v[o, i]) + 8) << (4 * (i % 2))
            rows.append(b)
        else:
            b = [0] * ((I + 3) // 4)
            for i in range(I):
                b[i // 4] |= (int(v[o, i]) + 2) << (2 * (i % 4))
            rows.append(b)
    return np.array(rows, np.uint8).reshape(-1)


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("I", [1, 2, 3, 7, 16, 33])
def test_bit_exact_vs_reference(bits, I):
    rng = np.random.default_rng(1000 * bits + I)
    w = (rng.standard_normal((5, I)) * rng.choice([1e-3, 1.0, 30.0], size=(5, 1))).astype(np.float32)
    w[0, 0] = 0.0
    if I > 2:
        w[1] = 0.0  # zero row -> floor scale
    v, s = quant.quantize_rows(w, bits)
    rv, rs = _reference(w, bits)
    np.testing.assert_array_equal(s, rs)
    np.testing.assert_array_equal(v.astype(np.int64), rv)
    payload, s2, fmt = quant.quantize(w, bits)
    np.testing.assert_array_equal(s2, rs)
    assert fmt == quant.storage_format(bits, 5, I)
    np.testing.assert_array_equal(payload, _ref_pack(rv, fmt))
    assert quant.infer_format(payload.size, 5, I) == fmt


@pytest.mark.parametrize("fmt,lo,hi", [("int8", -128, 127), ("int4", -8, 7), ("int2", -2, 1)])
@pytest.mark.parametrize("I", [1, 5, 8, 13])
def test_pack_unpack_roundtrip(fmt, lo, hi, I):
    rng = np.random.default_rng(I)
    v = rng.integers(lo, hi + 1, size=(4, I)).astype(np.int8)
    p = quant.pack(v, fmt)
    assert p.shape == (4, quant.payload_nbytes(fmt, 1, I))
    np.testing.assert_array_equal(quant.unpack(p.reshape(-1), fmt, 4, I), v)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_dequantize_error_bound(bits):
    rng = np.random.default_rng(bits)
    O, I = 16, 65
    w = (rng.standard_normal((O, I)) * np.exp(rng.uniform(-3, 3, size=(O, 1)))).astype(np.float32)
    payload, s, fmt = quant.quantize(w, bits)
    d = quant.dequantize(payload, s, O, I, name="w")
    assert d.dtype == np.float32 and d.shape == (O, I)
    err = np.abs(d - w)
    # round-to-nearest: at most half a step (+ float32 slack) per element
    assert np.all(err <= s[:, None] * (0.5 + 1e-5))
    amax = np.abs(w).max(axis=1)
    qmax = quant.qmax_for_bits(bits)
    assert np.all(err.max(axis=1) <= amax / qmax * 0.5 * (1 + 1e-5))
    # row extremes are represented exactly up to rounding of s
    np.testing.assert_allclose(np.abs(d).max(axis=1), amax, rtol=1e-6)
    with pytest.raises(ContainerError, match="w"):
        quant.dequantize(payload[:-1], s, O, I, name="w")
    with pytest.raises(ContainerError):
        quant.dequantize(payload, s[:-1], O, I, name="w")
