"""Tests for colibri.convert (HF glm_moe_dsa checkpoint -> colibri container).

Every test builds its own tiny fake model with numpy into tmp_path.
"""

import errno
import json
import os
import re
import struct
import subprocess
import sys
import time

import numpy as np
import pytest
import safetensors.numpy as stnp

from colibri import convert as cv
from colibri import quant
from colibri.config import ConfigError
from colibri.st import ContainerError, SafeTensorsDir, scan_file

# -- a tiny glm_moe_dsa config -------------------------------------------------------

BASE_CFG = dict(
    model_type="glm_moe_dsa",
    architectures=["GlmMoeDsaForCausalLM"],
    vocab_size=48,
    hidden_size=32,
    intermediate_size=24,
    moe_intermediate_size=8,
    num_hidden_layers=2,
    first_k_dense_replace=1,
    num_attention_heads=2,
    num_key_value_heads=2,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_shared_experts=1,
    q_lora_rank=16,
    kv_lora_rank=8,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=8,
    index_topk=8,
    index_head_dim=8,
    index_n_heads=2,
    n_group=1,
    topk_group=1,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    rms_norm_eps=1e-5,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    num_nextn_predict_layers=1,
    tie_word_embeddings=False,
    eos_token_id=[1, 2],
)


def make_cfg(**over):
    c = dict(BASE_CFG)
    c.update(over)
    return c


def make_tensors(cfg, seed=0, mtp=True, fused=False):
    """f32 tensors of a tiny glm_moe_dsa model (HF names), layer NL = MTP head."""
    rng = np.random.default_rng(seed)
    V, D, NL = cfg["vocab_size"], cfg["hidden_size"], cfg["num_hidden_layers"]
    H, Lq, Lkv = cfg["num_attention_heads"], cfg["q_lora_rank"], cfg["kv_lora_rank"]
    dn, dr, dv = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    E, Ie, Id = cfg["n_routed_experts"], cfg["moe_intermediate_size"], cfg["intermediate_size"]
    inh, ihd = cfg["index_n_heads"], cfg["index_head_dim"]

    def mat(*shape):
        return (rng.standard_normal(shape) * 0.05).astype(np.float32)

    def vec(n, base=1.0):
        return (base + 0.01 * rng.standard_normal(n)).astype(np.float32)

    t = {
        "model.embed_tokens.weight": mat(V, D),
        "lm_head.weight": mat(V, D),
        "model.norm.weight": vec(D),
    }
    for L in range(NL + (1 if mtp else 0)):
        p = f"model.layers.{L}."
        t[p + "input_layernorm.weight"] = vec(D)
        t[p + "post_attention_layernorm.weight"] = vec(D)
        t[p + "self_attn.q_a_proj.weight"] = mat(Lq, D)
        t[p + "self_attn.q_a_layernorm.weight"] = vec(Lq)
        t[p + "self_attn.q_b_proj.weight"] = mat(H * (dn + dr), Lq)
        t[p + "self_attn.kv_a_proj_with_mqa.weight"] = mat(Lkv + dr, D)
        t[p + "self_attn.kv_a_layernorm.weight"] = vec(Lkv)
        t[p + "self_attn.kv_b_proj.weight"] = mat(H * (dn + dv), Lkv)
        t[p + "self_attn.o_proj.weight"] = mat(D, H * dv)
        if L < NL:
            t[p + "self_attn.indexer.wq_b.weight"] = mat(inh * ihd, Lq)
            t[p + "self_attn.indexer.wk.weight"] = mat(ihd, D)
            t[p + "self_attn.indexer.weights_proj.weight"] = mat(inh, D)
            t[p + "self_attn.indexer.k_norm.weight"] = vec(ihd)
            t[p + "self_attn.indexer.k_norm.bias"] = vec(ihd, 0.0)
        if L < cfg["first_k_dense_replace"]:
            t[p + "mlp.gate_proj.weight"] = mat(Id, D)
            t[p + "mlp.up_proj.weight"] = mat(Id, D)
            t[p + "mlp.down_proj.weight"] = mat(D, Id)
        else:
            t[p + "mlp.gate.weight"] = mat(E, D)
            t[p + "mlp.gate.e_score_correction_bias"] = np.linspace(-0.1, 0.1, E).astype(np.float32)
            t[p + "mlp.shared_experts.gate_proj.weight"] = mat(Ie, D)
            t[p + "mlp.shared_experts.up_proj.weight"] = mat(Ie, D)
            t[p + "mlp.shared_experts.down_proj.weight"] = mat(D, Ie)
            gate_up = mat(E, 2 * Ie, D)
            down = mat(E, D, Ie)
            if fused:
                t[p + "mlp.experts.gate_up_proj"] = gate_up
                t[p + "mlp.experts.down_proj"] = down
            else:
                for e in range(E):
                    t[p + f"mlp.experts.{e}.gate_proj.weight"] = gate_up[e, :Ie].copy()
                    t[p + f"mlp.experts.{e}.up_proj.weight"] = gate_up[e, Ie:].copy()
                    t[p + f"mlp.experts.{e}.down_proj.weight"] = down[e].copy()
        if L == NL:
            t[p + "eh_proj.weight"] = mat(D, 2 * D)
            t[p + "enorm.weight"] = vec(D)
            t[p + "hnorm.weight"] = vec(D)
            t[p + "shared_head.norm.weight"] = vec(D)
            t[p + "shared_head.head.weight"] = mat(V, D)
            t[p + "embed_tokens.weight"] = mat(V, D)
    return t


def unfuse(tensors, cfg):
    """Per-expert view of a (possibly fused) tensor dict."""
    out = {}
    for name, w in tensors.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            pre, half = name[: -len("gate_up_proj")], w.shape[1] // 2
            for e in range(w.shape[0]):
                out[f"{pre}{e}.gate_proj.weight"] = w[e, :half]
                out[f"{pre}{e}.up_proj.weight"] = w[e, half:]
        elif name.endswith("mlp.experts.down_proj"):
            pre = name[: -len("down_proj")]
            for e in range(w.shape[0]):
                out[f"{pre}{e}.down_proj.weight"] = w[e]
        else:
            out[name] = w
    return out


