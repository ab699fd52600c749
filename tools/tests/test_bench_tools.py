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


# ---------------------------------------------------------------------------------------------
# llama-bench: build arguments, AMX detection, JSON parsing, report rows (nothing is built here)

DATA = pathlib.Path(__file__).resolve().parent / "data"
SPR_FLAGS = ("fpu vme sse2 avx2 avx512f avx512_vnni avx512_bf16 amx_bf16 avx512_fp16 amx_tile amx_int8 "
             "arch_capabilities")
EPYC_FLAGS = "fpu vme sse2 avx2 avx512f avx512_vnni avx512_bf16 avx512vbmi"


def test_amx_detection_from_cpuinfo():
    cpuinfo = (f"processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8480+\nflags\t\t: {SPR_FLAGS}\n\n"
               f"processor\t: 1\nflags\t\t: {EPYC_FLAGS}\n")
    flags = bench.cpu_flags(cpuinfo)
    assert flags[:2] == ["fpu", "vme"] and "amx_int8" in flags   # the first processor's line
    assert bench.amx_flags(flags) == ["amx_bf16", "amx_int8", "amx_tile"]
    assert bench.amx_flags(EPYC_FLAGS.split()) == []
    assert bench.cpu_flags("processor\t: 0\nmodel name\t: ARM\n") == []
    assert isinstance(bench.machine_info()["amx"], list)


def test_llama_bench_cmake_args():
    plain = bench.llama_bench_cmake_args("/src", "/build", amx_cpu=False)
    assert plain[:4] == ["-S", "/src", "-B", "/build"]
    assert "-DGGML_NATIVE=ON" in plain and "-DCMAKE_BUILD_TYPE=Release" in plain
    assert not any("amx" in a.lower() for a in plain)
    amx = bench.llama_bench_cmake_args("/src", "/build", amx_cpu=True)
    assert amx[: len(plain)] == plain
    assert "-DGGML_AMX_INT8=OFF" in amx and "-DGGML_AMX_TILE=OFF" in amx and "-DGGML_AMX_BF16=OFF" in amx
    for lang in ("C", "CXX"):
        flags = next(a for a in amx if a.startswith(f"-DCMAKE_{lang}_FLAGS="))
        assert set(flags.split("=", 1)[1].split()) == {"-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16"}


