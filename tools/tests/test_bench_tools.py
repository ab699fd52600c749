"""Benchmark tooling: tools/make_bench_model.py (--tiny) and the pure helpers of tools/bench.py.

Builds the tiny version of the benchmark fixture (needs torch + transformers, the optional oracle
dependency: skipped without them), checks its manifest, config and initialisation, then checks
the bytes-per-token computation against sizes worked out by hand from the config, for the f32
fixture and for its int4 container, and the markdown report.
"""
import importlib.util
import json
import math
import pathlib
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from colibri.st import SafeTensorsDir  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
TOOLS = ROOT / "tools"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


bench = _load("bench")
mbm = _load("make_bench_model")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "tiny"
    r = subprocess.run([sys.executable, str(TOOLS / "make_bench_model.py"), "--tiny", "--out", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return out


def _cfg(d):
    return json.loads((d / "config.json").read_text())


def test_manifest_and_config(tiny):
    from importlib.metadata import version

    man = json.loads((tiny / "bench_manifest.json").read_text())
    cfg = _cfg(tiny)
    assert man["seed"] == 1234 and man["name"] == "tiny"
    assert man["transformers_version"] == version("transformers")
    assert man["n_params"] > 0 and math.isclose(man["n_params_b"], man["n_params"] / 1e9, rel_tol=1e-3)
    with SafeTensorsDir(tiny) as st:
        names = st.names()
        n_saved = sum(st.info(n).numel for n in names if not n.endswith("e_score_correction_bias"))
    assert n_saved == man["n_params"]  # every parameter is saved, experts as 2-D per-expert tensors
    assert not any("gate_up_proj" in n for n in names)
    summ = man["config_summary"]
    for key, want in mbm.TINY.items():
        assert cfg[key] == want, key
        if key in summ:
            assert summ[key] == want, key
    assert cfg["model_type"] == "glm_moe_dsa" and cfg["architectures"] == ["GlmMoeDsaForCausalLM"]
    assert cfg["tie_word_embeddings"] is False
    assert cfg["mlp_layer_types"] == ["dense", "sparse"] == summ["mlp_layer_types"]
    # the medium fixture keeps the benchmark's shape
    med = mbm.config_kwargs()
    assert (med["vocab_size"], med["hidden_size"], med["num_hidden_layers"], med["n_routed_experts"],
            med["num_experts_per_tok"], med["index_head_dim"]) == (8192, 1024, 8, 32, 8, 32)


def test_initialisation(tiny):
    with SafeTensorsDir(tiny) as st:
        bias = st.read_f32("model.layers.1.mlp.gate.e_score_correction_bias")
        np.testing.assert_allclose(bias, np.linspace(-0.1, 0.1, 16), rtol=0, atol=1e-7)
        w = st.read_f32("model.layers.1.mlp.experts.3.up_proj.weight")
        assert w.shape == (32, 128) and 0.017 < float(w.std()) < 0.023 and abs(float(w.mean())) < 0.003
        np.testing.assert_array_equal(st.read_f32("model.layers.0.input_layernorm.weight"), np.ones(128))
        assert st.info("lm_head.weight").dtype == "F32"


def _expected_f32(c):
    """Bytes per decoded token of the f32 fixture, by hand from the config."""
    D, V, H = c["hidden_size"], c["vocab_size"], c["num_attention_heads"]
    Lq, Lkv, dn, dr, dv = c["q_lora_rank"], c["kv_lora_rank"], c["qk_nope_head_dim"], c["qk_rope_head_dim"], \
        c["v_head_dim"]
    E, k, Ie, I, ihd = c["n_routed_experts"], c["num_experts_per_tok"], c["moe_intermediate_size"], \
        c["intermediate_size"], c["index_head_dim"]
    nl, nd = c["num_hidden_layers"], c["first_k_dense_replace"]
    attn = Lq * D + Lq + H * (dn + dr) * Lq + (Lkv + dr) * D + Lkv + H * (dn + dv) * Lkv + D * H * dv
    comp = {
        "embedding row": D, "attention": nl * attn, "indexer keys": nl * (ihd * D + 2 * ihd),
        "norms": nl * 2 * D, "dense MLP": nd * 3 * I * D, "router": (nl - nd) * (E * D + E),
        "shared experts": (nl - nd) * 3 * Ie * D, "routed experts (top-k)": (nl - nd) * k * 3 * Ie * D,
        "final norm": D, "lm_head": V * D,
    }
    return {key: 4 * v for key, v in comp.items()}


def test_bytes_per_token_f32(tiny):
    got = bench.weight_bytes_per_token(str(tiny), ctx_len=96)
    want = _expected_f32(_cfg(tiny))
    assert {k: v for k, v in got["components"].items() if v} == want
    assert got["total"] == sum(want.values())
    assert got["moe_layers"] == 1 and got["experts_per_token"] == 4 and got["unused_bytes"] == 0
    # past index_topk the indexer's query side (wq_b, weights_proj) is read too
    c = _cfg(tiny)
    long = bench.weight_bytes_per_token(str(tiny), ctx_len=c["index_topk"] + 1)
    q_side = 4 * c["num_hidden_layers"] * (c["index_n_heads"] * c["index_head_dim"] * c["q_lora_rank"]
                                           + c["index_n_heads"] * c["hidden_size"])
    assert long["components"]["indexer queries"] == q_side and long["total"] == got["total"] + q_side


def test_bytes_per_token_int4(tiny, tmp_path):
    from colibri.convert import ConvertOptions, convert

    dst = tmp_path / "int4"
    convert(str(tiny), str(dst), ConvertOptions(expert_bits=4, dense_bits=4, io_bits=8), verbose=False)
    c = _cfg(tiny)
    D, V, Ie, k = c["hidden_size"], c["vocab_size"], c["moe_intermediate_size"], c["num_experts_per_tok"]
    got = bench.weight_bytes_per_token(str(dst), ctx_len=96)["components"]
    int4 = lambda O, I: O * ((I + 1) // 2) + 4 * O  # payload + f32 row scales  # noqa: E731
    assert got["routed experts (top-k)"] == k * (2 * int4(Ie, D) + int4(D, Ie))
    assert got["shared experts"] == 2 * int4(Ie, D) + int4(D, Ie)
    assert got["lm_head"] == V * D + 4 * V          # int8 io
    assert got["embedding row"] == D + 4
    assert got["dense MLP"] == 2 * int4(c["intermediate_size"], D) + int4(D, c["intermediate_size"])


def test_report_formatting(tiny):
    bpt = bench.weight_bytes_per_token(str(tiny), ctx_len=96)
    res = {
        "date": "today", "machine": {"cpu": "Test CPU", "usable_cpus": 2, "physical_cores": 2,
                                     "mem_total_bytes": 24 * 2**30},
        "params": {"threads": 2, "prompt_len": 32, "tokens": 64, "runs": 3},
        "fixture": json.loads((tiny / "bench_manifest.json").read_text()),
        "bandwidth": {"gbs": 10.0, "gbs_1thread": 8.0, "gbs_2threads": 10.0},
        "bytes_per_token": bpt,
        "rows": [
            {"engine": "colibri", "weights": "int4", "cached": "all", "ref": True, "prefill_tok_s": 200.0,
             "decode_tok_s": 40.0, "peak_rss_bytes": 3e8, "size_bytes": 2e8},
            {"engine": "HF transformers", "weights": "f32", "cached": "all", "prefill_tok_s": 100.0,
             "decode_tok_s": 10.0, "decode_samples": [9.5, 10.0, 12.25], "prefill_samples": [100.0],
             "tokens": [1, 2, 3, 4], "greedy_prefix_vs_hf_f32": 4},
            {"engine": "llama.cpp", "weights": "Q4_0", "error": "llama.cpp Q4_0: unknown | arch\nsecond"},
        ],
        "notes": ["a note"],
    }
    text = bench.render_report(res)
    assert "Test CPU" in text and "2 usable CPUs" in text
    hf = next(ln for ln in text.splitlines() if ln.startswith("| HF transformers"))
    assert "| 2.00× | 4.00× |" in hf
    bad = next(ln for ln in text.splitlines() if ln.startswith("| llama.cpp"))
    header = next(ln for ln in text.splitlines() if ln.startswith("| engine"))
    assert "FAILED: llama.cpp Q4_0: unknown \\| arch second" in bad
    assert bad.count(" | ") == header.count(" | ")  # the escaped pipe does not add a cell
    gbs = bpt["total"] * 40.0 / 1e9
    assert f"| {gbs:.2f} |" in text and "**" + bench.fmt_bytes(bpt["total"]) + "**" in text
    assert "- a note" in text
    assert "| 4/4 |" in hf
    assert "| HF transformers f32 | 100 – 100 | 9.50 – 12.25 |" in text
    table = bench.markdown_table(["a", "b"], [["x", "1.5"], ["y", "–"]])
    assert table.splitlines()[1] == "|:---|---:|"


def test_small_helpers():
    assert bench.bench_prompt(4, 8192) == [11, 48, 85, 122]
    assert bench.bench_prompt(3, 50) == [11, 48, 35]
    assert bench.median([3.0, None, 1.0, 2.0]) == 2.0 and bench.median([]) is None
    assert bench.fmt_ratio(3.0, 1.5) == "2.00×" and bench.fmt_ratio(1.0, None) == "–"
    assert bench.agreement([1, 2, 3], [1, 2, 4]) == 2
    out = "Traceback...\nllama_model_load: error loading model: unknown model architecture: 'x'\n" \
          "ValueError: Failed to load model from file: m.gguf\n"
    assert bench.last_error_line(out).startswith("llama_model_load: error loading model")
    assert bench.last_error_line("a\nNotImplementedError: nope\n\n") == "NotImplementedError: nope"
