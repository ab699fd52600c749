"""The integer matmul tiles in the engine (coli_rowdot_*_tile): every int4 matmul reads its
activations' split forms, and the fused FFN group quantizes input rows that several FFNs read once
for all of them. On layers that mix int8 and int4 matrices, for both idot paths, every ISA this CPU
has and one or two threads, the outputs equal the unfused path with one weight row per kernel call
bit for bit (decode rows and a verify batch)."""
import numpy as np
import pytest

from colibri import _core, model_init
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
