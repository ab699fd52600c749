"""Quantized parity: our converter's int8/int4 containers against transformers run with the same
weights dequantized (references made by tools/make_oracle.py)."""
import numpy as np
import pytest

from colibri import model_init
from colibri.convert import ConvertOptions, convert
from colibri.parity import check, load_ref
from conftest import DATA, ORACLES

CONTAINERS = {"int8": dict(expert_bits=8, dense_bits=8, io_bits=8),
              "int4": dict(expert_bits=4, dense_bits=4, io_bits=8)}


@pytest.fixture(scope="module")
def containers(tmp_path_factory):
    out = {}
    for name in ORACLES:
        for kind, bits in CONTAINERS.items():
            dst = tmp_path_factory.mktemp(f"{name}_{kind}")
            convert(DATA / name, dst, ConvertOptions(**bits), verbose=False)
            out[name, kind] = dst
    return out


@pytest.mark.parametrize("name", ORACLES)
@pytest.mark.parametrize("kind", CONTAINERS)
def test_quantized_parity(containers, name, kind):
    """Default numerics (integer dots on Q8 activations + Q8 residual): ≥ 95% teacher-forced
    agreement required; these oracles reach every position."""
    ref = load_ref(DATA / name / f"ref_{kind}.json")
    m = model_init(containers[name, kind])
    res = check(m, ref)
    assert res["tf_total"] >= 64
    assert res["tf_match"] >= 0.95 * res["tf_total"]
    assert res["tf_match"] == res["tf_total"]
    assert res["greedy_match"] == res["greedy_total"]
    assert res["max_abs_logit_diff"] < 5e-3


@pytest.mark.parametrize("kind", CONTAINERS)
def test_quantized_parity_float_path(containers, kind):
    """The float dequant-on-use path reproduces transformers' dequantized model to f32 precision."""
    ref = load_ref(DATA / "tiny_dsa" / f"ref_{kind}.json")
    m = model_init(containers["tiny_dsa", kind], idot=0)
    res = check(m, ref)
    assert res["tf_match"] == res["tf_total"]
    assert res["max_abs_logit_diff"] < 1e-4


def test_plain_q8_activations_reach_threshold_on_dense(containers):
    """colibrì's plain per-row Q8 activations (idot=1) on the dense-attention oracle."""
    ref = load_ref(DATA / "tiny_dense" / "ref_int4.json")
    res = check(model_init(containers["tiny_dense", "int4"], idot=1), ref)
    assert res["tf_match"] >= 0.95 * res["tf_total"]


def test_container_weights_equal_runtime_quantization(containers):
    """A float checkpoint quantized at load time holds exactly the converter's container weights."""
    conv = model_init(containers["tiny_dense", "int4"])
    rt = model_init(DATA / "tiny_dense", dense_bits=4, expert_bits=4)
    for a, b in [(conv.layers[0].q_b, rt.layers[0].q_b), (conv.layers[3].down, rt.layers[3].down)]:
        assert a.fmt == b.fmt == "int4"
        np.testing.assert_array_equal(a.dequantize(), b.dequantize())
    ea = conv.expert_load(4, 3)
    eb = rt.expert_load(4, 3)
    np.testing.assert_array_equal(ea.up.dequantize(), eb.up.dequantize())


def test_expert_read_is_one_pread(containers):
    m = model_init(containers["tiny_dense", "int4"])
    before = m.bytes_read
    e = m.expert_load(3, 2)
    payload = e.gate.nbytes + e.up.nbytes + e.down.nbytes - 4 * (2 * 32 + 128)
    assert e.slab.nbytes == payload
    assert m.bytes_read - before == payload + 4 * (2 * 32 + 128)


@pytest.mark.parametrize("kind", CONTAINERS)
def test_streaming_exact_on_container(containers, kind):
    ref = load_ref(DATA / "tiny_dsa" / f"ref_{kind}.json")
    a = model_init(containers["tiny_dsa", kind])
    b = model_init(containers["tiny_dsa", kind], cache_experts=1)
    _, la = a.forward_all(ref["full_ids"])
    _, lb = b.forward_all(ref["full_ids"])
    assert np.array_equal(la, lb)
    assert a.generate(ref["prompt_ids"], 16) == b.generate(ref["prompt_ids"], 16)


def test_every_kernel_variant_gives_identical_outputs(containers):
    """Every kernel variant gives the same tokens; logits differ only by float summation order (the
    integer dots themselves are bit-identical across variants, see test_kernels)."""
    from colibri import _core
    ref = load_ref(DATA / "tiny_dsa" / "ref_int4.json")
    best = _core.isa_best()
    outs = {}
    try:
        for isa in ["scalar", "avx2", "avx512vnni"]:
            if _core.ISA_NAMES[isa] > _core.ISA_NAMES[best]:
                continue
            m = model_init(containers["tiny_dsa", "int4"], isa=isa)
            assert _core.isa_active() == isa
            outs[isa] = m.forward_all(ref["full_ids"])
    finally:
        _core.select_isa(best)
    base_pred, base_logits = outs.pop("scalar")
    for isa, (pred, logits) in outs.items():
        np.testing.assert_array_equal(pred, base_pred, err_msg=isa)
        assert np.max(np.abs(logits - base_logits)) < 1e-3, isa


@pytest.mark.parametrize("name", ORACLES)
@pytest.mark.parametrize("kind", CONTAINERS)
@pytest.mark.parametrize("threads", [1, 2])
def test_fused_ffn_group_is_bit_identical(containers, name, kind, threads):
    """Decode and small batches run every FFN of an MoE call (routed + shared) or a dense MLP as one
    fused parallel group; its outputs equal the per-matmul path bit for bit, for any thread count."""
    from colibri import _core
    ref = load_ref(DATA / name / f"ref_{kind}.json")
    ids = ref["full_ids"][:24]
    outs, before = [], _core.max_threads()
    for fused in (True, False):
        _core.set_threads(threads)
        m = model_init(containers[name, kind])
        m.fused = fused
        m.kv_alloc(len(ids) + 8)
        rows = [m.step(ids[:16], 0)] + [m.step([t], 16 + i) for i, t in enumerate(ids[16:20])]
        rows.append(m.step_all(ids[20:24], 20))          # a verify-sized batch
        outs.append(rows)
    _core.set_threads(before)
    for a, b in zip(*outs):
        assert np.array_equal(a, b)