def _gcc_macros(*flags):
    r = subprocess.run(["gcc", *flags, "-dM", "-E", "-"], input="", capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_no_amx_flags_beat_march():
    """The build's premise: CMAKE_C_FLAGS come before ggml's -march on the compile line, and an
    explicit -mno-amx-* still wins over the AMX that the -march CPU implies (only the
    preprocessor runs: ggml's AMX kernels are compiled under __AMX_INT8__)."""
    assert "__AMX_INT8__" in _gcc_macros("-march=sapphirerapids")
    off = _gcc_macros(*bench.NO_AMX_CFLAGS.split(), "-march=sapphirerapids")
    assert "__AMX_INT8__" not in off and "__AMX_TILE__" not in off and "__AMX_BF16__" not in off
    assert "__AVX512VNNI__" in off  # the rest of the CPU's ISA stays
    # -march=native: the driver expands it into explicit -m flags of the host and puts the
    # user's own after them, so the last AMX flag cc1 sees is ours (on an AMX host too)
    r = subprocess.run(["gcc", *bench.NO_AMX_CFLAGS.split(), "-march=native", "-###", "-E", "-"], input="",
                       capture_output=True, text=True)
    cc1 = next(ln for ln in r.stderr.splitlines() if "cc1" in ln)
    for feat in ("amx-tile", "amx-int8", "amx-bf16"):
        seen = [t.strip('"') for t in cc1.split() if t.strip('"') in (f"-m{feat}", f"-mno-{feat}")]
        assert seen and seen[-1] == f"-mno-{feat}", (feat, seen)


def test_tree_fingerprint(tmp_path):
    src = tmp_path / "llama.cpp"
    (src / "ggml" / "src").mkdir(parents=True)
    (src / "CMakeLists.txt").write_text("project(x)\n")
    (src / "ggml" / "src" / "a.c").write_text("int a;\n")
    (src / "docs").mkdir()
    (src / "docs" / "x.md").write_text("doc\n")
    first = bench.tree_fingerprint(str(src))
    assert bench.tree_fingerprint(str(src)) == first
    (src / "docs" / "x.md").write_text("doc changed, not a build input\n")
    assert bench.tree_fingerprint(str(src)) == first
    (src / "ggml" / "src" / "a.c").write_text("int a = 1;\n")
    second = bench.tree_fingerprint(str(src))
    assert second != first
    (src / "ggml" / "src" / "b.c").write_text("")
    assert bench.tree_fingerprint(str(src)) != second


def test_ensure_llama_bench_reuses_a_current_build(tmp_path):
    """A build whose stamp matches the tree and the arguments is reused: no cmake runs (the tree
    here could not even configure).  Without an AMX CPU nothing is turned off; on one, with no
    library to ask whether AMX kernels were compiled, llama-bench runs with --repack 0."""
    src = tmp_path / "llama.cpp"
    (src / "src").mkdir(parents=True)
    (src / "src" / "llama.cpp").write_text("// not buildable\n")
    work = tmp_path / "work"
    build = work / "llama-bench-build"
    (build / "bin").mkdir(parents=True)
    (build / "bin" / "llama-bench").write_text("")
    for amx_cpu in (False, True):
        stamp = {"fingerprint": bench.tree_fingerprint(str(src)),
                 "cmake_args": bench.llama_bench_cmake_args(str(src), str(build), amx_cpu)}
        (build / "colibri_bench_build.json").write_text(json.dumps(stamp))
        got = bench.ensure_llama_bench(str(src), str(work), amx_cpu, timeout=60)
        assert "error" not in got and got["reused"] is True
        assert got["binary"] == str(build / "bin" / "llama-bench") and got["amx_compiled"] is None
        assert got["repack_off"] is amx_cpu
        cmd = bench.llama_bench_cmd(got["binary"], "m.gguf", 2, [32, 512], 64, 3, got["repack_off"])
        assert cmd[1:] == ["-m", "m.gguf", "-t", "2", "-p", "32,512", "-n", "64", "-r", "3", "-o", "json"] \
            + (["--repack", "0"] if amx_cpu else [])
    assert bench.amx_note(False, False, False) == "CPU without AMX"
    assert bench.amx_note(True, False, False) == f"AMX CPU: built with AMX off ({bench.NO_AMX_CFLAGS})"
    assert bench.amx_note(True, True, True) == "AMX CPU: --repack 0 (AMX still compiled in)"
    assert bench.lib_has_amx(None) is None and bench.lib_has_amx(str(src / "src" / "llama.cpp")) is None


def test_build_error_line():
    out = ("[ 40%] Building CXX object src/CMakeFiles/llama.dir/llama.cpp.o\n"
           "/src/llama.cpp:12:5: error: 'foo' was not declared in this scope\n"
           "   12 |     foo();\n"
           "gmake[2]: *** [src/CMakeFiles/llama.dir/build.make:76: src/llama.cpp.o] Error 1\n"
           "gmake[1]: *** [CMakeFiles/Makefile2:1020: src/CMakeFiles/llama.dir/all] Error 2\n"
           "gmake: *** [Makefile:146: all] Error 2\n")
    assert bench.build_error_line(out) == "/src/llama.cpp:12:5: error: 'foo' was not declared in this scope"
    conf = "-- The C compiler identification\nCMake Error at CMakeLists.txt:3 (project):\n  No CMAKE_CXX_COMPILER\n" \
           "-- Configuring incomplete, errors occurred!\n"
    assert bench.build_error_line(conf) == "CMake Error at CMakeLists.txt:3 (project): No CMAKE_CXX_COMPILER"
    assert bench.build_error_line("CMake Error at x.txt:1 (message):\n") == "CMake Error at x.txt:1 (message):"
    assert bench.build_error_line("all good\nbut exit 1\n") == "but exit 1"


def test_parse_llama_bench_json():
    """A real run's output: llama-bench -m bench-Q4_0.gguf -t 2 -p 32,512 -n 64 -r 3 -o json."""
    text = (DATA / "llama_bench_q4_0.json").read_text()
    raw = json.loads(text)
    got = bench.parse_llama_bench_json("some log line\n" + text)
    assert list(got["tests"]) == ["pp32", "pp512", "tg64"]
    for t, key in zip(raw, got["tests"]):
        g = got["tests"][key]
        assert g["avg_ts"] == t["avg_ts"] and g["stddev_ts"] == t["stddev_ts"]
        assert len(g["samples_ts"]) == 3  # from samples_ns: exact, where samples_ts has 3 decimals
        assert all(math.isclose(a, b, abs_tol=6e-4) for a, b in zip(g["samples_ts"], t["samples_ts"]))
        assert math.isclose(statistics_mean(g["samples_ts"]), g["avg_ts"], rel_tol=1e-9)
    meta = got["meta"]
    assert meta["n_threads"] == 2 and meta["repack"] is True and meta["model_type"].endswith("Q4_0")
    assert meta["build_commit"] == raw[0]["build_commit"] and "cpu_info" in meta
    row = bench.llama_bench_row(got, 32, 64)
    assert row["prefill_tok_s"] == raw[0]["avg_ts"] and row["decode_tok_s"] == raw[2]["avg_ts"]
    assert row["decode_samples"] == got["tests"]["tg64"]["samples_ts"]
    missing = bench.llama_bench_row(got, 16, 64)
    assert missing["prefill_tok_s"] is None and missing["prefill_samples"] == []
    assert bench._test_key({"n_prompt": 512, "n_gen": 64, "n_depth": 0}) == "pp512+tg64"
    assert bench._test_key({"n_prompt": 0, "n_gen": 64, "n_depth": 4096}) == "tg64 @ d4096"
    for bad in ("main: error: failed to load model\n", "[]", '[{"n_prompt": 32}]'):
        with pytest.raises(ValueError):
            bench.parse_llama_bench_json(bad)


def statistics_mean(xs):
    return sum(xs) / len(xs)


def _parsed(name):
    return bench.parse_llama_bench_json((DATA / name).read_text())


def test_ts_stats_matches_llama_bench():
    """Pooled samples are summarised with llama-bench's own statistics: its avg_ts / stddev_ts of
    a real -r 3 run come back from its samples."""
    for t in _parsed("llama_bench_q4_0.json")["tests"].values():
        got = bench.ts_stats(t["samples_ts"])
        assert math.isclose(got["avg_ts"], t["avg_ts"], rel_tol=1e-8)
        assert math.isclose(got["stddev_ts"], t["stddev_ts"], rel_tol=1e-5)
    assert bench.ts_stats([5.0]) == {"avg_ts": 5.0, "stddev_ts": 0.0, "samples_ts": [5.0]}


def test_merge_llama_bench_rounds():
    r3, r1 = _parsed("llama_bench_q4_0.json"), _parsed("llama_bench_q8_0_r1.json")  # real -r 3 and -r 1 runs
    assert [len(t["samples_ts"]) for t in r1["tests"].values()] == [1, 1, 1]
    merged = bench.merge_llama_bench([r3, r1, r1])
    assert merged["invocations"] == 3 and merged["meta"] == r3["meta"]
    for key in ("pp32", "pp512", "tg64"):
        pooled = r3["tests"][key]["samples_ts"] + 2 * r1["tests"][key]["samples_ts"]
        t = merged["tests"][key]
        assert t["samples_ts"] == pooled and t["avg_ts"] == bench.ts_stats(pooled)["avg_ts"]
        assert t["stddev_ts"] == bench.ts_stats(pooled)["stddev_ts"] > 0
        assert (t["n_prompt"], t["n_gen"]) == (r3["tests"][key]["n_prompt"], r3["tests"][key]["n_gen"])
    one = bench.merge_llama_bench([r1])["tests"]["tg64"]
    assert math.isclose(one["avg_ts"], r1["tests"]["tg64"]["avg_ts"], rel_tol=1e-8) and one["stddev_ts"] == 0.0


def _colibri_stats(prompt, prefill_s, forwards, decode_s):
    return {"prefill_tokens": prompt, "prefill_s": prefill_s, "forwards": forwards, "decode_s": decode_s}


def test_colibri_over_round():
    lb = _parsed("llama_bench_q8_0_r1.json")
    rnd = {"results": {"colibri int8": _colibri_stats(32, 0.16, 64, 0.252),   # 200 tok/s prefill, 250 decode
                       "colibri int8 long": _colibri_stats(512, 1.6, 2, 0.004), "Q8_0": lb}}
    t = lb["tests"]
    assert bench.colibri_rates(rnd["results"]["colibri int8"]) == (200.0, 250.0)
    over = lambda key, name="Q8_0", col="colibri int8": bench.colibri_over_round(rnd, col, name, key, 32, 64, 512)  # noqa: E731
    assert math.isclose(over("pp32"), 200 / t["pp32"]["avg_ts"], rel_tol=1e-5)
    assert math.isclose(over("tg64"), 250 / t["tg64"]["avg_ts"], rel_tol=1e-5)
    assert math.isclose(over("pp512"), 320 / t["pp512"]["avg_ts"], rel_tol=1e-5)
    assert over("pp32", name="Q4_0") is None and over("pp32", col="colibri int4") is None


def _llama_bench_res():
    parsed = bench.merge_llama_bench([_parsed("llama_bench_q4_0.json")])
    lb = {"engine": bench.LB, "weights": "Q4_0", "cached": "all", "size_bytes": 179133056,
          **bench.llama_bench_row(parsed, 32, 64), "note": bench.llama_bench_note(parsed, 512, "CPU without AMX")}
    t = parsed["tests"]
    int4 = {"weights": "int4 (io int8)", "peer": "Q4_0", "container": "int4", "idot": 2, "errors": [],
            "tests": {"pp32": bench.ts_stats([180.0, 220.0]), "pp512": bench.ts_stats([300.0]),
                      "tg64": bench.ts_stats([240.0, 260.0])},
            "ratios": {k: v / t[k]["avg_ts"] for k, v in (("pp32", 200.0), ("pp512", 300.0), ("tg64", 250.0))},
            "round_ratios": {"pp32": [0.3, 0.4], "tg64": [0.9, 1.1]}}
    return parsed, {
        "date": "today", "machine": {"cpu": "Test CPU", "usable_cpus": 2, "amx": []},
        "params": {"threads": 2, "prompt_len": 32, "tokens": 64, "runs": 3, "long_prompt": 512},
        "rows": [
            {"engine": "colibri", "weights": "int4 (io int8)", "cached": "all", "ref": True,
             "prefill_tok_s": 200.0, "decode_tok_s": 250.0},
            {"engine": bench.LCP, "weights": "Q4_0", "cached": "all", "prefill_tok_s": 400.0, "decode_tok_s": 125.0},
            lb,
            {"engine": bench.LCP, "weights": "Q8_0", "cached": "all", "prefill_tok_s": 300.0, "decode_tok_s": 100.0},
            {"engine": bench.LB, "weights": "Q8_0", "cached": "all",
             "error": "llama-bench build: /x/ggml.c:1:1: error: boom"},
        ],
        "engine_rounds": {"rounds_kept": 3, "colibri": {"int4": int4}},
        "llama": {"amx_note": "CPU without AMX"},
    }


def test_report_llama_bench_rows():
    parsed, res = _llama_bench_res()
    pp32, pp512, tg64 = (parsed["tests"][k] for k in ("pp32", "pp512", "tg64"))
    text = bench.render_report(res)
    assert "Machine: Test CPU, 2 usable CPUs; no AMX; 2 threads" in text
    res["machine"]["amx"] = ["amx_int8", "amx_tile"]
    assert "Machine: Test CPU, 2 usable CPUs; AMX: amx_int8 amx_tile; 2 threads" in bench.render_report(res)
    lines = text.splitlines()
    main_header = next(ln for ln in lines if ln.startswith("| engine | weights | experts cached"))
    main = [ln for ln in lines[lines.index(main_header):] if ln.startswith("| llama.cpp")]
    # the main table: llama-bench's row right after llama-cpp-python's for the same GGUF
    assert [ln.split(" | ")[0:2] for ln in main[:4]] == [
        ["| " + bench.LCP, "Q4_0"], ["| " + bench.LB, "Q4_0"], ["| " + bench.LCP, "Q8_0"], ["| " + bench.LB, "Q8_0"]]
    cells = [c.strip() for c in main[1].strip("|").split("|")]
    assert cells[4] == bench.fmt_num(pp32["avg_ts"]) and cells[5] == bench.fmt_num(tg64["avg_ts"], 2)
    assert cells[7] == f"{200.0 / pp32['avg_ts']:.2f}×" and cells[8] == f"{250.0 / tg64['avg_ts']:.2f}×"
    assert cells[10] == (f"pp512 {bench.fmt_num(pp512['avg_ts'])} ± {bench.fmt_num(pp512['stddev_ts'])} tok/s; "
                         "CPU without AMX")
    assert "FAILED: llama-bench build: /x/ggml.c:1:1: error: boom" in main[3]
    # no int8 row in this run: the Q8_0 rows are set against int4, and the table says so
    assert "Ratios: colibri ÷ peer (> 1 = colibri faster); Q4_0, Q8_0 rows against colibri int4 (io int8), " \
           "all experts cached." in text
    # the engine-only table: colibri and llama-bench from the same rounds, pp32 / pp512 / tg64
    eo_header = next(ln for ln in lines if ln.startswith("| engine | weights | pp32 tok/s"))
    assert eo_header == ("| engine | weights | pp32 tok/s | pp512 tok/s | tg64 tok/s | peer | colibri ÷ peer pp32 | "
                         "colibri ÷ peer pp512 | colibri ÷ peer tg64 | note |")
    assert "measured in the same 3 interleaved rounds" in text and "(pp512 = a 512-token prompt)" in text
    i = lines.index(eo_header)
    col, q4, q8 = lines[i + 2], lines[i + 3], lines[i + 4]
    sd200 = bench.fmt_num(bench.ts_stats([180.0, 220.0])["stddev_ts"])
    sd250 = bench.fmt_num(bench.ts_stats([240.0, 260.0])["stddev_ts"])
    assert col == (f"| colibri | int4 (io int8), all experts cached | 200 ± {sd200} | 300 ± 0.0 | 250 ± {sd250} "
                   f"| llama-bench Q4_0 | {200 / pp32['avg_ts']:.2f}× | {300 / pp512['avg_ts']:.2f}× | "
                   f"{250 / tg64['avg_ts']:.2f}× | --idot 2 (the default) |")
    sd = lambda t: f"{bench.fmt_num(t['avg_ts'])} ± {bench.fmt_num(t['stddev_ts'])}"  # noqa: E731
    assert q4 == f"| {bench.LB} | Q4_0 | {sd(pp32)} | {sd(pp512)} | {sd(tg64)} | – | – | – | – | CPU without AMX |"
    assert q8.startswith(f"| {bench.LB} | Q8_0 | – | – | – | – | – | – | – | FAILED: llama-bench build:")
    assert ("colibri ÷ its peer within each round (min – max): int4 (io int8) ÷ Q4_0: pp32 0.30–0.40×, "
            "tg64 0.90–1.10×.") in text
    # the spread table takes llama-bench's own samples
    lo, hi = min(tg64["samples_ts"]), max(tg64["samples_ts"])
    assert f"| {bench.LB} Q4_0 | " in text and f"{bench.fmt_num(lo, 2)} – {bench.fmt_num(hi, 2)} |" in text
    # the verdict reads int4 ÷ Q4_0 off the engine-only rounds
    v = bench.verdict_rows(res)[0]
    assert v["ratio"] == res["engine_rounds"]["colibri"]["int4"]["ratios"]["tg64"] and v["holds"] is (v["ratio"] >= 1.2)
    # without llama-bench rows or rounds there is no engine-only table
    res["rows"] = res["rows"][:2]
    del res["engine_rounds"]
    assert "pp32 tok/s" not in bench.render_report(res)


def test_engine_rounds_interleave(tiny, tmp_path, capsys):
    """The rounds run colibri for real (the tiny fixture's int4 container at --idot 2, its int8
    one at --idot 1) and an executable in llama-bench's place that logs its arguments and prints
    a captured llama-bench -r 1 output: the order reverses every other round, llama-bench's
    samples pool over the rounds, each colibri variant gets ratios to llama-bench on its peer
    quantization (int8 ÷ Q8_0) per round, a llama-bench that fails makes its row's error (and
    no ratios for int4, its Q4_0 peer), and a variant whose container failed is not run."""
    import argparse
    from colibri.convert import ConvertOptions, convert

    paths = {c: tmp_path / c for c in ("int4", "int8")}
    convert(str(tiny), str(paths["int4"]), ConvertOptions(expert_bits=4, dense_bits=4, io_bits=8), verbose=False)
    convert(str(tiny), str(paths["int8"]), ConvertOptions(expert_bits=8, dense_bits=8, io_bits=8), verbose=False)
    log = tmp_path / "calls.txt"
    fake = tmp_path / "llama-bench"
    fake.write_text(f"#!{sys.executable}\n"
                    "import sys\n"
                    f"open({str(log)!r}, 'a').write(' '.join(sys.argv[1:]) + '\\n')\n"
                    "if 'bad.gguf' in sys.argv:\n"
                    "    sys.stderr.write('main: error: failed to load model bad.gguf\\n'); sys.exit(1)\n"
                    f"sys.stdout.write(open({str(DATA / 'llama_bench_q8_0_r1.json')!r}).read())\n")
    fake.chmod(0o755)
    build = {"binary": str(fake), "repack_off": True, "amx_note": "AMX CPU: --repack 0"}
    rows = [{"engine": bench.LB, "weights": "Q8_0", "gguf": "q8.gguf"},
            {"engine": bench.LB, "weights": "Q4_0", "gguf": "bad.gguf"}]
    every = {v["name"]: v for v in bench.colibri_variants(["int4", "int8"], (2, 1))}
    assert list(every) == ["int4", "int4 --idot 1", "int8", "int8 --idot 1"]
    assert every["int8 --idot 1"]["extra"] == ("--idot", "1") and every["int4"]["extra"] == ()
    assert every["int8 --idot 1"]["weights"] == "int8, --idot 1" and every["int8"]["peer"] == "Q8_0"
    variants = [dict(every["int4"], path=str(paths["int4"]), error=None),
                dict(every["int8 --idot 1"], path=str(paths["int8"]), error=None),
                dict(every["int8"], path=str(paths["int8"]), error="colibri convert (int8): boom")]
    vocab = _cfg(tiny)["vocab_size"]
    args = argparse.Namespace(runs=2, retries=0, quiet_wait=0.0, threads=1, tokens=4, timeout=120)
    capsys.readouterr()
    out = bench.run_engine_rounds(variants, rows, build, bench.bench_prompt(32, vocab), bench.bench_prompt(512, vocab),
                                  args, str(tmp_path))
    logged = capsys.readouterr().err.splitlines()
    assert out["rounds_kept"] == 2 and len(out["rounds"]) == 2
    steps = ["colibri int4", "colibri int4 long", "colibri int8 --idot 1", "colibri int8 --idot 1 long"]
    # each round also measures the machine's streaming read, beside the engines
    assert out["rounds"][0]["order"] == steps + ["Q8_0", "Q4_0", bench.READ_STEP]
    assert out["rounds"][1]["order"] == [bench.READ_STEP, "Q8_0"] + steps[::-1]  # reversed; Q4_0 failed in round 1
    # colibri's processes: int4 without --idot, int8 with --idot 1 (warm-up + 2 rounds each)
    runs = [ln for ln in logged if " -m colibri run " in ln]
    assert len(runs) == 12
    assert all(("int8" in ln) == ("--idot 1" in ln) for ln in runs) and sum("--idot 1" in ln for ln in runs) == 6
    calls = log.read_text().splitlines()
    assert calls[0] == "-m q8.gguf -t 1 -p 32,512 -n 4 -r 1 -o json --repack 0"
    assert len(calls) == 3 and calls[1].startswith("-m bad.gguf")
    q8, bad = rows
    assert bad["error"] == "llama-bench: main: error: failed to load model bad.gguf (exit 1)"
    r1 = _parsed("llama_bench_q8_0_r1.json")["tests"]
    tests = q8["llama_bench"]["tests"]
    assert q8["llama_bench"]["invocations"] == 2 and tests["pp32"]["samples_ts"] == 2 * r1["pp32"]["samples_ts"]
    assert q8["prefill_tok_s"] == tests["pp32"]["avg_ts"] and q8["note"].endswith("AMX CPU: --repack 0")
    assert list(out["colibri"]) == ["int4", "int8 --idot 1", "int8"]
    i4, i8 = out["colibri"]["int4"], out["colibri"]["int8 --idot 1"]
    for col in (i4, i8):
        t = col["tests"]
        assert list(t) == ["pp32", "pp512", "tg4"] and all(len(t[k]["samples_ts"]) == 2 for k in t)
        assert all(x > 0 for x in t["tg4"]["samples_ts"])
        assert 0 < col["peak_rss_bytes"] <= col["ram_budget_bytes"] and col["errors"] == []
    # int4's peer (Q4_0) failed: no ratios; int8's ratios come from the same round's runs
    assert i4["ratios"] == {} and i4["round_ratios"] == {}
    # (the captured llama-bench output has tg64, not tg4: no tg4 ratio)
    assert set(i8["ratios"]) == {"pp32", "pp512"} and len(i8["round_ratios"]["pp32"]) == 2
    assert math.isclose(i8["round_ratios"]["pp32"][0] * r1["pp32"]["avg_ts"], i8["tests"]["pp32"]["samples_ts"][0],
                        rel_tol=1e-6)
    assert math.isclose(i8["ratios"]["pp512"], i8["tests"]["pp512"]["avg_ts"] / tests["pp512"]["avg_ts"])
    failed = out["colibri"]["int8"]
    assert failed["errors"] == ["colibri convert (int8): boom"] and failed["tests"] == {}
