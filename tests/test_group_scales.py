"""Group-scaled int4 / int8 weights: colibrì's default container since mid-2026 (one F32 scale per
64 inputs of each row, the last group partial, ``NAME.qs`` [O, G] or flat [O·G]; the DSA indexer in
separate ``out-idx-*`` shards), read and written (``convert --group-size``)."""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import colibri
from colibri import _core, plan, quant, tiers
from colibri.convert import ConvertOptions, convert
from colibri.st import ContainerError, SafeTensorsDir
from conftest import DATA

sys.path.insert(0, str(DATA.parent.parent / "tools"))
from bench_groups import random_weights  # noqa: E402  (the random glm_moe_dsa checkpoint builder)

VARIANTS = ["scalar", "avx2", "avx512vnni"]


def _supported():
    best = _core.ISA_NAMES[_core.isa_best()]
    return [v for v in VARIANTS if _core.ISA_NAMES[v] <= best]


@pytest.fixture
def restore_isa():
    before = _core.isa_active()
    yield
    _core.select_isa(before)


# ---------------------------------------------------------------------------------------------
# quantizers and the scale-count validator


def test_group_scales_are_group_amax_over_qmax_with_the_floor():
    w = np.zeros((2, 150), np.float32)
    w[0, :64] = np.linspace(-3.5, 2.0, 64)      # group 0: amax 3.5
    w[0, 64:128] = 0.7                          # group 1: amax 0.7
    w[0, 128:] = -1.4                           # group 2 (partial, 22 inputs): amax 1.4
    # row 1 all zero: every group gets the 1e-8 floor (kept from the per-row quantizer)
    v, s = quant.quantize_groups(w, 4, 64)
    assert s.shape == (2, 3) and s.dtype == np.float32
    np.testing.assert_array_equal(s[0], np.float32([3.5, 0.7, 1.4]) / np.float32(7))
    np.testing.assert_array_equal(s[1], np.full(3, quant.SCALE_FLOOR))
    assert v[0, 0] == -7 and np.all(v[0, 64:128] == 7) and np.all(v[0, 128:] == -7) and not v[1].any()
    payload, s2, fmt = quant.quantize(w, 4, group_size=64)
    assert fmt == "int4" and s2.shape == (2, 3)
    # the nibble packing is the per-row one: only the scales differ
    np.testing.assert_array_equal(payload, quant.pack_int4(v).reshape(-1))
    d = quant.dequantize(payload, s2, 2, 150)
    np.testing.assert_array_equal(d, v.astype(np.float32) * np.repeat(s2, 64, axis=1)[:, :150])


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("gs", [64, 128, 256])
def test_quantize_groups_against_a_loop(bits, gs):
    rng = np.random.default_rng(11)
    O, I = 7, 300
    w = (rng.standard_normal((O, I)) * np.exp(rng.uniform(-2, 2, (O, I)))).astype(np.float32)
    v, s = quant.quantize_groups(w, bits, gs)
    qmax = quant.qmax_for_bits(bits)
    for o in range(O):
        for g in range(-(-I // gs)):
            seg = w[o, g * gs:(g + 1) * gs]
            sc = max(np.float32(np.abs(seg).max()) / np.float32(qmax), np.float32(1e-8))
            assert s[o, g] == np.float32(sc)
            want = np.clip(np.rint(seg / np.float32(sc)), -qmax - 1, qmax)
            np.testing.assert_array_equal(v[o, g * gs:(g + 1) * gs], want)
    # finer groups never lose precision against one scale per row
    d_group = v.astype(np.float32) * np.repeat(s, gs, axis=1)[:, :I]
    vr, sr = quant.quantize_rows(w, bits)
    assert np.abs(d_group - w).sum() < np.abs(vr * sr[:, None] - w).sum()


def test_scale_group_size_reads_the_count():
    O, I = 256, 6144
    assert quant.scale_group_size((O,), "int4", O, I) == 0
    assert quant.scale_group_size((O, 1), "int4", O, I) == 0
    for gs in (64, 128, 256, 512):
        G = -(-I // gs)
        assert quant.scale_group_size((O, G), "int4", O, I) == gs
        assert quant.scale_group_size((O * G,), "int8", O, I) == gs
        assert quant.scale_group_size(O * G, "int4", O, I) == gs
    assert quant.scale_group_size((10, 2), "int4", 10, 100) == 64         # partial last group
    assert quant.scale_group_size((10,), "int4", 10, 64) == 0              # one group = per row
    with pytest.raises(ContainerError, match=r"model\.layers\.0\.self_attn\.q_a_proj\.weight\.qs: "
                                             r"4097 scales for 256 rows"):
        quant.scale_group_size((4097,), "int4", 256, 6144, "model.layers.0.self_attn.q_a_proj.weight")
    with pytest.raises(ContainerError, match="96 scales for 4 rows"):     # groups of 256/3: no such size
        quant.scale_group_size((96,), "int4", 4, 256 * 8)
    with pytest.raises(ContainerError, match=r"shape \[96, 256\]"):      # [G, O]: transposed
        quant.scale_group_size((96, 256), "int4", 256, 6144, "w")
    with pytest.raises(ContainerError, match="int4 and int8 only"):
        quant.scale_group_size((4, 2), "int2", 4, 100, "w")
    for bad in (32, 100, 192, -64, 1.5, "64"):
        with pytest.raises(ValueError, match="64, 128, 256"):
            quant.check_group_size(bad)
    assert quant.check_group_size(0) == 0 and quant.check_group_size(1024) == 1024


def test_rows_of_one_group_keep_per_row_scales():
    w = np.random.default_rng(0).standard_normal((5, 64)).astype(np.float32)
    p1, s1, _ = quant.quantize(w, 4, group_size=64)
    p0, s0, _ = quant.quantize(w, 4)
    assert s1.shape == (5,)
    np.testing.assert_array_equal(p1, p0)
    np.testing.assert_array_equal(s1, s0)
    with pytest.raises(ValueError, match="int4 and int8 only"):
        quant.quantize(np.ones((2, 200), np.float32), 2, group_size=64)


# ---------------------------------------------------------------------------------------------
# kernels


def _q8_pair(x, block):
    """The engine's idot=2 activation pair: Q8(x) and Q8 of its residual."""
    q1, s1 = _core.quantize_q8(x, block)
    blk = x.shape[0] if block == 0 or block >= x.shape[0] else block
    xr = (x - np.repeat(s1, blk)[:x.shape[0]] * q1.astype(np.float32)).astype(np.float32)
    q2, s2 = _core.quantize_q8(xr, block)
    return (q1, s1), (q2, s2)


def _fma32(a, b, c):
    """Correctly rounded float32 a·b + c, element-wise (numpy has no fma): the product is exact in
    float64, TwoSum gives the exact error of the float64 sum, and a float64 sum that lands exactly
    on a float32 midpoint is rounded toward the error's side."""
    a, b, c = (np.asarray(t, np.float32).astype(np.float64) for t in (a, b, c))
    p = a * b
    s = p + c
    bb = s - p
    err = (p - (s - bb)) + (c - bb)
    r = s.astype(np.float32)
    dn = np.where(r.astype(np.float64) > s, np.nextafter(r, np.float32(-np.inf)), r)
    up = np.nextafter(dn, np.float32(np.inf))
    mid = (dn.astype(np.float64) + up.astype(np.float64)) / 2
    fix = (s == mid) & (err != 0)
    return np.where(fix, np.where(err > 0, up, dn), r).astype(np.float32)


def _rowdotg_ref(v, ws, gs, q, xs, block, int4):
    """The group-scaled row dot's definition (include/coli_group.h) in numpy, operation by
    operation. One activation block, the lane form: per group g, D[l] = the exact dot of its inputs
    in lane l (int8: (i mod 64) // 4, int4: (i mod 128) // 8), A = fma(ws[g], D, A) lane-wise,
    then R16(A) and one product with xs. Several blocks, the segment form: per block b, in_b = Σ
    over its pieces (cut at the group boundaries) of ws[g] ⊗ dot_piece from 0; out = xs[0] ⊗ in_0
    ⊕ xs[1] ⊗ in_1 ..."""
    n = v.shape[0]
    bl = n if block == 0 or block >= n else block
    f = np.float32
    if bl == n:
        a = np.zeros(16, np.float32)
        prod = v.astype(np.int64) * q.astype(np.int64)
        lane = (np.arange(n) % 128) // 8 if int4 else (np.arange(n) % 64) // 4
        for g, i0 in enumerate(range(0, n, gs)):
            d = np.bincount(lane[i0:i0 + gs], weights=prod[i0:i0 + gs], minlength=16).astype(np.int64)
            a = _fma32(np.full(16, ws[g], np.float32), d.astype(np.float32), a)
        t8 = a[:8] + a[8:]
        t4 = t8[:4] + t8[4:]
        return f(xs[0] * f(f(t4[0] + t4[2]) + f(t4[1] + t4[3])))
    acc = None
    for b, i in enumerate(range(0, n, bl)):
        end = min(i + bl, n)
        inner = f(0)
        j = i
        while j < end:
            stop = min((j // gs + 1) * gs, end)
            d = int(np.dot(v[j:stop].astype(np.int64), q[j:stop].astype(np.int64)))
            inner = f(inner + f(ws[j // gs] * f(d)))
            j = stop
        p = f(xs[b] * inner)
        acc = p if acc is None else f(acc + p)
    return acc


SHAPES = [(5, 64), (6, 100), (5, 192), (3, 6144 + 36), (9, 1000)]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("gs", [64, 128, 256])
def test_grouped_matmul_is_its_definition_on_every_isa(bits, gs, restore_isa):
    """idot=1 and idot=2: every ISA variant returns the float32 definition exactly (so the variants
    are bit-identical to the scalar one), for odd widths, partial last groups, activation blocks
    that are and are not multiples of the group, and any batch (a row's value never depends on S)."""
    rng = np.random.default_rng(gs + bits)
    for O, I in SHAPES:
        W = rng.standard_normal((O, I)).astype(np.float32)
        payload, s, fmt = quant.quantize(W, bits, group_size=gs)
        qt = _core.QT.from_packed(payload, s, O, I)
        v = quant.unpack(payload, fmt, O, I)
        ws = s.reshape(O, -1)
        if ws.shape[1] == 1:
            continue
        assert qt.group_size == gs
        x = (rng.standard_normal((5, I)) * rng.uniform(0.1, 10)).astype(np.float32)
        for block in (0, 64, 128, 192):
            want = {}
            for idot in (1, 2):
                ref = np.empty((5, O), np.float32)
                for srow in range(5):
                    (q1, s1), (q2, s2) = _q8_pair(x[srow], block)
                    for o in range(O):
                        r1 = _rowdotg_ref(v[o], ws[o], gs, q1, s1, block, bits == 4)
                        ref[srow, o] = r1 if idot == 1 else np.float32(r1 + _rowdotg_ref(v[o], ws[o], gs, q2, s2,
                                                                                          block, bits == 4))
                want[idot] = ref
            for isa in _supported():
                _core.select_isa(isa)
                for idot in (1, 2):
                    for S in (1, 2, 3, 5):
                        y = _core.matmul(qt, x[:S], block=block, idot=idot)
                        np.testing.assert_array_equal(y, want[idot][:S], err_msg=f"{isa} {O}x{I} b{block} "
                                                                                   f"idot{idot} S{S}")
                before = _core.set_kernel_flags()
                try:                                     # one weight row per call: the same floats
                    _core.set_kernel_flags(group_kernels=False)
                    np.testing.assert_array_equal(_core.matmul(qt, x[:3], block=block), want[2][:3])
                finally:
                    _core.set_kernel_flags(**before)


@pytest.mark.parametrize("bits", [4, 8])
def test_grouped_float_paths(bits, restore_isa):
    """idot=0 (dequant-on-use) and the attention helpers on group-scaled rows: qt_addrows equals
    qt_addrow per row and numpy's float32 acc + (c·ws_g)·v bit for bit on every ISA; the float dots
    agree with the dequantized matrix to float rounding."""
    rng = np.random.default_rng(bits)
    for O, I in SHAPES:
        W = rng.standard_normal((O, I)).astype(np.float32)
        payload, s, fmt = quant.quantize(W, bits, group_size=64)
        qt = _core.QT.from_packed(payload, s.reshape(-1), O, I)      # flat [O·G] scales
        Wd = qt.dequantize()
        ws = s.reshape(O, -1)
        v = quant.unpack(payload, fmt, O, I).astype(np.float32)
        x = rng.standard_normal((3, I)).astype(np.float32)
        c = rng.standard_normal(O).astype(np.float32)
        acc = rng.standard_normal(I).astype(np.float32)
        want = acc.copy()
        for r in range(O):
            want = want + np.repeat(c[r] * ws[r], 64)[:I] * v[r]
        for isa in _supported():
            _core.select_isa(isa)
            ref = x.astype(np.float64) @ Wd.T.astype(np.float64)
            y = _core.matmul(qt, x, idot=0)
            np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
            np.testing.assert_allclose(qt.rowdots(0, O, x[0]), ref[0], rtol=1e-5, atol=1e-5 * np.abs(ref).max())
            np.testing.assert_array_equal(qt.addrows(0, c, acc), want, err_msg=isa)
            np.testing.assert_array_equal(qt.addrows(0, c, acc, one_by_one=True), want, err_msg=isa)


def test_per_row_matrices_keep_their_kernels(restore_isa):
    """A per-row matrix gives the same outputs as before groups existed: its scales read as
    per-row in either shape ([O] and [O, 1]), and the four-row kernels still serve it."""
    rng = np.random.default_rng(3)
    W = rng.standard_normal((37, 640)).astype(np.float32)
    payload, s, _ = quant.quantize(W, 4)
    a = _core.QT.from_packed(payload, s, 37, 640)
    b = _core.QT.from_packed(payload, s.reshape(37, 1), 37, 640)
    assert a.group_size == b.group_size == 0 and a.nbytes == 37 * 320 + 4 * 37
    x = rng.standard_normal((3, 640)).astype(np.float32)
    before = _core.set_kernel_flags()
    try:
        for S in (1, 3):
            _core.set_kernel_flags(group_kernels=True)
            y4 = _core.matmul(a, x[:S])
            _core.set_kernel_flags(group_kernels=False, block_sums=False)
            np.testing.assert_array_equal(y4, _core.matmul(b, x[:S]))
    finally:
        _core.set_kernel_flags(**before)


def test_bad_scale_counts_are_refused():
    payload = np.zeros(256 * 32, np.uint8)           # int4 [256, 64]
    with pytest.raises(ContainerError, match=r"q_a_proj\.weight\.qs: 4096 scales for 256 rows"):
        _core.QT.from_packed(payload, np.ones(4096, np.float32), 256, 64, "model.layers.0.self_attn.q_a_proj.weight")
    with pytest.raises(ContainerError, match="int4 and int8 only"):
        _core.QT.from_packed(np.zeros(4 * 25, np.uint8), np.ones(8, np.float32), 4, 100, "w2")   # int2 + groups
    qt = _core.QT.from_packed(np.zeros(4 * 50, np.uint8), np.ones((4, 2), np.float32), 4, 100)
    assert qt.group_size == 64 and qt.nbytes == 4 * 50 + 4 * 8 and qt.fmt == "int4"


# ---------------------------------------------------------------------------------------------
# a colibrì-style container: written by hand (not by our converter), indexer in out-idx-*


WIDE = dict(hidden_size=160, q_lora_rank=100, kv_lora_rank=96, moe_intermediate_size=80,
            intermediate_size=136)       # every width > 64 and most with a partial last group


def _wide_config(mtp):
    """tiny_dsa's config with wider rows: every matrix has more than one group of 64 inputs."""
    cfg = json.loads((DATA / "tiny_dsa" / "config.json").read_text())
    cfg.update(WIDE)
    if mtp:
        cfg["num_nextn_predict_layers"] = 1
    return cfg


def _colibri_quant(w, qmax, gs):
    """colibrì's converter rule, written out independently of colibri.quant: per group of gs inputs
    (gs = 0: per row) s = max(amax / qmax, 1e-8), v = clip(rint(w / s)); int4 nibbles v + 8, low
    nibble = even element; int8 bytes."""
    O, I = w.shape
    G = 1 if gs == 0 else -(-I // gs)
    width = I if gs == 0 else gs
    s = np.empty((O, G), np.float32)
    v = np.empty((O, I), np.int16)
    for g in range(G):
        seg = w[:, g * width:(g + 1) * width]
        sc = np.maximum(np.abs(seg).max(axis=1) / np.float32(qmax), np.float32(1e-8)).astype(np.float32)
        s[:, g] = sc
        v[:, g * width:(g + 1) * width] = np.clip(np.rint(seg / sc[:, None]), -qmax - 1, qmax)
    if qmax == 127:
        payload = v.astype(np.int8).view(np.uint8).reshape(-1)
    else:
        u = (v + 8).astype(np.uint8)
        if I % 2:
            u = np.concatenate([u, np.zeros((O, 1), np.uint8)], axis=1)
        payload = (u[:, 0::2] | (u[:, 1::2] << 4)).reshape(-1)
    deq = (v.astype(np.float32) * np.repeat(s, width, axis=1)[:, :I]).astype(np.float32)
    return payload, s, deq


def _write_colibri_style(src, dst_container, dst_float, mtp):
    """The container colibrì writes (int4 with groups of 64 for the projections and experts, int8
    for embed/lm_head, the indexer and the MTP head; group scales [O, G] for most, flat [O·G] for
    every third matrix, per-row [O] where a row is one group or for the int8 indexer), its indexer
    in out-idx-00000.safetensors and its MTP head in out-mtp-00000.safetensors; plus the float
    model holding exactly the dequantized weights."""
    cfg = _wide_config(mtp)
    t = random_weights(cfg, mtp)
    NL = cfg["num_hidden_layers"]
    shards = {"out-00000.safetensors": {}, "out-idx-00000.safetensors": {}, "out-mtp-00000.safetensors": {}}
    floats = {}
    for k, (name, w) in enumerate(sorted(t.items())):
        mtp_layer = name.startswith(f"model.layers.{NL}.")
        shard = ("out-mtp-00000.safetensors" if mtp_layer else
                 "out-idx-00000.safetensors" if ".indexer." in name else "out-00000.safetensors")
        quantized = w.ndim == 2 and not name.endswith("mlp.gate.weight")
        if not quantized:
            shards[shard][name] = w
            floats[name] = w
            continue
        int8 = mtp_layer or ".indexer." in name or name in ("model.embed_tokens.weight", "lm_head.weight")
        gs = 0 if ".indexer." in name else 64
        payload, s, deq = _colibri_quant(w, 127 if int8 else 7, gs)
        shards[shard][name] = payload
        shards[shard][name + ".qs"] = s.reshape(-1) if (s.shape[1] == 1 or k % 3 == 0) else s
        floats[name] = deq
    for d in (dst_container, dst_float):
        os.makedirs(d)
        (d / "config.json").write_text(json.dumps(cfg))
    for fname, tensors in shards.items():
        save_file(tensors, str(dst_container / fname))
    save_file(floats, str(dst_float / "model.safetensors"))
    return cfg


@pytest.fixture(scope="module")
def colibri_style(tmp_path_factory):
    root = tmp_path_factory.mktemp("colibri_style")
    cont, flt = root / "container", root / "float"
    _write_colibri_style(DATA / "tiny_dsa", cont, flt, mtp=True)
    return cont, flt


def test_colibri_style_container_loads(colibri_style):
    cont, flt = colibri_style
    m = colibri.model_init(cont)
    f = colibri.model_init(flt)
    try:
        assert m.has_dsa and m.has_mtp
        L0 = m.layers[0]
        assert L0.q_a.fmt == "int4" and L0.q_a.group_size == 64           # [100, 160]: 3 groups
        assert L0.kv_b.group_size == 64 and L0.iwq.fmt == "int8" and L0.iwq.group_size == 0
        assert m.embed.fmt == "int8" and m.embed.group_size == 64 and m.mtp.q_a.fmt == "int8"
        # every matrix holds exactly the dequantized weights of the float twin
        pairs = [(m.embed, f.embed), (m.lm_head, f.lm_head), (m.eh_proj, f.eh_proj)]
        for L, Lf in zip(list(m.layers) + [m.mtp], list(f.layers) + [f.mtp]):
            for k in ("q_a", "q_b", "kv_a", "kv_b", "o_proj", "gate", "up", "down", "iwq", "iwk", "iwp"):
                if getattr(L, k) is not None:
                    pairs.append((getattr(L, k), getattr(Lf, k)))
        for li in (3, 4, m.cfg.n_layers):
            E, Ef = m.expert_load(li, 5), f.expert_load(li, 5)
            pairs += [(E.gate, Ef.gate), (E.up, Ef.up), (E.down, Ef.down)]
        for a, b in pairs:
            np.testing.assert_array_equal(a.dequantize(), b.dequantize())
    finally:
        m.close()
        f.close()


@pytest.mark.parametrize("idot,tol", [(0, 2e-5), (2, 3e-3)])
def test_colibri_style_container_matches_its_float_model(colibri_style, idot, tol):
    """Logits of the group-scaled container equal the float model of its dequantized weights: to
    float rounding on the dequant-on-use path (every kernel, the absorbed attention's grouped
    kv_b helpers, the grouped int8 embedding row, the indexer from its own shard), to the
    activations' Q8 error on the integer path; the MTP head drafts the same tokens."""
    cont, flt = colibri_style
    ids = [(7 * i + 3) % 256 for i in range(24)]     # > index_topk = 8 keys: DSA selects
    m = colibri.model_init(cont, idot=idot)
    f = colibri.model_init(flt)
    try:
        _, lm = m.forward_all(ids)
        _, lf = f.forward_all(ids)
        assert np.abs(lm - lf).max() <= tol * np.abs(lf).max()
        assert (np.argmax(lm, 1) == np.argmax(lf, 1)).mean() >= 0.9
        if idot == 0:
            np.testing.assert_array_equal(np.argmax(lm, 1), np.argmax(lf, 1))
            for model in (m, f):
                model.kv_alloc(40)
                model.step(ids[:12], 0)
            assert m.mtp_draft(ids[12], 12, 3) == f.mtp_draft(ids[12], 12, 3)
    finally:
        m.close()
        f.close()


@pytest.mark.parametrize("threads", [1, 2])
def test_colibri_style_paths_are_bit_identical(colibri_style, threads):
    """On group-scaled matrices every path computes the same floats: the fused FFN group and one
    matmul per matrix, the tile kernels and one weight row per call, experts streamed (one cached
    per layer, reads overlapped) and all in RAM, decode rows and a verify batch."""
    cont, _ = colibri_style
    ids = [(5 * i + 11) % 256 for i in range(20)]
    before, flags = _core.max_threads(), _core.set_kernel_flags()
    outs = []
    try:
        _core.set_threads(threads)
        for fused, group_kernels, cache in [(True, True, 0), (False, True, 0), (True, False, 0), (True, True, 1)]:
            _core.set_kernel_flags(group_kernels=group_kernels)
            m = colibri.model_init(cont, cache_experts=cache)
            m.fused = fused
            m.kv_alloc(len(ids) + 4)
            rows = [m.step(ids[:12], 0)] + [m.step([t], 12 + i) for i, t in enumerate(ids[12:16])]
            rows.append(m.step_all(ids[16:20], 16))            # a verify-sized batch
            outs.append(rows)
            m.close()
    finally:
        _core.set_threads(before)
        _core.set_kernel_flags(**flags)
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            np.testing.assert_array_equal(a, b)
    m = colibri.model_init(cont)
    try:                                  # the verify batch's rows are the decode rows' values
        m.kv_alloc(len(ids) + 4)
        m.step(ids[:12], 0)
        for i, t in enumerate(ids[12:16]):
            m.step([t], 12 + i)
        seq = [m.step([t], 16 + i) for i, t in enumerate(ids[16:20])]
        np.testing.assert_array_equal(np.stack(seq), outs[0][-1])
    finally:
        m.close()


def test_colibri_style_plan_is_exact_and_a_cold_token_reads_it(colibri_style):
    cont, _ = colibri_style
    r = plan.build_report(cont, ram_gb=4, runtime_bytes=0)
    m = colibri.model_init(cont)
    try:
        assert r["format"] == "container" and r["config"]["has_dsa"]
        assert r["resident"]["engine_bytes"] == m.resident_bytes()
        rows = tiers.expert_bytes_by_row(m)
        for x in r["experts"]["rows"] + [r["experts"]["mtp"]]:
            E = m.expert_load(x["layer"], 1)
            ram = sum(W.nbytes for W in (E.gate, E.up, E.down))
            assert x["expert_bytes"] == x["expert_disk_bytes"] == ram == rows[x["layer"]]
        # int4 gate/up [80, 160] (3 groups a row) and down [160, 80] (2 groups): payload + scales
        assert r["experts"]["rows"][0]["expert_bytes"] == 2 * (80 * 80 + 4 * 80 * 3) + (160 * 40 + 4 * 160 * 2)
        m.kv_alloc(4)
        m.reset_stats()
        m.step([3], 0)
        assert m.bytes_read == r["per_token"]["disk_bytes_cold"]
        # the expert read: one pread of the three payloads, plus their three scale tensors
        before = m.bytes_read
        E = m.expert_load(4, 6)
        assert E.slab.nbytes == 2 * 80 * 80 + 160 * 40
        assert m.bytes_read - before == E.slab.nbytes + 4 * (2 * 80 * 3 + 160 * 2)
    finally:
        m.close()


def _rewrite(path, fn):
    tensors = load_file(str(path))
    fn(tensors)
    save_file(tensors, str(path))


@pytest.mark.parametrize("name,shard", [
    ("model.layers.0.self_attn.q_a_proj.weight.qs", "out-00000.safetensors"),
    ("model.layers.4.mlp.experts.2.down_proj.weight.qs", "out-00000.safetensors"),
    ("model.layers.0.self_attn.indexer.wk.weight.qs", "out-idx-00000.safetensors"),
])
def test_bad_scale_count_in_a_container_names_file_and_tensor(colibri_style, tmp_path, name, shard):
    cont, _ = colibri_style
    bad = tmp_path / "bad"
    shutil.copytree(cont, bad)

    def drop_one(t):
        t[name] = t[name].reshape(-1)[:-1].copy()
    _rewrite(bad / shard, drop_one)
    with pytest.raises(ContainerError, match=rf"{shard}: .*{name.replace('.', '[.]')}: \d+ scales for \d+ rows"):
        colibri.model_init(bad)
    with pytest.raises(plan.PlanError, match=rf"{name.replace('.', '[.]')}: \d+ scales for \d+ rows"):
        plan.build_report(bad, ram_gb=4)
    p = subprocess.run([sys.executable, "-m", "colibri", "plan", str(bad)], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 2 and "scales for" in p.stderr and "Traceback" not in p.stderr


# ---------------------------------------------------------------------------------------------
# our converter: --group-size


@pytest.fixture(scope="module")
def dense_containers(tmp_path_factory):
    out = {}
    for gs in (0, 64):
        dst = tmp_path_factory.mktemp(f"dense_g{gs}")
        convert(DATA / "tiny_dense", dst, ConvertOptions(expert_bits=4, dense_bits=4, io_bits=8, group_size=gs),
                verbose=False)
        out[gs] = dst
    return out


def _dequantized_twin(container, src, dst):
    """A float checkpoint holding a container's dequantized weights (colibri.quant.dequantize); the
    matrix shapes come from the source checkpoint it was converted from."""
    os.makedirs(dst)
    shutil.copy(container / "config.json", dst / "config.json")
    shapes = {n: w.shape for n, w in load_file(str(src / "model.safetensors")).items()}
    out = {}
    with SafeTensorsDir(container) as st:
        for name in st.names():
            if name.endswith(".qs"):
                continue
            if name + ".qs" in st:
                out[name] = quant.dequantize(st.read_raw(name), st.read_f32(name + ".qs"), *shapes[name], name)
            else:
                out[name] = st.read_f32(name)
    save_file(out, str(dst / "model.safetensors"))
    return dst


def test_convert_group_size_writes_the_grouped_container(dense_containers):
    dst = dense_containers[64]
    man = json.loads((dst / "colibri_convert.json").read_text())
    assert man["group_size"] == 64 and "group of 64" in man["quantization"]["scheme"]
    with SafeTensorsDir(dst) as st:
        assert st.info("model.layers.0.self_attn.o_proj.weight.qs").shape == (128, 2)        # int4, I = 128
        assert st.info("model.layers.0.self_attn.q_b_proj.weight.qs").shape == (128,)        # I = 64: one group
        assert st.info("model.embed_tokens.weight.qs").shape == (256,)                        # int8: per row
        assert st.info("model.layers.3.mlp.experts.0.gate_proj.weight.qs").shape == (32, 2)
        w = load_file(str(DATA / "tiny_dense" / "model.safetensors"))["model.layers.0.self_attn.o_proj.weight"]
        payload, s, _ = quant.quantize(w, 4, group_size=64)
        np.testing.assert_array_equal(st.read_raw("model.layers.0.self_attn.o_proj.weight"), payload)
        np.testing.assert_array_equal(st.read_f32("model.layers.0.self_attn.o_proj.weight.qs"), s)
    m = colibri.model_init(dst)
    try:
        assert m.layers[0].o_proj.group_size == 64 and m.layers[0].q_b.group_size == 0
        r = plan.build_report(dst, ram_gb=4, runtime_bytes=0)
        assert r["resident"]["engine_bytes"] == m.resident_bytes()
        x = r["experts"]["rows"][0]
        E = m.expert_load(x["layer"], 0)
        assert x["expert_bytes"] == x["expert_disk_bytes"] == sum(W.nbytes for W in (E.gate, E.up, E.down)) == \
            2 * (32 * 64 + 4 * 32 * 2) + (128 * 16 + 4 * 128)
    finally:
        m.close()


def test_convert_group_size_runs_close_to_float_and_per_row(dense_containers, tmp_path):
    """The group-scaled container's logits equal the float model of its dequantized weights (to
    float rounding on idot=0, to the Q8 activation error on the default idot=2), and its distance
    to the original float model is the int4 error of the per-row container: on this random tiny
    model (i.i.d. weights, flat logits) both quantizations move the logits by the same amount, and
    grouped and per-row differ from each other by no more than that."""
    ref = json.loads((DATA / "tiny_dense" / "ref_int4.json").read_text())
    ids = ref["full_ids"]
    twin = _dequantized_twin(dense_containers[64], DATA / "tiny_dense", tmp_path / "twin")
    logits = {}
    for key, path, kw in [("f32", DATA / "tiny_dense", {}), ("twin", twin, {}),
                          ("g0", dense_containers[64], dict(idot=0)), ("g2", dense_containers[64], {}),
                          ("r2", dense_containers[0], {})]:
        m = colibri.model_init(path, **kw)
        logits[key] = m.forward_all(ids)[1]
        m.close()
    scale = np.abs(logits["twin"]).max()
    assert np.abs(logits["g0"] - logits["twin"]).max() <= 2e-5 * scale
    assert np.abs(logits["g2"] - logits["twin"]).max() <= 3e-3 * scale
    err_group = np.abs(logits["g2"] - logits["f32"]).mean()
    err_row = np.abs(logits["r2"] - logits["f32"]).mean()
    assert 2 / 3 < err_group / err_row < 3 / 2
    assert np.abs(logits["g2"] - logits["r2"]).mean() <= 1.5 * max(err_group, err_row)


def test_convert_group_size_is_validated_and_recorded_for_resume(tmp_path):
    with pytest.raises(ValueError, match="--group-size 100"):
        ConvertOptions(group_size=100)
    p = subprocess.run([sys.executable, "-m", "colibri", "convert", str(DATA / "tiny_dense"), str(tmp_path / "x"),
                        "--group-size", "96"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "group size" in p.stderr and "Traceback" not in p.stderr
    dst = tmp_path / "c"
    convert(DATA / "tiny_dense", dst, ConvertOptions(group_size=64), verbose=False)
    with pytest.raises(ContainerError, match="group_size"):
        convert(DATA / "tiny_dense", dst, ConvertOptions(group_size=128), verbose=False)
    # a manifest from before group sizes existed means per-row: resuming per-row still works
    man = json.loads((dst / "colibri_convert.json").read_text())
    r = tmp_path / "r"
    convert(DATA / "tiny_dense", r, ConvertOptions(), verbose=False)
    old = json.loads((r / "colibri_convert.json").read_text())
    del old["group_size"]
    (r / "colibri_convert.json").write_text(json.dumps(old))
    convert(DATA / "tiny_dense", r, ConvertOptions(), verbose=False)
    assert man["group_size"] == 64


def test_bench_groups_tool_runs(tmp_path):
    """tools/bench_groups.py on the tiny fixture: both containers measured, groups of 64 closer to
    the float matmul than one scale per row."""
    out = tmp_path / "g.json"
    p = subprocess.run([sys.executable, str(DATA.parent.parent / "tools" / "bench_groups.py"), "--tiny",
                        "--tokens", "2", "--rounds", "1", "--json", str(out)], capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    d = json.loads(out.read_text())
    assert set(d["decode"]) == set(d["parity"]) == {"per_row", "group64"}
    assert d["bytes"]["group64"] > d["bytes"]["per_row"]
    for m in d["matmul"]:
        assert m["group64_rel_rms_err"] < m["per_row_rel_rms_err"]
