"""The integer matmul tiles in the engine (coli_rowdot_*_tile): every int4 matmul reads its
activations' split forms, and the fused FFN group quantizes input rows that several FFNs read once
for all of them. On layers that mix int8 and int4 matrices, for both idot paths, every ISA this CPU
has and one or two threads, the outputs equal the unfused path with one weight row per kernel call
bit for bit (decode rows and a verify batch)."""
import numpy as np
import pytest

from colibri import _core, model_init, quant
from colibri.convert import ConvertOptions, convert
from conftest import DATA

# shared expert / attention vs routed experts in different formats: in a decode MoE call the first
# FFN (a routed expert) quantizes the row that the shared expert reads too, whatever their formats
MIXES = {"dense8_expert4": dict(expert_bits=4, dense_bits=8, io_bits=8),
         "dense4_expert8": dict(expert_bits=8, dense_bits=4, io_bits=4)}
ISAS = [name for name in ("scalar", "avx2", "avx512vnni")
        if _core.ISA_NAMES[name] <= _core.ISA_NAMES[_core.isa_best()]]


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    out = {}
    for mix, bits in MIXES.items():
        dst = tmp_path_factory.mktemp(mix)
        convert(DATA / "tiny_dsa", dst, ConvertOptions(**bits), verbose=False)
        out[mix] = dst
    return out


def _decode(path, isa, idot, fused):
    m = model_init(path, isa=isa, idot=idot)
    m.fused = fused
    ids = [(7 * i + 3) % 200 + 2 for i in range(20)]
    m.kv_alloc(len(ids) + 4)
    rows = [m.step(ids[:12], 0)] + [m.step([t], 12 + i) for i, t in enumerate(ids[12:16])]
    rows.append(m.step_all(ids[16:20], 16))          # a verify-sized batch
    return rows


@pytest.mark.parametrize("mix", MIXES)
@pytest.mark.parametrize("idot", [1, 2])
@pytest.mark.parametrize("threads", [1, 2])
def test_tiles_and_shared_quantization_are_bit_identical(mixed, mix, idot, threads):
    before, flags, isa0 = _core.max_threads(), _core.set_kernel_flags(), _core.isa_active()
    try:
        _core.set_threads(threads)
        for isa in ISAS:
            _core.set_kernel_flags(group_kernels=True, block_sums=True)
            tiles = _decode(mixed[mix], isa, idot, fused=True)
            _core.set_kernel_flags(group_kernels=False, block_sums=False)
            one_row = _decode(mixed[mix], isa, idot, fused=False)
            for k, (a, b) in enumerate(zip(tiles, one_row)):
                np.testing.assert_array_equal(a, b, err_msg=f"{mix} {isa} idot={idot} step {k}")
    finally:
        _core.set_threads(before)
        _core.set_kernel_flags(**flags)
        _core.select_isa(isa0)


@pytest.fixture
def isa_each():
    """Runs the test body for every ISA this CPU has (yields the list; restores the ISA)."""
    before = _core.isa_active()
    yield ISAS
    _core.select_isa(before)


@pytest.mark.parametrize("bits", [8, 4])
def test_interleaved_rows_compute_the_plain_rows_floats(bits, isa_each):
    """QT.interleave lays each group of four rows out in 64-byte turns for the tiles; every matmul
    output (decode and batches, idot 1 and 2, one or several activation blocks, the tiles or one row
    per kernel call, with or without the block sums) equals the plain rows' bit for bit, and the
    rows read back (payload, dequantize) are the container's."""
    rng = np.random.default_rng(12)
    flags = _core.set_kernel_flags()
    try:
        for O, I in [(4, 64), (5, 100), (8, 127), (9, 128), (13, 129), (37, 255), (16, 1000), (12, 1025),
                     (6, 4097)]:
            W = rng.standard_normal((O, I)).astype(np.float32)
            payload, scale, _ = quant.quantize(W, bits)
            plain = _core.QT.from_packed(payload, scale, O, I)
            ilv = _core.QT.from_packed(payload.copy(), scale, O, I)
            assert ilv.interleave() and ilv.interleaved and not ilv.interleave()
            rb = I if bits == 8 else (I + 1) // 2
            assert np.array_equal(ilv.data, plain.data) == (rb <= 64)   # rows of one chunk: the same bytes
            np.testing.assert_array_equal(ilv.payload(), plain.data)
            np.testing.assert_array_equal(ilv.dequantize(), plain.dequantize())
            for isa in isa_each:
                _core.select_isa(isa)
                for S in (1, 2, 5):
                    x = rng.standard_normal((S, I)).astype(np.float32)
                    for idot in (1, 2):
                        for block in (0, 64, 128):
                            want = _core.matmul(plain, x, block=block, idot=idot)
                            for gk, sums in [(True, True), (True, False), (False, True)]:
                                _core.set_kernel_flags(group_kernels=gk, block_sums=sums)
                                np.testing.assert_array_equal(
                                    _core.matmul(ilv, x, block=block, idot=idot), want,
                                    err_msg=f"int{bits} {O}x{I} {isa} S={S} idot={idot} block={block} "
                                            f"group_kernels={gk} sums={sums}")
                            _core.set_kernel_flags(**flags)
    finally:
        _core.set_kernel_flags(**flags)


