"""tools/make_glm5_slice.py: a synthetic GLM-5-width slice written straight into the container.

The streaming writer against safetensors.numpy.save_file (byte for byte), values independent of
the chunk size, the folded codes (symmetric, zero mean, the std the scales assume), the shrunk
widths against the engine's constraints, then a shrunk slice (every width / 16) built through the
command line, with and without the MTP layer: file layout, formats, `plan --json` against the
tool's own plan and against sizes worked out from the widths, the engine generating a few hundred
tokens with finite logits (past index_topk, so the DSA selection runs), the `run` CLI, reruns,
bit-width flags and the errors.
"""
import hashlib
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import make_glm5_slice as g  # noqa: E402

from colibri import quant  # noqa: E402
from colibri.config import parse_config  # noqa: E402
from colibri.st import SafeTensorsDir, scan_file  # noqa: E402

TOOL = Path(__file__).resolve().parent.parent / "tools" / "make_glm5_slice.py"
SHRINK = 16


def tool(*args, timeout=120):
    return subprocess.run([sys.executable, str(TOOL), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)


def colibri(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "colibri", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def slices(tmp_path_factory):
    """{'plain': dir, 'mtp': dir}: shrunk slices (1 dense + 3 MoE layers), the second with --mtp."""
    root = tmp_path_factory.mktemp("glm5slice")
    out = {}
    for key, extra in (("plain", []), ("mtp", ["--mtp"])):
        d = root / key
        r = tool(d, "--shrink", SHRINK, "--seed", 7, "--json", *extra)
        assert r.returncode == 0, r.stderr[-3000:]
        out[key] = (d, json.loads(r.stdout))
    return out


def _cfg(d):
    return json.loads((d / "config.json").read_text())


def _file_bytes(d):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.glob("*.safetensors"))}


# -- the writer and the values ---------------------------------------------------------------------

def _mixed_plan():
    ts = [g.Tensor("m.b.weight", "U8", (3 * 1000 + 5,), "payload", "int4", 0.1),
          g.Tensor("m.b.weight.qs", "F32", (3,), "scales", "int4", 0.1),
          g.Tensor("m.a.norm.weight", "F32", (17,), "norm"),
          g.Tensor("m.z.gate.weight", "F32", (40, 30), "gauss", sigma=0.5),
          g.Tensor("m.a.weight", "U8", (77,), "payload", "int8", 0.1),
          g.Tensor("m.c.weight", "U8", (64,), "payload", "int2", 0.1),
          g.Tensor("m.a.bias", "F32", (9,), "bias")]
    return ts


def _arrays(ts, seed):
    out = {}
    for t in ts:
        raw = b"".join(bytes(memoryview(np.ascontiguousarray(c)).cast("B")) for c in g.tensor_chunks(t, seed))
        out[t.name] = np.frombuffer(raw, np.uint8 if t.dtype == "U8" else np.float32).reshape(t.shape).copy()
    return out


def test_streamed_file_is_byte_identical_to_safetensors_save_file(tmp_path, monkeypatch):
    from safetensors.numpy import save_file
    monkeypatch.setattr(g, "CHUNK_BYTES", 256)        # payloads and the f32 matrix span many chunks
    ts = _mixed_plan()
    g.write_file(str(tmp_path / "ours.safetensors"), g.FilePlan("ours.safetensors", g.disk_order(ts)), 5)
    save_file(_arrays(ts, 5), str(tmp_path / "ref.safetensors"))
    assert (tmp_path / "ours.safetensors").read_bytes() == (tmp_path / "ref.safetensors").read_bytes()
    assert not list(tmp_path.glob(".*.tmp"))