def shard_of(name, nl):
    """Three source shards: globals+layer 0 / layer 1+lm_head / MTP layer."""
    if name.startswith("lm_head"):
        return 1
    if name.startswith("model.layers."):
        L = int(name.split(".")[2])
        return min(L, 2) if L < nl else 2
    return 0


def write_raw(path, entries):
    """Minimal safetensors writer: entries = {name: (dtype, shape, bytes)}."""
    header, off, blobs = {}, 0, []
    for name, (dtype, shape, data) in entries.items():
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + len(data)]}
        off += len(data)
        blobs.append(data)
    hb = json.dumps(header).encode()
    hb += b" " * ((-len(hb)) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hb)) + hb + b"".join(blobs))


def write_model(d, cfg, tensors, raw=None, shard=None, extra_files=True):
    """Write tensors (f32 dict) plus raw entries {name: (dtype, shape, bytes)} as
    three shards; f32-only shards are written with safetensors itself."""
    os.makedirs(d, exist_ok=True)
    nl = cfg["num_hidden_layers"]
    shard = shard or (lambda n: shard_of(n, nl))
    raw = raw or {}
    groups = [dict(), dict(), dict()]
    for name, w in tensors.items():
        if name not in raw:
            groups[shard(name)][name] = ("F32", w.shape, np.ascontiguousarray(w, np.float32))
    for name, ent in raw.items():
        groups[shard(name)][name] = ent
    for k, g in enumerate(groups):
        path = os.path.join(d, f"model-{k + 1:05d}-of-00003.safetensors")
        if all(isinstance(v[2], np.ndarray) for v in g.values()):
            stnp.save_file({n: v[2] for n, v in g.items()}, path)
        else:
            write_raw(path, {n: (v[0], v[1], v[2].tobytes() if isinstance(v[2], np.ndarray) else v[2])
                             for n, v in g.items()})
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    if extra_files:
        with open(os.path.join(d, "tokenizer.json"), "w") as f:
            f.write('{"model": {"type": "BPE"}}')
        with open(os.path.join(d, "chat_template.jinja"), "w") as f:
            f.write("{{ messages }}")
        with open(os.path.join(d, "README.md"), "w") as f:
            f.write("not copied")
    return d


def dir_bytes(d):
    out = {}
    for n in sorted(os.listdir(d)):
        with open(os.path.join(d, n), "rb") as f:
            out[n] = f.read()
    return out


def do_convert(src, dst, **kw):
    return cv.convert(str(src), str(dst), cv.ConvertOptions(**kw), verbose=False)


# -- expected classification, written out independently of the converter -------------

def expected_fmt(name, nl, bits):
    layer = int(name.split(".")[2]) if name.startswith("model.layers.") else None
    if (name.endswith("norm.weight") or name.endswith("norm.bias") or name.endswith("mlp.gate.weight")
            or name.endswith("e_score_correction_bias")):
        return "f32", None
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        b = bits["io"]
    elif layer == nl:
        b = bits["mtp"]
    elif ".indexer." in name:
        b = bits["indexer"]
    elif ".mlp.experts." in name:
        b = bits["expert"]
    else:
        b = bits["dense"]
    return ("f32", None) if b >= 16 else (quant.container_format(b), b)


def check_container(dst, cfg, tensors, bits=None):
    """Every output tensor equals the independent quantization of its source."""
    bits = dict(cv.DEFAULT_BITS, **(bits or {}))
    nl = cfg["num_hidden_layers"]
    src = unfuse(tensors, cfg)
    with SafeTensorsDir(dst) as c:
        expected_names = set()
        for name, w in src.items():
            if name in (f"model.layers.{nl}.shared_head.head.weight", f"model.layers.{nl}.embed_tokens.weight"):
                assert name not in c
                continue
            fmt, b = expected_fmt(name, nl, bits)
            if fmt == "f32":
                expected_names.add(name)
                assert c.info(name).dtype == "F32"
                np.testing.assert_array_equal(c.read_f32(name), w)
                continue
            expected_names |= {name, name + ".qs"}
            info = c.info(name)
            O, I = w.shape
            assert info.dtype == "U8" and info.shape == (quant.payload_nbytes(fmt, O, I),), name
            payload, s, qfmt = quant.quantize(np.ascontiguousarray(w), b)
            assert qfmt == fmt
            np.testing.assert_array_equal(c.read_raw(name), payload, err_msg=name)
            assert c.info(name + ".qs").dtype == "F32"
            np.testing.assert_array_equal(c.read_f32(name + ".qs"), s, err_msg=name)
        assert set(c.names()) == expected_names


# -- fixtures ----------------------------------------------------------------------------

@pytest.fixture
def f32_model(tmp_path):
    cfg = make_cfg()
    t = make_tensors(cfg)
    write_model(tmp_path / "src", cfg, t)
    return tmp_path / "src", cfg, t


# -- main behaviour ------------------------------------------------------------------------

def test_convert_f32_model(f32_model, tmp_path):
    src, cfg, t = f32_model
    m = do_convert(src, tmp_path / "dst")
    dst = tmp_path / "dst"
    names = sorted(os.listdir(dst))
    assert names == ["chat_template.jinja", "colibri_convert.json", "config.json",
                     "out-00000.safetensors", "out-00001.safetensors", "out-00002.safetensors",
                     "tokenizer.json"]
    assert (dst / "config.json").read_bytes() == (src / "config.json").read_bytes()
    check_container(dst, cfg, t)
    man = json.loads((dst / "colibri_convert.json").read_text())
    assert man == m and man["complete"] is True
    assert man["bits"] == cv.DEFAULT_BITS
    assert man["containers"] == {"expert": "int4", "dense": "int4", "io": "int8",
                                 "mtp": "int8", "indexer": "int8"}
    assert man["source_shards"] == [f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3)]
    assert man["copied_files"] == ["config.json", "tokenizer.json", "chat_template.jinja"]


