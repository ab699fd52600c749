"""tools/project_spec.py: the projection's parts (unions from a trace, the formula, acceptance) and the
tool end to end on a shrunk GLM-5 slice (a tiny run: the tool, not the figures)."""
import json
import math
import pathlib
import subprocess
import sys

import pytest

TOOLS = pathlib.Path(__file__).parent.parent / "tools"
sys.path.insert(0, str(TOOLS))
import project_spec as ps  # noqa: E402


def write_trace(path, calls, topk=2, n_experts=8):
    head = {"format": "colibri-routing-trace", "version": 1, "model": "m", "n_layers": 2,
            "n_experts": n_experts, "topk": topk, "moe_layers": [1], "expert_bytes": {"1": 100}}
    with open(path, "w") as f:
        f.write(json.dumps(head) + "\n")
        for i, (s, e) in enumerate(calls):
            f.write(json.dumps({"f": i, "l": 1, "s": s, "e": e}) + "\n")


def test_trace_unions_count_windows_of_consecutive_decode_calls(tmp_path):
    # a prefill call (s = 3) breaks the run; two runs of decode calls follow
    calls = [(3, [0, 1, 2]), (1, [0, 1]), (1, [1, 2]), (1, [2, 3]), (1, [2, 3]), (1, [4, 5]),
             (2, [0, 1]), (1, [6, 7]), (1, [6, 7]), (1, [0, 6]), (1, [0, 1]), (1, [1, 2])]
    write_trace(tmp_path / "t.jsonl", calls)
    u = ps.trace_unions(str(tmp_path / "t.jsonl"), max_k=5)
    # windows of 5: [01 12 23 23 45] and [67 67 06 01 12]
    assert u["windows"] == 2
    assert u["union"][1] == pytest.approx((2 + 2) / 2)              # the newest call of each window
    assert u["union"][2] == pytest.approx((4 + 3) / 2)              # {2,3,4,5}, {0,1,2}
    assert u["union"][5] == pytest.approx((6 + 5) / 2)              # {0..5}, {0,1,2,6,7}
    assert u["overlap"] == pytest.approx((0 / 2 + 1 / 2) / 2)
    assert u["union_formula"][3] == pytest.approx(ps.union_formula(3, 2, u["overlap"]))
    write_trace(tmp_path / "short.jsonl", calls[:4])
    with pytest.raises(SystemExit, match="consecutive decode calls"):
        ps.trace_unions(str(tmp_path / "short.jsonl"), max_k=5)


def test_union_formula_and_tokens_per_iteration():
    assert ps.union_formula(1, 8, 0.413) == 8
    assert ps.union_formula(3, 8, 0.5) == pytest.approx(16)
    assert ps.union_formula(4, 8, 0.0) == 32
    assert ps.tokens_per_iteration([0.5, 0.25], 0) == 1
    assert ps.tokens_per_iteration([0.5, 0.25], 2) == 1.75
    assert math.isnan(ps.tokens_per_iteration([0.5], 2))
    assert ps.parse_accept("x=0.6,0.3") == ("x", [0.6, 0.3])
    for bad in ("0.6,0.3", "x=", "x=0.3,0.6", "x=1.5", "x=a"):
        with pytest.raises(Exception, match="--accept"):
            ps.parse_accept(bad)


@pytest.fixture(scope="module")
def shrunk_slice(tmp_path_factory):
    d = tmp_path_factory.mktemp("slice") / "s"
    r = subprocess.run([sys.executable, str(TOOLS / "make_glm5_slice.py"), str(d), "--shrink", "16", "--mtp"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return d


def test_project_spec_end_to_end_on_a_shrunk_slice(shrunk_slice, tmp_path):
    out = tmp_path / "p.json"
    args = ["--glm-ram", "24", "--disk", "1.5,ram", "--work", str(tmp_path), "--accept", "half=0.5,0.25,0.125,0.0625"]
    p = subprocess.run([sys.executable, str(TOOLS / "project_spec.py"), "--slice", str(shrunk_slice), "--samples", "1",
                        "--ram", "4", "--json", str(out)] + args, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    d = json.loads(out.read_text())
    c = d["costs"]
    assert c["expert_reads_while_timed"] == 0                     # timed calls ran from RAM
    assert sorted(c["verify"]) == sorted(f"{k} {kind}" for k in range(1, 6) for kind in ("distinct", "same"))
    assert all(len(v["union"]) == len(c["sparse"]) for v in c["verify"].values())
    assert c["verify"]["1 same"]["union"] == c["verify"]["1 distinct"]["union"]
    assert set(c["chain_s"]) == {"1", "2", "3", "4"} and set(c["absorb_s"]) == {"1", "2", "3", "4", "5"}
    (proj,) = d["projections"]
    assert proj["cache_experts"] >= 1 and proj["token_read_bytes"] > 0
    (curve,) = proj["curves"]
    disk, ram = curve["by_disk"]
    assert [r["depth"] for r in disk] == [0, 1, 2, 3, 4]
    # depth 0: one 1-row forward of the full model plus a token's reads; no drafts, no absorb
    f, r0 = d["fit"]["rows"]["1"], disk[0]
    compute = f["head_s"] + 3 * f["dense_s"] + 75 * (f["moe_fixed_s"] + d["fit"]["expert_s"] * 8)
    assert r0["s_per_token"] == pytest.approx(compute + proj["token_read_bytes"] / 1.5e9)
    assert ram[0]["s_per_token"] == pytest.approx(compute) and ram[2]["read_bytes"] == 0
    r2 = disk[2]                                                   # depth 2: 1.75 tokens per iteration
    assert r2["tokens_per_iteration"] == 1.75 and r2["union"] == pytest.approx(ps.union_formula(3, 8, 0.413))
    assert r2["read_bytes"] == pytest.approx(proj["token_read_bytes"] * r2["union"] / 8 + 2 * proj["draft_read_bytes"])
    assert r2["s_per_token"] == pytest.approx(r2["iteration_s"] / 1.75)
    assert "| acceptance | disk |" in p.stdout and "all in RAM" in p.stdout
    again = subprocess.run([sys.executable, str(TOOLS / "project_spec.py"), "--costs", str(out)] + args,
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and again.stdout.strip() == p.stdout.strip()
    bad = subprocess.run([sys.executable, str(TOOLS / "project_spec.py"), "--costs", str(out), "--disk", "0"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "--disk" in bad.stderr