def test_values_depend_on_seed_and_name_only_not_on_chunk_size(monkeypatch):
    ts = _mixed_plan()
    big = _arrays(ts, 3)
    monkeypatch.setattr(g, "CHUNK_BYTES", 64)
    small = _arrays(ts, 3)
    for name in big:
        np.testing.assert_array_equal(big[name], small[name])
    other = _arrays(ts, 4)
    assert not np.array_equal(big["m.b.weight"], other["m.b.weight"])
    renamed = _arrays([g.Tensor("m.x.weight", "U8", (3005,), "payload", "int4", 0.1)], 3)
    assert not np.array_equal(big["m.b.weight"], renamed["m.x.weight"])


@pytest.mark.parametrize("fmt", ["int8", "int4", "int2"])
def test_folded_codes_are_symmetric_with_zero_mean(fmt):
    q = quant.qmax_for_bits({"int8": 8, "int4": 4, "int2": 2}[fmt])
    per_byte = {"int8": 1, "int4": 2, "int2": 4}[fmt]
    words = np.random.default_rng(1).integers(0, 2 ** 64 - 1, 1 << 16, dtype=np.uint64, endpoint=True)
    words[:64] = 0                                      # all-zero words: every field folds
    before = quant.unpack(words.view(np.uint8).copy(), fmt, 1, words.nbytes * per_byte)[0]
    g.fold_codes(words, fmt)
    v = quant.unpack(words.view(np.uint8), fmt, 1, words.nbytes * per_byte)[0]
    # the reference: the most negative code becomes 0, every other value is unchanged
    np.testing.assert_array_equal(v, np.where(before == -q - 1, 0, before))
    assert v.min() == -q and v.max() == q
    assert abs(v.mean()) < 0.02 * g.value_std(fmt)
    assert v.astype(np.float64).std() == pytest.approx(g.value_std(fmt), rel=0.01)


def test_row_scales_give_the_planned_weight_std():
    t = g.Tensor("w.qs", "F32", (4000,), "scales", "int4", 0.02)
    s = _arrays([t], 0)["w.qs"]
    # E[s] = sigma / std(v) * exp(spread^2 / 2) for the log-normal spread
    expect = 0.02 / g.value_std("int4") * math.exp(g.ROW_SCALE_SPREAD ** 2 / 2)
    assert s.mean() == pytest.approx(expect, rel=0.03)
    assert np.all(s > 0) and np.all(np.isfinite(s))


# -- widths and config.json ---------------------------------------------------------------------

def test_full_widths_are_glm5s():
    d = g.shrunk_dims(1, 4096)
    assert d == {"vocab_size": 154880, "hidden_size": 6144, "num_attention_heads": 64, "q_lora_rank": 2048,
                 "kv_lora_rank": 512, "qk_nope_head_dim": 192, "qk_rope_head_dim": 64, "v_head_dim": 256,
                 "intermediate_size": 12288, "n_routed_experts": 256, "moe_intermediate_size": 2048,
                 "num_experts_per_tok": 8, "n_shared_experts": 1, "index_n_heads": 32, "index_head_dim": 128,
                 "index_topk": 2048}
    cfg = g.build_config(d, 1, 3, False, 0)
    c = parse_config(cfg)
    assert (c.n_layers, c.first_dense, c.sparse) == (4, 1, [False, True, True, True])
    assert c.idx_full == [True] * 4 and c.rope_theta == g.ROPE_THETA and c.norm_topk and c.routed_scale == 2.5
    assert cfg["model_type"] == "glm_moe_dsa" and cfg["architectures"] == ["GlmMoeDsaForCausalLM"]
    assert (cfg["n_group"], cfg["topk_group"], cfg["rms_norm_eps"]) == (1, 1, 1e-5)


@pytest.mark.parametrize("n", [2, 3, 7, 16, 64, 1000, 10 ** 6])
def test_shrunk_widths_keep_the_engines_constraints(n):
    d = g.shrunk_dims(n, 4096)
    cfg = g.build_config(d, 2, 2, True, 0)
    c = parse_config(cfg)                               # rope even, topk <= experts, index_hd >= rope, ...
    assert c.qk_rope % 2 == 0 and c.index_hd >= c.qk_rope and 1 <= c.topk <= c.n_experts
    assert c.vocab >= 4096 and c.n_heads >= 1 and c.index_nh >= 1
    for w in (c.hidden, c.q_lora, c.kv_lora, c.v_head, c.dense_inter, c.moe_inter):
        assert w % 4 == 0 and w >= 4                    # row lengths: no int4/int2 padding
    if n <= 64:
        assert c.hidden == 6144 // n // 4 * 4 and c.n_experts == 256 // n