def test_custom_bits_and_f32_passthrough(f32_model, tmp_path):
    src, cfg, t = f32_model
    bits = dict(expert_bits=2, dense_bits=16, io_bits=4, mtp_bits=3, indexer_bits=6)
    do_convert(src, tmp_path / "dst", **bits)
    check_container(tmp_path / "dst", cfg, t,
                    {"expert": 2, "dense": 16, "io": 4, "mtp": 3, "indexer": 6})


def test_expert_payloads_contiguous_down_gate_up(f32_model, tmp_path):
    src, cfg, t = f32_model
    do_convert(src, tmp_path / "dst")
    with SafeTensorsDir(tmp_path / "dst") as c:
        for L in (1, 2):  # MoE layer and MTP layer
            for e in range(cfg["n_routed_experts"]):
                p = f"model.layers.{L}.mlp.experts.{e}."
                d, g, u = (c.info(p + k + ".weight") for k in ("down_proj", "gate_proj", "up_proj"))
                assert d.file_index == g.file_index == u.file_index
                assert d.offset + d.nbytes == g.offset
                assert g.offset + g.nbytes == u.offset
                qs = [c.info(p + k + ".weight.qs") for k in ("down_proj", "gate_proj", "up_proj")]
                assert qs[0].offset + qs[0].nbytes == qs[1].offset
                assert qs[1].offset + qs[1].nbytes == qs[2].offset
        # layout: all F32 tensors first, then U8, names ascending within each dtype
        for fi in range(len(c.paths)):
            ts = sorted((info for info in c.tensors_in_file(fi)), key=lambda x: x.offset)
            dts = [x.dtype for x in ts]
            assert dts == sorted(dts, key=lambda x: x != "F32")
            for dt in ("F32", "U8"):
                ns = [x.name for x in ts if x.dtype == dt]
                assert ns == sorted(ns)


def test_writer_matches_safetensors_bytes(tmp_path):
    rng = np.random.default_rng(3)
    t = {
        "model.layers.1.mlp.experts.0.up_proj.weight": rng.integers(0, 255, 40).astype(np.uint8),
        "model.layers.1.mlp.experts.0.up_proj.weight.qs": rng.random(8).astype(np.float32),
        "model.layers.1.mlp.experts.0.down_proj.weight": rng.integers(0, 255, 33).astype(np.uint8),
        "model.norm.weight": rng.random(5).astype(np.float32),
        "a": np.zeros((0,), np.float32),
    }
    path = tmp_path / "x.safetensors"
    cv.save_file_atomic(t, str(path))
    assert path.read_bytes() == stnp.save(t)
    assert os.listdir(tmp_path) == ["x.safetensors"]  # no temporary left behind


def test_convert_is_deterministic_and_resume_keeps_files(f32_model, tmp_path):
    src, cfg, t = f32_model
    do_convert(src, tmp_path / "a")
    do_convert(src, tmp_path / "b")
    a = dir_bytes(tmp_path / "a")
    assert a == dir_bytes(tmp_path / "b")
    mtimes = {n: os.stat(tmp_path / "a" / n).st_mtime_ns for n in a if n.startswith("out-")}
    do_convert(src, tmp_path / "a")  # everything already done
    assert dir_bytes(tmp_path / "a") == a
    assert mtimes == {n: os.stat(tmp_path / "a" / n).st_mtime_ns for n in mtimes}


def test_interrupted_conversion_resumes_identically(f32_model, tmp_path):
    src, cfg, t = f32_model
    do_convert(src, tmp_path / "ref")
    ref = dir_bytes(tmp_path / "ref")
    dst = tmp_path / "dst"
    args = ["convert", str(src), str(dst)]
    with pytest.raises(cv.ConvertInterrupted):
        cv.run(_parse(args[1:]), _stop_after_shards=1)
    assert (dst / "out-00000.safetensors").exists()
    assert not (dst / "out-00001.safetensors").exists()
    assert json.loads((dst / "colibri_convert.json").read_text())["complete"] is False
    # a crash mid-write leaves a partial temporary: it must be ignored and replaced
    (dst / ".out-00001.safetensors.tmp").write_bytes(b"\x10\x00\x00\x00partial")
    assert cv.run(_parse(args[1:])) == 0
    assert dir_bytes(dst) == ref


def test_stop_env_hook_and_truncated_output_redone(f32_model, tmp_path, monkeypatch):
    src, cfg, t = f32_model
    do_convert(src, tmp_path / "ref")
    ref = dir_bytes(tmp_path / "ref")
    dst = tmp_path / "dst"
    monkeypatch.setenv(cv.STOP_ENV, "2")
    with pytest.raises(cv.ConvertInterrupted):
        cv.main([str(src), str(dst)])
    assert (dst / "out-00001.safetensors").exists() and not (dst / "out-00002.safetensors").exists()
    monkeypatch.delenv(cv.STOP_ENV)
    # simulate the reference converter's failure mode: a truncated final file
    p = dst / "out-00001.safetensors"
    p.write_bytes(p.read_bytes()[:-50])
    assert cv.main([str(src), str(dst)]) == 0
    assert dir_bytes(dst) == ref
    # an output whose header no longer matches the plan is redone as well
    q = dst / "out-00000.safetensors"
    stnp.save_file({"junk": np.zeros(3, np.float32)}, str(q))
    assert cv.main([str(src), str(dst)]) == 0
    assert dir_bytes(dst) == ref


def test_crash_while_writing_leaves_no_final_file(f32_model, tmp_path, monkeypatch):
    src, cfg, t = f32_model
    do_convert(src, tmp_path / "ref")
    dst = tmp_path / "dst"
    real = stnp.save_file
    calls = []

    def crashing_save_file(tensors, filename, metadata=None):
        calls.append(os.path.basename(filename))
        if len(calls) == 2:  # die half-way through writing the second shard
            with open(filename, "wb") as f:
                f.write(real.__module__.encode())
            raise OSError("disk full (simulated)")
        return real(tensors, filename, metadata)

    monkeypatch.setattr(stnp, "save_file", crashing_save_file)
    with pytest.raises(OSError, match="simulated"):
        do_convert(src, dst)
    assert calls == [".out-00000.safetensors.tmp", ".out-00001.safetensors.tmp"]
    assert (dst / "out-00000.safetensors").exists()
    assert not (dst / "out-00001.safetensors").exists()  # only the temporary is partial
    monkeypatch.setattr(stnp, "save_file", real)
    do_convert(src, dst)
    assert dir_bytes(dst) == dir_bytes(tmp_path / "ref")


