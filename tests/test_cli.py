"""The command-line contract: run, convert, parity."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import DATA


def colibri(*args, check=True):
    env = dict(os.environ, OMP_NUM_THREADS="2")
    p = subprocess.run([sys.executable, "-m", "colibri", *map(str, args)], capture_output=True, text=True,
                       env=env, timeout=300, cwd=DATA.parent.parent)   # the repository root, like the README
    if check and p.returncode != 0:
        raise AssertionError(f"exit {p.returncode}\nstdout: {p.stdout}\nstderr: {p.stderr}")
    return p


def test_help_lists_commands():
    out = colibri("--help").stdout
    for cmd in ("run", "convert", "parity"):
        assert cmd in out
    assert "--cache-experts" in colibri("run", "--help").stdout


def test_run_greedy_with_stats(tmp_path):
    ref = json.loads((DATA / "tiny_dense" / "ref.json").read_text())
    stats = tmp_path / "stats.json"
    prompt = ",".join(map(str, ref["prompt_ids"]))
    p = colibri("run", "--model", DATA / "tiny_dense", "--prompt-ids", prompt, "--max-tokens", 20,
                "--temperature", 0, "--cache-experts", 2, "--stats-json", stats, "--draft", 0)
    s = json.loads(stats.read_text())
    assert s["tokens"] == ref["full_ids"][len(ref["prompt_ids"]):]
    assert p.stdout.split() == [str(t) for t in s["tokens"]]
    for key in ("prefill_tokens", "prefill_s", "decode_tokens", "decode_s", "decode_tok_s", "forwards",
                "expert_hits", "expert_misses", "bytes_read", "peak_rss_bytes", "drafts_proposed",
                "drafts_accepted", "tokens_per_forward"):
        assert key in s
    assert s["prefill_tokens"] == 12 and s["decode_tokens"] == 20
    assert s["forwards"] == 20            # prefill + 19 decode steps (the last token is not forwarded)
    assert s["expert_misses"] > 0 and s["bytes_read"] > 0 and s["peak_rss_bytes"] > 0
    assert "tok/s" in p.stderr


def test_run_batch_gives_the_same_tokens_and_reports_ttft(tmp_path):
    """--batch N forwards the prompt in pieces of <= N tokens with the same result; the summary and
    --stats-json give the time to first token and the batch taken (default: the whole prompt)."""
    ids = ",".join(str((i * 37 + 11) % 256) for i in range(90))
    got = {}
    for batch in (0, 25):
        stats = tmp_path / f"s{batch}.json"
        p = colibri("run", "--model", DATA / "tiny_mtp", "--prompt-ids", ids, "--max-tokens", 8, "--temperature", 0,
                    "--batch", batch, "--stats-json", stats)
        got[batch] = s = json.loads(stats.read_text())
        assert s["prefill_batch"] >= 90 if batch == 0 else s["prefill_batch"] == 25
        assert s["prefill_s"] <= s["ttft_s"] <= s["prefill_s"] + s["decode_s"]
        assert "time to first token" in p.stderr
    assert got[0]["tokens"] == got[25]["tokens"]


def test_prefill_progress_shows_a_bar_only_for_long_prompts(capsys, monkeypatch):
    from colibri.runner import PrefillProgress
    quick = PrefillProgress()
    quick.update(50, 100)
    quick.close()
    assert capsys.readouterr().err == ""            # under a second: nothing printed
    monkeypatch.setattr(PrefillProgress, "SHOW_AFTER_S", 0.0)
    slow = PrefillProgress()
    for done in (10, 60, 100):
        slow.update(done, 100)
    slow.close()
    err = capsys.readouterr().err
    assert "[colibri] prefill" in err and "/100" in err and "tok/s" in err
    off = PrefillProgress(disable=True)
    off.update(100, 100)
    off.close()
    assert capsys.readouterr().err == ""


def test_run_sampling_is_seeded(tmp_path):
    args = ["run", "--model", DATA / "tiny_dsa", "--prompt-ids", "3,14,15", "--max-tokens", 12,
            "--temperature", 1.0, "--seed", 7, "--quiet"]
    assert colibri(*args).stdout == colibri(*args).stdout


@pytest.mark.parametrize("args,msg", [
    (["--prompt-ids", "3,x"], "--prompt-ids"),
    (["--prompt-ids", "3,99999"], "vocabulary"),
    (["--prompt-ids", "3", "--temperature", "-1"], "temperature"),
    (["--prompt-ids", "3", "--top-p", "1.5"], "top-p"),
    (["--prompt-ids", "3", "--max-tokens", "5000"], "context"),
    (["some text"], "tokenizer"),
    (["--prompt-ids", "3", "--draft", "99"], "--draft"),
    (["--prompt-ids", "3", "--draft", "many"], "--draft"),
    (["--prompt-ids", "3", "--batch", "-4"], "--batch"),
])
def test_run_bad_input(args, msg):
    p = colibri("run", "--model", DATA / "tiny_dense", *args, check=False)
    assert p.returncode != 0
    assert msg in p.stderr
    assert "Traceback" not in p.stderr


def test_parity_cli_pass_and_fail(tmp_path):
    ref_path = DATA / "tiny_dsa" / "ref.json"
    p = colibri("parity", DATA / "tiny_dsa", ref_path, "--json")
    res = json.loads(p.stdout)
    assert res["tf_match"] == res["tf_total"] == 32
    assert res["greedy_match"] == res["greedy_total"] == 20
    assert res["max_abs_logit_diff"] <= 1e-3
    bad = json.loads(ref_path.read_text())
    bad["tf_pred"][5] = (bad["tf_pred"][5] + 1) % 256
    bad_path = tmp_path / "bad.json"
    bad_path.write_text(json.dumps(bad))
    p = colibri("parity", DATA / "tiny_dsa", bad_path, "--json", check=False)
    assert p.returncode == 1
    assert json.loads(p.stdout)["tf_match"] == 31


def test_convert_cli_and_parity(tmp_path):
    dst = tmp_path / "int4"
    colibri("convert", DATA / "tiny_dense", dst, "--expert-bits", 4, "--dense-bits", 4, "--io-bits", 8)
    assert (dst / "config.json").exists()
    p = colibri("parity", dst, DATA / "tiny_dense" / "ref_int4.json", "--json")
    assert json.loads(p.stdout)["pass"]


def test_fp8_checkpoint_converts_exactly(tmp_path):
    """FP8 e4m3 weights with 128x128 block scales, converted to f32, reproduce the reference made from
    the same FP8 weights dequantized in transformers; converted to int4, they give the same container
    as the dequantized f32 weights do."""
    f32 = tmp_path / "f32"
    colibri("convert", DATA / "tiny_dense_fp8", f32, "--expert-bits", 32, "--dense-bits", 32, "--io-bits", 32,
            "--indexer-bits", 32)
    res = json.loads(colibri("parity", f32, DATA / "tiny_dense_fp8" / "ref.json", "--json").stdout)
    assert res["pass"] and res["max_abs_logit_diff"] <= 1e-3
    from safetensors.numpy import load_file
    i4 = tmp_path / "i4"
    colibri("convert", DATA / "tiny_dense_fp8", i4, "--expert-bits", 4, "--dense-bits", 4)
    i4_ref = tmp_path / "i4_ref"
    colibri("convert", f32, i4_ref, "--expert-bits", 4, "--dense-bits", 4)
    a = load_file(str(i4 / "out-00000.safetensors"))
    b = load_file(str(i4_ref / "out-00000.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_run_with_mtp_drafts(tmp_path):
    stats = tmp_path / "s.json"
    ref = json.loads((DATA / "tiny_mtp" / "ref.json").read_text())
    prompt = ",".join(map(str, ref["prompt_ids"]))
    p = colibri("run", "--model", DATA / "tiny_mtp", "--prompt-ids", prompt, "--max-tokens", 20,
                "--temperature", 0, "--draft", 2, "--stats-json", stats)
    s = json.loads(stats.read_text())
    assert s["tokens"] == ref["full_ids"][len(ref["prompt_ids"]):]
    assert s["drafts_proposed"] > 0
    assert "tokens/forward" in p.stderr and "MTP head" in p.stderr


def test_run_records_a_routing_trace(tmp_path):
    """--trace: one JSON line per MoE layer call, the experts each call requested, consistent with
    the expert counters (with every expert cached and read on first use, --lazy-experts, each distinct
    (layer, expert) loads once)."""
    ref = json.loads((DATA / "tiny_dense" / "ref.json").read_text())
    trace, stats = tmp_path / "t.jsonl", tmp_path / "s.json"
    colibri("run", "--model", DATA / "tiny_dense", "--prompt-ids", ",".join(map(str, ref["prompt_ids"])),
            "--max-tokens", 12, "--temperature", 0, "--draft", 0, "--trace", trace, "--stats-json", stats,
            "--lazy-experts")
    lines = [json.loads(x) for x in trace.read_text().splitlines()]
    head, calls = lines[0], lines[1:]
    cfg = json.loads((DATA / "tiny_dense" / "config.json").read_text())
    assert head["format"] == "colibri-routing-trace" and head["n_experts"] == cfg["n_routed_experts"]
    assert all(str(i) in head["expert_bytes"] and head["expert_bytes"][str(i)] > 0 for i in head["moe_layers"])
    s = json.loads(stats.read_text())
    assert len(calls) == len(head["moe_layers"]) * s["forwards"]
    assert calls[0]["s"] == len(ref["prompt_ids"]) and all(c["s"] == 1 for c in calls[len(head["moe_layers"]):])
    for c in calls:
        assert c["l"] in head["moe_layers"] and c["e"] == sorted(set(c["e"]))
        assert 1 <= len(c["e"]) <= min(c["s"] * head["topk"], head["n_experts"])
    assert sum(len(c["e"]) for c in calls) == s["expert_hits"] + s["expert_misses"]
    assert len({(c["l"], e) for c in calls for e in c["e"]}) == s["expert_misses"]
    assert s["warm_experts"] == 0


def test_run_reads_every_expert_at_start_when_all_fit(tmp_path):
    """Every expert fits the budget: run reads them all before the prompt (no miss while generating,
    the same tokens as reading them on first use); a partial cache reads none up front."""
    ref = json.loads((DATA / "tiny_dense" / "ref.json").read_text())
    cfg = json.loads((DATA / "tiny_dense" / "config.json").read_text())
    n_moe = sum(1 for t in cfg["mlp_layer_types"] if t == "sparse")
    got = {}
    for name, extra in (("warm", ()), ("lazy", ("--lazy-experts",)), ("partial", ("--cache-experts", "2"))):
        stats = tmp_path / f"{name}.json"
        p = colibri("run", "--model", DATA / "tiny_dense", "--prompt-ids", ",".join(map(str, ref["prompt_ids"])),
                    "--max-tokens", 12, "--temperature", 0, "--draft", 0, "--stats-json", stats, *extra)
        got[name] = (json.loads(stats.read_text()), p.stderr)
    warm, err = got["warm"]
    assert warm["warm_experts"] == n_moe * cfg["n_routed_experts"] and warm["warm_bytes"] > 0
    assert warm["expert_misses"] == 0 and warm["bytes_read"] == 0
    assert f"every expert fits: {warm['warm_experts']} read at start-up" in err
    assert got["lazy"][0]["expert_misses"] > 0 and got["partial"][0]["warm_experts"] == 0
    assert warm["tokens"] == got["lazy"][0]["tokens"] == got["partial"][0]["tokens"]


@pytest.mark.parametrize("env,want", [({"COLIBRI_SPIN": "off"}, "passive"), ({"COLIBRI_SPIN": "on"}, "spin 10000"),
                                      ({"OMP_WAIT_POLICY": "active"}, "active"),
                                      ({"COLIBRI_SPIN": "on", "GOMP_SPINCOUNT": "77"}, "spin 77")])
def test_openmp_wait_policy(env, want):
    """Threads spin (bounded) only when asked or when the CPUs are idle at start-up; a policy set by
    the user wins. The choice is made before the extension loads libgomp."""
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "COLIBRI_SPIN")}
    code = "import os, colibri; print(colibri.WAIT_POLICY, os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'))"
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(base, **env),
                       cwd=DATA.parent.parent, timeout=120)
    assert p.returncode == 0, p.stderr
    policy = p.stdout.split()
    assert " ".join(policy[:2] if want.startswith("spin") else policy[:1]) == want
    if want == "passive":
        assert policy[1] == "passive"
