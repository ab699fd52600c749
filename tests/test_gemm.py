"""The batch GEMMs (include/coli_gemm.h: AMX-INT8 tiles, AVX-512 VNNI): prefill's integer matmuls
give bit for bit what the decode tiles give, for every format, layout, width and row count; the
paths turn off cleanly."""
import os
import subprocess
import sys

import numpy as np
import pytest

from colibri import _core, model_init
from colibri.convert import convert
from colibri.models import DEFAULT_MODEL_DIR
from conftest import DATA


@pytest.fixture
def amx_restored():
    was = _core.amx_active()
    yield
    _core.select_amx(was)
    _core.set_kernel_flags(gemm=True)


def _paths():
    """(name, set-up) of every path a batch matmul can take on this machine: the decode tiles (the
    reference), the VNNI GEMM and the AMX GEMM where the ISA has them."""
    def tiles():
        _core.set_kernel_flags(gemm=False)

    def vnni():
        _core.set_kernel_flags(gemm=True)
        _core.select_amx(False)

    def amx():
        _core.set_kernel_flags(gemm=True)
        _core.select_amx(True)
    out = [("tiles", tiles)]
    if _core.isa_active() == "avx512vnni":
        out.append(("vnni", vnni))
    if _core.isa_active() == "avx512vnni" and _core.amx_supported():
        out.append(("amx", amx))
    return out


def _qt(rng, fmt, O, I, ilv):
    if fmt == "i8":
        payload = rng.integers(-127, 128, O * I).astype(np.int8).view(np.uint8)
    else:
        payload = rng.integers(0, 256, O * ((I + 1) // 2)).astype(np.uint8)
    qt = _core.QT.from_packed(payload, rng.uniform(0.01, 0.1, O).astype(np.float32), O, I)
    if ilv:
        qt.interleave()
    return qt


def _bits(a):
    return np.ascontiguousarray(a).view(np.uint32)


def test_select_amx_is_on_only_where_the_cpu_has_it(amx_restored):
    assert _core.select_amx(True) == _core.amx_supported() == _core.amx_active()
    assert _core.select_amx(False) is False and not _core.amx_active()


@pytest.mark.parametrize("fmt", ["i8", "i4"])
@pytest.mark.parametrize("O,I", [(37, 64), (64, 1024), (33, 77), (100, 301), (5, 63), (48, 513)])
def test_gemm_matmul_is_bit_identical_to_the_tiles(fmt, O, I, amx_restored):
    rng = np.random.default_rng(O * 1000 + I)
    for ilv in (False, True):
        qt = _qt(rng, fmt, O, I, ilv)
        for S in (8, 17, 64, 511):
            x = rng.standard_normal((S, I)).astype(np.float32)
            x[3] = 0.0                                  # an all-zero row (scale 0)
            for idot in (1, 2):
                got = {}
                for name, use in _paths():
                    use()
                    got[name] = _core.matmul(qt, x, idot=idot)
                for name, y in got.items():
                    np.testing.assert_array_equal(_bits(y), _bits(got["tiles"]), err_msg=name)
                # and each row as decode computes it alone
                np.testing.assert_array_equal(_bits(got["tiles"][S - 1]),
                                              _bits(_core.matmul(qt, x[S - 1:], idot=idot)[0]))


@pytest.fixture(scope="module")
def int4(tmp_path_factory):
    out = tmp_path_factory.mktemp("int4") / "c"
    convert(DATA / "tiny_dsa", out, verbose=False)
    return out


@pytest.mark.parametrize("model", ["int4", "default"])
def test_prefill_logits_and_kv_equal_with_and_without_amx(model, int4, amx_restored):
    path = int4 if model == "int4" else DEFAULT_MODEL_DIR
    ids = [(i * 37 + 11) % 256 for i in range(70)]
    out = []
    for _, use in _paths():
        use()
        m = model_init(path)
        m.kv_alloc(len(ids) + 4)
        logits = m.step_all(ids, 0)
        nxt = m.step([int(np.argmax(logits[-1]))], len(ids))
        out.append((logits, nxt, [np.array(a) for a in m.Lc]))
    for got in out[1:]:
        np.testing.assert_array_equal(out[0][0], got[0])
        np.testing.assert_array_equal(out[0][1], got[1])
        for a, b in zip(out[0][2], got[2]):
            np.testing.assert_array_equal(a, b)


def test_colibri_amx_0_turns_the_path_off_at_import():
    code = "from colibri import _core; print(_core.amx_active(), _core.amx_supported())"
    env = dict(os.environ, COLIBRI_AMX="0")
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    active, supported = p.stdout.split()
    assert active == "False" and supported in ("True", "False")


def test_the_ram_plan_counts_the_gemm_scratch():
    from types import SimpleNamespace
    from colibri import tiers
    # 17 rows of 65 inputs: 2 blocks of 16 rows x 2 chunks of 64 inputs, 1 KiB each, for q1 and q2; the
    # rows' sums; a 2-chunk panel of two 1-KiB tiles and a residual row of 65 floats per thread
    assert _core.gemm_scratch_bytes(17, 65, 2) == 2 * 2 * 2 * 1024 + 8 * 17 + 2 * (2 * 2 * 1024 + 4 * 65)
    m = model_init(DEFAULT_MODEL_DIR)
    c = m.cfg
    inter = max(c.dense_inter, c.moe_inter * max(c.n_shared, 1), c.moe_inter)
    widest = max(2 * c.hidden, c.q_lora, c.kv_lora, c.n_heads * c.v_head, inter)
    ctx = 1000
    est = tiers.work_bytes_estimate(SimpleNamespace(cfg=c, has_dsa=True), ctx)
    assert est >= _core.gemm_scratch_bytes(_core.chunk_rows(ctx), widest, _core.max_threads())