# -- a shrunk slice -----------------------------------------------------------------------------

def test_config_manifest_and_tokenizer(slices):
    for key, (d, summary) in slices.items():
        cfg = _cfg(d)
        assert cfg["num_hidden_layers"] == 4 and cfg["first_k_dense_replace"] == 1
        assert cfg["mlp_layer_types"] == ["dense", "sparse", "sparse", "sparse"]
        assert cfg["hidden_size"] == 6144 // SHRINK and cfg["n_routed_experts"] == 256 // SHRINK
        assert cfg["index_topk"] == 2048 // SHRINK and cfg["indexer_types"] == ["full"] * 4
        assert cfg["num_nextn_predict_layers"] == (1 if key == "mtp" else 0)
        assert all(0 <= e < cfg["vocab_size"] for e in cfg["eos_token_id"])
        man = json.loads((d / "colibri_convert.json").read_text())
        assert man["complete"] is True and man["format"] == "colibri-container"
        assert "synthetic" in man["synthetic"]["note"] and man["synthetic"]["seed"] == 7
        assert man["bits"] == {"expert": 4, "dense": 4, "io": 8, "mtp": 8, "indexer": 8}
        assert [s["output"] for s in man["shards"]] == sorted(p.name for p in d.glob("*.safetensors"))
        assert man["classes"]["expert"]["formats"] == {"int4": 3 * 3 * cfg["n_routed_experts"]}
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(str(d / "tokenizer.json"))
        assert tok.get_vocab_size() == cfg["vocab_size"]
        ids = tok.encode("def f(x): return x").ids
        assert ids and max(ids) < 4096 and tok.decode(ids) == "def f(x): return x"
        assert tok.decode([cfg["vocab_size"] - 1]) == f"<|t{cfg['vocab_size'] - 1}|>"
        assert summary["file_bytes"] == {p.name: p.stat().st_size for p in d.glob("*.safetensors")}
        assert summary["bytes_written"] == summary["bytes_total"] == sum(summary["file_bytes"].values())


def _fmt_of(st, name, O, I):
    return quant.infer_format(st.info(name).nbytes, O, I, name)