def _parse(argv):
    import argparse
    p = argparse.ArgumentParser()
    cv.add_arguments(p)
    return p.parse_args(argv)


def test_cli_arguments():
    a = _parse(["S", "D"])
    assert (a.src, a.dst, a.expert_bits, a.dense_bits, a.io_bits, a.mtp_bits, a.indexer_bits) == \
        ("S", "D", 4, 4, 8, 8, 8)
    a = _parse(["S", "D", "--expert-bits", "2", "--dense-bits", "8", "--io-bits", "16",
                "--mtp-bits", "4", "--indexer-bits", "32"])
    assert (a.expert_bits, a.dense_bits, a.io_bits, a.mtp_bits, a.indexer_bits) == (2, 8, 16, 4, 32)
    for bad in ("12", "1", "x"):
        with pytest.raises(SystemExit):
            _parse(["S", "D", "--expert-bits", bad])


# -- other input dtypes -----------------------------------------------------------------------

def bf16_bits(x):
    u = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype("<u2")


def bf16_to_f32(b):
    return (b.astype(np.uint32) << 16).view(np.float32)


@pytest.mark.parametrize("dtype", ["BF16", "F16"])
def test_half_precision_input_equals_f32_input(tmp_path, dtype):
    cfg = make_cfg()
    t = make_tensors(cfg, seed=5)
    raw, equiv = {}, {}
    for n, w in t.items():
        if dtype == "BF16":
            b = bf16_bits(w)
            raw[n] = ("BF16", w.shape, b.tobytes())
            equiv[n] = bf16_to_f32(b).reshape(w.shape)
        else:
            h = w.astype(np.float16)
            raw[n] = ("F16", w.shape, h.tobytes())
            equiv[n] = h.astype(np.float32)
    write_model(tmp_path / "half", cfg, t, raw=raw)
    write_model(tmp_path / "full", cfg, equiv)
    do_convert(tmp_path / "half", tmp_path / "o1")
    do_convert(tmp_path / "full", tmp_path / "o2")
    assert_same_container(tmp_path / "o1", tmp_path / "o2")
    check_container(tmp_path / "o1", cfg, equiv)


def assert_same_container(a, b):
    da, db = dir_bytes(a), dir_bytes(b)
    ma, mb = json.loads(da.pop("colibri_convert.json")), json.loads(db.pop("colibri_convert.json"))
    assert ma.pop("source") != mb.pop("source")
    assert ma == mb
    assert da.keys() == db.keys()
    for n in da:
        assert da[n] == db[n], n


def test_fused_experts_split(tmp_path):
    cfg = make_cfg()
    fused = make_tensors(cfg, seed=7, fused=True)
    assert "model.layers.1.mlp.experts.gate_up_proj" in fused
    write_model(tmp_path / "fused", cfg, fused)
    write_model(tmp_path / "split", cfg, unfuse(fused, cfg))
    do_convert(tmp_path / "fused", tmp_path / "o1")
    do_convert(tmp_path / "split", tmp_path / "o2")
    assert_same_container(tmp_path / "o1", tmp_path / "o2")
    check_container(tmp_path / "o1", cfg, fused)
    with SafeTensorsDir(tmp_path / "o1") as c:
        assert not any("gate_up_proj" in n for n in c.names())
        # gate = first I rows of each expert's gate_up, up = the rest
        Ie = cfg["moe_intermediate_size"]
        w = fused["model.layers.1.mlp.experts.gate_up_proj"][3]
        for part, rows in (("gate_proj", w[:Ie]), ("up_proj", w[Ie:])):
            name = f"model.layers.1.mlp.experts.3.{part}.weight"
            d = quant.dequantize(c.read_raw(name), c.read_f32(name + ".qs"), Ie, cfg["hidden_size"])
            s = c.read_f32(name + ".qs")
            assert np.all(np.abs(d - rows) <= s[:, None] * 0.5001)


# -- FP8 input ---------------------------------------------------------------------------------

def e4m3_values():
    c = np.arange(256)
    e, m = (c >> 3) & 15, c & 7
    v = np.where(e == 0, m / 8 * 2.0 ** -6, (1 + m / 8) * 2.0 ** (e - 7.0))
    v = np.where(c & 0x80, -v, v)
    v[[0x7F, 0xFF]] = np.nan
    return v.astype(np.float32)


E4M3 = e4m3_values()


def e4m3_encode(x):
    """Round float32 values to the nearest e4m3fn code (ties to even code), saturating."""
    codes = np.array([c for c in range(256) if (c & 0x7F) != 0x7F])
    vals = E4M3[codes].astype(np.float64)
    flat = np.clip(np.asarray(x, np.float64).reshape(-1), -448.0, 448.0)
    d = np.abs(flat[:, None] - vals[None, :])
    cand = d == d.min(axis=1, keepdims=True)
    even = cand & ((codes & 1) == 0)[None, :]
    pick = np.where(even.any(axis=1), np.argmax(even, axis=1), np.argmax(cand, axis=1))
    return codes[pick].astype(np.uint8).reshape(np.shape(x))


