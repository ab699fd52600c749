"""Engine parity against the HF transformers oracles (f32), path variants, expert streaming."""
import json
import shutil

import numpy as np
import pytest

from colibri import model_init
from colibri.parity import check, load_ref
from conftest import DATA, ORACLES


def _ref(name, file="ref.json"):
    return load_ref(DATA / name / file)


@pytest.mark.parametrize("name", ORACLES)
@pytest.mark.parametrize("absorb", [-1, 0, 1])
def test_f32_parity(name, absorb):
    m = model_init(DATA / name, absorb=absorb)
    res = check(m, _ref(name))
    assert res["tf_total"] == 32 and res["greedy_total"] == 20
    assert res["tf_match"] == 32
    assert res["greedy_match"] == 20
    assert res["max_abs_logit_diff"] <= 1e-3


@pytest.mark.parametrize("name", ORACLES)
def test_f32_parity_long(name):
    ref = _ref(name, "ref_long.json")
    m = model_init(DATA / name)
    res = check(m, ref)
    assert res["tf_match"] == res["tf_total"] >= 80
    assert res["greedy_match"] == res["greedy_total"]
    assert res["max_abs_logit_diff"] <= 1e-3


def test_dsa_force_is_exact_when_context_fits():
    """Selecting every key through the sparse path equals dense attention."""
    ref = _ref("tiny_dense")
    a = model_init(DATA / "tiny_dense")
    b = model_init(DATA / "tiny_dense", dsa_force=True)
    _, la = a.forward_all(ref["full_ids"])
    _, lb = b.forward_all(ref["full_ids"])
    assert np.max(np.abs(la - lb)) < 1e-4


@pytest.mark.parametrize("name", ORACLES)
def test_expert_streaming_is_exact(name):
    """A cache of one expert per layer gives bit-identical outputs to a cache holding them all."""
    ref = _ref(name)
    full = model_init(DATA / name)
    one = model_init(DATA / name, cache_experts=1)
    g_full = full.generate(ref["prompt_ids"], 12)
    g_one = one.generate(ref["prompt_ids"], 12)
    assert g_full == g_one
    _, l_full = full.forward_all(ref["full_ids"])
    _, l_one = one.forward_all(ref["full_ids"])
    assert np.array_equal(l_full, l_one)
    assert one.expert_misses > full.expert_misses
    assert one.bytes_read > full.bytes_read > 0
    assert full.expert_hits > 0


def test_step_matches_step_all_rows():
    """Decode one token at a time gives the same logits as the batched forward (absorbed path)."""
    ref = _ref("tiny_dsa")
    ids = ref["full_ids"][:20]
    m = model_init(DATA / "tiny_dsa", absorb=1)
    m.kv_alloc(len(ids))
    batch = m.step_all(ids, 0)
    m.kv_alloc(len(ids))
    rows = [m.step([t], p) for p, t in enumerate(ids)]
    assert np.max(np.abs(np.stack(rows) - batch)) < 1e-4


def _write_bf16(tensors, path):
    """Write float tensors as a BF16 safetensors file (truncating f32 to its upper 16 bits)."""
    import struct
    header, blobs, at = {}, [], 0
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name], dtype=np.float32)
        b = (a.view(np.uint32) >> 16).astype(np.uint16).tobytes()
        header[name] = {"dtype": "BF16", "shape": list(a.shape), "data_offsets": [at, at + len(b)]}
        blobs.append(b)
        at += len(b)
    hb = json.dumps(header).encode()
    hb += b" " * (-len(hb) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hb)) + hb + b"".join(blobs))


def test_bf16_checkpoint_loads(tmp_path):
    """A bf16 HF checkpoint loads (kept f32 or quantized at load) and equals the f32 checkpoint of
    the same (bf16-rounded) weights."""
    from safetensors.numpy import load_file, save_file
    tensors = load_file(str(DATA / "tiny_dsa" / "model.safetensors"))
    rounded = {k: ((v.view(np.uint32) >> 16) << 16).view(np.float32) for k, v in tensors.items()}
    (tmp_path / "bf16").mkdir()
    (tmp_path / "f32").mkdir()
    for d in ("bf16", "f32"):
        shutil.copy(DATA / "tiny_dsa" / "config.json", tmp_path / d / "config.json")
    _write_bf16(tensors, tmp_path / "bf16" / "model.safetensors")
    save_file(rounded, str(tmp_path / "f32" / "model.safetensors"))
    ids = _ref("tiny_dsa")["full_ids"]
    _, a = model_init(tmp_path / "bf16").forward_all(ids)
    _, b = model_init(tmp_path / "f32").forward_all(ids)
    np.testing.assert_array_equal(a, b)
    _, c = model_init(tmp_path / "bf16", dense_bits=8, expert_bits=4).forward_all(ids)
    assert np.max(np.abs(c - a)) < 1.0


@pytest.mark.parametrize("name", ["tiny_dsa", "tiny_mtp"])
def test_resident_bytes_counts_every_resident_array(name):
    """resident_bytes() (the RAM projection's resident term) equals the bytes of every weight the
    model holds outside the expert cache, found by walking the layers' attributes."""
    from colibri._core import QT
    m = model_init(DATA / name)
    seen, total = set(), 0

    def add(v):
        nonlocal total
        if isinstance(v, QT):
            v = v.data if v.scale is None else (v.data, v.scale)
        for a in (v if isinstance(v, tuple) else (v,)):
            if isinstance(a, np.ndarray) and id(a) not in seen:
                seen.add(id(a))
                total += a.nbytes

    attrs = [a for a in dir(m.layers[0]) if not a.startswith("_")]
    for L in list(m.layers) + ([m.mtp] if m.has_mtp else []):
        for a in attrs:
            add(getattr(L, a))
    for v in (m.embed, m.lm_head, m.final_norm) + ((m.eh_proj, m.enorm, m.hnorm, m.mtp_norm) if m.has_mtp else ()):
        add(v)
    assert m.resident_bytes() == total