def test_file_layout_and_formats(slices):
    d, _ = slices["mtp"]
    cfg = _cfg(d)
    D, E, Ie, nl = cfg["hidden_size"], cfg["n_routed_experts"], cfg["moe_intermediate_size"], 4
    files = sorted(d.glob("*.safetensors"))
    assert [p.name for p in files] == [f"out-{i:05d}.safetensors" for i in range(nl + 2)]
    for p in files:
        tensors, hlen, data_end = scan_file(str(p))     # offsets valid, nothing past the end
        assert 8 + hlen + data_end == p.stat().st_size and hlen % 8 == 0
        infos = list(tensors.values())
        assert sorted(infos, key=lambda t: t.offset) == infos          # header in data order
        order = [(t.dtype != "F32", t.name) for t in infos]           # F32 first, then names ascending
        assert order == sorted(order)
        for a, b in zip(infos, infos[1:]):
            assert a.offset + a.nbytes == b.offset                     # no gaps
    with SafeTensorsDir(str(d)) as st:
        for layer in range(1, nl + 1):
            for e in range(E):
                p = f"model.layers.{layer}.mlp.experts.{e}."
                dn, gt, up = (st.info(p + m + ".weight") for m in ("down_proj", "gate_proj", "up_proj"))
                assert dn.file_index == gt.file_index == up.file_index
                assert dn.offset + dn.nbytes == gt.offset and gt.offset + gt.nbytes == up.offset
                assert st.info(p + "gate_proj.weight.qs").shape == (Ie,)
            want = "int8" if layer == nl else "int4"                   # the MTP layer's experts: int8
            assert _fmt_of(st, f"model.layers.{layer}.mlp.experts.3.down_proj.weight", D, Ie) == want
            assert st.info(f"model.layers.{layer}.mlp.gate.weight").dtype == "F32"
            assert st.info(f"model.layers.{layer}.mlp.gate.e_score_correction_bias").dtype == "F32"
        assert _fmt_of(st, "model.embed_tokens.weight", cfg["vocab_size"], D) == "int8"
        assert _fmt_of(st, "lm_head.weight", cfg["vocab_size"], D) == "int8"
        assert _fmt_of(st, "model.layers.0.mlp.down_proj.weight", D, cfg["intermediate_size"]) == "int4"
        assert _fmt_of(st, "model.layers.2.self_attn.q_a_proj.weight", cfg["q_lora_rank"], D) == "int4"
        nh, hd = cfg["index_n_heads"], cfg["index_head_dim"]
        assert _fmt_of(st, "model.layers.1.self_attn.indexer.wq_b.weight", nh * hd, cfg["q_lora_rank"]) == "int8"
        assert _fmt_of(st, f"model.layers.{nl}.eh_proj.weight", D, 2 * D) == "int8"
        assert _fmt_of(st, f"model.layers.{nl}.self_attn.o_proj.weight", D,
                       cfg["num_attention_heads"] * cfg["v_head_dim"]) == "int8"
        assert f"model.layers.{nl}.self_attn.indexer.wq_b.weight" not in st         # no MTP indexer
        assert st.info("model.norm.weight").dtype == "F32"


def _int4_bytes(O, I):
    return O * I // 2 + 4 * O


def test_plan_matches_what_the_tool_wrote(slices):
    for key, (d, summary) in slices.items():
        r = colibri("plan", d, "--json")
        assert r.returncode == 0, r.stderr
        rep = json.loads(r.stdout)
        assert rep["format"] == "container" and rep["config"]["has_dsa"]
        assert rep["config"]["has_mtp"] == (key == "mtp")
        cfg = _cfg(d)
        D, Ie = cfg["hidden_size"], cfg["moe_intermediate_size"]
        expert = 2 * _int4_bytes(Ie, D) + _int4_bytes(D, Ie)         # worked out from the widths
        for row in rep["experts"]["rows"]:
            assert row["expert_disk_bytes"] == row["expert_bytes"] == expert == summary["expert_bytes"][
                str(row["layer"])]
            assert row["layer_disk_bytes"] == cfg["n_routed_experts"] * expert
        if key == "mtp":
            mtp = rep["experts"]["mtp"]
            assert mtp["expert_disk_bytes"] == 3 * (Ie * D + 4 * Ie) + 4 * (D - Ie)    # int8: O*I + 4*O each
        # resident = every tensor on disk except the routed experts (payload + 4*O, vectors 4*n)
        assert rep["resident"]["engine_bytes"] == summary["resident_bytes"]
        with SafeTensorsDir(str(d)) as st:
            assert summary["resident_bytes"] == sum(st.info(n).nbytes for n in st.names()
                                                    if ".mlp.experts." not in n)


def _sample(logits, rng):
    p = np.exp((logits - logits.max()).astype(np.float64))
    return int(rng.choice(len(p), p=p / p.sum()))