def fp8_quantize(w, block):
    """DeepSeek-style FP8: e4m3 codes + per-block scale (amax/448), w ~ fp8 * scale."""
    lead, (R, C) = w.shape[:-2], w.shape[-2:]
    nb = (-(-R // block[0]), -(-C // block[1]))
    scale = np.zeros(lead + nb, np.float32)
    for bi in range(nb[0]):
        for bj in range(nb[1]):
            blk = w[..., bi * block[0]:(bi + 1) * block[0], bj * block[1]:(bj + 1) * block[1]]
            amax = np.abs(blk).max(axis=(-1, -2))
            scale[..., bi, bj] = np.maximum(amax, 1e-6) / np.float32(448)
    rows, cols = np.arange(R) // block[0], np.arange(C) // block[1]
    full = scale[..., rows, :][..., :, cols]
    codes = e4m3_encode(w / full)
    deq = E4M3[codes] * full  # float32 * float32
    return codes, scale, deq.astype(np.float32)


def is_fp8_candidate(name, w):
    if name in ("model.embed_tokens.weight", "lm_head.weight") or name.endswith("mlp.gate.weight"):
        return False
    return w.ndim >= 2


@pytest.mark.parametrize("block,fused,scale_dtype", [
    ((8, 8), False, "F32"),      # several (partial) blocks per matrix
    ((8, 8), True, "BF16"),      # fused experts: 'up' rows start in the second row block
    (None, False, "F32"),        # default 128x128 blocks (hidden 136 -> two column blocks)
])
def test_fp8_input_equals_dequantized_f32_input(tmp_path, block, fused, scale_dtype):
    over = {"hidden_size": 136} if block is None else {}  # > 128 -> two column blocks
    if block is not None:
        over["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                       "weight_block_size": list(block)}
    cfg = make_cfg(**over)
    blk = block or (128, 128)
    t = make_tensors(cfg, seed=11, fused=fused)
    raw, equiv = {}, {}
    for n, w in t.items():
        if not is_fp8_candidate(n, w):
            equiv[n] = w
            continue
        codes, scale, deq = fp8_quantize(w, blk)
        if scale_dtype == "BF16":
            sb = bf16_bits(scale)
            scale = bf16_to_f32(sb).reshape(scale.shape)
            raw[n + "_scale_inv"] = ("BF16", scale.shape, sb.tobytes())
            rows, cols = np.arange(w.shape[-2]) // blk[0], np.arange(w.shape[-1]) // blk[1]
            deq = (E4M3[codes] * scale[..., rows, :][..., :, cols]).astype(np.float32)
        else:
            raw[n + "_scale_inv"] = ("F32", scale.shape, scale.tobytes())
        raw[n] = ("F8_E4M3", w.shape, codes.tobytes())
        equiv[n] = deq
    nl = cfg["num_hidden_layers"]

    def shard(name):  # layer-1 block scales live in another shard than their weights
        if name.endswith("_scale_inv") and name.startswith("model.layers.1."):
            return 2
        return shard_of(name, nl)

    write_model(tmp_path / "fp8", cfg, t, raw=raw, shard=shard)
    write_model(tmp_path / "f32", cfg, equiv, shard=shard)
    do_convert(tmp_path / "fp8", tmp_path / "o1")
    do_convert(tmp_path / "f32", tmp_path / "o2")
    assert_same_container(tmp_path / "o1", tmp_path / "o2")
    check_container(tmp_path / "o1", cfg, equiv)


# -- bad input -------------------------------------------------------------------------------------

def test_missing_source_and_config(tmp_path):
    with pytest.raises(ContainerError, match="does not exist"):
        do_convert(tmp_path / "nothere", tmp_path / "dst")
    (tmp_path / "src").mkdir()
    stnp.save_file({"x": np.zeros(2, np.float32)}, str(tmp_path / "src" / "m.safetensors"))
    with pytest.raises(ConfigError, match="config.json"):
        do_convert(tmp_path / "src", tmp_path / "dst")
    (tmp_path / "src" / "config.json").write_text('{"hidden_size": 4, "vocab_size": 8}')
    with pytest.raises(ConfigError, match="num_hidden_layers"):
        do_convert(tmp_path / "src", tmp_path / "dst")


def test_cli_reports_errors(tmp_path, capsys):
    assert cv.main([str(tmp_path / "nothere"), str(tmp_path / "dst")]) == 1
    err = capsys.readouterr().err
    assert "error" in err and "nothere" in err


@pytest.mark.parametrize("name,shape,pattern", [
    ("model.embed_tokens.weight", (40, 32), r"vocab_size"),
    ("lm_head.weight", (48, 30), r"vocab_size"),
    ("model.layers.0.self_attn.q_a_proj.weight", (12, 32), r"q_lora_rank"),
    ("model.layers.1.mlp.experts.2.down_proj.weight", (32, 9), r"expected \[32, 8\] = \[hidden_size, moe"),
    ("model.layers.1.mlp.experts.4.down_proj.weight", (32, 8), r"out of range.*n_routed_experts = 4"),
])
def test_wrong_shape_vs_config(tmp_path, name, shape, pattern):
    cfg = make_cfg()
    t = make_tensors(cfg, seed=1)
    t[name] = np.zeros(shape, np.float32)
    write_model(tmp_path / "src", cfg, t)
    with pytest.raises(ContainerError, match=pattern) as ei:
        do_convert(tmp_path / "src", tmp_path / "dst")
    assert name in str(ei.value) and ".safetensors" in str(ei.value)
    assert not (tmp_path / "dst").exists()  # refused before writing anything


def test_nan_and_inf_refused(tmp_path):
    cfg = make_cfg()
    t = make_tensors(cfg, seed=2)
    t["model.layers.1.mlp.experts.1.up_proj.weight"][3, 5] = np.nan
    write_model(tmp_path / "src", cfg, t)
    with pytest.raises(ContainerError, match=r"model\.layers\.1\.mlp\.experts\.1\.up_proj\.weight.*NaN"):
        do_convert(tmp_path / "src", tmp_path / "dst")
    t = make_tensors(cfg, seed=2)
    t["model.layers.0.input_layernorm.weight"][0] = np.inf
    write_model(tmp_path / "src2", cfg, t)
    with pytest.raises(ContainerError, match=r"input_layernorm.*Inf"):
        do_convert(tmp_path / "src2", tmp_path / "dst2")


def test_fp8_errors(tmp_path):
    cfg = make_cfg()
    t = make_tensors(cfg, seed=3)
    n = "model.layers.0.self_attn.o_proj.weight"
    codes, scale, _ = fp8_quantize(t[n], (128, 128))
    # missing scale_inv
    write_model(tmp_path / "a", cfg, t, raw={n: ("F8_E4M3", codes.shape, codes.tobytes())})
    with pytest.raises(ContainerError, match=r"o_proj\.weight.*weight_scale_inv"):
        do_convert(tmp_path / "a", tmp_path / "oa")
    # NaN code (0x7F) inside an FP8 weight
    bad = codes.copy()
    bad[1, 2] = 0x7F
    write_model(tmp_path / "b", cfg, t, raw={n: ("F8_E4M3", bad.shape, bad.tobytes()),
                                             n + "_scale_inv": ("F32", scale.shape, scale.tobytes())})
    with pytest.raises(ContainerError, match=r"o_proj\.weight.*NaN"):
        do_convert(tmp_path / "b", tmp_path / "ob")
    # scale of the wrong shape
    write_model(tmp_path / "c", cfg, t, raw={n: ("F8_E4M3", codes.shape, codes.tobytes()),
                                             n + "_scale_inv": ("F32", (2, 2), np.ones(4, np.float32).tobytes())})
    with pytest.raises(ContainerError, match=r"weight_scale_inv.*expected \[1, 1\]"):
        do_convert(tmp_path / "c", tmp_path / "oc")


def test_unknown_and_unsupported_dtype(tmp_path):
    cfg = make_cfg()
    t = make_tensors(cfg, seed=4)
    n = "model.layers.0.mlp.up_proj.weight"
    write_model(tmp_path / "a", cfg, t, raw={n: ("Q7", (24, 32), b"\0" * 24 * 32)})
    with pytest.raises(ContainerError, match=r"up_proj\.weight.*unknown dtype 'Q7'"):
        do_convert(tmp_path / "a", tmp_path / "oa")
    write_model(tmp_path / "b", cfg, t, raw={n: ("I32", (24, 32), b"\0" * 24 * 32 * 4)})
    with pytest.raises(ContainerError, match=r"up_proj\.weight.*unsupported dtype I32"):
        do_convert(tmp_path / "b", tmp_path / "ob")


def test_truncated_and_garbage_source_shard(tmp_path, f32_model):
    src, cfg, t = f32_model
    p = src / "model-00002-of-00003.safetensors"
    good = p.read_bytes()
    p.write_bytes(good[:-7])
    with pytest.raises(ContainerError, match=r"model-00002-of-00003\.safetensors.*truncated"):
        do_convert(src, tmp_path / "dst")
    p.write_bytes(struct.pack("<Q", 16) + b"this is not json" + good[24:])
    with pytest.raises(ContainerError, match=r"model-00002-of-00003\.safetensors.*JSON"):
        do_convert(src, tmp_path / "dst")


def test_refuses_to_mix_conversions(f32_model, tmp_path):
    src, cfg, t = f32_model
    do_convert(src, tmp_path / "dst")
    with pytest.raises(ContainerError, match="bits"):
        do_convert(src, tmp_path / "dst", expert_bits=8)
    stnp.save_file({"x": np.zeros(1, np.float32)}, str(tmp_path / "dst" / "stray.safetensors"))
    with pytest.raises(ContainerError, match="stray.safetensors"):
        do_convert(src, tmp_path / "dst")
    (tmp_path / "other").mkdir()
    stnp.save_file({"x": np.zeros(1, np.float32)}, str(tmp_path / "other" / "out-00000.safetensors"))
    with pytest.raises(ContainerError, match="colibri_convert.json"):
        do_convert(src, tmp_path / "other")
    with pytest.raises(ContainerError, match="differ from the source"):
        do_convert(src, src)


def test_mtp_copies_dropped_and_missing_mtp_ok(tmp_path):
    cfg = make_cfg()
    t = make_tensors(cfg, seed=9, mtp=False)
    write_model(tmp_path / "src", cfg, t)
    do_convert(tmp_path / "src", tmp_path / "dst")
    check_container(tmp_path / "dst", cfg, t)
    man = json.loads((tmp_path / "dst" / "colibri_convert.json").read_text())
    # without an MTP layer the third source shard is empty: no output file for it
    assert man["shards"][2] == {"source": "model-00003-of-00003.safetensors", "output": None}
    assert not (tmp_path / "dst" / "out-00002.safetensors").exists()


# -- an incomplete or padded checkpoint: model.safetensors.index.json ---------------------------

def write_index(src):
    """model.safetensors.index.json naming every tensor of the folder's shards (as HF writes it)."""
    wmap = {}
    for p in sorted(src.glob("*.safetensors")):
        wmap.update({n: p.name for n in scan_file(str(p))[0]})
    (src / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": 0}, "weight_map": wmap}, indent=2))
    return wmap


def test_index_naming_a_missing_shard(f32_model, tmp_path):
    """A shard the index names is missing: refused before anything is written, naming the shard
    and a tensor of it (it used to convert 2 of 3 shards and record "complete": true)."""
    src, cfg, t = f32_model
    wmap = write_index(src)
    gone = "model-00002-of-00003.safetensors"
    (src / gone).unlink()
    with pytest.raises(ContainerError, match=r"index\.json: names shard model-00002-of-00003\.safetensors "
                                             r"\(tensor '.*' and \d+ more\).*missing") as ei:
        do_convert(src, tmp_path / "dst")
    first = next(n for n, shard in wmap.items() if shard == gone)
    assert repr(first) in str(ei.value)
    assert not (tmp_path / "dst").exists()


def test_index_naming_a_tensor_absent_from_its_shard(f32_model, tmp_path):
    src, cfg, t = f32_model
    write_index(src)
    p = src / "model-00002-of-00003.safetensors"
    tensors = stnp.load_file(str(p))
    del tensors["model.layers.1.self_attn.o_proj.weight"]
    stnp.save_file(tensors, str(p))
    with pytest.raises(ContainerError, match=r"names tensor 'model\.layers\.1\.self_attn\.o_proj\.weight' in "
                                             r"shard model-00002-of-00003\.safetensors.*does not hold it"):
        do_convert(src, tmp_path / "dst")
    assert not (tmp_path / "dst").exists()


def test_unnamed_adapter_is_skipped_with_a_warning(f32_model, tmp_path, capsys):
    src, cfg, t = f32_model
    write_index(src)
    do_convert(src, tmp_path / "ref")
    stnp.save_file({"model.norm.weight": np.zeros(cfg["hidden_size"], np.float32),
                    "base_model.lora_A.weight": np.zeros((2, 4), np.float32)}, str(src / "adapter.safetensors"))
    capsys.readouterr()
    cv.convert(str(src), str(tmp_path / "dst"), verbose=True)
    err = capsys.readouterr().err
    assert f"warning: {src / 'adapter.safetensors'}: not a shard named by model.safetensors.index.json; skipped" in err
    assert dir_bytes(tmp_path / "dst") == dir_bytes(tmp_path / "ref")


def _rewrite_header(path, fn):
    """Apply fn to the JSON header of a safetensors file (the data stay as they are)."""
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    fn(header)
    hb = json.dumps(header).encode()
    hb += b" " * ((-len(hb)) % 8)
    path.write_bytes(struct.pack("<Q", len(hb)) + hb + raw[8 + n:])


def test_overlapping_tensor_ranges_refused(f32_model, tmp_path):
    src, cfg, t = f32_model
    p = src / "model-00003-of-00003.safetensors"

    def alias(h):  # hnorm's entry points into enorm's bytes
        b0, b1 = h["model.layers.2.enorm.weight"]["data_offsets"]
        h["model.layers.2.hnorm.weight"]["data_offsets"] = [b0 + 4, b1 + 4]

    _rewrite_header(p, alias)
    with pytest.raises(ContainerError, match=r"model-00003-of-00003\.safetensors: tensors "
                                             r"'model\.layers\.2\.enorm\.weight' .* and "
                                             r"'model\.layers\.2\.hnorm\.weight' .* overlap"):
        do_convert(src, tmp_path / "dst")
    assert not (tmp_path / "dst").exists()


# -- config.json: the engine's validator, before any weight is read ---------------------------------

@pytest.mark.parametrize("over,field", [
    ({"n_group": 2}, "n_group"),
    ({"n_routed_experts": 0}, "n_routed_experts"),
    ({"num_attention_heads": 0}, "num_attention_heads"),
    ({"num_experts_per_tok": 99}, "num_experts_per_tok"),
    ({"model_type": "llama"}, "model_type"),
    ({"architectures": ["LlamaForCausalLM"]}, "architectures"),
])
def test_bad_config_refused_before_reading_weights(f32_model, tmp_path, monkeypatch, over, field):
    """Configs the engine refuses are refused by convert too, in well under a second, before any
    safetensors header is read and without creating DST (a GLM-5 conversion takes hours)."""
    src, cfg, t = f32_model
    (src / "config.json").write_text(json.dumps(make_cfg(**over)))

    def no_weights(*a, **k):
        raise AssertionError("convert read the weights before validating config.json")

    monkeypatch.setattr(cv, "SafeTensorsDir", no_weights)
    monkeypatch.setattr(cv, "scan_file", no_weights)
    t0 = time.perf_counter()
    with pytest.raises(ConfigError, match=rf"config\.json: field '{field}'"):
        do_convert(src, tmp_path / "dst")
    assert time.perf_counter() - t0 < 0.25
    assert not (tmp_path / "dst").exists()


def _colibri_cli(*args, code=None):
    """`python -m colibri ARGS` in a subprocess; with ``code``, that Python runs first (a patch)."""
    run_main = "import runpy, sys; sys.argv = ['colibri'] + sys.argv[1:]; runpy.run_module('colibri', run_name='__main__')"
    argv = [sys.executable, "-c", (code or "") + "\n" + run_main, *map(str, args)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))


def test_llama_checkpoint_refused_at_the_cli(f32_model, tmp_path):
    src, cfg, t = f32_model
    llama = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 48, "hidden_size": 32,
             "intermediate_size": 24, "num_hidden_layers": 2, "num_attention_heads": 2,
             "num_key_value_heads": 2, "rms_norm_eps": 1e-5}
    (src / "config.json").write_text(json.dumps(llama))
    p = subprocess.run([sys.executable, "-m", "colibri", "convert", str(src), str(tmp_path / "dst")],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 1, p.stderr
    assert "Traceback" not in p.stderr
    assert p.stderr.strip().splitlines() == [
        f"colibri convert: error: {src / 'config.json'}: field 'model_type' = 'llama': colibri runs only "
        "'glm_moe_dsa' models (GLM-5.x); this checkpoint is another architecture"]
    assert not (tmp_path / "dst").exists()


def test_nested_text_config_converts(f32_model, tmp_path):
    src, cfg, t = f32_model
    do_convert(src, tmp_path / "flat")
    nested = {"model_type": "glm_moe_dsa", "architectures": ["GlmMoeDsaForCausalLM"], "text_config": cfg}
    (src / "config.json").write_text(json.dumps(nested))
    do_convert(src, tmp_path / "nested")
    a, b = dir_bytes(tmp_path / "flat"), dir_bytes(tmp_path / "nested")
    assert a.pop("config.json") != b.pop("config.json")
    assert a == b
    (src / "config.json").write_text(json.dumps(dict(nested, text_config=dict(cfg, n_group=2))))
    with pytest.raises(ConfigError, match="n_group"):
        do_convert(src, tmp_path / "bad")


# -- disk space and file modes -----------------------------------------------------------------------

class _Statvfs:
    """What os.statvfs reports: f_bavail free blocks of f_frsize bytes."""

    def __init__(self, free):
        self.f_bavail, self.f_frsize = free, 1


def test_planned_bytes_bound_each_output(f32_model, tmp_path):
    src, cfg, t = f32_model
    do_convert(src, tmp_path / "dst")
    with SafeTensorsDir(src) as index:
        plans = cv.plan_conversion(index, cv.load_config(str(src)), cv.ConvertOptions())
    for fi, items in enumerate(plans):
        size = os.path.getsize(tmp_path / "dst" / cv.output_name(fi))
        n = sum(len(it.outputs()) for it in items)
        assert size <= cv.output_bytes(items) <= size + 128 * n


def test_not_enough_free_space_refused_up_front(f32_model, tmp_path, monkeypatch, capsys):
    src, cfg, t = f32_model
    with SafeTensorsDir(src) as index:
        plans = cv.plan_conversion(index, cv.load_config(str(src)), cv.ConvertOptions())
    planned = sum(cv.output_bytes(items) for items in plans)
    seen = []

    def statvfs(path):
        seen.append(path)
        return _Statvfs(planned - 1)

    monkeypatch.setattr(os, "statvfs", statvfs)
    dst = tmp_path / "new" / "dst"
    assert cv.main([str(src), str(dst)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.fullmatch(
        rf"colibri convert: error: {re.escape(str(dst))}: not enough free space: the conversion writes "
        r"0\.00 GB, the file system has 0\.00 GB free; free 0\.00 GB or choose another destination", err[0]), err
    assert seen == [str(tmp_path)]  # DST's nearest existing parent
    assert not (tmp_path / "new").exists()


def test_free_space_counts_only_what_is_left_to_write(f32_model, tmp_path, monkeypatch):
    src, cfg, t = f32_model
    with SafeTensorsDir(src) as index:
        plans = cv.plan_conversion(index, cv.load_config(str(src)), cv.ConvertOptions())
    dst = tmp_path / "dst"
    with pytest.raises(cv.ConvertInterrupted):
        cv.convert(str(src), str(dst), stop_after_shards=1, verbose=False)
    free = cv.output_bytes(plans[1]) + cv.output_bytes(plans[2]) + 6000  # + manifest and copies
    assert free < sum(cv.output_bytes(items) for items in plans)
    monkeypatch.setattr(os, "statvfs", lambda path: _Statvfs(free))
    with pytest.raises(cv.NoSpaceError, match="not enough free space"):
        do_convert(src, tmp_path / "fresh")  # the whole conversion does not fit
    do_convert(src, dst)  # what is left of it does
    assert json.loads((dst / "colibri_convert.json").read_text())["complete"] is True


def _disk_full(kind):
    if kind == "OSError":
        return OSError(errno.ENOSPC, "No space left on device")
    from safetensors import SafetensorError  # how the library reports it
    return SafetensorError('Error while serializing: I/O error: No space left on device (os error 28) '
                           'at path "/x/.tmpAbC123"')


@pytest.mark.parametrize("kind", ["OSError", "SafetensorError"])
def test_disk_full_while_writing_is_resumable(f32_model, tmp_path, monkeypatch, kind):
    src, cfg, t = f32_model
    do_convert(src, tmp_path / "ref")
    dst = tmp_path / "dst"
    real = stnp.save_file
    calls = []

    def full_disk(tensors, filename, metadata=None):
        calls.append(os.path.basename(filename))
        if len(calls) == 2:  # the second shard does not fit
            with open(filename, "wb") as f:
                f.write(b"partial")
            raise _disk_full(kind)
        return real(tensors, filename, metadata)

    monkeypatch.setattr(stnp, "save_file", full_disk)
    with pytest.raises(cv.NoSpaceError) as ei:
        do_convert(src, dst)
    msg = str(ei.value)
    assert ei.value.errno == errno.ENOSPC and "\n" not in msg
    assert msg.startswith(f"{dst}: no space left on the device while writing out-00001.safetensors (")
    assert msg.endswith("run the same command again to resume")
    assert sorted(os.listdir(dst)) == ["chat_template.jinja", "colibri_convert.json", "config.json",
                                       "out-00000.safetensors", "tokenizer.json"]  # temporary removed
    assert json.loads((dst / "colibri_convert.json").read_text())["complete"] is False
    monkeypatch.setattr(stnp, "save_file", real)
    do_convert(src, dst)
    assert dir_bytes(dst) == dir_bytes(tmp_path / "ref")


def test_disk_full_at_the_cli(f32_model, tmp_path):
    """`python -m colibri convert` on a disk that fills up: one error line, exit 1, no traceback;
    the same command run again finishes the conversion."""
    src, cfg, t = f32_model
    do_convert(src, tmp_path / "ref")
    dst = tmp_path / "dst"
    patch = """
import safetensors.numpy as stnp
from safetensors import SafetensorError
real, calls = stnp.save_file, []
def full_disk(tensors, filename, metadata=None):
    calls.append(filename)
    if len(calls) == 2:
        open(filename, "wb").write(b"partial")
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
    return real(tensors, filename, metadata)
stnp.save_file = full_disk
"""
    p = _colibri_cli("convert", src, dst, code=patch)
    assert p.returncode == 1, p.stderr
    assert "Traceback" not in p.stderr
    errors = [line for line in p.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and errors[0].startswith(
        f"colibri convert: error: {dst}: no space left on the device while writing out-00001.safetensors"), p.stderr
    assert not any(n.startswith(".") for n in os.listdir(dst))
    assert json.loads((dst / "colibri_convert.json").read_text())["complete"] is False
    p = _colibri_cli("convert", src, dst)
    assert p.returncode == 0, p.stderr
    assert "done: 2 shard(s) written, 1 kept from an earlier run" in p.stderr
    assert dir_bytes(dst) == dir_bytes(tmp_path / "ref")


@pytest.mark.parametrize("mask,mode", [(0o022, 0o644), (0o027, 0o640)])
def test_outputs_honour_the_umask(f32_model, tmp_path, mask, mode):
    src, cfg, t = f32_model
    old = os.umask(mask)
    try:
        do_convert(src, tmp_path / "dst")
    finally:
        os.umask(old)
    modes = {n: os.stat(tmp_path / "dst" / n).st_mode & 0o777 for n in os.listdir(tmp_path / "dst")}
    assert modes == {n: mode for n in modes} and "out-00000.safetensors" in modes
