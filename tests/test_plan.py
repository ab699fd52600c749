"""``colibri plan``: the header-only RAM/disk plan agrees with a loaded engine, and bad input is a
clear message with exit status 2."""
import json
import pathlib
import shutil
import struct
import sys

import numpy as np
import pytest

import colibri
from colibri import _core, tiers
from colibri.models import default_model_dir
from colibri.st import SafeTensorsDir
from conftest import DATA

from colibri import plan

MODELS = {"tiny_dense": DATA / "tiny_dense", "tiny_dsa": DATA / "tiny_dsa", "tiny_mtp": DATA / "tiny_mtp",
          "default": default_model_dir()}
BITS = [(32, 32), (8, 8), (4, 4), (8, 4)]


@pytest.fixture(scope="module")
def loaded():
    """model_init of each test model at each bit setting, loaded once."""
    cache = {}

    def get(name, db, eb):
        key = (name, db, eb)
        if key not in cache:
            cache[key] = colibri.model_init(MODELS[name], dense_bits=db, expert_bits=eb)
        return cache[key]
    yield get
    for m in cache.values():
        m.close()


@pytest.mark.parametrize("db,eb", BITS)
@pytest.mark.parametrize("name", list(MODELS))
def test_report_matches_the_loaded_engine(name, db, eb, loaded):
    m = loaded(name, db, eb)
    c = m.cfg
    r = plan.build_report(MODELS[name], dense_bits=db, expert_bits=eb, ram_gb=4, runtime_bytes=0)
    res = r["resident"]
    assert res["engine_bytes"] == m.resident_bytes()
    assert res["total_bytes"] == m.resident_bytes()
    assert res["total_bytes"] == res["engine_bytes"] + res["uncounted_bytes"]
    assert sum(res["groups"].values()) == res["total_bytes"]
    assert r["config"]["has_mtp"] == m.has_mtp and r["config"]["has_dsa"] == m.has_dsa
    assert (res["groups"]["mtp_head"] > 0) == m.has_mtp
    # experts: expert 0 per row as tiers.expert_bytes_by_row, and every expert's bytes as loaded
    rows = tiers.expert_bytes_by_row(m)
    main = [(i, b) for i, b in enumerate(rows[:c.n_layers]) if b > 0]
    assert [(x["layer"], x["expert_bytes"]) for x in r["experts"]["rows"]] == main
    assert (r["experts"]["mtp"] or {"expert_bytes": 0})["expert_bytes"] == rows[c.n_layers]
    total = 0
    for x in r["experts"]["rows"] + ([r["experts"]["mtp"]] if r["experts"]["mtp"] else []):
        sizes = []
        for e in range(c.n_experts):
            E = m.expert_load(x["layer"], e)
            sizes.append(sum(W.nbytes for W in (E.gate, E.up, E.down)))   # payload + scales, in RAM
        assert x["expert_bytes"] == sizes[0] and x["layer_bytes"] == sum(sizes)
        total += sum(sizes)
    assert r["experts"]["total_bytes"] == total
    # KV cache and work buffers: the engine's own formulas
    assert r["kv_bytes"] == m.kv_bytes(r["ctx"]) and r["kv_bytes_per_position"] == m.kv_bytes(1)
    assert r["batch"] == tiers.prefill_batch(m, r["ctx"])         # the batch `run` takes
    assert r["work_bytes"] == tiers.work_bytes_estimate(m, r["ctx"], r["batch"])
    assert r["ctx"] == min(plan.DEFAULT_CTX, c.max_positions)
    # per-token disk reads at hit rate 0: top-k experts of every main MoE layer
    assert r["per_token"]["hit_rate_assumed"] == 0.0
    assert r["per_token"]["disk_bytes_cold"] == c.topk * sum(x["expert_disk_bytes"] for x in r["experts"]["rows"])
    assert r["per_token"]["mtp_draft_disk_bytes"] == c.topk * (r["experts"]["mtp"] or {"expert_disk_bytes": 0})["expert_disk_bytes"]
    emb_row = 0 if r["config"]["tied_embeddings"] else res["groups"]["embed"] // c.vocab
    assert r["per_token"]["resident_bytes_touched"] == (
        res["total_bytes"] - res["groups"]["mtp_head"] - res["groups"]["embed"] + emb_row)