@pytest.mark.parametrize("key", ["plain", "mtp"])
def test_engine_generates_hundreds_of_tokens_with_finite_logits(slices, key):
    from colibri._core import model_init
    d, summary = slices[key]
    m = model_init(str(d), cache_experts=4)              # experts stream through a small LRU
    try:
        assert m.has_dsa and m.has_mtp == (key == "mtp")
        assert m.resident_bytes() == summary["resident_bytes"]
        n_new = 300 if key == "plain" else 40
        m.kv_alloc(16 + n_new + 8)
        rng = np.random.default_rng(0)
        prompt = [int(t) for t in rng.integers(0, 4096, 16)]
        logits = m.step(prompt, 0)
        kv, spread = len(prompt), []
        for _ in range(n_new):                            # past index_topk (128): DSA selects keys
            assert np.all(np.isfinite(logits))
            spread.append(float(logits.std()))
            tok = _sample(logits, rng)
            logits = m.step([tok], kv)
            kv += 1
        assert 0.5 < min(spread) and max(spread) < 10     # lm_head sigma: logits of std ~2
        h = np.asarray(m.hlast)
        assert np.all(np.isfinite(h)) and 0.1 < np.sqrt((h ** 2).mean()) < 100
        if key == "mtp":
            drafts = m.mtp_draft(tok, kv, 3)
            assert len(drafts) == 3 and all(np.all(np.isfinite(x)) for x in m.mtp_logits)
    finally:
        m.close()


@pytest.mark.parametrize("key", ["plain", "mtp"])
def test_run_cli_with_a_text_prompt(slices, key, tmp_path):
    d, summary = slices[key]
    stats = tmp_path / "s.json"
    r = colibri("run", "--model", d, "def f(x):", "--max-tokens", 4, "--seed", 1, "--stats-json", stats)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip()                               # every id decodes to visible text
    s = json.loads(stats.read_text())
    assert 1 <= s["decode_tokens"] <= 4 and s["prefill_tokens"] >= 1
    assert s["resident_bytes"] == summary["resident_bytes"]


def test_rerun_keeps_files_and_same_seed_same_bytes(slices, tmp_path):
    d, _ = slices["plain"]
    before = _file_bytes(d)
    r = tool(d, "--shrink", SHRINK, "--seed", 7, "--json")
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert s["written"] == [] and s["kept"] == sorted(before) and _file_bytes(d) == before
    again = tmp_path / "again"
    assert tool(again, "--shrink", SHRINK, "--seed", 7).returncode == 0
    assert _file_bytes(again) == before                   # reproducible
    other = tmp_path / "other"
    assert tool(other, "--shrink", SHRINK, "--seed", 8).returncode == 0
    assert all(_file_bytes(other)[n] != h for n, h in before.items())


def test_rerun_redoes_a_damaged_file(slices, tmp_path):
    d = tmp_path / "s"
    assert tool(d, "--shrink", 32).returncode == 0
    before = _file_bytes(d)
    victim = d / "out-00002.safetensors"
    with open(victim, "r+b") as f:
        f.truncate(victim.stat().st_size - 10)
    (d / ".out-00003.safetensors.tmp").write_bytes(b"partial")
    r = tool(d, "--shrink", 32, "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["written"] == ["out-00002.safetensors"]
    assert _file_bytes(d) == before and not list(d.glob(".*.tmp"))


def test_bits_flags(tmp_path):
    d = tmp_path / "b"
    r = tool(d, "--shrink", 32, "--dense-layers", 1, "--moe-layers", 1, "--expert-bits", 8, "--dense-bits", 16,
             "--io-bits", 4, "--indexer-bits", 2)
    assert r.returncode == 0, r.stderr
    cfg = _cfg(d)
    D, Ie, V = cfg["hidden_size"], cfg["moe_intermediate_size"], cfg["vocab_size"]
    with SafeTensorsDir(str(d)) as st:
        assert _fmt_of(st, "model.layers.1.mlp.experts.0.up_proj.weight", Ie, D) == "int8"
        assert _fmt_of(st, "lm_head.weight", V, D) == "int4"
        assert _fmt_of(st, "model.layers.0.self_attn.indexer.wk.weight", cfg["index_head_dim"], D) == "int2"
        o = st.info("model.layers.0.self_attn.o_proj.weight")              # --dense-bits 16: f32
        assert o.dtype == "F32" and o.shape == (D, cfg["num_attention_heads"] * cfg["v_head_dim"])
        assert "model.layers.0.self_attn.o_proj.weight.qs" not in st
    man = json.loads((d / "colibri_convert.json").read_text())
    assert man["containers"] == {"expert": "int8", "dense": "f32", "io": "int4", "mtp": "int8", "indexer": "int2"}
    r = colibri("run", "--model", d, "--prompt-ids", "1,2,3", "--max-tokens", 3)
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.mark.parametrize("args, msg", [
    (["--shrink", 0], "--shrink must be >= 1"),
    (["--dense-layers", 0, "--moe-layers", 0], "--dense-layers 0 --moe-layers 0: give at least one layer"),
    (["--moe-layers", 200], "at most 128 layers"),
    (["--seed", -1], "--seed must be >= 0"),
])
def test_bad_options_fail_cleanly(tmp_path, args, msg):
    r = tool(tmp_path / "x", *args)
    assert r.returncode == 1 and f"make_glm5_slice.py: error: {msg}" in r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "x").exists()