def test_interleave_only_where_the_tiles_read():
    """Group-scaled, f32 and short matrices keep their layout; the float path and the attention
    helpers, which read rows one by one, refuse interleaved rows with an error naming the cause
    instead of reading them wrong."""
    rng = np.random.default_rng(3)
    W = rng.standard_normal((8, 128)).astype(np.float32)
    assert not _core.QT.from_f32(W).interleave()
    payload, scale, _ = quant.quantize(W, 4, group_size=64)
    assert not _core.QT.from_packed(payload, scale, 8, 128).interleave()
    payload, scale, _ = quant.quantize(W[:3], 8)
    assert not _core.QT.from_packed(payload, scale, 3, 128).interleave()
    payload, scale, _ = quant.quantize(W, 8)
    qt = _core.QT.from_packed(payload, scale, 8, 128)
    assert qt.interleave()
    x = rng.standard_normal((1, 128)).astype(np.float32)
    for call in (lambda: _core.matmul(qt, x, idot=0), lambda: qt.rowdots(0, 2, x[0]),
                 lambda: qt.addrows(0, np.ones(2, np.float32), np.zeros(128, np.float32))):
        with pytest.raises(ValueError, match="interleaved"):
            call()


def test_model_interleaves_the_matmul_only_matrices(mixed, monkeypatch):
    """On AVX-512 VNNI a model lays out the resident matrices that only the integer matmuls read
    (not kv_b, not the embedding, nothing on the float path or another ISA), and decodes the same
    floats as with every matrix in the container's layout (COLIBRI_INTERLEAVE=0)."""
    path = mixed["dense4_expert8"]
    isa0 = _core.isa_active()

    def laid_out(m):
        return [W.interleaved for L in m.layers for W in (L.q_a, L.o_proj, L.gate)]
    try:
        assert not any(laid_out(model_init(path, idot=0)))
        assert not any(laid_out(model_init(path, isa="avx2" if "avx2" in ISAS else "scalar")))
    finally:
        _core.select_isa(isa0)
    m = model_init(path)
    assert all(laid_out(m)) == (isa0 == "avx512vnni")
    assert not m.layers[0].kv_b.interleaved and not m.embed.interleaved
    out = [_decode(path, _core.isa_active(), 2, fused=True)]
    monkeypatch.setenv("COLIBRI_INTERLEAVE", "0")
    m0 = model_init(path)
    assert not m0.layers[0].q_a.interleaved
    out.append(_decode(path, _core.isa_active(), 2, fused=True))
    for a, b in zip(*out):
        np.testing.assert_array_equal(a, b)


def test_ffn_scratch_bytes_is_what_the_scratch_allocates(mixed):
    """The RAM plan's term for the fused FFN group (ffn_scratch_bytes) equals the bytes the scratch
    allocates, split forms included (every int4 matmul reads them now)."""
    for pairs, D, I, nt in [(1, 128, 64, 1), (153, 6144, 2048, 2), (17, 100, 37, 4)]:
        fs = _core.FfnScratch(3, pairs, D, I, nt)
        assert fs.nbytes == _core.ffn_scratch_bytes(pairs, D, I, nt)
    m = model_init(mixed["dense8_expert4"])
    m.kv_alloc(24)
    m.step([3, 4, 5], 0)                                    # makes the model's scratch
    c = m.cfg
    fs = m._ffn_scratch(1, 1, 1)
    assert fs.nbytes == _core.ffn_scratch_bytes(fs.max_pairs, c.hidden, fs.I, fs.xr.shape[0])