@pytest.mark.parametrize("name", list(MODELS))
def test_ram_plan_equals_configure(name, loaded, tmp_path, monkeypatch):
    """Same capacity, projected peak and budget as tiers.configure, for roomy and tight budgets."""
    monkeypatch.setenv("COLIBRI_USAGE_DIR", str(tmp_path))
    m = loaded(name, 32, 32)
    E = m.cfg.n_experts
    for ctx in (64, None):
        two = plan.build_report(MODELS[name], ctx=ctx, ram_gb=8, runtime_bytes=12345, cache_experts=2,
                                mtp_tier=False)
        ctx = two["ctx"]
        tight = (two["ram"]["projected_peak_bytes"] + 100) / 1e9     # fits 2 cached experts per row, not 3
        for ram_gb, req, cap in ((8, 0, E), (8, 3, 3), (8, 2, 2), (tight, 4, 2), (tight, 0, E)):
            # the prefill batch of the roomy plan throughout (the default shrinks on small budgets:
            # test_default_batch_follows_the_budget)
            r = plan.build_report(MODELS[name], ctx=ctx, ram_gb=ram_gb, runtime_bytes=12345, cache_experts=req,
                                  mtp_tier=False, batch=two["batch"])
            t = tiers.configure(m, ctx, requested=req, ram_gb=ram_gb, runtime=12345, autopin=False, learn=False,
                                mtp_tier=False, batch=two["batch"])
            p = r["ram"]
            assert p["error"] is None
            assert (p["capacity"], p["projected_peak_bytes"], p["expert_avail_bytes"], p["budget_bytes"]) == (
                cap, t.plan.projected_peak_bytes, t.plan.expert_avail_bytes, t.plan.budget_bytes)
            assert t.plan.capacity == cap and p["streaming"] == (cap < E) and p["notes"] == t.plan.notes
            assert p["work_bytes"] == r["work_bytes"] + 12345 and p["resident_bytes"] == m.resident_bytes()
            assert p["min_ram_bytes"] <= p["projected_peak_bytes"] <= p["budget_bytes"]
            assert p["min_ram_bytes"] == min(p["one_cached_ram_bytes"], p["all_cached_ram_bytes"]) if req == 0 \
                else p["min_ram_bytes"] <= p["one_cached_ram_bytes"]
            # the smallest budget that plans with the report's prefill batch, and one just below it
            # that cannot (a smaller budget may plan with a smaller default batch)
            assert r["batch"] == t.batch
            for margin, ok in ((20, True), (-20, False)):
                low = plan.build_report(MODELS[name], ctx=ctx, ram_gb=(p["min_ram_bytes"] + margin) / 1e9,
                                        runtime_bytes=12345, cache_experts=req, batch=r["batch"])["ram"]
                assert (low["error"] is None) == ok, (margin, req)
            cold = r["per_token"]["disk_bytes_cold"]
            assert r["per_token"]["disk_bytes_uniform"] == round(cold * (1 - cap / E))


@pytest.mark.parametrize("name", ["tiny_dsa", "default"])
def test_a_cold_token_reads_the_planned_bytes(name):
    r = plan.build_report(MODELS[name], ram_gb=8)
    m = colibri.model_init(MODELS[name])
    try:
        m.kv_alloc(4)
        m.reset_stats()
        m.step([3], 0)
        assert m.bytes_read == r["per_token"]["disk_bytes_cold"]
    finally:
        m.close()


def test_int4_container(tmp_path):
    from colibri.convert import ConvertOptions, convert
    dst = tmp_path / "dsa_int4"
    convert(DATA / "tiny_dsa", dst, ConvertOptions(expert_bits=4, dense_bits=4, io_bits=8), verbose=False)
    r = plan.build_report(dst, ram_gb=4, runtime_bytes=0, dense_bits=32, expert_bits=32)
    m = colibri.model_init(dst)
    try:
        assert r["format"] == "container"
        assert r["resident"]["engine_bytes"] == m.resident_bytes()
        assert r["resident"]["total_bytes"] == m.resident_bytes()
        x = r["experts"]["rows"][0]
        assert x["expert_bytes"] == x["expert_disk_bytes"] == tiers.expert_bytes_by_row(m)[x["layer"]]
        E = m.expert_load(x["layer"], 0)
        # int4 gate, up [32, 128] and down [128, 32]: packed rows + one f32 scale per row
        assert x["expert_bytes"] == sum(W.nbytes for W in (E.gate, E.up, E.down)) == \
            2 * (32 * 64 + 4 * 32) + (128 * 16 + 4 * 128)
    finally:
        m.close()


