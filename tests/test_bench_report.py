"""tools/bench.py's report from synthetic results (no engine runs): colibri int4 and int8, each
at --idot 2 and --idot 1, set against llama-bench on its peer quantization; the streaming-read
bandwidth next to the copy figure; the verdict table of issue 12's must-hold lines."""
import importlib.util
import json
import math
from pathlib import Path

import numpy as np
import pytest

TOOLS = Path(__file__).resolve().parent.parent / "tools"


def _load():
    spec = importlib.util.spec_from_file_location("bench", TOOLS / "bench.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


bench = _load()
GB = 10 ** 9
BUDGET = 20 * GB


def _lb_tests(pp32, pp512, tg64):
    return {k: bench.ts_stats(v) for k, v in (("pp32", pp32), ("pp512", pp512), ("tg64", tg64))}


def _col_row(variant, cached, decode, ref=False, **kw):
    v = next(x for x in bench.colibri_variants(["int4", "int8"], (2, 1)) if x["name"] == variant)
    return dict({"engine": "colibri", "weights": v["weights"], "cached": cached, "ref": ref, "variant": variant,
                 "container": v["container"], "idot": v["idot"], "peer": v["peer"], "prefill_tok_s": 150.0,
                 "decode_tok_s": decode, "peak_rss_bytes": 2 * 10 ** 8, "ram_budget_bytes": BUDGET}, **kw)


def _variant(name, tests, peer_tests, round_ratios):
    v = next(x for x in bench.colibri_variants(["int4", "int8"], (2, 1)) if x["name"] == name)
    ts = {k: bench.ts_stats(x) for k, x in tests.items()}
    return {"weights": v["weights"], "peer": v["peer"], "container": v["container"], "idot": v["idot"],
            "tests": ts, "errors": [], "peak_rss_bytes": 3 * 10 ** 8, "ram_budget_bytes": BUDGET,
            "ratios": {k: ts[k]["avg_ts"] / peer_tests[k]["avg_ts"] for k in ts},
            "round_ratios": round_ratios}


def _bpt(total, experts):
    comp = {k: 0 for k in bench.COMPONENTS}
    comp.update({"attention": total - experts - 1000, "routed experts (top-k)": experts, "embedding row": 1000})
    return {"components": comp, "total": total}


def synthetic():
    """A complete run: int4 decodes 300 tok/s (all cached), 250 from the page cache; int8 200;
    llama-bench Q4_0 tg64 240, Q8_0 tg64 150; streaming read 30 GB/s, copy 45 GB/s."""
    q4 = _lb_tests([400.0], [380.0], [230.0, 250.0])
    q8 = _lb_tests([350.0], [330.0], [150.0])
    eo = {"int4": _variant("int4", {"pp32": [200.0], "pp512": [300.0], "tg64": [290.0, 310.0]}, q4,
                           {"pp32": [0.5], "tg64": [1.2, 1.3]}),
          "int4 --idot 1": _variant("int4 --idot 1", {"pp32": [220.0], "pp512": [330.0], "tg64": [330.0]}, q4,
                                    {"tg64": [1.4]}),
          "int8": _variant("int8", {"pp32": [190.0], "pp512": [280.0], "tg64": [170.0]}, q8, {"tg64": [1.0, 1.2]}),
          "int8 --idot 1": _variant("int8 --idot 1", {"pp32": [210.0], "pp512": [300.0], "tg64": [200.0]}, q8,
                                    {"tg64": [1.3]})}
    lb = lambda w, t: {"engine": bench.LB, "weights": w, "cached": "all", "llama_bench": {"tests": t},  # noqa: E731
                       "prefill_tok_s": t["pp32"]["avg_ts"], "decode_tok_s": t["tg64"]["avg_ts"]}
    return {
        "date": "today", "machine": {"cpu": "Test CPU", "usable_cpus": 2, "amx": []},
        "params": {"threads": 2, "prompt_len": 32, "tokens": 64, "runs": 3, "long_prompt": 512},
        "rows": [
            _col_row("int4", "all", 300.0, ref=True),
            _col_row("int4", "4 (page cache)", 250.0, expert_load_bytes_per_token=5 * 10 ** 6),
            _col_row("int4", "4 (disk, O_DIRECT)", 40.0, read_gb_s=1.8, peak_rss_bytes=BUDGET + 1),
            _col_row("int4 --idot 1", "all", 330.0),
            _col_row("int8", "all", 200.0),
            _col_row("int8 --idot 1", "all", 220.0),
            {"engine": bench.LCP, "weights": "Q4_0", "cached": "all", "prefill_tok_s": 450.0, "decode_tok_s": 150.0},
            lb("Q4_0", q4),
            {"engine": bench.LCP, "weights": "Q8_0", "cached": "all", "prefill_tok_s": 380.0, "decode_tok_s": 100.0},
            lb("Q8_0", q8),
        ],
        "engine_rounds": {"rounds_kept": 2, "colibri": eo},
        "llama": {"amx_note": "CPU without AMX"},
        "bandwidth": {"array_bytes": 1 << 30, "repeats": 5, "gbs": 45.0, "gbs_1thread": 40.0, "gbs_2threads": 45.0,
                      "read": {"array_bytes": 1 << 30, "repeats": 5, "method": "uint64 add.reduce", "gbs": 30.0,
                               "memory_bound": True,
                               "methods": {"uint64 add.reduce": {"gbs_1thread": 25.0, "gbs_2threads": 30.0,
                                                                 "in_cache_gbs_2threads": 75.0},
                                           "float64 add.reduce": {"gbs_1thread": 20.0, "gbs_2threads": 28.0,
                                                                  "in_cache_gbs_2threads": 40.0}}}},
        "bytes_per_token": _bpt(60 * 10 ** 6, 40 * 10 ** 6),
        "bytes_per_token_int8": _bpt(110 * 10 ** 6, 75 * 10 ** 6),
        "disk": {"tool": "fio", "gbs": {"qd1": 1.0, "qd8": 2.0}, "best_gbs": 2.0},
        "notes": ["a note"],
    }


def _table(lines, header_start):
    """The rows (cells) of the markdown table whose header starts with ``header_start``."""
    i = next(j for j, ln in enumerate(lines) if ln.startswith(header_start))
    out = []
    for ln in lines[i + 2:]:
        if not ln.startswith("|"):
            break
        out.append([c.strip() for c in ln.strip().strip("|").split(" | ")])
    return out


def test_main_table_sets_each_peer_against_colibri_of_its_quantization():
    lines = bench.render_report(synthetic()).splitlines()
    main = {(r[0], r[1], r[2]): r for r in _table(lines, "| engine | weights | experts cached")}
    assert ("colibri", "int4 (io int8), --idot 1", "all") in main and ("colibri", "int8, --idot 1", "all") in main
    # Q4_0 rows ÷ colibri int4 (300 tok/s decode); Q8_0 rows ÷ colibri int8 (200)
    assert main[(bench.LCP, "Q4_0", "all")][8] == "2.00×" and main[(bench.LB, "Q4_0", "all")][8] == "1.25×"
    assert main[(bench.LCP, "Q8_0", "all")][8] == "2.00×" and main[(bench.LB, "Q8_0", "all")][8] == "1.33×"
    assert ("Ratios: colibri ÷ peer (> 1 = colibri faster); Q4_0 rows against colibri int4 (io int8), all experts "
            "cached; Q8_0 rows against colibri int8, all experts cached.") in lines


def test_main_table_q8_rows_fall_back_to_int4_only_without_an_int8_row():
    res = synthetic()
    res["rows"] = [r for r in res["rows"] if r.get("container") != "int8"]
    main = {(r[0], r[1]): r for r in _table(bench.render_report(res).splitlines(), "| engine | weights | experts")}
    assert main[(bench.LCP, "Q8_0")][8] == "3.00×"
    res = synthetic()
    res["rows"][4] = dict(res["rows"][4], error="colibri convert (int8): boom")   # int8 measured, but failed
    main = {(r[0], r[1]): r for r in _table(bench.render_report(res).splitlines(), "| engine | weights | experts")}
    assert main[(bench.LCP, "Q8_0")][8] == "–" and main[(bench.LCP, "Q4_0")][8] == "2.00×"


def test_engine_only_table_has_one_colibri_row_per_variant_against_its_peer():
    res = synthetic()
    text = bench.render_report(res)
    lines = text.splitlines()
    eo = _table(lines, "| engine | weights | pp32 tok/s")
    assert [(r[0], r[1], r[5]) for r in eo] == [
        ("colibri", "int4 (io int8), all experts cached", "llama-bench Q4_0"),
        ("colibri", "int4 (io int8), --idot 1, all experts cached", "llama-bench Q4_0"),
        ("colibri", "int8, all experts cached", "llama-bench Q8_0"),
        ("colibri", "int8, --idot 1, all experts cached", "llama-bench Q8_0"),
        (bench.LB, "Q4_0", "–"), (bench.LB, "Q8_0", "–")]
    int4, int8 = eo[0], eo[2]
    assert int4[4] == "300 ± 14.1" and int4[6:9] == ["0.50×", "0.79×", "1.25×"] and int4[9] == "--idot 2 (the default)"
    assert int8[6:9] == ["0.54×", "0.85×", "1.13×"] and eo[3][9] == "--idot 1"
    assert eo[4][2:5] == ["400 ± 0.0", "380 ± 0.0", "240 ± 14.1"] and eo[4][6:] == ["–", "–", "–", "CPU without AMX"]
    assert ("colibri ÷ its peer within each round (min – max): int4 (io int8) ÷ Q4_0: pp32 0.50–0.50×, "
            "tg64 1.20–1.30×; int4 (io int8), --idot 1 ÷ Q4_0: tg64 1.40–1.40×; int8 ÷ Q8_0: tg64 1.00–1.20×; "
            "int8, --idot 1 ÷ Q8_0: tg64 1.30–1.30×.") in lines
    idot = next(ln for ln in lines if ln.startswith("--idot 2 (the default"))
    assert idot.endswith("the averages above (< 1 = what the residual costs): int4 (io int8): pp32 0.91×, "
                         "pp512 0.91×, tg64 0.91×; int8: pp32 0.90×, pp512 0.93×, tg64 0.85×.")
    # a variant whose runs failed shows the failure, and llama-bench's ratios to it are gone
    res["engine_rounds"]["colibri"]["int8"] = dict(res["engine_rounds"]["colibri"]["int8"], tests={}, ratios={},
                                                   round_ratios={}, errors=["colibri run: boom"])
    eo = _table(bench.render_report(res).splitlines(), "| engine | weights | pp32 tok/s")
    assert eo[2][2:] == ["–"] * 7 + ["FAILED: colibri run: boom"]


def test_weight_bytes_against_streaming_read_and_copy():
    lines = bench.render_report(synthetic()).splitlines()
    comp = _table(lines, "| component |")
    assert comp[-1] == ["**total**", "**60.00 MB**", "**110.00 MB**"]
    assert ["routed experts (top-k)", "40.00 MB", "75.00 MB"] in comp
    gbs = {r[0]: r for r in _table(lines, "|  | decode tok/s | weight GB/s")}
    # int4: 60 MB × 300 tok/s = 18 GB/s = 60% of 30 GB/s read, 40% of 45 GB/s copy; int8: 110 MB × 200
    assert gbs["colibri int4 (io int8), all experts cached"][2:5] == ["18.00", "60.0%", "40.0%"]
    assert gbs["colibri int8, all experts cached"][2:5] == ["22.00", "73.3%", "48.9%"]
    assert gbs["colibri int4 (io int8), 4 (page cache) experts cached"][5] == "5.00 MB"
    read = next(r for k, r in gbs.items() if k.startswith("streaming read"))
    assert read[0] == "streaming read (uint64 add.reduce of 1 GiB, 2 threads, best of 5)"
    assert read[2:5] == ["30.00", "100%", "66.7%"]
    copy = next(r for k, r in gbs.items() if k.startswith("copy"))
    assert copy[2:5] == ["45.00", "150.0%", "100%"]
    text = "\n".join(lines)
    assert ("uint64 add.reduce: 25.00 GB/s with 1 thread, 30.00 with 2, 75.00 on 512 KiB per thread in cache; "
            "float64 add.reduce: 20.00 GB/s with 1 thread, 28.00 with 2, 40.00 on 512 KiB per thread in cache. The "
            "read bandwidth is uint64 add.reduce's 2-thread figure; the reduction runs 2.5× faster in cache, so the "
            "1-GiB figure is the memory's.") in text


def test_read_share_pairs_each_round_decode_with_its_own_streaming_read():
    """With a streaming read measured in the engine-only rounds, the bandwidth line divides each
    round's decode by that round's read and takes the median (the host's speed moves between the
    main table and the start-up measurement)."""
    res = synthetic()
    res["engine_rounds"]["read_rounds"] = [
        {"read_gbs": 20.0, "decode_tok_s": {"int4": 250.0, "int8": 150.0}},      # 15 GB/s: 75%
        {"read_gbs": 40.0, "decode_tok_s": {"int4": 300.0}},                     # 18 GB/s: 45%
        {"read_gbs": 30.0, "decode_tok_s": {"int4": 320.0}}]                     # 19.2 GB/s: 64%
    line = next(r for r in bench.verdict_rows(res) if "streaming-read" in r["must_hold"])
    assert line["ratio"] == pytest.approx(0.64) and line["holds"] is True and line["ratio_text"] == "64.0%"
    assert line["measured"].startswith("60.00 MB/token × colibri's tg64 ÷ the streaming read of the same round, "
                                       "3 rounds: 18.00 GB/s of 30.00 GB/s (medians), per round 45.0–75.0%")
    assert "main table 60.00 MB/token × 300 tok/s" in line["measured"]


def test_verdict_table_lists_each_must_hold_line_at_the_end():
    res = synthetic()
    text = bench.render_report(res)
    lines = text.splitlines()
    header = "| must hold | measured | ratio | target | holds |"
    assert header in lines
    assert all(not ln.strip() or ln.startswith("|") for ln in lines[lines.index(header):])  # the report's end
    v = {r[0]: r for r in _table(lines, header)}
    i4 = v["int4 (io int8) all cached ≥ 1.2× llama-bench Q4_0 (tg64, engine-only rounds)"]
    assert i4[1:] == ["colibri 300 tok/s, llama-bench Q4_0 240 tok/s (avg of 2 rounds; within a round 1.20–1.30×)",
                      "1.25×", "≥ 1.20×", "yes"]
    bw = v["int4 (io int8) all cached ≥ 60% of the 2-thread streaming-read bandwidth in weight bytes per second"]
    assert bw[1:] == ["main table 60.00 MB/token × 300 tok/s = 18.00 GB/s of 30.00 GB/s read at the start (60.0%)",
                      "60.0%", "≥ 60%", "yes"]
    i8 = v["int8 all cached ≥ 1.2× llama-bench Q8_0 (tg64, engine-only rounds)"]
    assert i8[2:] == ["1.13×", "≥ 1.20×", "**no**"]
    paged = v["4 experts/layer from the page cache ≥ 0.8× colibri's all-cached decode"]
    assert paged[1:] == ["250 ÷ 300 tok/s (int4, main table)", "0.83×", "≥ 0.80×", "yes"]
    assert v["O_DIRECT reads ≥ 0.85× fio's best on the same file"][1:] == ["1.80 GB/s ÷ 2.00 GB/s", "0.90×",
                                                                           "≥ 0.85×", "yes"]
    rss = {k: r for k, r in v.items() if k.startswith("peak RSS")}
    assert len(rss) == 6 + 4   # each colibri row of the main table, each variant of the engine-only rounds
    assert rss["peak RSS ≤ the RAM budget: colibri int4 (io int8), 4 (disk, O_DIRECT) cached"][4] == "**no**"
    assert rss["peak RSS ≤ the RAM budget: colibri int8, --idot 1, engine-only rounds"][1:] == [
        "300.00 MB of 20.00 GB", "1.5%", "≤ 100%", "yes"]
    assert v["--idot 1 measured side by side: int8 --idot 2 ÷ --idot 1 (tg64, engine-only rounds)"][1:] == [
        "170 ÷ 200 tok/s", "0.85×", "(no bar: what --idot 2 costs)", "–"]
    # the JSON carries the same lines
    rows = json.loads(json.dumps(bench.verdict_rows(res)))
    assert [r["holds"] for r in rows[:5]] == [True, True, False, True, True]
    assert math.isclose(rows[0]["ratio"], 300 / 240) and rows[1]["ratio_text"] == "60.0%"


def test_direct_line_pairs_each_run_with_the_disk_measured_after_it():
    res = synthetic()
    direct = next(r for r in res["rows"] if "O_DIRECT" in str(r.get("cached")))
    # the disk's own figure moves between runs: each run is judged against its own minute
    direct["disk_pairs"] = [(1.0, 1.25), (1.8, 2.0), (0.9, 1.0)]
    v = {r["must_hold"]: r for r in bench.verdict_rows(res)}
    line = v["O_DIRECT reads ≥ 0.85× fio's best on the same file"]
    assert math.isclose(line["ratio"], 0.9) and line["holds"] is True
    assert line["measured"] == ("1.00 GB/s ÷ 1.25 GB/s (medians of 3 runs, each ÷ the disk measured right after "
                                "it: per run 0.80–0.90×)")
    direct["disk_pairs"] = [(0.8, 1.25), (0.9, 1.25), (1.8, 2.0)]
    assert {r["must_hold"]: r for r in bench.verdict_rows(res)}[line["must_hold"]]["holds"] is False


def test_verdict_says_what_this_run_did_not_measure():
    res = synthetic()
    res["rows"] = [r for r in res["rows"] if r.get("container") != "int8" and r.get("idot", 2) == 2
                   and "O_DIRECT" not in str(r.get("cached"))]
    res["engine_rounds"]["colibri"] = {"int4": res["engine_rounds"]["colibri"]["int4"]}
    del res["bytes_per_token_int8"], res["disk"]
    res["bandwidth"].pop("read")
    v = {r["must_hold"]: r for r in bench.verdict_rows(res)}
    for must in ("int8 all cached ≥ 1.2× llama-bench Q8_0 (tg64, engine-only rounds)",
                 "O_DIRECT reads ≥ 0.85× fio's best on the same file",
                 "int4 (io int8) all cached ≥ 60% of the 2-thread streaming-read bandwidth in weight bytes per second",
                 "--idot 1 measured side by side: int4 (io int8) --idot 2 ÷ --idot 1 (tg64, engine-only rounds)"):
        assert v[must]["measured"] == "not measured in this run" and v[must]["holds"] is None
    assert v["int4 (io int8) all cached ≥ 1.2× llama-bench Q4_0 (tg64, engine-only rounds)"]["holds"] is True
    text = bench.render_report(res)
    assert "| O_DIRECT reads ≥ 0.85× fio's best on the same file | not measured in this run | – | ≥ 0.85× | – |" in text
    assert "Weight bytes read per decoded token (colibri's containers: int4 (io int8)):" in text
    assert "% of streaming read" in text and "streaming read (" not in text


def test_prefill_lines_judge_int4_with_and_without_amx_against_q4_0():
    res = synthetic()
    eo = res["engine_rounds"]["colibri"]
    q4 = _lb_tests([400.0], [380.0], [230.0, 250.0])           # synthetic()'s llama-bench Q4_0
    eo["int4 AMX off"] = _variant("int4", {"pp32": [440.0], "pp512": [475.0], "tg64": [300.0]}, q4,
                                  {"pp32": [1.0, 1.2], "pp512": [1.2, 1.3]})
    v = {r["must_hold"]: r for r in bench.verdict_rows(res)}
    short = v["int4 (io int8), AMX off, all cached ≥ 1.2× llama-bench Q4_0 (pp32, engine-only rounds)"]
    long = v["int4 (io int8), AMX off, all cached ≥ 1.5× llama-bench Q4_0 (pp512, engine-only rounds)"]
    assert math.isclose(short["ratio"], 440 / 400) and short["holds"] is False
    assert math.isclose(long["ratio"], 475 / 380) and long["holds"] is False
    assert "within a round 1.20–1.30×" in long["measured"]
    assert v["int4 (io int8) all cached ≥ 1.5× llama-bench Q4_0 (pp512, engine-only rounds)"]["holds"] is not None
    # the AMX-off variant: the default run with COLIBRI_AMX=0, only for the containers asked
    vs = bench.colibri_variants(["int4", "int8"], (2,), amx_off=("int4",))
    assert [(x["name"], x["env"]) for x in vs] == [("int4", {}), ("int4 AMX off", {"COLIBRI_AMX": "0"}),
                                                   ("int8", {})]


def test_variants_and_their_flags():
    names = lambda vs: [v["name"] for v in vs]  # noqa: E731
    assert names(bench.colibri_variants(["int4", "int8"], (2, 1))) == ["int4", "int4 --idot 1", "int8", "int8 --idot 1"]
    assert names(bench.colibri_variants(["int4"], (2,))) == ["int4"]
    args = bench.build_parser().parse_args(["--skip-int8", "--skip-idot1"])
    assert args.skip_int8 and args.skip_idot1
    args = bench.build_parser().parse_args([])
    assert not args.skip_int8 and not args.skip_idot1
    assert bench.CONTAINERS["int8"]["bits"] == (8, 8, 8) and bench.CONTAINERS["int4"]["bits"] == (4, 4, 8)


def test_read_bandwidth_measures_every_pass():
    got = bench.measure_read_bandwidth(np.ones(1 << 20, dtype=np.float64), repeats=1)   # 8 MiB
    assert list(got["methods"]) == [name for name, _ in bench.READ_PASSES]
    best = max(m["gbs_2threads"] for m in got["methods"].values())
    assert got["gbs"] == best == got["methods"][got["method"]]["gbs_2threads"] and best > 0
    assert all(m["gbs_1thread"] > 0 and m["in_cache_gbs_2threads"] > 0 for m in got["methods"].values())
    assert got["array_bytes"] == 8 << 20 and isinstance(got["memory_bound"], bool)
