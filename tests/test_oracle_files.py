"""Self-consistency checks of the committed oracle data in tests/data (written by tools/make_oracle.py).

Pure Python (json + struct): no torch, no numpy needed.
"""

import json
import math
import os
import re
import struct

import pytest

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
F32_MODELS = ["tiny_dense", "tiny_dsa"]
ALL_MODELS = F32_MODELS + ["tiny_dense_fp8", "tiny_mtp"]
REF_FILES = {
    "tiny_dense": ["ref.json", "ref_long.json", "ref_int8.json", "ref_int4.json"],
    "tiny_dsa": ["ref.json", "ref_long.json", "ref_int8.json", "ref_int4.json"],
    "tiny_dense_fp8": ["ref.json"],
    "tiny_mtp": ["ref.json"],  # plus mtp_ref.json (own checks at the end)
}
MTP_DEPTH = 4
MTP_EXTRA = {"eh_proj.weight": "2D", "enorm.weight": "D", "hnorm.weight": "D", "shared_head.norm.weight": "D"}
PROMPT = [3, 14, 159, 26, 53, 58, 200, 11, 77, 240, 5, 99]
N_NEW = 20
LONG_PROMPT_LEN = 16
LONG_NEW = 64
QUANT = {
    "ref_int8.json": {"expert_bits": 8, "dense_bits": 8, "io_bits": 8, "indexer_bits": 8},
    "ref_int4.json": {"expert_bits": 4, "dense_bits": 4, "io_bits": 8, "indexer_bits": 8},
}
COMMON_CFG = {
    "model_type": "glm_moe_dsa",
    "vocab_size": 256,
    "hidden_size": 128,
    "intermediate_size": 64,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 5,
    "first_k_dense_replace": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "q_lora_rank": 64,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 24,
    "qk_rope_head_dim": 8,
    "v_head_dim": 32,
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "tie_word_embeddings": False,
    "rms_norm_eps": 1e-5,
    "attention_bias": False,
    "max_position_embeddings": 4096,
    "mlp_layer_types": ["dense", "dense", "dense", "sparse", "sparse"],
    # HF overwrites head_dim with qk_rope_head_dim (it drives the rotary embedding)
    "head_dim": 8,
    "qk_head_dim": 32,
}
MODEL_CFG = {
    "tiny_dense": {"index_topk": 4096, "index_head_dim": 16, "index_n_heads": 2,
                   "indexer_types": ["full"] * 5},
    "tiny_dsa": {"index_topk": 8, "index_head_dim": 32, "index_n_heads": 16,
                 "indexer_types": ["full", "full", "shared", "full", "shared"]},
}
MODEL_CFG["tiny_dense_fp8"] = MODEL_CFG["tiny_dense"]
MODEL_CFG["tiny_mtp"] = MODEL_CFG["tiny_dense"]
DTYPE_SIZE = {"F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1}
EXPERT_RE = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------

def load_json(*parts):
    with open(os.path.join(DATA, *parts)) as f:
        return json.load(f)


def st_header(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        hdr = json.loads(f.read(n))
    hdr.pop("__metadata__", None)
    return hdr, 8 + n


def st_read(path, name):
    """Decode one tensor (F32 / BF16 / F8_E4M3) to a flat list of Python floats."""
    hdr, base = st_header(path)
    t = hdr[name]
    a, b = t["data_offsets"]
    with open(path, "rb") as f:
        f.seek(base + a)
        raw = f.read(b - a)
    if t["dtype"] == "F32":
        return list(struct.unpack(f"<{len(raw) // 4}f", raw))
    if t["dtype"] == "BF16":
        hi = struct.unpack(f"<{len(raw) // 2}H", raw)
        return list(struct.unpack(f"<{len(hi)}f", struct.pack(f"<{len(hi)}I", *[h << 16 for h in hi])))
    if t["dtype"] == "F8_E4M3":
        return [e4m3_to_float(x) for x in raw]
    raise AssertionError(t["dtype"])


def e4m3_to_float(byte):
    s = -1.0 if byte & 0x80 else 1.0
    e = (byte >> 3) & 0xF
    m = byte & 0x7
    assert not (e == 0xF and m == 0x7), "NaN in fp8 payload"
    if e == 0:
        return s * m * 2.0 ** -9
    return s * (1.0 + m / 8.0) * 2.0 ** (e - 7)


def f32(x):
    return struct.unpack("<f", struct.pack("<f", x))[0]


def argmax(row):
    best = 0
    for i, v in enumerate(row):
        if v > row[best]:
            best = i
    return best


def numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


# ----------------------------------------------------------------------------------------------
# files / configs
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("model", ALL_MODELS)
def test_files_exist(model):
    d = os.path.join(DATA, model)
    for fn in ["config.json", "model.safetensors"] + REF_FILES[model]:
        assert os.path.isfile(os.path.join(d, fn)), fn
    # the quantized containers themselves are never committed
    assert not [f for f in os.listdir(d) if f.startswith("out-")]


def test_total_size_reasonable():
    total = 0
    for root, _, files in os.walk(DATA):
        total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
    assert total < 16 * 1024 * 1024, total          # the four oracles + the default model's reference


@pytest.mark.parametrize("model", ALL_MODELS)
def test_config(model):
    cfg = load_json(model, "config.json")
    assert "_oracle" not in cfg
    assert cfg["architectures"] == ["GlmMoeDsaForCausalLM"]
    for k, v in {**COMMON_CFG, **MODEL_CFG[model]}.items():
        assert cfg[k] == v, (k, cfg[k], v)
    assert len(cfg["indexer_types"]) == cfg["num_hidden_layers"]
    assert cfg["indexer_types"][0] == "full"
    assert set(cfg["indexer_types"]) <= {"full", "shared"}
    if model == "tiny_dense_fp8":
        qc = cfg["quantization_config"]
        assert qc["quant_method"] == "fp8" and qc["weight_block_size"] == [128, 128]
        base = load_json("tiny_dense", "config.json")
        assert {k: v for k, v in cfg.items() if k != "quantization_config"} == base
    else:
        assert "quantization_config" not in cfg


def test_dsa_has_full_and_shared_layers():
    cfg = load_json("tiny_dsa", "config.json")
    assert {"full", "shared"} == set(cfg["indexer_types"])
    assert cfg["index_topk"] < len(PROMPT) + N_NEW


# ----------------------------------------------------------------------------------------------
# safetensors contents
# ----------------------------------------------------------------------------------------------

def expected_shapes(cfg):
    D, V = cfg["hidden_size"], cfg["vocab_size"]
    H = cfg["num_attention_heads"]
    dn, dr, dv = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    Lq, Lkv = cfg["q_lora_rank"], cfg["kv_lora_rank"]
    Id, Ie, E = cfg["intermediate_size"], cfg["moe_intermediate_size"], cfg["n_routed_experts"]
    ih, inh = cfg["index_head_dim"], cfg["index_n_heads"]
    s = {"model.embed_tokens.weight": [V, D], "lm_head.weight": [V, D], "model.norm.weight": [D]}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        s.update({
            p + "input_layernorm.weight": [D], p + "post_attention_layernorm.weight": [D],
            p + "self_attn.q_a_proj.weight": [Lq, D], p + "self_attn.q_a_layernorm.weight": [Lq],
            p + "self_attn.q_b_proj.weight": [H * (dn + dr), Lq],
            p + "self_attn.kv_a_proj_with_mqa.weight": [Lkv + dr, D],
            p + "self_attn.kv_a_layernorm.weight": [Lkv],
            p + "self_attn.kv_b_proj.weight": [H * (dn + dv), Lkv],
            p + "self_attn.o_proj.weight": [D, H * dv],
        })
        if cfg["indexer_types"][i] == "full":
            s.update({
                p + "self_attn.indexer.wq_b.weight": [inh * ih, Lq],
                p + "self_attn.indexer.wk.weight": [ih, D],
                p + "self_attn.indexer.weights_proj.weight": [inh, D],
                p + "self_attn.indexer.k_norm.weight": [ih],
                p + "self_attn.indexer.k_norm.bias": [ih],
            })
        if cfg["mlp_layer_types"][i] == "dense":
            s.update({p + "mlp.gate_proj.weight": [Id, D], p + "mlp.up_proj.weight": [Id, D],
                      p + "mlp.down_proj.weight": [D, Id]})
        else:
            Is = Ie * cfg["n_shared_experts"]
            s.update({p + "mlp.gate.weight": [E, D], p + "mlp.gate.e_score_correction_bias": [E],
                      p + "mlp.shared_experts.gate_proj.weight": [Is, D],
                      p + "mlp.shared_experts.up_proj.weight": [Is, D],
                      p + "mlp.shared_experts.down_proj.weight": [D, Is]})
            for e in range(E):
                q = p + f"mlp.experts.{e}."
                s.update({q + "gate_proj.weight": [Ie, D], q + "up_proj.weight": [Ie, D],
                          q + "down_proj.weight": [D, Ie]})
    return s


def check_layout(path, hdr, base):
    end = 0
    for name, t in hdr.items():
        a, b = t["data_offsets"]
        assert b - a == numel(t["shape"]) * DTYPE_SIZE[t["dtype"]], name
        end = max(end, b)
    assert base + end == os.path.getsize(path)
    assert not any("gate_up_proj" in n for n in hdr)


@pytest.mark.parametrize("model", F32_MODELS)
def test_f32_safetensors(model):
    cfg = load_json(model, "config.json")
    path = os.path.join(DATA, model, "model.safetensors")
    hdr, base = st_header(path)
    check_layout(path, hdr, base)
    want = expected_shapes(cfg)
    assert set(hdr) == set(want), sorted(set(hdr) ^ set(want))
    for n, t in hdr.items():
        assert t["dtype"] == "F32", n
        assert t["shape"] == want[n], (n, t["shape"], want[n])
    n_exp = sum(1 for n in hdr if EXPERT_RE.match(n))
    assert n_exp == 3 * cfg["n_routed_experts"] * cfg["mlp_layer_types"].count("sparse")
    # e_score_correction_bias = linspace(-0.1, 0.1, 8); norm weights keep HF init (ones / zero bias)
    E = cfg["n_routed_experts"]
    lin = [f32(-0.1 + 0.2 * i / (E - 1)) for i in range(E)]
    for i, t in enumerate(cfg["mlp_layer_types"]):
        if t == "sparse":
            got = st_read(path, f"model.layers.{i}.mlp.gate.e_score_correction_bias")
            assert all(abs(g - w) < 1e-7 for g, w in zip(got, lin)), got
    assert set(st_read(path, "model.layers.0.input_layernorm.weight")) == {1.0}
    assert set(st_read(path, "model.layers.0.self_attn.indexer.k_norm.bias")) == {0.0}


def test_fp8_safetensors():
    cfg = load_json("tiny_dense_fp8", "config.json")
    path = os.path.join(DATA, "tiny_dense_fp8", "model.safetensors")
    hdr, base = st_header(path)
    check_layout(path, hdr, base)
    want = expected_shapes(cfg)
    weights = {n: t for n, t in hdr.items() if not n.endswith("_scale_inv")}
    assert set(weights) == set(want)
    for n, t in weights.items():
        assert t["shape"] == want[n], n
        fp8 = len(t["shape"]) == 2 and not n.endswith("mlp.gate.weight") \
            and n not in ("model.embed_tokens.weight", "lm_head.weight")
        if fp8:
            assert t["dtype"] == "F8_E4M3", n
            s = hdr[n + "_scale_inv"]
            O, I = t["shape"]
            assert s["dtype"] == "F32" and s["shape"] == [-(-O // 128), -(-I // 128)], n
        else:
            assert t["dtype"] in ("BF16", "F32"), n
            assert n + "_scale_inv" not in hdr
    assert hdr["model.layers.0.self_attn.kv_b_proj.weight_scale_inv"]["shape"] == [2, 1]
    # block quantization sanity on one matrix with two row blocks: dequantized ~ original f32 weight
    name = "model.layers.0.self_attn.kv_b_proj.weight"
    O, I = hdr[name]["shape"]
    q = st_read(path, name)
    sc = st_read(path, name + "_scale_inv")
    w = st_read(os.path.join(DATA, "tiny_dense", "model.safetensors"), name)
    for bo in range(2):
        rows = range(bo * 128, min(O, bo * 128 + 128))
        amax = max(abs(w[r * I + c]) for r in rows for c in range(I))
        assert sc[bo] == f32(amax / 448.0) or abs(sc[bo] - amax / 448.0) <= 1e-6 * sc[bo]
        assert max(abs(q[r * I + c]) for r in rows for c in range(I)) == 448.0
        for r in rows:
            for c in range(I):
                deq = q[r * I + c] * sc[bo]
                assert abs(deq - w[r * I + c]) <= abs(w[r * I + c]) * 2 ** -4 + sc[bo] * 2 ** -9


# ----------------------------------------------------------------------------------------------
# reference files
# ----------------------------------------------------------------------------------------------

REF_CASES = [(m, f) for m in ALL_MODELS for f in REF_FILES[m]]


@pytest.fixture(scope="module")
def refs():
    cache = {}

    def get(model, fn):
        if (model, fn) not in cache:
            cache[(model, fn)] = load_json(model, fn)
        return cache[(model, fn)]
    return get


@pytest.mark.parametrize("model,fn", REF_CASES)
def test_ref_fields_and_lengths(refs, model, fn):
    r = refs(model, fn)
    for k in ["transformers_version", "torch_version", "model", "seed", "config_summary", "prompt_ids",
              "full_ids", "tf_pred", "logits", "diagnostics", "generate_matches_cacheless"]:
        assert k in r, k
    assert r["model"] == model
    cfg = load_json(model, "config.json")
    V = cfg["vocab_size"]
    for k, v in r["config_summary"].items():
        if k in cfg:
            assert cfg[k] == v, k
    P, ids = r["prompt_ids"], r["full_ids"]
    if fn == "ref.json":
        assert P == PROMPT and len(ids) == len(PROMPT) + N_NEW
    else:
        assert len(P) == LONG_PROMPT_LEN and len(ids) == LONG_PROMPT_LEN + LONG_NEW
    assert ids[: len(P)] == P
    assert all(isinstance(t, int) and 0 <= t < V for t in ids)
    assert len(r["tf_pred"]) == len(ids)
    assert len(r["logits"]) == len(ids)
    assert all(len(row) == V for row in r["logits"])
    assert all(math.isfinite(x) for row in r["logits"] for x in row)
    if "greedy_logits_last" in r:
        assert len(r["greedy_logits_last"]) == V
    if fn in QUANT:
        assert r["quant"] == QUANT[fn]
    else:
        assert "quant" not in r
    if r["generate_matches_cacheless"]:
        assert "full_ids_generate" not in r
    else:
        assert len(r["full_ids_generate"]) == len(ids)


@pytest.mark.parametrize("model,fn", REF_CASES)
def test_ref_tf_consistency(refs, model, fn):
    r = refs(model, fn)
    P, ids, pred, lg = r["prompt_ids"], r["full_ids"], r["tf_pred"], r["logits"]
    # tf_pred is the argmax of the stored logits (no exact ties)
    for i, row in enumerate(lg):
        a = argmax(row)
        assert pred[i] == a, i
        assert sum(1 for x in row if x == row[a]) == 1, i
    # the greedy continuation is what teacher forcing predicts
    for i in range(len(P) - 1, len(ids) - 1):
        assert pred[i] == ids[i + 1], i
    # the recorded margin matches the stored logits
    margins = [sorted(row)[-1] - sorted(row)[-2] for row in lg]
    assert abs(min(margins) - r["diagnostics"]["tf_min_argmax_margin"]) < 1e-6
    assert min(margins) >= r.get("acceptance_thresholds", {}).get("margin", 0.0)


@pytest.mark.parametrize("model,fn", REF_CASES)
def test_ref_diagnostics(refs, model, fn):
    r = refs(model, fn)
    d = r["diagnostics"]
    assert r["generate_matches_cacheless"] is True
    assert d["eos_token_in_continuation"] is False
    assert d["router_selection_mismatch_vs_recompute"] == 0
    th = r["acceptance_thresholds"]
    assert d["router_min_gap"] >= th["router"]
    cfg = load_json(model, "config.json")
    if cfg["index_topk"] < len(r["full_ids"]):
        assert r["dsa_min_topk_gap"] == d["dsa_min_topk_gap"]
        assert d["dsa_min_topk_gap"] >= th["dsa"]
        assert d["dsa_rows_with_selection"] > 0
        assert d["dsa_selection_mismatch_vs_recompute"] == 0
    else:
        assert r["dsa_min_topk_gap"] is None


def test_short_dsa_gap_at_least_1e4(refs):
    assert refs("tiny_dsa", "ref.json")["dsa_min_topk_gap"] >= 1e-4


@pytest.mark.parametrize("model", F32_MODELS)
def test_long_refs_share_prompt_and_seed(refs, model):
    rs = [refs(model, fn) for fn in REF_FILES[model]]
    assert len({r["seed"] for r in rs}) == 1
    longs = rs[1:]
    assert all(r["prompt_ids"] == longs[0]["prompt_ids"] for r in longs)
    # f32 and quantized refs are computed from different weights: logits must differ
    assert longs[0]["logits"][0] != longs[1]["logits"][0]
    assert longs[1]["logits"][0] != longs[2]["logits"][0]


def test_fp8_ref_differs_from_f32(refs):
    a, b = refs("tiny_dense", "ref.json"), refs("tiny_dense_fp8", "ref.json")
    assert a["prompt_ids"] == b["prompt_ids"] and a["seed"] == b["seed"]
    assert a["logits"][0] != b["logits"][0]


# ----------------------------------------------------------------------------------------------
# tiny_mtp: native MTP head saved as model.layers.{num_hidden_layers}.* + mtp_ref.json
# ----------------------------------------------------------------------------------------------

def mtp_expected_shapes(cfg):
    """Tensors of the MTP layer NL: a MoE decoder layer without indexer, plus the MTP extras."""
    NL, D = cfg["num_hidden_layers"], cfg["hidden_size"]
    ext = dict(cfg, num_hidden_layers=NL + 1, indexer_types=cfg["indexer_types"] + ["shared"],
               mlp_layer_types=cfg["mlp_layer_types"] + ["sparse"])
    pre = f"model.layers.{NL}."
    s = {n: v for n, v in expected_shapes(ext).items() if n.startswith(pre)}
    for n, kind in MTP_EXTRA.items():
        s[pre + n] = [D, 2 * D] if kind == "2D" else [D]
    return s


def rmsnorm(x, w, eps):
    r = 1.0 / math.sqrt(sum(v * v for v in x) / len(x) + eps)
    return [v * r * g for v, g in zip(x, w)]


def matvec(w, rows, cols, x):
    assert len(w) == rows * cols and len(x) == cols
    return [sum(w[r * cols + c] * x[c] for c in range(cols)) for r in range(rows)]


def test_mtp_files_and_config():
    d = os.path.join(DATA, "tiny_mtp")
    for fn in ("config.json", "model.safetensors", "ref.json", "mtp_ref.json"):
        assert os.path.isfile(os.path.join(d, fn)), fn
    cfg = load_json("tiny_mtp", "config.json")
    assert cfg["num_hidden_layers"] == 5 and cfg["num_nextn_predict_layers"] == 1
    assert len(cfg["indexer_types"]) == len(cfg["mlp_layer_types"]) == 5
    # same architecture as tiny_dense; the only config difference is the MTP layer count
    base = load_json("tiny_dense", "config.json")
    assert {k: v for k, v in cfg.items() if k != "num_nextn_predict_layers"} == base


def test_mtp_safetensors():
    cfg = load_json("tiny_mtp", "config.json")
    path = os.path.join(DATA, "tiny_mtp", "model.safetensors")
    hdr, base = st_header(path)
    check_layout(path, hdr, base)
    main, mtp = expected_shapes(cfg), mtp_expected_shapes(cfg)
    want = {**main, **mtp}
    assert len(want) == len(main) + len(mtp)
    assert set(hdr) == set(want), sorted(set(hdr) ^ set(want))
    for n, t in hdr.items():
        assert t["dtype"] == "F32", n
        assert t["shape"] == want[n], (n, t["shape"], want[n])
    NL, E = cfg["num_hidden_layers"], cfg["n_routed_experts"]
    pre = f"model.layers.{NL}."
    assert not [n for n in hdr if n.startswith(pre + "self_attn.indexer.")]
    assert not [n for n in hdr if n.startswith(f"model.layers.{NL + 1}.")]
    exp = {(int(m.group(2)), m.group(3)) for m in map(EXPERT_RE.match, hdr) if m and int(m.group(1)) == NL}
    assert exp == {(e, p) for e in range(E) for p in ("gate_proj", "up_proj", "down_proj")}
    assert pre + "mlp.gate.weight" in hdr and pre + "mlp.shared_experts.down_proj.weight" in hdr
    lin = [f32(-0.1 + 0.2 * i / (E - 1)) for i in range(E)]
    got = st_read(path, pre + "mlp.gate.e_score_correction_bias")
    assert all(abs(g - w) < 1e-7 for g, w in zip(got, lin)), got
    assert set(st_read(path, pre + "input_layernorm.weight")) == {1.0}
    for n in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight"):  # ~ N(1, 0.1)
        w = st_read(path, pre + n)
        mean = sum(w) / len(w)
        sd = math.sqrt(sum((v - mean) ** 2 for v in w) / len(w))
        assert abs(mean - 1.0) < 0.05 and 0.05 < sd < 0.2, (n, mean, sd)
    # with tiny_dense's seed the main model is tiny_dense's, tensor for tensor
    if load_json("tiny_mtp", "ref.json")["seed"] == load_json("tiny_dense", "ref.json")["seed"]:
        other = os.path.join(DATA, "tiny_dense", "model.safetensors")
        for n in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.4.mlp.experts.7.down_proj.weight",
                  "model.layers.0.self_attn.kv_b_proj.weight"):
            assert st_read(path, n) == st_read(other, n), n


@pytest.fixture(scope="module")
def mtp():
    return load_json("tiny_mtp", "mtp_ref.json"), load_json("tiny_mtp", "ref.json")


def test_mtp_ref_fields(mtp):
    m, r = mtp
    for k in ("transformers_version", "torch_version", "model", "seed", "depth", "mtp_layer", "prompt_ids",
              "full_ids", "positions", "next_tokens", "chains", "gaps", "first_logits", "first_hx_norm",
              "hidden_last_positions", "hidden_last", "first_hx", "min_gap", "router_min_gap", "checks"):
        assert k in m, k
    cfg = load_json("tiny_mtp", "config.json")
    V, D = cfg["vocab_size"], cfg["hidden_size"]
    assert m["model"] == "tiny_mtp" and m["seed"] == r["seed"]
    assert m["mtp_layer"] == cfg["num_hidden_layers"]
    assert m["depth"] == MTP_DEPTH
    assert m["prompt_ids"] == r["prompt_ids"] == PROMPT and m["full_ids"] == r["full_ids"]
    ids = m["full_ids"]
    n = len(ids) - 1
    assert n >= 20
    assert m["positions"] == list(range(n))
    assert m["next_tokens"] == ids[1:]
    assert len(m["chains"]) == len(m["gaps"]) == len(m["first_logits"]) == len(m["first_hx_norm"]) == n
    for c, g in zip(m["chains"], m["gaps"]):
        assert len(c) == len(g) == MTP_DEPTH
        assert all(isinstance(t, int) and 0 <= t < V for t in c)
    assert all(len(row) == V for row in m["first_logits"])
    assert all(math.isfinite(x) for row in m["first_logits"] for x in row)
    assert all(math.isfinite(x) and x > 0 for x in m["first_hx_norm"])
    hp = m["hidden_last_positions"]
    assert 0 in hp and n - 1 in hp and len(PROMPT) - 1 in hp and all(0 <= p < n for p in hp)
    assert len(m["hidden_last"]) == len(m["first_hx"]) == len(hp)
    assert all(len(row) == D for row in m["hidden_last"] + m["first_hx"])
    c = m["checks"]
    assert c["bit_identical_with_full_indexer_topk_4096"] is True
    assert c["max_abs_diff_step0_vs_single_causal_forward"] < 1e-5
    assert c["max_abs_diff_lm_head_norm_hidden_vs_tf_logits"] < 1e-5


def test_mtp_ref_argmax_and_gaps(mtp):
    m, _ = mtp
    th = m["acceptance_thresholds"]
    for p, row in enumerate(m["first_logits"]):
        a = argmax(row)
        assert m["chains"][p][0] == a, p
        s = sorted(row)
        assert s[-1] > s[-2], p
        assert abs((s[-1] - s[-2]) - m["gaps"][p][0]) < 1e-6, p
    flat = [g for row in m["gaps"] for g in row]
    assert min(flat) == m["min_gap"]
    w = m["min_gap_where"]
    assert m["gaps"][w["p"]][w["g"]] == m["min_gap"]
    assert m["min_gap"] >= th["argmax"] >= 1e-4
    assert m["router_min_gap"] >= th["router"] >= 1e-4
    assert m["router_selection_mismatch_vs_recompute"] == 0
    # a random head does not mirror the main model: chains are not just a copy of the continuation
    assert any(c[0] != t for c, t in zip(m["chains"], m["full_ids"][2:]))


def test_mtp_convention_sensitivity(mtp):
    """The recorded wrong-convention re-runs: the concat order is decisive; model.norm before hnorm is
    almost invisible because model.norm.weight is all ones (RMSNorm after RMSNorm ~ idempotent)."""
    m, _ = mtp
    s = m["convention_sensitivity"]
    assert set(s) == {"skip_model_norm_at_step0", "model_norm_also_at_chained_steps", "concat_order_swapped"}
    assert s["concat_order_swapped"]["first_drafts_differing"] > len(m["positions"]) // 2
    assert s["concat_order_swapped"]["max_abs_diff_first_logits"] > 0.1
    assert s["model_norm_also_at_chained_steps"]["max_abs_diff_first_logits"] == 0.0  # step 0 unaffected
    assert s["skip_model_norm_at_step0"]["max_abs_diff_first_logits"] < 1e-3


def test_mtp_hidden_last_and_first_input(mtp):
    """hidden_last is the PRE-norm residual (model.norm + lm_head reproduce ref.json's logits), and
    first_hx = eh_proj . [enorm(embed(tok_{p+1})) ; hnorm(model.norm(h_p))] (embedding part first)."""
    m, r = mtp
    cfg = load_json("tiny_mtp", "config.json")
    V, D, eps = cfg["vocab_size"], cfg["hidden_size"], cfg["rms_norm_eps"]
    path = os.path.join(DATA, "tiny_mtp", "model.safetensors")
    pre = f"model.layers.{cfg['num_hidden_layers']}."
    norm = st_read(path, "model.norm.weight")
    head = st_read(path, "lm_head.weight")
    embed = st_read(path, "model.embed_tokens.weight")
    eh = st_read(path, pre + "eh_proj.weight")
    enorm, hnorm = st_read(path, pre + "enorm.weight"), st_read(path, pre + "hnorm.weight")
    assert set(norm) == {1.0}  # hence the RMS test below: a post-norm row would have RMS ~ 1
    for p, h, hx in zip(m["hidden_last_positions"], m["hidden_last"], m["first_hx"]):
        rms = math.sqrt(sum(v * v for v in h) / D)
        assert abs(rms - 1.0) > 0.2, (p, rms)
        hn = rmsnorm(h, norm, eps)
        lg = matvec(head, V, D, hn)
        assert max(abs(a - b) for a, b in zip(lg, r["logits"][p])) < 1e-4, p
        tok = m["full_ids"][p + 1]
        e = rmsnorm(embed[tok * D:(tok + 1) * D], enorm, eps)
        want = matvec(eh, D, 2 * D, e + rmsnorm(hn, hnorm, eps))
        assert max(abs(a - b) for a, b in zip(want, hx)) < 1e-4, p
        assert abs(math.sqrt(sum(v * v for v in hx)) - m["first_hx_norm"][p]) < 1e-4, p