def test_bad_bits_and_help():
    r = tool("/nonexistent", "--expert-bits", 9)
    assert r.returncode == 2 and "--expert-bits" in r.stderr and "Traceback" not in r.stderr
    r = tool("--help")
    assert r.returncode == 0 and "example:" in r.stdout and "--shrink" in r.stdout and "--mtp" in r.stdout


def test_destination_errors(slices, tmp_path):
    d, _ = slices["plain"]
    r = tool(d, "--shrink", SHRINK, "--seed", 8)             # other options into the same folder
    assert r.returncode == 1 and "different options" in r.stderr and "colibri_convert.json" in r.stderr
    f = tmp_path / "file"
    f.write_text("x")
    r = tool(f, "--shrink", SHRINK)
    assert r.returncode == 1 and "is not a directory" in r.stderr
    stray = tmp_path / "stray"
    stray.mkdir()
    (stray / "model.safetensors").write_bytes(b"")
    r = tool(stray, "--shrink", SHRINK)
    assert r.returncode == 1 and "no colibri_convert.json" in r.stderr
    conv = tmp_path / "conv"
    conv.mkdir()
    (conv / "colibri_convert.json").write_text(json.dumps({"format": "colibri-container"}))
    r = tool(conv, "--shrink", SHRINK)
    assert r.returncode == 1 and "not a synthetic slice" in r.stderr


def test_not_enough_disk_space_is_refused_before_writing(tmp_path, monkeypatch):
    import collections
    Usage = collections.namedtuple("Usage", "total used free")
    monkeypatch.setattr(g.shutil, "disk_usage", lambda p: Usage(10 ** 9, 10 ** 9 - 1000, 1000))
    with pytest.raises(g.SliceError, match="needs .* GB, only 0.0 GB are free"):
        g.make_slice(str(tmp_path / "d"), shrink=SHRINK, verbose=False)
    assert not list((tmp_path / "d").glob("*.safetensors"))


def test_headers_only_gives_the_same_plan_in_a_few_bytes(slices, tmp_path):
    """--headers-only writes the same headers with the data left as holes: plan reads the same
    numbers (for a full-size GLM-5 plan without its ~390 GB), and the files use almost no disk."""
    d, _ = slices["mtp"]
    h = tmp_path / "h"
    r = tool(h, "--shrink", SHRINK, "--seed", 7, "--mtp", "--headers-only")
    assert r.returncode == 0, r.stderr[-3000:]
    full = json.loads(colibri("plan", d, "--json").stdout)
    hollow = json.loads(colibri("plan", h, "--json").stdout)
    for key in ("resident", "experts", "kv_bytes", "per_token"):
        assert full[key] == hollow[key]
    sizes = sorted((p.name, p.stat().st_size) for p in d.glob("*.safetensors"))
    assert sizes == sorted((p.name, p.stat().st_size) for p in h.glob("*.safetensors"))
    assert sum(p.stat().st_blocks * 512 for p in h.glob("*.safetensors")) < 0.5 * sum(s for _, s in sizes)