def test_mtp_required_mirrors_the_engine():
    assert plan.MTP_REQUIRED == tuple(_core.MTP_REQUIRED)


# -- command line -----------------------------------------------------------------------------------

def test_json_output(capsys):
    assert plan.main([str(MODELS["default"]), "--json", "--ram", "2", "--ctx", "512"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert set(rep) >= {"model", "format", "dense_bits", "expert_bits", "config", "resident", "experts", "ctx",
                        "kv_bytes", "kv_bytes_per_position", "work_bytes", "runtime_bytes", "runtime_source",
                        "ram", "per_token", "notes"}
    assert rep["format"] == "container" and rep["ctx"] == 512 and rep["config"]["has_mtp"]
    assert rep["ram"]["budget_bytes"] == 2_000_000_000 and rep["ram"]["budget_source"] == "given"
    assert rep["ram"]["capacity"] == rep["config"]["n_experts"] and not rep["ram"]["streaming"]   # all fit
    assert rep["ram"]["projected_peak_bytes"] <= rep["ram"]["budget_bytes"]
    # resident_bytes() counts every resident group, the MTP head included
    assert rep["resident"]["uncounted"] == [] and rep["resident"]["uncounted_bytes"] == 0
    assert rep["resident"]["groups"]["mtp_head"] > 0 and rep["resident"]["groups"]["router"] > 0
    assert rep["runtime_bytes"] > 0                   # the runtime estimate: this process's RSS


def test_default_model_and_table(capsys):
    assert plan.main(["--cache-experts", "4", "--ram", "4"]) == 0
    out = capsys.readouterr().out
    assert default_model_dir() in out
    cfg = json.loads((pathlib.Path(default_model_dir()) / "config.json").read_text())
    for text in ("resident total", f"layer {cfg['num_hidden_layers']} (MTP)",
                 f"4 of {cfg['n_routed_experts']} experts cached", "hit rate 0 assumed", "per MTP draft"):
        assert text in out, text


def test_checkpoint_table_notes_disk_vs_ram(capsys):
    assert plan.main([str(MODELS["tiny_mtp"]), "--expert-bits", "4", "--dense-bits", "8", "--ram", "1"]) == 0
    out = capsys.readouterr().out
    assert "format    checkpoint" in out and "budgets the LRU with the RAM bytes" in out


def test_default_budget_is_measured(capsys):
    assert plan.main([str(MODELS["tiny_dense"]), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert "available" in rep["ram"]["budget_source"] or rep["ram"]["budget_source"] == "assumed"


def test_budget_too_small_exits_1_with_the_report(capsys):
    assert plan.main([str(MODELS["tiny_dsa"]), "--json", "--ram", "0.001"]) == 1
    rep = json.loads(capsys.readouterr().out)
    assert "not enough RAM" in rep["ram"]["error"]
    assert rep["ram"]["min_ram_bytes"] > 1_000_000
    assert "capacity" not in rep["ram"] and rep["per_token"]["disk_bytes_uniform"] is None
    assert plan.main([str(MODELS["tiny_dsa"]), "--ram", "0.001"]) == 1
    assert "DOES NOT FIT" in capsys.readouterr().out


def write_safetensors(path, tensors):
    """A safetensors file of float32 arrays (name -> array)."""
    header, blobs, at = {}, [], 0
    for name, a in tensors.items():
        a = np.ascontiguousarray(a, np.float32)
        header[name] = {"dtype": "F32", "shape": list(a.shape), "data_offsets": [at, at + a.nbytes]}
        blobs.append(a.tobytes())
        at += a.nbytes
    h = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))


def copy_model(tmp_path, name="tiny_dense", drop=(), fuse=False, sub="m"):
    """tiny model with some tensors dropped, or with the routed experts fused into 3-D tensors."""
    dst = tmp_path / sub
    dst.mkdir()
    shutil.copy(DATA / name / "config.json", dst)
    with SafeTensorsDir(DATA / name) as st:
        t = {n: st.read_f32(n) for n in st.names() if n not in drop}
    if fuse:
        c = colibri.load_config(str(DATA / name))
        for i in range(c.n_layers):
            p = f"model.layers.{i}.mlp.experts."
            if p + "0.gate_proj.weight" not in t:
                continue
            gu, dn = [], []
            for e in range(c.n_experts):
                gu.append(np.concatenate([t.pop(f"{p}{e}.gate_proj.weight"), t.pop(f"{p}{e}.up_proj.weight")]))
                dn.append(t.pop(f"{p}{e}.down_proj.weight"))
            t[p + "gate_up_proj"], t[p + "down_proj"] = np.stack(gu), np.stack(dn)
    write_safetensors(dst / "model.safetensors", t)
    return dst


def test_fused_experts_are_planned_as_converted(tmp_path, capsys):
    fused = copy_model(tmp_path, fuse=True)
    a = plan.build_report(fused, expert_bits=4, ram_gb=4, runtime_bytes=0)
    b = plan.build_report(MODELS["tiny_dense"], expert_bits=4, ram_gb=4, runtime_bytes=0)
    assert a["experts"] == b["experts"] and a["resident"] == b["resident"]
    assert any("fused" in n for n in a["notes"])


def error_of(capsys, argv):
    rc = plan.main(argv)
    cap = capsys.readouterr()
    assert rc == 2 and cap.out == "" and "Traceback" not in cap.err
    assert cap.err.startswith("colibri plan: error: ")
    return cap.err


def test_bad_inputs(tmp_path, capsys):
    missing = tmp_path / "nope"
    assert f"{missing}: no such directory" in error_of(capsys, [str(missing)])
    # a folder without config.json
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "config.json: not found" in error_of(capsys, [str(empty)])
    # a config without a required field
    bad = tmp_path / "badcfg"
    bad.mkdir()
    cfg = json.loads((DATA / "tiny_dense" / "config.json").read_text())
    del cfg["hidden_size"]
    (bad / "config.json").write_text(json.dumps(cfg))
    err = error_of(capsys, [str(bad)])
    assert "config.json" in err and "hidden_size" in err and "missing" in err
    # no safetensors file
    shutil.copy(DATA / "tiny_dense" / "config.json", empty)
    assert "no .safetensors file" in error_of(capsys, [str(empty)])
    # a corrupt header
    (empty / "model.safetensors").write_bytes(struct.pack("<Q", 20) + b"{not json at all!!!}")
    err = error_of(capsys, [str(empty)])
    assert "model.safetensors" in err and "not valid JSON" in err
    # a truncated file
    data = (DATA / "tiny_dense" / "model.safetensors").read_bytes()
    (empty / "model.safetensors").write_bytes(data[:len(data) // 2])
    err = error_of(capsys, [str(empty)])
    assert "model.safetensors" in err and "truncated" in err
    # missing tensors: a routed expert, a norm, lm_head
    d = copy_model(tmp_path, drop=("model.layers.4.mlp.experts.5.up_proj.weight",), sub="a")
    assert "missing tensor model.layers.4.mlp.experts.5.up_proj.weight" in error_of(capsys, [str(d)])
    d = copy_model(tmp_path, drop=("model.layers.1.post_attention_layernorm.weight",), sub="b")
    assert "missing tensor model.layers.1.post_attention_layernorm.weight" in error_of(capsys, [str(d)])
    d = copy_model(tmp_path, drop=("lm_head.weight",), sub="c")
    assert "missing tensor lm_head.weight" in error_of(capsys, [str(d)])
    # options
    assert "exceeds the model's context" in error_of(capsys, [str(MODELS["tiny_dense"]), "--ctx", "5000"])
    assert "--ctx must be >= 1" in error_of(capsys, [str(MODELS["tiny_dense"]), "--ctx", "0"])
    assert "--ram must be a positive" in error_of(capsys, [str(MODELS["tiny_dense"]), "--ram", "-1"])
    assert "--cache-experts must be an integer >= 0" in error_of(capsys, [str(MODELS["tiny_dense"]), "--cache-experts", "-2"])


def test_wrong_shape_names_the_file(tmp_path, capsys):
    d = copy_model(tmp_path)
    with SafeTensorsDir(d) as st:
        t = {n: st.read_f32(n) for n in st.names()}
    t["model.layers.0.self_attn.o_proj.weight"] = t["model.layers.0.self_attn.o_proj.weight"][:, :7]
    write_safetensors(d / "model.safetensors", t)
    err = error_of(capsys, [str(d)])
    assert "model.safetensors" in err and "o_proj" in err and "expected" in err


def test_model_without_moe_layers_plans_as_configure(tmp_path, monkeypatch):
    """Every layer dense: no expert rows, and the placeholder plan configure makes."""
    monkeypatch.setenv("COLIBRI_USAGE_DIR", str(tmp_path))
    d = tmp_path / "dense"
    d.mkdir()
    cfg = json.loads((DATA / "tiny_dense" / "config.json").read_text())
    cfg["mlp_layer_types"] = ["dense"] * cfg["num_hidden_layers"]
    (d / "config.json").write_text(json.dumps(cfg))
    with SafeTensorsDir(DATA / "tiny_dense") as st:
        t = {n: st.read_f32(n) for n in st.names() if ".mlp.experts." not in n}
    rng = np.random.default_rng(0)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}.mlp."
        for n in list(t):
            if n.startswith(p + "gate.") or n.startswith(p + "shared_experts."):
                del t[n]
        H, F = cfg["hidden_size"], cfg["intermediate_size"]
        for m, shape in (("gate_proj", (F, H)), ("up_proj", (F, H)), ("down_proj", (H, F))):
            t.setdefault(f"{p}{m}.weight", rng.standard_normal(shape).astype(np.float32) * 0.02)
    write_safetensors(d / "model.safetensors", t)
    r = plan.build_report(d, ram_gb=1, runtime_bytes=999)
    m = colibri.model_init(d)
    try:
        t = tiers.configure(m, r["ctx"], ram_gb=1, runtime=999, autopin=False, learn=False)
        assert r["experts"]["rows"] == [] and r["experts"]["total_bytes"] == 0
        assert r["resident"]["engine_bytes"] == m.resident_bytes()
        assert r["resident"]["total_bytes"] == m.resident_bytes()
        assert r["ram"]["projected_peak_bytes"] == t.plan.projected_peak_bytes
        assert r["ram"]["capacity"] == t.plan.capacity and r["runtime_bytes"] == 0
        assert r["per_token"]["disk_bytes_cold"] == 0 and r["per_token"]["disk_bytes_uniform"] is None
    finally:
        m.close()


def test_default_batch_follows_the_budget():
    """run's default --batch (tiers.prefill_batch): the whole context, halved (not below
    MIN_BATCH) while a forward's scratch passes WORK_SHARE of the budget; the plan reports it and
    counts the scratch of that batch; an explicit batch is kept."""
    m = _core.model_init(MODELS["tiny_dsa"])
    ctx = 4096
    assert tiers.prefill_batch(m, 100, ram_gb=8) == 100
    assert tiers.prefill_batch(m, ctx, ram_gb=8) == ctx
    assert tiers.prefill_batch(m, ctx, ram_gb=8, requested=77) == 77
    full = tiers.work_bytes_estimate(m, ctx, ctx)
    small = tiers.prefill_batch(m, ctx, ram_gb=full / tiers.WORK_SHARE / 1e9 / 3)
    assert tiers.MIN_BATCH <= small < ctx
    assert tiers.work_bytes_estimate(m, ctx, small) < full
    assert tiers.prefill_batch(m, ctx, ram_gb=1e-6) == tiers.MIN_BATCH
    r = plan.build_report(MODELS["tiny_dsa"], ctx=ctx, ram_gb=full / tiers.WORK_SHARE / 1e9 / 3)
    assert r["batch"] == small and r["work_bytes"] == plan.work_bytes(m.cfg, ctx, m.has_dsa, small)
    with pytest.raises(ValueError, match="--batch must be >= 1"):
        tiers.prefill_batch(m, ctx, requested=-1)
